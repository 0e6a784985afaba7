"""The one verifier: a proposal tree checked by ONE target forward, greedy or lossless sampling.

Cache convention: the target's KV cache holds every committed token except the last one, the "pending"
token (the target's own latest output; the prefill of the prompt produces the first one, as HF generate
does). A step feeds [pending, node_0, ...,
node_{N-1}] in one forward:

    position ids   = cache_length + depth      (root depth 0)
    attention      = the whole cache + the node's ancestors and itself (tree attention, Miao et al. 2023
                     SpecInfer §4.2; Cai et al. 2024 Medusa §2.3.1). A chain needs no custom mask: the
                     ordinary causal mask is the tree mask of a chain, so chains skip the 4-D mask.

For trees, HF models (transformers 5, Llama and Gemma 3 alike) take a 4-D float mask [1, 1, q, kv] with 0 for
"may attend" and the dtype's minimum for "may not" as is (masking_utils returns a 4-D mask untouched), with
both the sdpa and eager attention kernels. Row r of the logits is the target's distribution after the
root-to-r path, so node r's children and the bonus token are judged from row r.

Acceptance rules (all lossless — the emitted token at each position is distributed as the target's p):

1. Greedy (temperature 0): walk from the root; at node u let y = argmax p_u; move to the child whose token
   is y if there is one, else emit y and stop. Every emitted token is the target's argmax given the
   committed prefix, so the output equals plain greedy decoding token for token.
2. Deterministic candidates (`q is None`: n-gram, Medusa top-k, greedy drafts) under sampling: draw
   y ~ p_u; follow the child equal to y if any, else emit y. The token taken at u is exactly y ~ p_u
   whatever the candidates are (they do not depend on y), so this is lossless for any candidate set.
3. Sampled candidates (`q` given; children of u are i.i.d. draws from q_u): SpecInfer's multi-step
   speculative sampling (Miao et al. 2023, Alg. 2). With r = p_u, for each child x in order: accept with
   probability min(1, r(x)/q_u(x)); on rejection r <- norm(max(0, r - q_u)). If every child is rejected
   emit a draw from r. For a single child this is Leviathan et al. 2023 / Chen et al. 2023 speculative
   sampling: P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ min(p, q))·norm(max(0, p - q))(x) = p(x).
   Applied child by child, each rejection leaves exactly the residual that makes the next draw's
   marginal correct, so the emitted token at u is ~ p_u.

After the decision only the accepted path stays in the cache: block offsets [0 (root), 1 + accepted nodes]
are gathered to the front of the block and the rest is cropped (`kvcache.keep_positions`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.decoding.budget import prune
from draftsmith.decoding.proposer import AcceptResult, Proposal, Proposer, TargetFeatures, TreeSpec
from draftsmith.decoding.sampling import SamplingConfig, residual, sample, uniform
from draftsmith.errors import DraftsmithError
from draftsmith.targets import kvcache
from draftsmith.targets.families import text_config


def tree_attention(parents: list[int], cache_len: int, dtype: torch.dtype,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """4-D additive mask [1, 1, N+1, cache_len+N+1] and position ids [1, N+1] for a block [root, nodes...].

    Block row 0 is the root (pending token); row 1+i is node i. Row r may attend every cached position and
    the block rows on its root path (itself included).
    """
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    depth = [0] * (n + 1)
    for i, p in enumerate(parents):
        r, pr = i + 1, p + 1  # block rows
        allowed[r] = allowed[pr]
        allowed[r, r] = True
        depth[r] = depth[pr] + 1
    full = torch.ones(n + 1, cache_len + n + 1, dtype=torch.bool)
    full[:, cache_len:] = allowed
    mask = torch.zeros(full.shape, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    positions = torch.tensor(depth, dtype=torch.long) + cache_len
    return mask[None, None].to(device), positions[None].to(device)


def layer_masks(config, mask: torch.Tensor, positions: torch.Tensor, cache_len: int):
    """`tree_attention`'s mask per layer type, for a target with windowed layers (Gemma 3 and gpt-oss sliding
    layers, Llama 4 chunked ones): the model applies a 4-D mask as given to every layer, so the window is
    added here, on the nodes' positions (a node at depth d sits at cache_len + d). A target of full layers
    gets the mask itself."""
    tc = text_config(config)
    types = set(getattr(tc, "layer_types", None) or ())
    if types <= {"full_attention"}:
        return mask
    q = positions[0]
    keys = torch.cat([torch.arange(cache_len, device=q.device), q])
    out = {}
    for kind in types:
        window, chunk = getattr(tc, "sliding_window", None), getattr(tc, "attention_chunk_size", None)
        if kind == "sliding_attention" and window:
            far = q[:, None] - keys[None, :] >= window  # transformers: kv_idx > q_idx - sliding_window
        elif kind == "chunked_attention" and chunk:
            far = q[:, None] // chunk != keys[None, :] // chunk
        elif kind in ("full_attention", "sliding_attention", "chunked_attention"):
            far = None
        else:
            raise DraftsmithError(f"tree verification: the target's layer type '{kind}' (config layer_types) has "
                                  "no mask here; use a chain (tree off) for this target")
        out[kind] = mask if far is None else mask.masked_fill(far[None, None], torch.finfo(mask.dtype).min)
    return out


def accept_greedy(proposal: Proposal, argmax: list[int]) -> tuple[list[int], int]:
    """Rule 1. argmax[r] = target argmax at block row r. Returns (accepted node path, next token)."""
    path: list[int] = []
    u = -1
    children = proposal.children
    tokens = proposal.tokens.tolist()
    while True:
        y = argmax[u + 1]
        nxt = next((c for c in children.get(u, ()) if tokens[c] == y), None)
        if nxt is None:
            return path, y
        path.append(nxt)
        u = nxt


def accept_sampled(proposal: Proposal, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Rules 2 and 3. p: [N+1, V] processed target probabilities (row r = block row r)."""
    path: list[int] = []
    u = -1
    children = proposal.children
    tokens = proposal.tokens.tolist()
    q = proposal.q
    while True:
        kids = children.get(u, [])
        row = p[u + 1]
        if not kids:
            return path, sample(row, generator)
        if q is None:  # rule 2
            y = sample(row, generator)
            nxt = next((c for c in kids if tokens[c] == y), None)
            if nxt is None:
                return path, y
        else:  # rule 3 (SpecInfer MSS; Leviathan for one child)
            r = row
            nxt = None
            for c in kids:
                x = tokens[c]
                qc = q[c].to(r.device, torch.float32)
                qx = float(qc[x])
                ratio = float(r[x]) / qx if qx > 0 else float("inf")
                if uniform(generator, r.device) < min(1.0, ratio):
                    nxt = c
                    break
                r = residual(r, qc)
            if nxt is None:
                return path, sample(r, generator)
        path.append(nxt)
        u = nxt


@dataclass
class StepStats:
    """Counters of one sequence (summed over sequences by `GenerationStats`)."""

    proposed: int = 0  # proposed draft tokens (tree nodes) that were verified
    pruned: int = 0  # proposed nodes the cost model cut before verification (decoding/budget.py)
    accepted: int = 0  # accepted draft tokens
    steps: int = 0  # verification forwards
    emitted: int = 0  # tokens emitted by verification steps (accepted + correction/bonus, after truncation)
    proposed_at: list[int] = field(default_factory=list)  # [d]: steps whose proposal reached depth d+1
    accepted_at: list[int] = field(default_factory=list)  # [d]: steps that accepted >= d+1 tokens
    # [d]: steps that accepted the first d tokens and whose last accepted node (the root for d = 0) had a child,
    # so a token at depth d+1 was tried: accepted_at[d] / tried_at[d] is the acceptance at position d+1 given
    # the path got there (the "n-α" of the EAGLE paper, Li et al. 2024, which training-time test keeps flat)
    tried_at: list[int] = field(default_factory=list)
    proposer_time: float = 0.0
    target_time: float = 0.0

    def record(self, proposal: Proposal, n_accepted: int, path: list[int] | None = None) -> None:
        """`path`: the accepted node indices (root to leaf); without it the proposal is taken as a chain."""
        depth = proposal.depth if len(proposal) else 0
        if path is None:
            tried = min(n_accepted + 1, depth)
        else:  # a chain too: its last accepted node has a child unless the whole chain was accepted
            tried = n_accepted + (1 if proposal.children.get(path[-1] if path else -1) else 0)
        for lst, n in ((self.proposed_at, depth), (self.accepted_at, n_accepted), (self.tried_at, tried)):
            while len(lst) < depth:
                lst.append(0)
            for d in range(n):
                lst[d] += 1
        self.proposed += len(proposal)
        self.accepted += n_accepted
        self.steps += 1


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a wall-clock time covers them (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SequenceVerifier:
    """Speculative decoding state of ONE sequence: target cache, committed tokens, proposer, counters."""

    def __init__(self, model, proposer: Proposer, sampling: SamplingConfig, generator: torch.Generator | None,
                 vocab_size: int | None = None, cost=None):
        self.cost = cost  # a decoding.budget.VerifyCost: cut scored proposals to the nodes that pay
        proposer.use_cost(cost)  # a proposer that can stop drafting what would be cut does (EAGLE-2)
        self.model = model
        self.proposer = proposer
        self.sampling = sampling
        self.generator = generator
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.cache = None
        self.context: torch.Tensor | None = None
        self.stats = StepStats()
        self.last_step: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)  # proposed, accepted, proposer s, target s
        # whether the last step's draft was rejected: the node where the accepted path ends (the root when
        # nothing was accepted) had children in the proposal, none of them the target's token
        self.last_rejected = False

    # -- target forward ------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 want_logits: bool = True) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Logits of every fed position (want_logits) or of the last one only, plus declared features."""
        prop = self.proposer
        if prop.needs_features:
            from draftsmith.capture.forward import capture_forward

            cap = capture_forward(self.model, ids, attention_mask=mask, layers=list(prop.target_layers),
                                  want_logits=True, past_key_values=self.cache, position_ids=positions,
                                  use_cache=True, logits_to_keep=0 if want_logits else 1)
            feats = TargetFeatures(cap.last_hidden[0] if prop.needs_last_hidden else None,
                                   {i: h[0] for i, h in cap.layers.items()})
            return cap.logits[0], feats
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=self.cache, position_ids=positions,
                         use_cache=True, logits_to_keep=0 if want_logits else 1)
        return out.logits[0], None

    # -- sequence lifecycle --------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, prompt: torch.Tensor) -> int:
        """Prefill the whole prompt into a fresh cache and take the first token from its last logits (as
        HF generate does, so plain decoding does no extra forward). That token becomes the pending token;
        the proposer is told the context (prompt + first token) and the features of every prompt position.
        Returns the first token."""
        prompt = prompt.to(self.device).reshape(-1)
        if prompt.numel() == 0:
            raise DraftsmithError("empty prompt")
        self.cache = kvcache.new_cache(self.model)
        self.stats = StepStats()
        t0 = time.perf_counter()
        pos = torch.arange(prompt.numel(), device=self.device)[None]
        logits, feats = self._forward(prompt[None], pos, None, want_logits=False)  # last position only
        last = logits[-1]
        if self.sampling.greedy:
            first = int(last.argmax())
        else:
            from draftsmith.decoding.sampling import probs_from_logits

            first = sample(probs_from_logits(last, self.sampling), self.generator)
        self.context = torch.cat([prompt, torch.tensor([first], dtype=torch.long, device=self.device)])
        sync(self.device)
        self.stats.target_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.proposer.begin(self.context, feats)
        self.stats.proposer_time += time.perf_counter() - t0
        return first

    @torch.no_grad()
    def step(self, spec: TreeSpec) -> list[int]:
        """Propose, verify in one target forward, roll back the cache. Returns the new tokens (>= 1)."""
        assert self.context is not None, "call begin() first"
        cache_len = self.context.numel() - 1
        t0 = time.perf_counter()
        proposal = (self.proposer.propose(self.context, spec, self.sampling, self.generator) if spec.depth else
            Proposal.empty(self.device))
        sync(self.device)
        t1 = time.perf_counter()
        self.stats.proposer_time += t1 - t0
        proposal.validate(spec, self.vocab_size)
        if self.cost is not None and proposal.scores is not None and (proposal.q is None or self.sampling.greedy):
            n_proposed = len(proposal)
            proposal = prune(proposal, self.cost, (t1 - t0) / self.cost.t_step_s)
            self.stats.pruned += n_proposed - len(proposal)
        proposal.tokens = proposal.tokens.to(self.device)

        ids = torch.cat([self.context[-1:], proposal.tokens])[None]
        if proposal.is_chain:
            mask = None
            positions = torch.arange(cache_len, cache_len + ids.shape[1], device=self.device)[None]
        else:
            mask, positions = tree_attention(proposal.parent_list, cache_len, self.dtype, self.device)
            mask = layer_masks(self.model.config, mask, positions, cache_len)
        logits, feats = self._forward(ids, positions, mask)

        if self.sampling.greedy:
            path, token = accept_greedy(proposal, logits.argmax(-1).tolist())
        else:
            from draftsmith.decoding.sampling import probs_from_logits

            path, token = accept_sampled(proposal, probs_from_logits(logits, self.sampling), self.generator)
        keep = [0] + [1 + i for i in path]
        kvcache.keep_positions(self.cache, cache_len, keep)
        new_tokens = proposal.tokens[path].tolist() + [token]
        self.context = torch.cat([self.context, torch.tensor(new_tokens, dtype=torch.long, device=self.device)])
        sync(self.device)
        t2 = time.perf_counter()
        self.stats.target_time += t2 - t1
        self.stats.record(proposal, len(path), path)
        self.last_step = (len(proposal), len(path), t1 - t0, t2 - t1)
        self.last_rejected = (path[-1] if path else -1) in proposal.children

        if feats is not None:
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            feats = TargetFeatures(
                feats.last_hidden.index_select(0, idx) if feats.last_hidden is not None else None,
                {i: h.index_select(0, idx) for i, h in feats.layers.items()},
            )
        self.proposer.accept(AcceptResult(proposal, path, new_tokens, self.context, feats))
        self.stats.proposer_time += time.perf_counter() - t2
        return new_tokens
