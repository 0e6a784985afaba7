"""Adaptive k: choose the chain length of every step from the request's running acceptance and the cost model.

Per step the controller maximises the cost model's speedup (decoding/cost.py)

    S(k) = E[tokens | k] / (v(k) + k·c),   E[tokens | k] = 1 + Σ_{d=1..k} Π_{j<=d} a_j

over k = 0..k_max, where a_j is the running conditional acceptance at draft position j (accepted at j given
proposed at j) of THIS request, v(k) the measured verify cost of k+1 tokens relative to one, and c the
proposer's cost per drafted token relative to one target step, estimated online from the step timings.
Counts decay by `decay` per step so the estimate follows the text (code blocks, then prose, ...), and
start from a weak prior (`prior_alpha` with weight `prior_weight`). When S(k) <= 1 for every k > 0
the request falls back to plain decoding (k = 0) and re-probes with a short chain every `probe_every`
plain steps, so a request whose text becomes predictable again gets speculation back.

(Related: the dynamic draft lengths of SpecDec++ (Huang et al. 2024) and vLLM's acceptance-driven
heuristics; this is the simplest controller that uses the measured cost model.)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveK:
    v: dict[str, float]  # cost model v(k), keys "0".."k_max" (cost.measure_verify_cost()["v"])
    k_max: int = 8
    c: float | None = None  # proposer cost per drafted token / target step; None = estimated online
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9
    probe_every: int = 8
    probe_k: int = 2
    # state (per request; reset())
    proposed: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    plain_steps: int = 0
    t_step: float | None = None  # EMA of one 1-token target step (s)
    c_est: float | None = None
    history: list[int] = field(default_factory=list)  # k of every step

    def __post_init__(self):
        avail = sorted(int(k) for k in self.v)
        self.k_max = min(self.k_max, max(avail))
        if self.k_max < 1:
            raise ValueError("adaptive k needs v(k) measured for some k >= 1")

    def reset(self) -> None:
        self.proposed, self.accepted, self.plain_steps, self.history = [], [], 0, []

    # --- estimates --------------------------------------------------------------------------------
    def acceptance(self, d: int) -> float:
        """Running conditional acceptance at draft position d (0-based), with the prior."""
        n = self.proposed[d] if d < len(self.proposed) else 0.0
        a = self.accepted[d] if d < len(self.accepted) else 0.0
        return (a + self.prior_alpha * self.prior_weight) / (n + self.prior_weight)

    def cost_c(self) -> float:
        if self.c is not None:
            return self.c
        return self.c_est if self.c_est is not None else 0.0

    def speedup(self, k: int) -> float:
        e, run = 1.0, 1.0
        for d in range(k):
            run *= self.acceptance(d)
            e += run
        return e / (self.v[str(k)] + k * self.cost_c())

    def best_k(self) -> tuple[int, float]:
        table = {k: self.speedup(k) for k in range(self.k_max + 1) if str(k) in self.v}
        k = max(table, key=lambda x: (round(table[x], 9), -x))
        return k, table[k]

    # --- the controller ---------------------------------------------------------------------------
    def next_k(self) -> int:
        k, _ = self.best_k()
        if k == 0:
            self.plain_steps += 1
            if self.plain_steps >= self.probe_every:  # look again: the text may have become predictable
                self.plain_steps = 0
                k = min(self.probe_k, self.k_max)
        else:
            self.plain_steps = 0
        self.history.append(k)
        return k

    def update(self, k_used: int, n_proposed: int, n_accepted: int, proposer_s: float = 0.0,
               target_s: float = 0.0) -> None:
        """After a step: the chain asked for (k_used), what the proposer returned, what was accepted, timings."""
        for lst in (self.proposed, self.accepted):
            for i in range(len(lst)):
                lst[i] *= self.decay
            while len(lst) < n_proposed:
                lst.append(0.0)
        for d in range(n_proposed):
            self.proposed[d] += 1.0
            if d < n_accepted:
                self.accepted[d] += 1.0
        if target_s > 0:
            one = target_s / self.v.get(str(n_proposed), 1.0)
            self.t_step = one if self.t_step is None else 0.8 * self.t_step + 0.2 * one
        if n_proposed > 0 and proposer_s > 0 and self.t_step:
            c = proposer_s / n_proposed / self.t_step
            self.c_est = c if self.c_est is None else 0.8 * self.c_est + 0.2 * c

    @property
    def mean_k(self) -> float | None:
        return sum(self.history) / len(self.history) if self.history else None
