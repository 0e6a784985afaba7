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


def merge_trees(proposals: list[Proposal], spec: TreeSpec) -> tuple[Proposal, list[list[int]]]:
    """Trie-merge `proposals` (priority order) into one tree that fits `spec`.

    Returns the merged proposal (q = None) and, per input proposal, the merged index of each of its nodes
    (-1 where the node was cut by the budget; a cut node's descendants are cut too).
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    n_children: dict[int, int] = {}
    index: dict[tuple[int, int], int] = {}
    capacity = spec.capacity()
    maps: list[list[int]] = []
    for prop in proposals:
        mine: list[int] = []
        for tok, par in zip(prop.tokens.tolist(), prop.parent_list):
            mp = -1 if par < 0 else mine[par]
            if par >= 0 and mp < 0:  # its parent was cut
                mine.append(-1)
                continue
            key = (mp, int(tok))
            if key in index:
                mine.append(index[key])
                continue
            d = 1 if mp < 0 else depth[mp] + 1
            if d > spec.depth or len(tokens) >= capacity or n_children.get(mp, 0) >= spec.branching[d - 1]:
                mine.append(-1)
                continue
            index[key] = len(tokens)
            mine.append(len(tokens))
            n_children[mp] = n_children.get(mp, 0) + 1
            tokens.append(int(tok))
            parents.append(mp)
            depth.append(d)
        maps.append(mine)
    device = proposals[0].tokens.device if proposals else "cpu"
    merged = Proposal(torch.tensor(tokens, dtype=torch.long, device=device),
                      torch.tensor(parents, dtype=torch.long, device=device), None)
    return merged, maps


def union_spec(specs: list[TreeSpec]) -> TreeSpec:
    """A verifier budget that holds every sub-tree side by side: per depth the summed branching, and the
    summed node capacity."""
    depth = max((s.depth for s in specs), default=0)
    branching = tuple(max(1, sum(s.branching[d] for s in specs if d < s.depth)) for d in range(depth))
    return TreeSpec(branching, sum(s.capacity() for s in specs))


class MultiProposer(Proposer):
    """Merge the trees of `proposers` (priority order) into one proposal per step."""

    tracks_branches = True

    def __init__(self, proposers: list[Proposer], specs: list[TreeSpec] | None = None, k: int = 4,
                 names: list[str] | None = None):
        if len(proposers) < 2:
            raise ConfigError("a multi-proposer tree needs at least two proposers")
        self.proposers = proposers
        if specs is None:
            specs = [p.default_tree_spec() or TreeSpec.chain(k) for p in proposers]
        if len(specs) != len(proposers):
            raise ConfigError(f"{len(proposers)} proposers but {len(specs)} tree specs")
        self.specs = specs
        self.names = names or _unique([p.name for p in proposers])
        self.name = "multi:" + "+".join(self.names)
        self.needs_last_hidden = any(p.needs_last_hidden for p in proposers)
        self.target_layers = sorted({int(i) for p in proposers for i in p.target_layers})
        self.stats = {n: BranchStats() for n in self.names}
        self._maps: list[list[int]] = []
        self._subs: list[Proposal] = []
        self._last: Proposal | None = None

    def default_tree_spec(self) -> TreeSpec:
        return union_spec(self.specs)

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
        merged, self._maps = merge_trees(subs, spec)
        self._subs, self._last = subs, merged
        return merged

    def accept(self, result: AcceptResult) -> None:
        path = result.accepted_nodes
        n_acc = len(path)
        if result.proposal is not self._last:  # a step the verifier ran without asking us (depth 0)
            self._subs = [Proposal.empty(result.context.device) for _ in self.proposers]
            self._maps = [[] for _ in self.proposers]
        self._last = None
        for name, p, sub, mp in zip(self.names, self.proposers, self._subs, self._maps):
            where = {m: i for i, m in enumerate(mp) if m >= 0}
            own: list[int] = []
            for node in path:  # the accepted path's prefix that lies on this proposer's branch
                if node not in where:
                    break
                own.append(where[node])
            s = self.stats[name]
            s.proposed += len(sub)
            s.accepted += len(own)
            s.steps += 1
            if n_acc and len(own) == n_acc:
                s.wins += 1
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
