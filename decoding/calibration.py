"""How well a proposer's acceptance estimates match what the verifier accepted: expected calibration error and
the reliability table behind it.

A proposer that scores its drafted tokens (DSpark's confidence head: P(token j accepted | tokens before it
accepted)) is calibrated when, among the tokens it gave confidence ≈ p, a fraction ≈ p was accepted. With the
estimates cut into `bins` equal-width bins over [0, 1],

    ECE = Σ_b (n_b / n) · |mean estimate in b − accepted fraction in b|

(Guo et al. 2017, "On Calibration of Modern Neural Networks"). A pair enters only where the verifier decided
the token: the first rejected token of a chain is a pair (estimate, 0), the tokens after it are not (they were
never judged), which is what a conditional estimate is about.
"""

from __future__ import annotations

import torch


def reliability(estimates: torch.Tensor, accepted: torch.Tensor, bins: int = 10) -> list[dict]:
    """Per bin of the estimates [n] in [0, 1]: {lo, hi, n, mean_estimate, accepted} (empty bins left out)."""
    p = estimates.detach().float().flatten().clamp(0, 1)
    y = accepted.detach().float().flatten()
    which = (p * bins).long().clamp(max=bins - 1)
    out = []
    for b in range(bins):
        at = which == b
        n = int(at.sum())
        if n:
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n, "mean_estimate": float(p[at].mean()),
                        "accepted": float(y[at].mean())})
    return out


def expected_calibration_error(estimates: torch.Tensor, accepted: torch.Tensor, bins: int = 10) -> float | None:
    """ECE of estimates [n] against accepted [n] (0/1); None without pairs."""
    return table_ece(reliability(estimates, accepted, bins))


def table_ece(table: list[dict]) -> float | None:
    """ECE of a `reliability` table: its bins' gaps weighted by their sizes; None for an empty table."""
    total = sum(r["n"] for r in table)
    if not total:
        return None
    return sum(r["n"] / total * abs(r["mean_estimate"] - r["accepted"]) for r in table)


def summary(estimates: list[float], accepted: list[int], bins: int = 10) -> dict:
    """The report's calibration entry of collected pairs: n, ECE, mean estimate, accepted fraction, the table."""
    if not estimates:
        return {"n": 0, "ece": None, "bins": []}
    p, y = torch.tensor(estimates), torch.tensor(accepted, dtype=torch.float32)
    table = reliability(p, y, bins)
    return {"n": len(estimates), "ece": table_ece(table), "mean_estimate": float(p.mean()), "accepted": float(y.mean()),
            "bins": table}
