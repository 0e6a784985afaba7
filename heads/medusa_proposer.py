"""Medusa as a proposer for the shared verifier.

Medusa reads the target's post-norm last hidden state at the newest cached position h_t, whose own
lm_head gave the pending token x_{t+1}; head i proposes x_{t+2+i}, i.e. the node at depth i+1 below the
pending token. Candidates are deterministic (argmax for a chain, rank paths of the calibrated sparse tree
for a tree), so the proposal carries q = None and the verifier's "sample y ~ p, follow the matching child"
rule keeps sampling lossless. The verifier hands back h at every newly cached position; only the last
one matters (it is the bonus position).
"""

from __future__ import annotations

import torch

from draftsmith.decoding.proposer import AcceptResult, Proposal, Proposer, TargetFeatures, TreeSpec
from draftsmith.heads.medusa import MedusaHeads, MedusaTree


class MedusaProposer(Proposer):
    name = "medusa"
    needs_last_hidden = True

    def __init__(self, heads: MedusaHeads, tree: MedusaTree | None = None):
        self.heads = heads.eval()
        self.tree = tree
        self.h: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    def default_tree_spec(self) -> TreeSpec:
        """The widest spec the calibrated tree needs (depth, per-depth branching, node count)."""
        if not self.tree or not self.tree.paths:
            return TreeSpec.chain(self.num_heads)
        depth = max(len(p) for p in self.tree.paths)
        branching = tuple(1 + max(p[d] for p in self.tree.paths if len(p) > d) for d in range(depth))
        return TreeSpec(branching, max_nodes=len(self.tree.paths))

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures | None) -> None:
        self.h = None
        if features is not None and features.last_hidden is not None and len(features):
            self.h = features.last_hidden[-1]

    def accept(self, result: AcceptResult) -> None:
        if result.features is not None and result.features.last_hidden is not None and len(result.features):
            self.h = result.features.last_hidden[-1]

    @torch.no_grad()
    def propose(self, context, spec: TreeSpec, sampling, generator) -> Proposal:
        depth = min(spec.depth, self.num_heads)
        if self.h is None or depth == 0:
            return Proposal.empty(context.device)
        param = next(self.heads.parameters(), None)
        h = self.h.to(param.dtype) if param is not None else self.h
        if spec.is_chain or self.tree is None:
            tokens = self.heads.first_logits(depth, h).argmax(-1).tolist()
            return Proposal.chain(tokens, device=context.device)
        paths = [p for p in self.tree.paths
                 if len(p) <= depth and all(r < spec.branching[d] for d, r in enumerate(p))]
        if spec.max_nodes is not None:
            paths = paths[: spec.max_nodes]  # tree paths are ordered parents-first: a prefix stays closed
        used_depth = max((len(p) for p in paths), default=0)
        ranks_needed = [1 + max((p[d] for p in paths if len(p) > d), default=0) for d in range(used_depth)]
        logits = self.heads.first_logits(used_depth, h) if used_depth else None
        top = [logits[d].topk(ranks_needed[d]).indices.tolist() for d in range(used_depth)]
        index = {p: i for i, p in enumerate(paths)}
        tokens = [top[len(p) - 1][p[-1]] for p in paths]
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=context.device),
                        torch.tensor(parents, dtype=torch.long, device=context.device))
