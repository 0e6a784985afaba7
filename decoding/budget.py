"""Cost-aware tree size: verify only as many proposed nodes as pay for their verification.

A tree proposer (Medusa's calibrated tree, EAGLE-2's reranked tree) proposes up to its node budget. Every
node adds a row to the verify forward, and on a CPU the forward's cost grows with its rows: v(n), the time
of a forward over the pending token plus n nodes in units of a 1-token step, reaches about 3 at n = 48 for
SmolLM2-135M here (BENCHMARKS.md). A proposal may carry `scores`: the estimated probability that node i
is accepted, i.e. that its whole root path is accepted (Medusa: the product of its heads' calibrated
rank accuracies; EAGLE-2: the product of the draft's probabilities along the path, the "confidence ≈
acceptance rate" observation of Li et al. 2024, EAGLE-2 §3). A path probability never grows from a node
to its child, so the nodes sorted by score (ties: proposal order, parents first) are closed under
ancestors at every cut, and the expected accepted length of the first n of them is the sum of their
scores (Medusa §3.1.2 and Sequoia, Chen et al. 2024, use the same additivity). Each step keeps the
n that maximises

    (1 + Σ_{i<n} score_i) / (v(n) + c_step)

the expected tokens per unit of time of this step, c_step being the time the proposer just spent (in
target steps). The pruned tree is still a valid proposal whose candidates were fixed before
verification, so greedy verification is exactly as lossless as before; under sampling only proposals
with deterministic candidates (q = None) are pruned, since dropping some of several i.i.d. draws by
their identity would bias the multi-candidate rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.decoding.proposer import Proposal
from draftsmith.errors import ConfigError


@dataclass(frozen=True)
class VerifyCost:
    """v[n] = time of a verify forward over the pending token and n nodes / time of a 1-token step."""

    v: tuple[float, ...]
    t_step_s: float

    def __post_init__(self):
        if not self.v or self.t_step_s <= 0:
            raise ConfigError("a verify cost model needs v(0..n) and a positive 1-token step time")

    @classmethod
    def from_measurement(cls, measured: dict, monotone: bool = True) -> VerifyCost:
        """From `decoding.cost.measure_verify_cost`'s dict ({"v": {"0": 1.0, "1": ...}, "t_step_s": ...}).

        monotone: replace the medians by their closest non-decreasing fit (timing noise makes a measured
        v(n) dip now and then, and a dip would make one node count look cheaper than fewer)."""
        v = [float(measured["v"][str(n)]) for n in range(len(measured["v"]))]
        return cls(tuple(isotonic(v) if monotone else v), float(measured["t_step_s"]))

    def __call__(self, n: int) -> float:
        if n < len(self.v):
            return self.v[n]
        # past the measured range: extend the last measured slope (the forward is linear in rows there)
        slope = (self.v[-1] - self.v[-2]) if len(self.v) > 1 else 0.0
        return self.v[-1] + max(slope, 0.0) * (n - len(self.v) + 1)


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for x in values:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def _best(sorted_scores: list[float], cost: VerifyCost, c_step: float | Sequence[float]) -> tuple[int, float]:
    def c(n: int) -> float:
        return float(c_step) if isinstance(c_step, (int, float)) else float(c_step[n])

    best_n, best, total = 0, 1.0 / (cost(0) + c(0)), 1.0
    for n, s in enumerate(sorted_scores, 1):
        total += s
        rate = total / (cost(n) + c(n))
        if rate > best:
            best_n, best = n, rate
    return best_n, best


def best_size(sorted_scores: list[float], cost: VerifyCost, c_step: float | Sequence[float] = 0.0) -> int:
    """The n in 0..len(sorted_scores) maximising (1 + sum of the first n scores) / (v(n) + c_step), where
    c_step is the proposer's time in target steps: one number, or one per n (c_step[n])."""
    return _best(sorted_scores, cost, c_step)[0]


def best_rate(sorted_scores: list[float], cost: VerifyCost, c_step: float = 0.0) -> float:
    """That maximum itself: expected tokens per target-step of time of the best cut."""
    return _best(sorted_scores, cost, c_step)[1]


def worth_deeper(scores: list[float], bound: float, new_per_level: list[int], budget: int, cost: VerifyCost,
                 c_now: float, c_level: float) -> bool:
    """Whether drafting more tree levels can beat cutting the tree `scores` (path probabilities) now.

    Level j adds at most new_per_level[j] nodes, none scoring above `bound` (a child never outscores its
    parent), and costs c_level more proposer time; the tree keeps its best `budget` nodes. If no number of
    further levels could raise the best rate even with every new node at `bound`, stop (an upper bound,
    so stopping never gives up a tree that would have paid more)."""
    have = sorted(scores, reverse=True)
    now = best_rate(have[:budget], cost, c_now)
    extra: list[float] = []
    for j, m in enumerate(new_per_level, 1):
        extra += [bound] * m
        if best_rate(sorted(have + extra, reverse=True)[:budget], cost, c_now + j * c_level) > now:
            return True
    return False


def prune(proposal: Proposal, cost: VerifyCost, c_step: float = 0.0) -> Proposal:
    """The proposal cut to its best-paying nodes (see the module docstring); unchanged without scores."""
    n = len(proposal)
    if proposal.scores is None or n == 0:
        return proposal
    scores = proposal.scores.tolist()
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    keep_n = best_size([scores[i] for i in order], cost, c_step)
    if keep_n == n:
        return proposal
    keep = sorted(order[:keep_n])
    new_index = {old: new for new, old in enumerate(keep)}
    parents = proposal.parent_list
    try:
        new_parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep]
    except KeyError:
        raise ConfigError("proposal scores grow from a parent to a child: they must be path probabilities") from None
    device = proposal.tokens.device
    idx = torch.tensor(keep, dtype=torch.long, device=device)
    return Proposal(proposal.tokens.index_select(0, idx), torch.tensor(new_parents, dtype=torch.long, device=device),
                    proposal.q.index_select(0, idx.to(proposal.q.device)) if proposal.q is not None else None,
                    scores=proposal.scores.index_select(0, idx.to(proposal.scores.device)))
