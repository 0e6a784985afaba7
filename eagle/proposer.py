"""EAGLE as a proposer for the shared verifier: chain drafting and the EAGLE-2 dynamic tree.

State of one sequence. The verifier hands over the target's features (the layers the head reads,
`target_layers`) of every position it caches: the prompt (`begin`) and, after each step, the root and
the accepted nodes (`accept`). The draft's own KV cache (`DraftKV`, one layer) holds one step-0 entry per
COMMITTED position s: input (features f_s, embedding of x_{s+1}) at position id s. Entries are added
lazily at the next `propose`, in one forward over the new positions; the output at the last one (the
bonus position t = len(context) - 2, whose x_{t+1} is the pending token) is the draft's first step a^0.

Drafting from a^0 at position t (EAGLE-3 training-time test, see `eagle/model.py`): a node at depth d
holds token y_d (the draft's prediction from its parent's output); expanding it runs the layer on
(parent's output feature, embedding of y_d) at position t + d, attending every committed entry plus its
ancestors' scratch entries and itself. Scratch entries (chain or tree) are cropped away at the end of
`propose`: the cache never keeps a draft-made entry, so a rejection needs no other rollback, and the
entries for the accepted tokens are recomputed from the target's real features on the next call.

EAGLE-2 dynamic tree (Li et al. 2024, §4): the draft's confidence approximates acceptance, so a node's
value is the product of its path's draft probabilities, V(node) = Π p_draft (summed as log-probs).
  1. The root's top-k tokens are the depth-1 nodes.
  2. At every depth, expand only the `topk` most valuable nodes of that depth (one batched forward),
     each giving its top-k children (at most spec.branching[d]).
  3. Rerank ALL created nodes by value and keep the best `max_nodes`. A child's value never exceeds its
     parent's (p <= 1; ties broken by depth), so the kept set is closed under ancestors: a valid tree.
When the verifier cuts trees by a cost model (`decoding/budget.py`, via `use_cost`), the values are the
scores it cuts by, and step 2 stops at the first depth whose levels no cut could use
(`budget.worth_deeper`: an upper bound with every new node at the best frontier value). The scores are
the values times λ, a running calibration of the draft's confidence against the verifier's acceptances
(`calibration`; `DRAFTSMITH_EAGLE_CALIBRATE=0` turns it off).
Candidates are deterministic given the context (argmax / top-k), so proposals carry q = None and the
verifier's rule "sample y ~ p, follow the child equal to y" keeps sampling lossless; greedy verification
reproduces the target's greedy output.
"""

from __future__ import annotations

import math
import os
import time

import torch

from draftsmith.decoding.budget import worth_deeper
from draftsmith.decoding.proposer import AcceptResult, FeatureProposer, Proposal, TreeSpec
from draftsmith.eagle.model import DraftKV, EagleHead, load_eagle
from draftsmith.errors import ConfigError


class EagleProposer(FeatureProposer):
    name = "eagle"
    who = "EAGLE proposer"

    def __init__(self, head: EagleHead, tree: bool = True, depth: int = 5, topk: int = 4, max_nodes: int = 24,
                 calibrate: bool | None = None, **_opts):
        if depth < 1 or topk < 1 or max_nodes < 1:
            raise ConfigError(f"EAGLE proposer needs depth, topk, max_nodes >= 1 (got {depth}, {topk}, {max_nodes})")
        super().__init__(head, depth, tree, topk, max_nodes)
        self.kv = DraftKV()  # one step-0 entry per committed position (n_done of them)
        self.root: torch.Tensor | None = None  # a^0 at the newest committed position, [H]
        self.cost = None  # the verifier's VerifyCost, if it cuts trees: then drafting stops where the cut would
        self.level_s: float | None = None  # running mean time of one tree level (an expansion), seconds
        # calibration of the draft's confidence against what the verifier accepts (see `calibration`)
        if calibrate is None:
            calibrate = os.environ.get("DRAFTSMITH_EAGLE_CALIBRATE", "1") != "0"
        self.calibrate = calibrate
        self.seen_accepted = 0.0  # decayed sum of accepted lengths of verified scored proposals
        self.seen_expected = 0.0  # decayed sum of their raw expected lengths (Σ raw path probabilities)
        self.scale_used = 1.0  # the calibration factor the last proposal's scores carry

    CALIBRATION_PRIOR = 2.0  # pseudo-steps of "confidence is right" before any evidence
    CALIBRATION_DECAY = 0.99  # per verified step: the last ~100 steps count

    @property
    def calibration(self) -> float:
        """λ: the factor on the draft's path probabilities that makes them predict acceptance, estimated as
        (accepted + prior) / (expected + prior) over recent steps. A draft's confidence is the EAGLE-2 proxy
        for acceptance; an undertrained head is overconfident (λ < 1), and without λ the cost-model cut
        would keep nodes that are never accepted."""
        if not self.calibrate:
            return 1.0
        return (self.seen_accepted + self.CALIBRATION_PRIOR) / (self.seen_expected + self.CALIBRATION_PRIOR)

    @property
    def head(self) -> EagleHead:
        return self.network

    def use_cost(self, cost) -> None:
        self.cost = cost

    def use_dtype(self, dtype: torch.dtype) -> bool:
        self.level_s = None  # a level's time was measured in the old dtype
        return super().use_dtype(dtype)

    # EAGLE-2's defaults on a GPU (Li et al. 2024): depth 6, the top 10 expanded per level, 60 nodes verified
    GPU_TREE = {"depth": 6, "topk": 10, "max_nodes": 60}

    def gpu_tree(self) -> tuple[EagleProposer, TreeSpec]:
        """A proposer over the same head with EAGLE-2's GPU budget, and its tree (see Proposer.gpu_tree)."""
        other = EagleProposer(self.head, tree=True, calibrate=self.calibrate, **self.GPU_TREE)
        return other, other.default_tree_spec()

    # --- state --------------------------------------------------------------------------------------
    def restart(self) -> None:
        self.kv = DraftKV()
        self.root = None

    def accept(self, result: AcceptResult) -> None:
        super().accept(result)
        prop = result.proposal
        if self.calibrate and self.cost is not None and prop is not None and prop.scores is not None and len(prop):
            # the verified (possibly cut) tree: its scores are λ·raw, its expected length Σ raw
            decay = self.CALIBRATION_DECAY
            self.seen_accepted = decay * self.seen_accepted + len(result.accepted_nodes)
            self.seen_expected = decay * self.seen_expected + float(prop.scores.sum()) / self.scale_used

    def _enter_committed(self, context: torch.Tensor) -> None:
        """Step-0 entries for the committed positions whose features arrived since the last call."""
        feats = self.take_pending()
        if feats is None:
            return
        start, n = self.n_done, feats.shape[0]
        if start + n > context.numel() - 1:
            raise ConfigError(f"EAGLE proposer got features for {start + n} positions, context has {context.numel()}")
        tokens = context[start + 1: start + n + 1].to(self._device)  # x_{s+1} for s = start .. start+n-1
        positions = torch.arange(start, start + n, device=self._device)[None]
        allowed = torch.ones(n, start + n, dtype=torch.bool, device=self._device)
        allowed[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self._device).tril()
        out = self.head.layer_step(self.head.fuse(feats)[None], self.head.embed(tokens)[None], positions, self.kv,
                                   allowed)
        self.n_done = start + n
        self.root = out[0, -1]

    # --- drafting -----------------------------------------------------------------------------------
    def _expand(self, parents_h: torch.Tensor, tokens: torch.Tensor, depth: int,
                ancestors: list[list[int]]) -> torch.Tensor:
        """Run the layer for q nodes at `depth` (their parents' outputs [q, H], their tokens [q]); node i attends
        every committed entry, the scratch entries `ancestors[i]` (absolute kv indices) and itself."""
        q = tokens.numel()
        base = len(self.kv)
        allowed = torch.zeros(q, base + q, dtype=torch.bool, device=self._device)
        allowed[:, : self.n_done] = True
        for i, anc in enumerate(ancestors):
            if anc:
                allowed[i, anc] = True
            allowed[i, base + i] = True
        positions = torch.full((1, q), self.n_done - 1 + depth, dtype=torch.long, device=self._device)
        out = self.head.layer_step(parents_h[None], self.head.embed(tokens)[None], positions, self.kv, allowed)
        return out[0]

    @torch.no_grad()
    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling, generator) -> Proposal:
        device = context.device
        self._enter_committed(context)
        depth = spec.depth  # the verifier's budget (default_tree_spec() is this proposer's own choice)
        if self.root is None or depth == 0:
            return Proposal.empty(device)
        try:
            if spec.is_chain or not self.tree:
                return self._chain(depth, device)
            return self._tree(spec, depth, device)
        finally:
            self.kv.crop(self.n_done)  # drop every draft-made entry (the rollback)

    def _chain(self, depth: int, device) -> Proposal:
        h = self.root
        tokens: list[int] = []
        chain_kv: list[int] = []
        for d in range(1, depth + 1):
            tok = self.head.to_target_ids(self.head.logits(h).argmax(-1, keepdim=True))
            tokens.append(int(tok))
            if d < depth:
                h = self._expand(self.head.next_feature(h)[None], tok, d, [list(chain_kv)])[0]
                chain_kv.append(len(self.kv) - 1)
        return Proposal.chain(tokens, device=device)

    def _tree(self, spec: TreeSpec, depth: int, device) -> Proposal:
        """EAGLE-2's dynamic tree: expand the most valuable nodes level by level, then keep the best `budget`."""
        budget = min(spec.max_nodes or self.max_nodes, spec.capacity())
        tree = _DraftTree(self.head, self.topk, spec.branching)
        t_start = time.perf_counter()
        lam = self.calibration if self.cost is not None else 1.0  # the scores' calibration (see `calibration`)
        tree.add_children(-1, self.head.logits(self.root), 0.0, 1)
        frontier = list(range(len(tree.tok)))
        for d in range(1, depth):
            # EAGLE-2 step 2: expand the `topk` most valuable nodes of this depth
            chosen = sorted(frontier, key=lambda i: -tree.score[i])[: self.topk]
            if not chosen or not self._deeper_pays(tree, chosen, d, depth, budget, lam, t_start):
                break
            t_level = time.perf_counter()
            frontier = self._expand_level(tree, chosen, d)
            dt = time.perf_counter() - t_level
            self.level_s = dt if self.level_s is None else 0.8 * self.level_s + 0.2 * dt
        # the draft's path probability is EAGLE-2's estimate of the node's acceptance: the verifier may cut
        # the tree to the nodes that pay for their verification (decoding/budget.py)
        # (times λ, the calibration against what was accepted, when the verifier cuts by them)
        self.scale_used = lam
        return tree.rerank(budget, lam, device)

    def _deeper_pays(self, tree: _DraftTree, chosen: list[int], d: int, depth: int, budget: int, lam: float,
                     t_start: float) -> bool:
        """Whether drafting level d+1 can pay: the verifier will cut the tree to the nodes that pay
        (decoding/budget.py), so levels no cut could use are not drafted, judged by an upper bound on what
        they could add. Without a measured cost every level is drafted."""
        if self.cost is None or self.level_s is None:
            return True
        t_step = self.cost.t_step_s
        per_level = [len(chosen) * self.topk] + [self.topk * self.topk] * (depth - d - 1)
        return worth_deeper([lam * math.exp(x) for x in tree.score], lam * math.exp(max(tree.score[i] for i in chosen)),
                            per_level, budget, self.cost, (time.perf_counter() - t_start) / t_step,
                            self.level_s / t_step)

    def _expand_level(self, tree: _DraftTree, chosen: list[int], d: int) -> list[int]:
        """Run the layer once for the chosen nodes of depth d; their children join the tree. Returns the new
        frontier (the children's indices)."""
        parents_h = self.head.next_feature(
            torch.stack([self.root if tree.parent[i] < 0 else tree.hidden[tree.parent[i]] for i in chosen]))
        anc = [tree.ancestors(tree.parent[i]) if tree.parent[i] >= 0 else [] for i in chosen]
        tokens = torch.tensor([tree.tok[i] for i in chosen], dtype=torch.long, device=self._device)
        base = len(self.kv)
        out = self._expand(parents_h, tokens, d, anc)
        logits = self.head.logits(out)
        first_new = len(tree.tok)
        for r, i in enumerate(chosen):
            tree.kv_index[i] = base + r
            tree.hidden[i] = out[r]
            tree.add_children(i, logits[r], tree.score[i], d + 1)
        return list(range(first_new, len(tree.tok)))


class _DraftTree:
    """The nodes of one EAGLE-2 draft tree, in creation order (parents before children)."""

    def __init__(self, head: EagleHead, topk: int, branching):
        self.head, self.topk, self.branching = head, topk, branching
        self.tok: list[int] = []
        self.parent: list[int] = []
        self.score: list[float] = []  # log path probability
        self.node_depth: list[int] = []
        self.kv_index: dict[int, int] = {}  # expanded node -> its scratch kv entry
        self.hidden: dict[int, torch.Tensor] = {}  # expanded node -> its output feature

    def add_children(self, par: int, logits: torch.Tensor, par_score: float, d: int) -> None:
        k = min(self.topk, self.branching[d - 1], logits.shape[-1])
        logp, ids = torch.log_softmax(logits.float(), -1).topk(k)
        for lp, t in zip(logp.tolist(), self.head.to_target_ids(ids).tolist()):
            self.tok.append(t)
            self.parent.append(par)
            self.score.append(par_score + lp)
            self.node_depth.append(d)

    def ancestors(self, i: int) -> list[int]:
        """Scratch kv entries of node i and its ancestors, root first."""
        out = []
        while i >= 0:
            out.append(self.kv_index[i])
            i = self.parent[i]
        return out[::-1]

    def rerank(self, budget: int, scale: float, device) -> Proposal:
        """EAGLE-2 step 3: rerank every node, keep the best `budget` (closed under ancestors: a child's path
        probability never exceeds its parent's, and ties go to the shallower, earlier node)."""
        keep = sorted(range(len(self.tok)), key=lambda i: (-self.score[i], self.node_depth[i], i))[:budget]
        keep.sort()
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [new_index[self.parent[i]] if self.parent[i] >= 0 else -1 for i in keep]
        scores = torch.tensor([self.score[i] for i in keep], dtype=torch.float32).exp() * scale
        return Proposal(torch.tensor([self.tok[i] for i in keep], dtype=torch.long, device=device),
                        torch.tensor(parents, dtype=torch.long, device=device), scores=scores)


def build_proposer(target, path: str, **opts):
    """Decoder registry hook: `eagle:PATH` -> an EagleProposer for `target` (fingerprint checked)."""
    from draftsmith.targets.gemm import use_rows_linear

    head, _ = load_eagle(path, target)
    use_rows_linear(head)  # tree expansion feeds a few nodes per forward
    return EagleProposer(head, **opts)
