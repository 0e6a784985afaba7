"""Multi-proposer token trees: several proposers' candidates merged into ONE tree, verified in one pass.

SpecInfer (Miao et al. 2023, §3) verifies the token trees of several small speculative models at once; the
same idea applies to any mix of draftsmith proposers (a draft model, Medusa heads, EAGLE, n-gram lookup).
Every sub-proposer proposes for the same context with its own tree budget; the trees are merged as a trie
(two nodes with the same parent and the same token become one), so a prefix two proposers agree on costs
one verified position, and the target checks every branch in the same forward.

Losslessness: the merged candidates come from different distributions (and a node may stand for several
proposers), so the merged proposal is declared deterministic (`q = None`) and the verifier uses its rule 2
(sample y ~ p, follow the child equal to y): the token emitted at each position is exactly a draw from the
target, whatever the candidate set. Greedy decoding stays token-for-token equal to the target's.

Attribution: after each step every sub-proposer is credited with the number of accepted tokens that lie
on its own branch (the longest prefix of the accepted path it proposed), and a "win" when its branch
reached the accepted depth (ties credit everyone). `branch_stats()` returns these counters.

Budget: the merged tree holds at most as many nodes as the largest sub-tree alone (`default_tree_spec`;
at the GPU-sized budget, `gpu_tree`, EAGLE-2's 60 nodes in total, not 60 plus the lookup's chain), so a
merged tree is compared with the head alone at the same verification cost. Which nodes stay is decided by
score, the estimated probability that a node's root path is accepted: a sub-proposer's own path
probabilities (EAGLE-2, Medusa) times a running calibration against what the verifier accepted on its
branch, and for a proposer without scores (n-gram lookup, a draft chain) its measured acceptance at each
depth. A node two proposers share keeps the higher estimate. A child never outscores its parent, so the
best n nodes form a tree, and the merged proposal carries the scores: under `--tree auto` the verifier
cuts it further to the nodes that pay on this machine (decoding/budget.py), per step, so lookup's branch
stays where it is accepted (text the answer copies) and drops out where it is not.

Spec syntax: `multi:ngram+medusa:runs/medusa/x+draft:runs/distill/y` (sub-specs joined by `+`). Each
sub-proposer uses its own default tree (`default_tree_spec`, e.g. Medusa's calibrated tree, EAGLE-2's
budget) or a chain of `k`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.decoding.proposer import AcceptResult, Proposal, Proposer, TargetFeatures, TreeSpec
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import ConfigError


@dataclass
class BranchStats:
    """Per sub-proposer counters over the steps of a run."""

    proposed: int = 0  # nodes it proposed (before merging)
    accepted: int = 0  # accepted tokens on its branch
    wins: int = 0  # steps where its branch reached the accepted depth (accepted >= 1)
    steps: int = 0

    def to_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "wins": self.wins, "steps": self.steps,
                "alpha": self.accepted / self.proposed if self.proposed else None,
                "win_rate": self.wins / self.steps if self.steps else None}


def merge_trees(proposals: list[Proposal], spec: TreeSpec,
                scores: list[list[float]] | None = None) -> tuple[Proposal, list[list[int]]]:
    """Trie-merge `proposals` (priority order) into one tree that fits `spec`.

    Without `scores`, nodes are taken in priority order until the budget is full. With `scores` (per
    proposal, per node: the estimated probability that the node's root path is accepted, never above its
    parent's), every node within the depth and branching limits is merged first, a shared node keeps its
    highest estimate, and the best `spec.capacity()` by score stay (ties: shallower, then earlier), which is
    a tree since no child outscores its parent; the merged proposal then carries those scores.

    Returns the merged proposal (q = None) and, per input proposal, the merged index of each of its nodes
    (-1 where the node was cut by the budget; a cut node's descendants are cut too).
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    best: list[float] = []
    n_children: dict[int, int] = {}
    index: dict[tuple[int, int], int] = {}
    capacity = spec.capacity()
    limit = capacity if scores is None else None  # scored: cut by score after merging everything
    maps: list[list[int]] = []
    for j, prop in enumerate(proposals):
        mine: list[int] = []
        for i, (tok, par) in enumerate(zip(prop.tokens.tolist(), prop.parent_list)):
            mp = -1 if par < 0 else mine[par]
            if par >= 0 and mp < 0:  # its parent was cut
                mine.append(-1)
                continue
            key = (mp, int(tok))
            score = scores[j][i] if scores is not None else 0.0
            if key in index:
                mine.append(index[key])
                best[index[key]] = max(best[index[key]], score)
                continue
            d = 1 if mp < 0 else depth[mp] + 1
            full = limit is not None and len(tokens) >= limit
            if d > spec.depth or full or n_children.get(mp, 0) >= spec.branching[d - 1]:
                mine.append(-1)
                continue
            index[key] = len(tokens)
            mine.append(len(tokens))
            n_children[mp] = n_children.get(mp, 0) + 1
            tokens.append(int(tok))
            parents.append(mp)
            depth.append(d)
            best.append(score)
        maps.append(mine)
    keep = list(range(len(tokens)))
    if scores is not None and len(tokens) > capacity:
        keep = sorted(sorted(keep, key=lambda n: (-best[n], depth[n], n))[:capacity])
    new = {old: i for i, old in enumerate(keep)}
    if any(parents[n] >= 0 and parents[n] not in new for n in keep):
        raise ConfigError("merged proposal scores grow from a parent to a child: they must be path probabilities")
    device = proposals[0].tokens.device if proposals else "cpu"
    merged = Proposal(torch.tensor([tokens[n] for n in keep], dtype=torch.long, device=device),
                      torch.tensor([new[parents[n]] if parents[n] >= 0 else -1 for n in keep], dtype=torch.long,
                                   device=device), None,
                      scores=None if scores is None else torch.tensor([best[n] for n in keep], dtype=torch.float32))
    return merged, [[new.get(m, -1) for m in mine] for mine in maps]


def union_spec(specs: list[TreeSpec]) -> TreeSpec:
    """A verifier budget that holds every sub-tree side by side: per depth the summed branching, and the
    summed node capacity."""
    depth = max((s.depth for s in specs), default=0)
    branching = tuple(max(1, sum(s.branching[d] for s in specs if d < s.depth)) for d in range(depth))
    return TreeSpec(branching, sum(s.capacity() for s in specs))


class Confidence:
    """What one sub-proposer's nodes are worth, learned from what the verifier accepted on its branch.

    A proposer with scores of its own (path probabilities) gets them times λ = (accepted + prior) / (expected
    + prior), expected being the sum of its verified nodes' scores (EAGLE's own calibration, eagle/proposer.py,
    applied here to every scored proposer alike). A proposer without scores gets, at depth d, the share of
    the steps with a verified node of its at depth d whose branch was accepted to depth d, made non-increasing
    over d. Both forget at DECAY per step (the last ~50 steps count: lookup pays on one prompt and not the
    next), and start from PRIOR pseudo-steps of "half of each level is accepted"."""

    PRIOR = 2.0
    DECAY = 0.98

    def __init__(self):
        self.accepted = 0.0
        self.expected = 0.0
        self.offered: list[float] = []  # per depth (0 = depth 1): steps with a verified node there
        self.reached: list[float] = []  # per depth: steps whose accepted branch reached it

    def scores(self, prop: Proposal) -> list[float]:
        if prop.scores is not None:
            lam = (self.accepted + self.PRIOR) / (self.expected + self.PRIOR)
            return [min(1.0, lam * float(x)) for x in prop.scores.tolist()]
        rates, low = [], 1.0
        for d in range(max(prop.depths, default=0)):
            seen = self.offered[d] if d < len(self.offered) else 0.0
            hit = self.reached[d] if d < len(self.reached) else 0.0
            low = min(low, (hit + self.PRIOR * 0.5 ** (d + 1)) / (seen + self.PRIOR))
            rates.append(low)
        return [rates[d - 1] for d in prop.depths]

    def update(self, prop: Proposal, verified: list[bool], accepted: int) -> None:
        """One step: which of its nodes the verifier saw, and how deep its branch was accepted."""
        decay = self.DECAY
        self.accepted = decay * self.accepted + accepted
        if prop.scores is not None:
            seen = [float(x) for x, v in zip(prop.scores.tolist(), verified) if v]
            self.expected = decay * self.expected + sum(seen)
        depths = {d for d, v in zip(prop.depths, verified) if v}
        n = max(depths, default=0)
        while len(self.offered) < n:
            self.offered.append(0.0)
            self.reached.append(0.0)
        for d in range(len(self.offered)):
            self.offered[d] = decay * self.offered[d] + (d + 1 in depths)
            self.reached[d] = decay * self.reached[d] + (d + 1 in depths and accepted >= d + 1)


class MultiProposer(Proposer):
    """Merge the trees of `proposers` (priority order) into one proposal per step, at most `budget` nodes
    (default: the largest sub-tree's own), the best by score (see the module docstring)."""

    tracks_branches = True

    def __init__(self, proposers: list[Proposer], specs: list[TreeSpec] | None = None, k: int = 4,
                 names: list[str] | None = None, budget: int | None = None):
        if len(proposers) < 2:
            raise ConfigError("a multi-proposer tree needs at least two proposers")
        self.proposers = proposers
        self.k = k
        if specs is None:
            specs = [p.default_tree_spec() or TreeSpec.chain(k) for p in proposers]
        if len(specs) != len(proposers):
            raise ConfigError(f"{len(proposers)} proposers but {len(specs)} tree specs")
        self.specs = specs
        self.budget = budget if budget is not None else max(sp.capacity() for sp in specs)
        self.names = names or _unique([p.name for p in proposers])
        self.name = "multi:" + "+".join(self.names)
        self.needs_last_hidden = any(p.needs_last_hidden for p in proposers)
        self.target_layers = sorted({int(i) for p in proposers for i in p.target_layers})
        self.stats = {n: BranchStats() for n in self.names}
        self.confidence = [Confidence() for _ in proposers]
        self._maps: list[list[int]] = []
        self._subs: list[Proposal] = []
        self._last: Proposal | None = None

    def default_tree_spec(self) -> TreeSpec:
        union = union_spec(self.specs)
        return TreeSpec(union.branching, min(union.capacity(), self.budget))

    def gpu_tree(self) -> tuple[MultiProposer, TreeSpec] | None:
        """The merged tree at the GPU-sized budget: each sub-proposer's own GPU-sized tree (EAGLE-2's 60 nodes)
        merged, at most the largest of those budgets in total; a proposer without one (n-gram lookup) drafts a
        chain as deep as the deepest of them. None when no sub-proposer has a GPU-sized tree."""
        own = [p.gpu_tree() for p in self.proposers]
        if all(g is None for g in own):
            return None
        depth = max(g[1].depth for g in own if g is not None)
        props = [g[0] if g is not None else p for g, p in zip(own, self.proposers)]
        specs = [g[1] if g is not None else TreeSpec.chain(depth) for g in own]
        budget = max(g[1].capacity() for g in own if g is not None)
        other = MultiProposer(props, specs, self.k, self.names, budget)
        return other, other.default_tree_spec()

    def use_cost(self, cost) -> None:
        for p in self.proposers:  # EAGLE-2 stops drafting levels no cut could use
            p.use_cost(cost)

    def reset_stats(self) -> None:
        self.stats = {n: BranchStats() for n in self.names}

    def use_dtype(self, dtype: torch.dtype) -> bool:
        return any([p.use_dtype(dtype) for p in self.proposers])  # a list: every one is cast

    def branch_stats(self) -> dict[str, dict]:
        return {n: s.to_dict() for n, s in self.stats.items()}

    def _features_for(self, prop: Proposer, feats: TargetFeatures | None) -> TargetFeatures | None:
        if not prop.needs_features or feats is None:
            return None
        return TargetFeatures(feats.last_hidden if prop.needs_last_hidden else None,
                              {i: feats.layers[i] for i in prop.target_layers})

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures | None) -> None:
        for p in self.proposers:
            p.begin(prompt_ids, self._features_for(p, features))

    @torch.no_grad()
    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        subs = []
        for p, own in zip(self.proposers, self.specs):
            sub_spec = own.truncated(min(own.depth, spec.depth))
            subs.append(p.propose(context, sub_spec, sampling, generator) if sub_spec.depth else
                        Proposal.empty(context.device))
        budget = TreeSpec(spec.branching, min(spec.capacity(), self.budget))
        merged, self._maps = merge_trees(subs, budget, [c.scores(sub) for c, sub in zip(self.confidence, subs)])
        self._subs, self._last = subs, merged
        return merged

    def _verified(self, result: AcceptResult) -> tuple[set[int], list[int]]:
        """The merged nodes the verifier saw (all of ours, or those its cost-model cut kept: a new proposal with
        the same tokens under the same parents) and the accepted path, both as indices of our merged tree."""
        ours, seen = self._last, result.proposal
        if seen is ours:
            return set(range(len(ours))), list(result.accepted_nodes)
        index = {(p, t): i for i, (t, p) in enumerate(zip(ours.tokens.tolist(), ours.parent_list))}
        at: list[int] = []
        for t, p in zip(seen.tokens.tolist(), seen.parent_list):
            at.append(index[(at[p] if p >= 0 else -1, t)])
        return set(at), [at[n] for n in result.accepted_nodes]

    def accept(self, result: AcceptResult) -> None:
        if self._last is None:  # a step the verifier ran without asking us (depth 0)
            self._subs = [Proposal.empty(result.context.device) for _ in self.proposers]
            self._maps = [[] for _ in self.proposers]
            verified, path = set(), []
        else:
            verified, path = self._verified(result)
        n_acc = len(path)
        self._last = None
        for j, (name, p, sub, mp) in enumerate(zip(self.names, self.proposers, self._subs, self._maps)):
            where = {m: i for i, m in enumerate(mp) if m >= 0}
            own: list[int] = []
            for node in path:  # the accepted path's prefix that lies on this proposer's branch
                if node not in where:
                    break
                own.append(where[node])
            seen = [m in verified for m in mp]
            self.confidence[j].update(sub, seen, len(own))
            s = self.stats[name]
            s.proposed += len(sub)
            s.accepted += len(own)
            s.steps += 1
            if n_acc and len(own) == n_acc:
                s.wins += 1
            if sub.scores is not None:  # its own calibration counts the nodes that were verified only
                sub = Proposal(sub.tokens, sub.parents, sub.q,
                               scores=sub.scores * torch.tensor(seen, dtype=sub.scores.dtype))
            p.accept(AcceptResult(sub, own, result.new_tokens, result.context,
                                  self._features_for(p, result.features)))


def _unique(names: list[str]) -> list[str]:
    out, seen = [], {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def build_multi(arg: str, target, build_proposer, **opts) -> MultiProposer:
    """`multi:A+B+...` -> MultiProposer over build_proposer(A), build_proposer(B), ... (`build_proposer` is
    decoding/factory.py's, handed down so that this module does not import the factory that imports it)."""
    parts = [s.strip() for s in arg.split("+") if s.strip()]
    if len(parts) < 2:
        raise ConfigError(f"proposer 'multi:{arg}': give at least two sub-proposers joined by '+', "
                          "e.g. multi:ngram+medusa:runs/medusa/smollm2-135m")
    if any(p.lower().startswith("multi") for p in parts):
        raise ConfigError("multi-proposer trees do not nest")
    k = int(opts.pop("k", 4))
    return MultiProposer([build_proposer(p, target, **opts) for p in parts], k=k)
