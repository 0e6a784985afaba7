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
from draftsmith.medusa.model import MedusaHeads, MedusaTree, load_medusa


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
        return TreeSpec(_ranks(self.tree.paths), max_nodes=len(self.tree.paths))

    def gpu_tree(self) -> tuple[MedusaProposer, TreeSpec]:
        """The whole calibrated tree, uncut (see Proposer.gpu_tree); its own proposer state, the same heads."""
        return MedusaProposer(self.heads, self.tree), self.default_tree_spec()

    def _paths_within(self, spec: TreeSpec, depth: int) -> list[int]:
        """Indices of the calibrated tree's paths that `spec` admits up to `depth`, in build order (parents
        first, most probable first): the first max_nodes of them are a prefix, closed under parents."""
        kept = [i for i, p in enumerate(self.tree.paths)
                if len(p) <= depth and all(r < spec.branching[d] for d, r in enumerate(p))]
        return kept[: spec.max_nodes] if spec.max_nodes is not None else kept

    def fit_tree(self, spec: TreeSpec, cost, head_cost: list[float] | None = None) -> TreeSpec:
        """`spec` cut to the calibrated tree's best-paying prefix under the verify cost model (a
        `decoding.budget.VerifyCost`). The node probabilities do not depend on the context, so the cut is
        the same every step and is made once: the heads of depths the cut drops are then never run, and
        the time of the heads a prefix needs (head_cost[d] for d heads, in target steps; measured here when
        not given) counts against it."""
        if self.tree is None or self.tree.probs is None:
            return spec
        from draftsmith.decoding.budget import best_size

        kept = self._paths_within(spec, spec.depth)
        if head_cost is None:
            head_cost = self.measure_head_cost(cost.t_step_s)
        depth_at = [0]  # depth_at[n]: heads the first n paths need
        for i in kept:
            depth_at.append(max(depth_at[-1], len(self.tree.paths[i])))
        # paths are in build order, most probable first (medusa/model.py build_tree): a prefix is the top-n
        n = best_size([self.tree.probs[i] for i in kept], cost, [head_cost[d] for d in depth_at])
        paths = [self.tree.paths[i] for i in kept[:n]]
        return TreeSpec(_ranks(paths), max_nodes=n)

    @torch.no_grad()
    def measure_head_cost(self, t_step_s: float, repeats: int = 7) -> list[float]:
        """[d] = median time of running the first d heads on one hidden state / `t_step_s` (d = 0..K)."""
        import statistics
        import time

        param = next(self.heads.parameters())
        h = torch.randn(self.heads.config.hidden_size, dtype=param.dtype, device=param.device)
        out = [0.0]
        for d in range(1, self.num_heads + 1):
            self.heads.first_logits(d, h)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.heads.first_logits(d, h).argmax(-1)
                if h.device.type == "cuda":
                    torch.cuda.synchronize(h.device)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times) / t_step_s)
        return out

    def use_dtype(self, dtype: torch.dtype) -> bool:
        """The heads' own parameters; heads that share the target's lm_head still project through it."""
        from draftsmith.targets.precision import cast_parameters

        cast_parameters(self.heads, dtype)
        return True

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
            tokens = self.heads.to_target(self.heads.first_logits(depth, h).argmax(-1)).tolist()
            return Proposal.chain(tokens, device=context.device)
        kept = self._paths_within(spec, depth)
        paths = [self.tree.paths[i] for i in kept]
        ranks_needed = _ranks(paths)
        used_depth = len(ranks_needed)
        logits = self.heads.first_logits(used_depth, h) if used_depth else None
        top = [self.heads.to_target(logits[d].topk(ranks_needed[d]).indices).tolist() for d in range(used_depth)]
        index = {p: i for i, p in enumerate(paths)}
        tokens = [top[len(p) - 1][p[-1]] for p in paths]
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        scores = None
        if self.tree.probs is not None:  # calibrated path probabilities: the verifier may cut the tree
            scores = torch.tensor([self.tree.probs[i] for i in kept], dtype=torch.float32)
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=context.device),
                        torch.tensor(parents, dtype=torch.long, device=context.device), scores=scores)


def _ranks(paths: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Per depth, how many ranks of that head the paths use (the branching a spec needs for them); () for none."""
    depth = max((len(p) for p in paths), default=0)
    return tuple(1 + max(p[d] for p in paths if len(p) > d) for d in range(depth))


def build_proposer(target, path: str, **opts):
    """Decoder registry hook: `medusa:PATH` -> a MedusaProposer for `target` (fingerprint checked)."""
    from draftsmith.medusa.medusa2 import adapted_target, has_adapter
    from draftsmith.targets.gemm import use_rows_linear

    heads, tree, _ = load_medusa(path, target)
    use_rows_linear(heads)
    prop = MedusaProposer(heads, tree if opts.get("tree", True) else None)
    if has_adapter(path):  # Medusa-2: the heads read, and the verifier must be, the adapted target
        prop.verifier_target = adapted_target(target, path)
    return prop
