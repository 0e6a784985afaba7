"""DSpark as a proposer for the shared verifier: DFlash's one parallel forward over the block, then the Markov
head left to right.

State is DFlash's (dflash/proposer.py: the context keys/values of every committed position, the block
[pending, M, ..., M] run over them). Per step:

  chain   y_0 = the pending token; for j = 1..depth: l_j = b_j + W2 W1[y_{j-1}], y_j = argmax l_j, and the
          confidence c_j = σ(w · [h_j; W1[y_{j-1}]] + β). The proposal carries scores Π_{i<=j} c_i, the estimated
          probability that the chain is accepted up to j, so the verifier's cost model (decoding/budget.py,
          under `--tree auto`) verifies only the prefix that pays: draftsmith's form of vLLM's adaptive
          verification (`confidence_cut: false` leaves the chain whole).
  tree    (`tree: true`) under every kept node of slot d-1, the top-k of slot d's logits corrected by THAT
          node's token (each branch gets its own Markov bias), kept by path probability like EAGLE-2's rerank;
          scores are the path probabilities.

Candidates are deterministic given the context (q = None): the verifier's "sample y ~ p, follow the child
equal to y" rule keeps sampling lossless, and greedy output is the target's whatever is proposed.

Calibration: for every chain the verifier judged, the proposer keeps (c_j, accepted) for the tokens it
accepted and the first one it rejected (decoding/calibration.py), which the evaluator reports as ECE and a
reliability table.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.proposer import AcceptResult, Proposal, TreeSpec
from draftsmith.dflash.proposer import DFlashProposer, best_nodes
from draftsmith.dspark.model import DSparkDraft, load_dspark


class DSparkProposer(DFlashProposer):
    name = "dspark"
    estimates_acceptance = True

    def __init__(self, draft: DSparkDraft, depth: int | None = None, tree: bool = False, topk: int = 2,
                 max_nodes: int = 24, confidence_cut: bool = True, **opts):
        super().__init__(draft, depth=depth, tree=tree, topk=topk, max_nodes=max_nodes, **opts)
        self.confidence_cut = bool(confidence_cut) and draft.confidence_head is not None
        self._last: list[float] | None = None  # the confidences of the last chain proposed
        self.reset_stats()

    def gpu_tree(self) -> tuple[DSparkProposer, TreeSpec]:
        other = DSparkProposer(self.draft, depth=self.draft.config.block_size - 1, tree=True, **self.GPU_TREE)
        return other, other.default_tree_spec()

    # --- drafting -----------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling, generator) -> Proposal:
        device = context.device
        self._last = None
        depth = min(spec.depth, self.draft.config.block_size - 1)
        if depth == 0:
            return Proposal.empty(device)
        h = self.draft.head_states(self.block_states(context)[:depth])
        base = self.draft.head_logits(h)
        prev = context[-1:].to(self._device)
        if spec.is_chain or not self.tree:
            return self._chain(h, base, prev, device)
        return self._tree(h, base, prev, spec, device)

    def _chain(self, h: torch.Tensor, base: torch.Tensor, prev: torch.Tensor, device) -> Proposal:
        markov, draft = self.draft.markov_head, self.draft
        tokens, embeds = [], []
        for j in range(base.shape[0]):
            e = markov.embed(prev)
            y = draft.to_target_ids((base[j] + markov.bias(e)[0].to(base.dtype)).argmax(-1, keepdim=True))
            tokens.append(y)
            embeds.append(e)
            prev = y
        proposal = Proposal.chain(torch.cat(tokens), device=device)
        if draft.confidence_head is not None:
            conf = torch.sigmoid(draft.confidence_head(h, torch.cat(embeds)).float())
            self._last = conf.tolist()
            if self.confidence_cut:
                proposal.scores = conf.cumprod(0).cpu()
        return proposal

    def _tree(self, h: torch.Tensor, base: torch.Tensor, prev: torch.Tensor, spec: TreeSpec, device) -> Proposal:
        """Per slot d, the top-k tokens under every kept node of slot d-1, each from slot d's logits corrected by
        that node's own token, valued by the product of their probabilities; the best `max_nodes` are kept (a
        child's value never exceeds its parent's, so the kept set is closed under ancestors)."""
        markov, draft = self.draft.markov_head, self.draft
        budget = min(spec.max_nodes or self.max_nodes, spec.capacity())
        tok: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        frontier = [(-1, 0.0, int(prev[0]))]  # (node, log path probability, its token)
        for d in range(base.shape[0]):
            k = min(self.topk, spec.branching[d], base.shape[-1])
            prev_ids = torch.tensor([t for _, _, t in frontier], dtype=torch.long, device=self._device)
            logits = base[d][None] + markov.bias(markov.embed(prev_ids)).to(base.dtype)  # [F, N]
            logp, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
            ids = draft.to_target_ids(ids)
            nxt = []
            for (par, s, _), lps, ts in zip(frontier, logp.tolist(), ids.tolist()):
                for lp, t in zip(lps, ts):
                    tok.append(t)
                    parent.append(par)
                    score.append(s + lp)
                    nxt.append((len(tok) - 1, s + lp, t))
            frontier = sorted(nxt, key=lambda x: -x[1])[:budget]
        return best_nodes(tok, parent, score, budget, device)

    # --- calibration --------------------------------------------------------------------------------
    def accept(self, result: AcceptResult) -> None:
        super().accept(result)
        if self._last is None or not len(result.proposal):
            return
        judged = len(result.proposal)  # what the verifier kept of the chain (a prefix: scores only fall)
        m = len(result.accepted_nodes)
        for j in range(min(m + 1, judged)):
            self._estimates.append(self._last[j])
            self._accepted.append(int(j < m))
        self._last = None

    def reset_stats(self) -> None:
        self._estimates: list[float] = []
        self._accepted: list[int] = []

    def acceptance_estimates(self) -> tuple[list[float], list[int]]:
        """(estimate, accepted) of every drafted token the verifier judged since `reset_stats`."""
        return list(self._estimates), list(self._accepted)


def build_proposer(target, path: str, **opts):
    """Decoder registry hook: `dspark:PATH` -> a DSparkProposer for `target` (fingerprint checked)."""
    draft, _ = load_dspark(path, target)
    return DSparkProposer(draft, **opts)
