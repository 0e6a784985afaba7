"""DFlash as a proposer for the shared verifier: one forward drafts a block.

State of one sequence. The verifier hands over the target's tapped features of every position it caches:
the prompt (`begin`) and, after each step, the root and the accepted nodes (`accept`) — every committed
position except the pending token, whose feature the target has not computed yet. The draft keeps, per
layer, the context keys/values of those positions (`DFlashDraft.context_kv`), appended lazily at the next
`propose`. A proposal runs the block [pending, M, ..., M] at positions n-1 .. n-1+B-1 (n = len(context))
over that cache and its own keys, and drafts slot j's argmax (j = 1..depth).

Chain: the argmax of each slot. Tree (`tree: true`): each slot's top-k (spec.branching) as alternatives,
children of every node of the previous slot, kept by path probability like EAGLE-2's rerank — the block
forward gives every slot's distribution at once, so the tree costs no extra draft forward, only verified
nodes. Candidates are deterministic given the context, so proposals carry q = None: the verifier's
"sample y ~ p, follow the child equal to y" rule keeps sampling lossless.

A draft with a reduced vocabulary (`draft_vocab_size`) ranks its own N tokens; the chosen ids are mapped to
target ids through d2t before the verifier sees them (a token outside the vocabulary is never proposed, so
it is only ever a rejection: greedy output stays the target's).
"""

from __future__ import annotations

import torch

from draftsmith.decoding.proposer import FeatureProposer, Proposal, TreeSpec
from draftsmith.dflash.model import DFlashDraft, load_dflash
from draftsmith.errors import ConfigError


class DFlashProposer(FeatureProposer):
    name = "dflash"
    who = "DFlash proposer"

    def __init__(self, draft: DFlashDraft, depth: int | None = None, tree: bool = False, topk: int = 2,
                 max_nodes: int = 24, **_opts):
        bs = draft.config.block_size
        depth = bs - 1 if depth is None else depth
        if not 1 <= depth <= bs - 1:
            raise ConfigError(f"DFlash proposer: depth must be in 1..{bs - 1} (block size {bs}), got {depth}")
        if topk < 1 or max_nodes < 1:
            raise ConfigError(f"DFlash proposer needs topk, max_nodes >= 1 (got {topk}, {max_nodes})")
        super().__init__(draft, depth, tree, topk, max_nodes)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: the context keys/values

    @property
    def draft(self) -> DFlashDraft:
        return self.network

    # A GPU verifies EAGLE-2's 60 nodes in about the time of one token, so the GPU-sized shape of a block is the
    # tree of each slot's top 10 cut to the 60 best paths: the same budget as an EAGLE head's (eagle/proposer.py
    # GPU_TREE). The chain of the whole block, what vLLM and SGLang serve, is the proposer's default shape.
    GPU_TREE = {"topk": 10, "max_nodes": 60}

    def gpu_tree(self) -> tuple[DFlashProposer, TreeSpec]:
        other = DFlashProposer(self.draft, depth=self.draft.config.block_size - 1, tree=True, **self.GPU_TREE)
        return other, other.default_tree_spec()

    # --- state --------------------------------------------------------------------------------------
    def restart(self) -> None:
        self.cache = None

    def _enter_committed(self) -> None:
        """Context keys/values for the committed positions whose features arrived since the last call."""
        feats = self.take_pending()
        if feats is None:
            return
        feats = feats[None]
        n = feats.shape[1]
        positions = torch.arange(self.n_done, self.n_done + n, device=self._device)[None]
        new = self.draft.context_kv(self.draft.context(feats), positions)
        if self.cache is None:
            self.cache = new
        else:
            self.cache = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2))
                          for (k0, v0), (k1, v1) in zip(self.cache, new)]
        self.n_done += n

    # --- drafting -----------------------------------------------------------------------------------
    @torch.no_grad()
    def block_logits(self, context: torch.Tensor) -> torch.Tensor:
        """[B-1, V] logits of slots 1..B-1 of the block anchored at the pending token ([B-1, N] over a reduced
        draft vocabulary: `draft.to_target_ids` maps their ids)."""
        return self.draft.logits(self.block_states(context))

    @torch.no_grad()
    def block_states(self, context: torch.Tensor) -> torch.Tensor:
        """[B-1, H] outputs z of slots 1..B-1 of the block anchored at the pending token (one forward)."""
        self._enter_committed()
        n = context.numel()
        if self.cache is None or self.n_done != n - 1:
            raise ConfigError(f"DFlash proposer has the features of {self.n_done} positions, the context needs "
                              f"{n - 1} (every committed token but the pending one)")
        bs = self.draft.config.block_size
        ids = torch.full((1, bs), self.draft.config.mask_token_id, dtype=torch.long, device=self._device)
        ids[0, 0] = context[-1]
        positions = torch.arange(n - 1, n - 1 + bs, device=self._device)[None]
        z = self.draft.run_blocks(ids, positions, self.cache, None)  # every context key precedes the anchor
        return z[0, 1:]

    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling, generator) -> Proposal:
        device = context.device
        depth = min(spec.depth, self.draft.config.block_size - 1)
        if depth == 0:
            return Proposal.empty(device)
        logits = self.block_logits(context)[:depth]
        if spec.is_chain or not self.tree:
            return Proposal.chain(self.draft.to_target_ids(logits.argmax(-1)), device=device)
        return self._tree(logits, spec, device)

    def _tree(self, logits: torch.Tensor, spec: TreeSpec, device) -> Proposal:
        """Per slot d the top-k tokens under every kept node of slot d-1, valued by the product of their
        slots' probabilities; the best `max_nodes` are kept (closed under ancestors: a child's value never
        exceeds its parent's)."""
        budget = min(spec.max_nodes or self.max_nodes, spec.capacity())
        logp, ids = torch.log_softmax(logits.float(), -1).topk(min(self.topk, logits.shape[-1]), dim=-1)
        ids = self.draft.to_target_ids(ids)
        tok, parent, score = [], [], []
        frontier = [(-1, 0.0)]
        for d in range(logits.shape[0]):
            k = min(self.topk, spec.branching[d])
            nxt = []
            for par, s in frontier:
                for lp, t in zip(logp[d, :k].tolist(), ids[d, :k].tolist()):
                    tok.append(t)
                    parent.append(par)
                    score.append(s + lp)
                    nxt.append((len(tok) - 1, s + lp))
            frontier = sorted(nxt, key=lambda x: -x[1])[:budget]
        return best_nodes(tok, parent, score, budget, device)


def best_nodes(tok: list[int], parent: list[int], score: list[float], budget: int, device) -> Proposal:
    """The `budget` nodes of highest log path probability `score` (ties: creation order) as a proposal, closed
    under ancestors (a child's value never exceeds its parent's); scores = path probabilities."""
    keep: list[int] = []
    index: dict[int, int] = {}
    for i in sorted(sorted(range(len(tok)), key=lambda i: (-score[i], i))[:budget]):
        if parent[i] < 0 or parent[i] in index:  # creation order: a parent is decided before its children
            index[i] = len(keep)
            keep.append(i)
    return Proposal(torch.tensor([tok[i] for i in keep], dtype=torch.long, device=device),
                    torch.tensor([index[parent[i]] if parent[i] >= 0 else -1 for i in keep], dtype=torch.long,
                                 device=device),
                    scores=torch.tensor([score[i] for i in keep], dtype=torch.float32).exp())


def build_proposer(target, path: str, **opts):
    """Decoder registry hook: `dflash:PATH` -> a DFlashProposer for `target` (fingerprint checked)."""
    draft, _ = load_dflash(path, target)
    return DFlashProposer(draft, **opts)
