"""The two decisions of a retraining run, as pure functions of measured numbers.

staleness: is the current version stale on recent traffic?
    - target fingerprint changed (tokenizer / config: hard; weights digest: the target was retrained)
    - any domain's α below the absolute floor
    - any domain's α dropped by more than `max_drop` below what the version recorded for that domain
gate: may the candidate replace the current version?
    - lossless everywhere (greedy output equals the target's)
    - α on recent traffic beats the current version's by at least `min_gain`
    - α on the baseline eval set is no more than `baseline_margin` below the current version's
policy: per-domain enable/disable for the serving layer (α below the floor after retraining → disable)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from draftsmith.config import FRACTION, Range, validated


@validated
@dataclass
class Thresholds:
    alpha_floor: Annotated[float, FRACTION] = 0.3
    max_drop: Annotated[float, FRACTION] = 0.1
    # domains with fewer measured prompts are reported, not judged
    min_domain_prompts: Annotated[int, Range(ge=1, le=10**6)] = 3


@validated
@dataclass
class GateRule:
    min_gain: Annotated[float, FRACTION] = 0.02
    baseline_margin: Annotated[float, FRACTION] = 0.03
    require_lossless: bool = True
    # the serving engine judges too: the candidate is exported for vLLM and `serve-check`ed (loads, decodes
    # losslessly against vLLM alone) before it is promoted; needs vLLM's environment (make setup-vllm)
    serve_check: bool = False


@dataclass
class Verdict:
    yes: bool
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"yes": self.yes, "reasons": self.reasons}


def _domains(report: dict) -> dict[str, dict]:
    return {d: v for d, v in (report.get("domains") or {}).items() if isinstance(v, dict)}


def staleness(traffic_report: dict, recorded_alpha: dict[str, float], fingerprint_diffs: list[str],
              weights_changed: bool, th: Thresholds) -> Verdict:
    reasons = []
    if fingerprint_diffs:
        reasons.append(f"target fingerprint changed: {', '.join(fingerprint_diffs)}")
    if weights_changed:
        reasons.append("target weights changed since this version was trained")
    for domain, row in sorted(_domains(traffic_report).items()):
        if row.get("n_prompts", 0) < th.min_domain_prompts or row.get("alpha") is None:
            continue
        alpha = row["alpha"]
        if alpha < th.alpha_floor:
            reasons.append(f"{domain}: alpha {alpha:.3f} below the floor {th.alpha_floor:.3f}")
        before = recorded_alpha.get(domain)
        if before is not None and before - alpha > th.max_drop:
            reasons.append(f"{domain}: alpha fell from {before:.3f} to {alpha:.3f} (more than {th.max_drop:.3f})")
    return Verdict(bool(reasons), reasons)


def overall_alpha(report: dict) -> float:
    overall = report.get("overall") or {}
    return float(overall.get("alpha", 0.0))


def all_lossless(*reports: dict) -> bool:
    return all(bool(row.get("lossless", False)) for r in reports for row in _domains(r).values())


def gate(cur_traffic: dict, cand_traffic: dict, cur_base: dict, cand_base: dict, rule: GateRule) -> Verdict:
    reasons = []
    ok = True
    if rule.require_lossless and not all_lossless(cand_traffic, cand_base):
        ok = False
        reasons.append("candidate is not lossless")
    a_cur, a_new = overall_alpha(cur_traffic), overall_alpha(cand_traffic)
    if a_new < a_cur + rule.min_gain:
        ok = False
        reasons.append(f"traffic alpha {a_new:.3f} does not beat current {a_cur:.3f} by {rule.min_gain:.3f}")
    else:
        reasons.append(f"traffic alpha {a_cur:.3f} -> {a_new:.3f}")
    b_cur, b_new = overall_alpha(cur_base), overall_alpha(cand_base)
    if b_new < b_cur - rule.baseline_margin:
        ok = False
        reasons.append(f"baseline alpha fell {b_cur:.3f} -> {b_new:.3f} (margin {rule.baseline_margin:.3f})")
    else:
        reasons.append(f"baseline alpha {b_cur:.3f} -> {b_new:.3f}")
    return Verdict(ok, reasons)


def domain_policy(report: dict, alpha_floor: float, version: str) -> dict:
    """{domain: {"speculate": bool, "alpha": α, "why": ...}} for the serving layer."""
    out = {}
    for domain, row in sorted(_domains(report).items()):
        if row.get("alpha") is None:  # nothing was drafted there: no evidence that speculation pays
            out[domain] = {"speculate": False, "alpha": None, "why": "alpha not measured (no drafted tokens)"}
            continue
        alpha = float(row["alpha"])
        enable = alpha >= alpha_floor
        out[domain] = {
            "speculate": enable,
            "alpha": round(alpha, 4),
            "why": f"alpha {alpha:.3f} {'>=' if enable else '<'} floor {alpha_floor:.3f}",
        }
    return {"version": version, "alpha_floor": alpha_floor, "domains": out}


def recorded_alpha(manifest: dict, where: str) -> dict[str, float]:
    """{domain: α} a version recorded on traffic when it was promoted (its manifest's `traffic_eval`), each
    row checked as an evaluation report's domain row (evaluation/report_file.py's `domain_problem`: α finite,
    in [0, 1]); a domain whose α was not measured is left out. A bad field is one DataError naming `where`."""
    from draftsmith.errors import DataError, show
    from draftsmith.evaluation.report_file import domain_problem

    recorded = manifest.get("traffic_eval") or {}
    domains = recorded.get("domains") or {} if isinstance(recorded, dict) else None
    if not isinstance(domains, dict):
        field = "traffic_eval.domains" if isinstance(recorded, dict) else "traffic_eval"
        value = recorded.get("domains") if isinstance(recorded, dict) else recorded
        raise DataError(f"{where}: {field} is {show(value)}, expected a map of domain -> its measurements")
    for domain, row in domains.items():
        problem = domain_problem(row, f"traffic_eval.domains.{domain}", nested=False)
        if problem:
            raise DataError(f"{where}: {problem}")
    return {d: float(row["alpha"]) for d, row in domains.items() if row.get("alpha") is not None}
