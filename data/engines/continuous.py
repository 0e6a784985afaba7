"""A continuous-batching decode loop for self-distillation on CPU (and anywhere else).

Why not `model.generate`: a static batch wastes every step a finished row still occupies, and a
DynamicCache re-concatenates the whole KV cache on every step (O(batch x length) memory traffic per
token). Here the loop calls the model directly:

- the KV cache is preallocated per layer as [slots, kv_heads, capacity, head_dim]; a decode step writes
  one column for every active row (no re-concatenation). Keys and values are whatever the model's attention
  caches, each buffer its own shape: DeepSeek-V3's latent attention caches its latent and its rotated shared
  key (one head each, widths kv_lora_rank and qk_rope_head_dim) and expands per-head K and V from them itself;
- every active row is right-aligned at the shared write column `n`: a row's prompt occupies columns
  [n - P, n) when it is admitted and the columns before it are masked out (left padding). Position ids
  are per row (its own token count), so RoPE sees each row as if it were alone;
- a finished row leaves at once and the last active row moves into its slot, so the batch stays dense;
  when enough slots are free, the next prompts (sorted by length) are prefilled and merged in
  (continuous batching), in groups of similar length so that no prompt pays for a longer one's padding;
- the prompts' common prefix (a chat template's system preamble) is prefilled once per run and is the past
  of every prefill, except for a target with windowed layers (`windowed`);
- leading columns no row needs any more (rows that left) are dropped once they are a quarter of the used
  ones, or when the cache runs out of columns;
- a decode step's attention runs over a few ranges of rows (sorted by first column at each admission), each
  from its rows' first column: a row with a short context does not read the columns in front of it. The
  query heads that share a KV head are the rows of one product (`_decode_gqa`).

Sampling is per row with a generator seeded by the row's own seed, so a row's sample does not depend on
which other rows share its batch; greedy decoding equals one-prompt-at-a-time decoding up to float noise.

Optional capture keeps, for every position of the final sequence, chosen layer outputs (layer convention
of capture/layers.py), the post-norm last hidden state and top-k logits. Top-k logits of the prompt
positions before `Request.logits_from` are zeros: a prefill runs the lm_head over the columns some row
wants (for a single-turn row, the last prompt position), not over the whole prompt. The final token is
never fed back during generation, so with capture on a finished row stays for one extra step that feeds it.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from draftsmith.capture.forward import capture_forward, topk_with_logsumexp
from draftsmith.data.engines.base import Completion, Request, TextEngine, run_stats
from draftsmith.decoding.sampling import SamplingConfig, probs_from_logits, sample
from draftsmith.targets.families import text_config

GQA_SDPA = "draftsmith_sdpa_gqa"
# set by the engine around a decode forward: (rows, key columns, [(r0, r1, c0), ...]); see `_decode_spans`
_DECODE_SPANS: contextvars.ContextVar[tuple[int, int, list[tuple[int, int, int]]] | None] = contextvars.ContextVar(
    "draftsmith_decode_spans", default=None)


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA with grouped-query attention done by torch (enable_gqa) even with a padding mask.

    transformers' sdpa path copies K and V `num_key_value_groups` times (repeat_kv) whenever a mask is
    given, which on CPU costs more than the attention itself for long batched caches. The engine's decode
    steps (one query column, `_DECODE_SPANS` set) go to `_decode_spans` instead.
    """
    spans = _DECODE_SPANS.get()
    if spans is not None and query.shape[2] == 1 and spans[0] == query.shape[0] and spans[1] == key.shape[2]:
        return _decode_spans(query, key, value, attention_mask, scaling, spans[2]), None
    # transformers skips the mask when it is purely causal (no padding): then causality is on us
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _decode_spans(query, key, value, attention_mask, scaling, spans):
    """A decode step's attention, each range of rows [r0, r1) over columns [c0, T) only.

    Every active row is right-aligned at the shared write column, so a row admitted with a short context
    has its masked columns (left padding, columns of rows that left) in front of it. Columns every row of a
    range masks contribute exp(-inf) = 0 to its softmax: skipping them changes nothing but the work."""
    out = query.new_empty(query.shape[0], 1, query.shape[1], value.shape[3])  # MLA: V narrower than Q and K
    for r0, r1, c0 in spans:
        mask = attention_mask[r0:r1, ..., c0:] if attention_mask is not None else None
        out[r0:r1] = _decode_gqa(query[r0:r1], key[r0:r1, :, c0:], value[r0:r1, :, c0:], mask, scaling)
    return out


def _decode_gqa(query, key, value, attention_mask, scaling):
    """One decode step's attention as two matmuls per KV head, its query heads stacked as rows.

    query [B, H, 1, D], key [B, KV, T, D], value [B, KV, T, Dv] (Dv = D but for latent attention, whose value
    heads are narrower). The G = H / KV query heads that share a KV head become the rows of one [G, D] x [D, T]
    product, so the G heads read each cached key together. Returns [B, 1, H, Dv]."""
    b, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    q = (query * scale).reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2))  # [B, KV, G, T]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # [B, 1, 1, T], True = attend
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:  # additive
            scores += attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, 1, heads, value.shape[-1])


def _register_gqa_attention() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GQA_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(GQA_SDPA, _sdpa_gqa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)


@contextlib.contextmanager
def gqa_attention(model) -> Iterator[None]:
    """Use `_sdpa_gqa` for this model while decoding (only where it was using plain sdpa)."""
    configs = list({id(c): c for c in (model.config, text_config(model.config))}.values())
    old = [c._attn_implementation for c in configs]
    if "sdpa" not in old:
        yield
        return
    _register_gqa_attention()
    try:
        for c, o in zip(configs, old):
            if o == "sdpa":
                c._attn_implementation = GQA_SDPA
        yield
    finally:
        for c, o in zip(configs, old):
            c._attn_implementation = o


def windowed(config) -> bool:
    """Whether a target has sliding-window or chunked attention layers (Gemma 3, gpt-oss, Mistral's window,
    Llama 4's chunks). transformers builds their masks from cache columns, not position ids, so a row's columns
    must be contiguous: the shared prefix lays a row out as [prefix | left padding | suffix], where the padding
    would count as distance inside the window (greedy rows of the tiny gpt-oss and Llama 4 differed from
    `generate` so), and such a target prefills each prompt whole."""
    c = text_config(config)
    types = getattr(c, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(c, "sliding_window", None) or getattr(c, "attention_chunk_size", None))


@dataclass
class CaptureSpec:
    layers: list[int] = field(default_factory=list)
    topk: int = 0
    last_hidden: bool = False
    dtype: torch.dtype = torch.bfloat16


_CAPTURED = ("last_hidden", "topk_values", "topk_indices", "topk_logsumexp")  # per-row lists besides layers


class _SlotLayer(DynamicLayer):
    """One layer's view of the shared slot store: writes new keys at column n, returns columns [0, n+t)."""

    def __init__(self, store: _SlotStore, idx: int):
        super().__init__()
        # a proxy, not a reference: store -> cache -> layers -> store would be a cycle, and the store's
        # buffers (GBs at batch 96) would outlive the run until the garbage collector's next full pass
        self.store, self.idx = weakref.proxy(store), idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are owned by the store
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.store.write(self.idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.store.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.n + query_length, 0


def _move_columns(buf: torch.Tensor, rows: int, src: int, dst: int, length: int) -> None:
    """buf[:rows, :, dst:dst+length] = buf[:rows, :, src:src+length] for overlapping ranges, copied in
    chunks that do not overlap (no clone of the whole cache) unless that takes too many small copies."""
    d = abs(dst - src)
    if d == 0 or length <= 0:
        return
    if length > 8 * d:
        buf[:rows, :, dst : dst + length] = buf[:rows, :, src : src + length].clone()
        return
    starts = range(0, length, d)
    for s in reversed(starts) if dst > src else starts:  # a right move copies its far end first
        e = min(s + d, length)
        buf[:rows, :, dst + s : dst + e] = buf[:rows, :, src + s : src + e]


class _SlotStore:
    """Preallocated KV buffers for `slots` rows; rows [0, a) are active, columns [0, n) are in use."""

    def __init__(self, num_layers: int, slots: int, capacity: int):
        self.num_layers, self.slots, self.capacity = num_layers, slots, capacity
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mask = torch.zeros(slots, capacity, dtype=torch.long)
        self.n = 0
        self.a = 0
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(num_layers)])

    def _alloc(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Buffers shaped like one layer's cached keys and values, each its own: what a layer caches is the
        model's choice, and DeepSeek-V3's latent attention caches one normed latent (kv_lora_rank) as its
        "keys" and one rotated shared key (qk_rope_head_dim) as its "values", a single head each, expanded
        to per-head K and V inside its attention after the cache is read."""
        def buffers(like: torch.Tensor) -> list[torch.Tensor]:
            shape = (self.slots, like.shape[1], self.capacity, like.shape[3])
            return [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(self.num_layers)]

        self.k, self.v = buffers(keys), buffers(values)

    def write(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        t = k.shape[2]
        self.k[idx][: self.a, :, self.n : self.n + t] = k
        self.v[idx][: self.a, :, self.n : self.n + t] = v
        return self.k[idx][: self.a, :, : self.n + t], self.v[idx][: self.a, :, : self.n + t]

    def shift(self, by: int) -> None:
        """Move the used columns by `by` (right if > 0, left if < 0) for the active rows."""
        a, n = self.a, self.n
        if by == 0 or a == 0:
            self.n = max(0, n + by) if a == 0 else n
            return
        src, dst = max(0, -by), max(0, by)
        for buf in (*self.k, *self.v):
            _move_columns(buf, a, src, dst, n - src)
        m = self.mask[:a, src:n].clone()
        self.mask[:a, : max(n, n + by)] = 0
        self.mask[:a, dst : n + by] = m
        self.n = n + by

    def dead_columns(self) -> int:
        """Leading columns that no active row attends to (rows that left, left padding)."""
        live = self.mask[: self.a, : self.n].any(0).nonzero()
        return int(live[0]) if len(live) else self.n

    def compact(self, min_fraction: float = 0.25) -> None:
        """Drop the dead leading columns once they are `min_fraction` of the used ones.

        Every row attends over all n columns, so dead columns cost every decode step; moving the live ones
        costs about one step's attention reads, and pays back within a few steps at this fraction.
        """
        if self.a and self.n >= 16:
            dead = self.dead_columns()
            if dead >= max(16, min_fraction * self.n):
                self.shift(-dead)

    def ensure_capacity(self, columns: Callable[[], int]) -> None:
        """Make `columns()` (re-evaluated after compaction) fit: drop all-masked leading columns, else grow."""
        if columns() <= self.capacity:
            return
        if self.a:
            dead = self.dead_columns()
            if dead:
                self.shift(-dead)
        if columns() <= self.capacity:
            return
        new_cap = max(columns(), int(self.capacity * 1.5))
        grow = new_cap - self.capacity
        self.k = [torch.nn.functional.pad(b, (0, 0, 0, grow)) for b in self.k]
        self.v = [torch.nn.functional.pad(b, (0, 0, 0, grow)) for b in self.v]
        self.mask = torch.nn.functional.pad(self.mask, (0, grow))
        self.capacity = new_cap

    def starts(self, columns: int) -> torch.Tensor:
        """Each active row's first attended column (every active row attends to at least one)."""
        return self.mask[: self.a, :columns].argmax(1)

    def reorder(self, order: Sequence[int]) -> None:
        """Permute the active rows: row i becomes old row order[i]."""
        a, n = self.a, self.n
        idx = torch.as_tensor(order, dtype=torch.long)
        for buf in (*self.k, *self.v):
            buf[:a, :, :n] = buf[:a, :, :n].index_select(0, idx)
        self.mask[:a, :n] = self.mask[:a, :n].index_select(0, idx)

    def move_row(self, src: int, dst: int) -> None:
        n = self.n
        for buf in (*self.k, *self.v):
            buf[dst, :, :n] = buf[src, :, :n]
        self.mask[dst, :n] = self.mask[src, :n]


@dataclass
class _Row:
    req: Request
    pos: int  # position id of the next token fed
    tokens: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    done: bool = False  # stop decided; with capture it stays one more step to feed its last token
    stopped: bool = False
    cap: dict[str, list] | None = None


def _seed_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed % (2**63))
    return g


@dataclass
class _Prefill:
    rows: list[_Row]
    first: list[int]  # each row's first generated token
    cache: DynamicCache  # [b, kv_heads, S + P, head_dim] per layer (S: shared prefix, P: longest suffix)
    mask: torch.Tensor  # [b, S + P], left padding of the suffixes = 0


@dataclass
class _Prefix:
    length: int
    keys: list[torch.Tensor]  # per layer [1, kv_heads, S, head_dim]
    values: list[torch.Tensor]
    cap: dict[str, Any] | None = None  # captured states of the prefix positions, shared by every row


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix shared by every sequence."""
    first = seqs[0]
    n = min(len(x) for x in seqs)
    for x in seqs[1:]:
        i = 0
        while i < n and x[i] == first[i]:
            i += 1
        n = i
    return n


def length_groups(reqs: Sequence[Request], max_padding: float, max_tokens: int | None = None) -> list[list[Request]]:
    """Split requests into prefill groups, by length, each padded with at most `max_padding` x its tokens
    and, when `max_tokens` is given, holding at most that many padded tokens (one longer prompt alone excepted).

    A left-padded prefill costs rows x longest prompt: one long prompt among short ones would make every
    row pay for its length (a 1,350-token prompt in a group of 16 ~100-token prompts cost 14x the compute).
    The token bound caps a prefill's activations.
    """
    order = sorted(reqs, key=lambda r: len(r.prompt_ids))
    groups: list[list[Request]] = []
    tokens = 0
    for r in order:
        n = len(r.prompt_ids)
        padded = (len(groups[-1]) + 1) * n if groups else 0  # the last group's size with r in it
        if groups and (max_tokens is None or padded <= max_tokens) and padded <= (1 + max_padding) * (tokens + n):
            groups[-1].append(r)
            tokens += n
        else:
            groups.append([r])
            tokens = n
    return groups


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, gens: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row from logits [B, V]: argmax, or temperature + nucleus (top-p) sampling.

    Nucleus sampling (Holtzman et al., 2020): keep the smallest prefix of tokens, by descending
    probability, whose mass reaches top_p; renormalise; draw.
    """
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    # the decoder's own warpers (decoding/sampling.py): one definition of temperature and top-p
    probs = probs_from_logits(logits, sampling)
    return [sample(probs[i], g) for i, g in enumerate(gens)]


class ContinuousBatcher(TextEngine):
    """Decode many prompts with one frozen causal LM. See the module docstring for the scheme."""

    def __init__(self, model, eos_token_ids: Sequence[int], pad_token_id: int, batch_size: int = 32,
                 sampling: SamplingConfig | None = None, capture: CaptureSpec | None = None,
                 refill_fraction: float = 0.25, gqa_sdpa: bool = True, max_padding: float = 0.15,
                 shared_prefix: bool = True, min_prefix: int = 8, prefill_tokens: int = 8192,
                 decode_spans: int = 4):
        self.model = model
        self.eos = set(int(e) for e in eos_token_ids)
        self.pad = int(pad_token_id)
        self.batch_size = batch_size
        self.sampling = sampling or SamplingConfig()
        self.capture = capture
        self.captures = capture is not None  # Completion.capture holds the row's states
        # admit new prompts once this many slots are free (prefills are batched, not one by one)
        self.refill = max(1, int(batch_size * refill_fraction))
        # torch's enable_gqa instead of transformers' repeat_kv under a padding mask: 3-6% per decode step
        # at batch 32-64 on SmolLM2 (2 CPU cores, 2026-11-23)
        self.gqa_sdpa = gqa_sdpa
        # a decode step's attention in this many row ranges, each over the columns its rows attend to (rows
        # kept sorted by first column); 0 = one SDPA call over every used column. Needs gqa_sdpa.
        self.decode_spans = decode_spans if gqa_sdpa else 0
        self.max_padding = max_padding  # prefill groups pad at most this fraction of their tokens
        self.prefill_tokens = prefill_tokens  # ... and hold at most this many tokens
        # with top-k capture a prefill keeps [rows, columns, vocab] logits for the columns its rows want
        # (`Request.logits_from`): groups are split to keep those near 256 MB (a 24 x 500-token group of
        # all-position logits was 2.4 GB on SmolLM2)
        self.logit_tokens = 0
        if capture is not None and capture.topk:
            vocab = model.get_output_embeddings().weight.shape[0]
            self.logit_tokens = max(1, (256 << 20) // (4 * vocab))
        # the prompts' common prefix (a chat template's system preamble) is prefilled once per run
        self.shared_prefix, self.min_prefix = shared_prefix and not windowed(model.config), min_prefix
        self._prefix: _Prefix | None = None
        self.num_layers = text_config(model.config).num_hidden_layers

    # ------------------------------------------------------------------ forward

    def _forward(self, ids, mask, pos, cache, keep: int = 1):
        """One forward; the lm_head runs on the last `keep` columns only (0: every column)."""
        if self.capture is None:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=keep)
            return out.logits, None
        cap = capture_forward(self.model, ids, mask, layers=self.capture.layers, past_key_values=cache,
                              position_ids=pos, use_cache=True, logits_to_keep=keep)
        return cap.logits, cap

    def _record(self, rows: list[_Row], cap, logits: torch.Tensor, keep: list[tuple[int, int]],
                logits_start: int = 0) -> None:
        """Append captured states: for row i, columns [c0, c1) of this forward's outputs.

        `logits` holds the forward's columns [logits_start, T); top-k entries of the columns left of it are
        zeros. Conversions and top-k run once over the whole forward, not once per row."""
        spec = self.capture
        first = min(c for c, _ in keep)  # columns left of every row's span are padding only
        states = {("layers", layer): cap.layers[layer][:, first:].to(spec.dtype) for layer in spec.layers}
        if spec.last_hidden:
            states[("last_hidden", None)] = cap.last_hidden[:, first:].to(spec.dtype)
        lo = max(first, logits_start)
        if spec.topk:
            values, indices, lse = topk_with_logsumexp(logits[:, lo - logits_start :], spec.topk)
        for i, (row, (c0, c1)) in enumerate(zip(rows, keep)):
            for (name, layer), x in states.items():
                piece = x[i, c0 - first : c1 - first]
                (row.cap[name][layer] if layer is not None else row.cap[name]).append(piece)
            if spec.topk:
                a = min(max(c0, lo), c1)
                if a > c0:  # no logits computed for these columns
                    row.cap["topk_values"].append(torch.zeros(a - c0, spec.topk))
                    row.cap["topk_indices"].append(torch.zeros(a - c0, spec.topk, dtype=torch.long))
                    row.cap["topk_logsumexp"].append(torch.zeros(a - c0))
                if c1 > a:
                    row.cap["topk_values"].append(values[i, a - lo : c1 - lo])
                    row.cap["topk_indices"].append(indices[i, a - lo : c1 - lo])
                    row.cap["topk_logsumexp"].append(lse[i, a - lo : c1 - lo])

    # ------------------------------------------------------------------ admission

    def _new_capture(self) -> dict[str, Any]:
        """A row's capture lists; they start with the shared prefix's states when there is one."""
        pre = self._prefix.cap if self._prefix is not None else None
        return {"layers": {i: list(pre["layers"][i]) if pre else [] for i in self.capture.layers},
                **{k: list(pre[k]) if pre else [] for k in _CAPTURED}}

    def _prefix_forward(self, ids: list[int], all_logits: bool) -> _Prefix:
        """The shared prefix's keys / values (and captured states), computed once per run."""
        x = torch.tensor([ids], dtype=torch.long)
        cache = DynamicCache()
        keep = 0 if all_logits and self.capture is not None and self.capture.topk else 1
        logits, cap = self._forward(x, torch.ones_like(x), torch.arange(len(ids)).unsqueeze(0), cache, keep)
        prefix = _Prefix(len(ids), [lay.keys for lay in cache.layers], [lay.values for lay in cache.layers])
        if cap is not None:
            row = _Row(Request(None, ids, 0), pos=len(ids), cap=self._new_capture())
            self._record([row], cap, logits, [(0, len(ids))], logits_start=len(ids) - logits.shape[1])
            prefix.cap = row.cap
        return prefix

    def _logit_columns(self, r: Request) -> int:
        """How many of the request's suffix columns (after the shared prefix) need logits."""
        S = self._prefix.length if self._prefix is not None else 0
        n = len(r.prompt_ids)
        if not (self.capture is not None and self.capture.topk):
            return 1
        return n - S if r.logits_from is None else n - max(min(r.logits_from, n - 1), S)

    def _logit_groups(self, group: list[Request]) -> list[list[Request]]:
        """Split a prefill group so that rows x logit columns stays within the logits budget."""
        if not self.logit_tokens:
            return [group]
        out: list[list[Request]] = []
        widest = 0
        for r in sorted(group, key=self._logit_columns):
            w = self._logit_columns(r)
            if out and (len(out[-1]) + 1) * max(widest, w) <= self.logit_tokens:
                out[-1].append(r)
            else:
                out.append([r])
            widest = w  # ascending order: the newest row is the widest of its group
        return out

    def _prefill(self, reqs: list[Request]) -> _Prefill:
        """One left-padded forward over `reqs` (similar lengths: see `length_groups`).

        With a shared prefix only the suffixes are fed; the prefix's keys / values are the past, so a row's
        columns are [prefix | left padding | suffix] and its position ids continue after the prefix."""
        S = self._prefix.length if self._prefix is not None else 0
        P = max(len(r.prompt_ids) for r in reqs) - S
        b = len(reqs)
        ids = torch.full((b, P), self.pad, dtype=torch.long)
        mask = torch.ones(b, S + P, dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r.prompt_ids) - S
            ids[i, P - n :] = torch.tensor(r.prompt_ids[S:], dtype=torch.long)
            mask[i, S : S + P - n] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, S:]
        cache = DynamicCache()
        if S:
            for li, (k, v) in enumerate(zip(self._prefix.keys, self._prefix.values)):
                cache.update(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), li)
        keep = max(self._logit_columns(r) for r in reqs)
        logits, cap = self._forward(ids, mask, pos, cache, keep)
        rows = []
        for r in reqs:
            row = _Row(r, pos=len(r.prompt_ids))
            if not self.sampling.greedy:
                row.gen = _seed_generator(r.seed)
            if self.capture is not None:
                row.cap = self._new_capture()
            rows.append(row)
        if cap is not None:
            self._record(rows, cap, logits, [(P - (len(r.prompt_ids) - S), P) for r in reqs], logits_start=P - keep)
        first = sample_next(logits[:, -1], self.sampling, [r.gen for r in rows])
        return _Prefill(rows, first, cache, mask)

    def _admit(self, store: _SlotStore, rows: list[_Row], reqs: list[Request]) -> int:
        """Prefill `reqs` (in groups of similar length) and merge them into the store. Returns prompt tokens."""
        groups = [sub for g in length_groups(reqs, self.max_padding, self.prefill_tokens)
                  for sub in self._logit_groups(g)]
        done = [self._prefill(g) for g in groups]
        P = max(d.mask.shape[1] for d in done)
        if not store.k:
            store._alloc(done[0].cache.layers[0].keys, done[0].cache.layers[0].values)
        store.ensure_capacity(lambda: max(P, store.n) + 1)
        if P > store.n:
            store.shift(P - store.n)
        n = store.n
        for d in done:  # every new row ends at column n like every active row
            a, b, p = store.a, len(d.rows), d.mask.shape[1]
            for li in range(self.num_layers):
                store.k[li][a : a + b, :, n - p : n] = d.cache.layers[li].keys
                store.v[li][a : a + b, :, n - p : n] = d.cache.layers[li].values
                store.k[li][a : a + b, :, : n - p] = 0
                store.v[li][a : a + b, :, : n - p] = 0
            store.mask[a : a + b, :n] = 0
            store.mask[a : a + b, n - p : n] = d.mask
            store.a = a + b
            for row, tok in zip(d.rows, d.first):
                self._accept(row, tok)
                rows.append(row)
        if self.decode_spans > 1:  # longest context first, so that row ranges share their first columns
            order = store.starts(n).argsort(stable=True).tolist()
            if order != list(range(store.a)):
                store.reorder(order)
                rows[:] = [rows[i] for i in order]
        return sum(int(d.mask.sum()) for d in done)

    def _spans(self, store: _SlotStore, columns: int) -> tuple[int, int, list[tuple[int, int, int]]] | None:
        """Split the active rows into `decode_spans` ranges; each range attends from its rows' first column."""
        if not self.decode_spans:
            return None
        a = store.a
        starts = store.starts(columns)
        k = min(self.decode_spans, a)
        bounds = [round(i * a / k) for i in range(k + 1)]
        return a, columns, [(r0, r1, int(starts[r0:r1].min())) for r0, r1 in zip(bounds, bounds[1:]) if r1 > r0]

    def _accept(self, row: _Row, tok: int) -> None:
        row.tokens.append(tok)
        if tok in self.eos:
            row.done, row.stopped = True, True
        elif len(row.tokens) >= row.req.max_new_tokens:
            row.done = True

    # ------------------------------------------------------------------ main loop

    def run(self, requests: Sequence[Request], on_done: Callable[[Completion], None],
            on_tokens: Callable[[int], None] | None = None, sort_by_length: bool = True) -> dict[str, float]:
        """Generate for every request; `on_done` gets each Completion as soon as its row finishes."""
        with gqa_attention(self.model) if self.gqa_sdpa else contextlib.nullcontext():
            return self._run(requests, on_done, on_tokens, sort_by_length)

    @torch.inference_mode()
    def _run(self, requests, on_done, on_tokens, sort_by_length) -> dict[str, float]:
        queue = sorted(requests, key=lambda r: len(r.prompt_ids)) if sort_by_length else list(requests)
        queue.reverse()  # pop() from the end = shortest first
        if not queue:
            return run_stats(0, 0.0)
        t0 = time.perf_counter()
        self._prefix = None  # so that the prefix's own capture does not start from an earlier run's
        self._prefix = self._shared_prefix(queue)
        prefill_s = time.perf_counter() - t0
        longest = max(len(r.prompt_ids) for r in queue)
        max_new = max(r.max_new_tokens for r in queue)
        store = _SlotStore(self.num_layers, self.batch_size, longest + max_new + 8)
        rows: list[_Row] = []
        generated = prompt_tokens = steps = rows_fed = 0
        while queue or rows:
            free = self.batch_size - store.a
            if queue and (free >= self.refill or not rows):
                take = [queue.pop() for _ in range(min(free, len(queue)))]
                t1 = time.perf_counter()
                prompt_tokens += self._admit(store, rows, take)
                prefill_s += time.perf_counter() - t1
                generated += len(take)
                if on_tokens:
                    on_tokens(len(take))
                self._retire(store, rows, on_done)
                continue
            if not rows:
                break
            steps += 1
            rows_fed += store.a
            generated += self._decode_step(store, rows, on_tokens)
            self._retire(store, rows, on_done)
            store.compact()
        seconds = time.perf_counter() - t0
        # prefill_seconds: admission (prefill + merge); mean_batch: rows fed per decode step (the tail and the
        # dips between refills lower it below batch_size)
        return {"generated_tokens": generated, "prompt_tokens": prompt_tokens, "decode_steps": steps,
                "seconds": seconds, "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
                "prefill_seconds": prefill_s, "mean_batch": rows_fed / steps if steps else 0.0}

    def _shared_prefix(self, queue: list[Request]) -> _Prefix | None:
        """The prompts' common prefix, prefilled once, when it is at least `min_prefix` tokens (every row keeps
        one token of its own to prefill)."""
        if not self.shared_prefix:
            return None
        S = min(common_prefix_length([r.prompt_ids for r in queue]), min(len(r.prompt_ids) for r in queue) - 1)
        if S < self.min_prefix:
            return None
        wants = [r.logits_from for r in queue]  # does any row want logits inside the prefix?
        return self._prefix_forward(queue[0].prompt_ids[:S], all_logits=any(f is None or f < S - 1 for f in wants))

    def _decode_step(self, store: _SlotStore, rows: list[_Row], on_tokens) -> int:
        """One decode step for every active row: feed its last token, sample its next one (rows that are done
        were fed their final token, for capture, and sample nothing). Returns the tokens sampled."""
        store.ensure_capacity(lambda: store.n + 1)
        a, n = store.a, store.n
        ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long)
        pos = torch.tensor([[r.pos] for r in rows], dtype=torch.long)
        store.mask[:a, n] = 1
        token = _DECODE_SPANS.set(self._spans(store, n + 1))
        try:
            logits, cap = self._forward(ids, store.mask[:a, : n + 1], pos, store.cache)
        finally:
            _DECODE_SPANS.reset(token)
        store.n = n + 1
        if cap is not None:
            self._record(rows, cap, logits, [(0, 1)] * len(rows))
        fed_final = [r.done for r in rows]  # these rows were only fed their last token
        for r in rows:
            r.pos += 1
        live = [i for i, r in enumerate(rows) if not r.done]
        if live:
            toks = sample_next(logits[live, -1], self.sampling, [rows[i].gen for i in live])
            for i, tok in zip(live, toks):
                self._accept(rows[i], tok)
            if on_tokens:
                on_tokens(len(live))
        for r, fed in zip(rows, fed_final):
            if fed and r.cap is not None:
                r.cap["fed_final"] = True
        return len(live)

    def _retire(self, store: _SlotStore, rows: list[_Row], on_done) -> None:
        """Hand finished rows to the caller and compact the slots (last active row moves into the hole)."""
        i = 0
        while i < len(rows):
            r = rows[i]
            ready = r.done and (r.cap is None or r.cap.get("fed_final", False))
            if not ready:
                i += 1
                continue
            on_done(self._completion(r))
            last = len(rows) - 1
            if i != last:
                store.move_row(last, i)
                rows[i] = rows[last]
            rows.pop()
            store.a -= 1
        if store.a == 0:
            store.n = 0

    def _completion(self, row: _Row) -> Completion:
        cap = None
        if row.cap is not None:
            c = row.cap
            cap = {"layers": {i: torch.cat(v) for i, v in c["layers"].items()}}
            cap.update({k: torch.cat(c[k]) if c[k] else None for k in _CAPTURED})
        return Completion(row.req.key, row.req.prompt_ids, row.tokens, row.stopped, cap)
