"""DFlash: a block drafter that predicts a whole block of tokens in one non-causal forward pass.

Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036); the
layout follows what vLLM (`qwen3_dflash.py`), SGLang and speculators serve.

Notation: x_0..x_{T-1} the tokens, h^k_t the target's residual stream after decoder layer k (the layer
convention of `capture/layers.py`, = HF hidden_states[k + 1]) for the K tapped layers k_1 < ... < k_K,
e(x) the target's frozen token embedding (plain rows), B the block size, M the mask token.

  context    c_t = hidden_norm(fc([h^{k_1}_t; ...; h^{k_K}_t]))          fc: K·H -> H, no bias
  block      at anchor a (a token whose own target feature is not known yet: at inference, the pending
             token the target just produced): inputs [x_a, M, ..., M] (B tokens) at positions a..a+B-1
  layers     N Qwen3-style decoder layers (pre-norm, q/k RMS norms per head, RoPE, SwiGLU). In every layer
             the block's queries attend the context's keys/values (k_norm(k_proj(c_t)), v_proj(c_t) at
             position t, for every t < a) and the whole block's own (bidirectional); the context itself is
             never updated by the layers (it enters K/V only, without the layer's input norm)
  logits     lm_head_target(norm(z_j)) at slot j predicts x_{a+j}, j = 1..B-1 (slot 0 is the anchor); with a
             reduced draft vocabulary (`draft_vocab_size` N, EAGLE-3's, heads/vocab.py) the draft's own
             lm_head [N, H] over the N tokens the target writes most, started from the target's rows and
             trained, and target_id = draft_id + d2t[draft_id]: the full vocabulary's logits over every
             slot of every block are what a training step spends most on (49,152 rows on SmolLM2)
  loss       Σ_j w_j · CE_j / Σ_j w_j, w_j = exp(-(j-1)/γ) (paper Eq. 4: early slots matter more, since a
             draft is accepted only up to its first miss)

Training draws random anchors per row and runs all their blocks in one forward: the keys are
[context | block_1 | ... | block_n], block i's queries see context t < a_i and block i only.
At inference the draft keeps the context keys/values of every committed position in its own cache (one
entry per verified token and layer) and runs one forward of B queries per step.

The target's embedding and lm_head are attached by reference (`attach_target`): not parameters, not trained,
not saved; exports name neither (the serving stacks share the target's). A draft with its own reduced lm_head
saves it with d2t/t2d (buffers, the serving stacks' names), and vLLM loads all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import artifact, schema
from draftsmith.errors import ConfigError
from draftsmith.heads.vocab import check_draft_vocab
from draftsmith.targets.families import (
    attention_dims,
    embedding_rows,
    embeddings,
    full_attention_rope,
    lm_head,
    rope_fields,
    text_config,
    whole,
)
from draftsmith.targets.gemm import rows_linear


def reference_layers(num_layers: int, taps: int) -> list[int]:
    """The reference's tap rule (output-of-layer ids): one tap in the middle, or `taps` evenly spaced from
    layer 1 to layer L-3 (never the last layer, whose output no serving stack captures)."""
    if num_layers < 4:
        raise ConfigError(f"DFlash needs a target of at least 4 layers for its default taps, got {num_layers}: "
                          "name target_layers")
    if taps == 1:
        return [num_layers // 2]
    return sorted({round(1 + i * (num_layers - 4) / (taps - 1)) for i in range(taps)})


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[B] loss weight per slot: 0 for the anchor, exp(-(j-1)/γ) for j >= 1 (1 everywhere without γ)."""
    j = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if gamma is None else torch.exp(-(j - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass
class DFlashConfig:
    """Shape of a DFlash drafter (stored as the artifact's config.json)."""

    hidden_size: int
    vocab_size: int  # the target's
    target_layers: list[int]  # output-of-layer ids, ascending and distinct (the order the stacks concatenate)
    num_layers: int
    block_size: int
    mask_token_id: int
    layer_config: dict = field(default_factory=dict)  # one draft layer: Qwen3 field names (`layer_config_dict`)
    draft_vocab_size: int | None = None  # an own lm_head over this many tokens; None: the target's lm_head

    def __post_init__(self):
        if list(self.target_layers) != sorted(set(self.target_layers)) or not self.target_layers:
            raise ValueError(f"target_layers must be distinct and ascending, got {self.target_layers}")
        if not 1 <= self.num_layers <= 16:
            raise ValueError(f"num_layers must be in 1..16, got {self.num_layers}")
        if not 2 <= self.block_size <= 64:
            raise ValueError(f"block_size must be in 2..64, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a row of the target's embedding (0..{self.vocab_size - 1}), "
                             f"got {self.mask_token_id}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size - 1} (below the target's vocabulary; "
                             f"null shares the target's lm_head), got {self.draft_vocab_size}")

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None


def layer_config_dict(target_config) -> dict:
    """The draft layer's config, Qwen3 field names (what vLLM's DFlash drafter and SGLang's build), sized from
    the target: hidden, heads, kv heads, head_dim, MLP width, norm eps, the target's full-attention RoPE."""
    tc = text_config(target_config)
    heads, kv_heads, head_dim = attention_dims(tc)
    return {"model_type": "qwen3", "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6), **rope_fields(full_attention_rope(tc)),
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 8192),
            "vocab_size": tc.vocab_size, "hidden_act": "silu", "attention_bias": False}


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (as the targets' and the serving stacks' norms are)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd] (rotate-half layout, the neox style vLLM assumes by default)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.hd)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values [B, kv_heads, T, hd] of x [B, T, H] at the positions of cos/sin."""
        k = self.k_norm(self._heads(self.k_proj(x), self.nkv)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.nkv).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """x [B, Q, H] (normed block); ctx_k/ctx_v [B, kv_heads, S, hd]; mask bool [B, 1, Q, S+Q] or None."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.nh)).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.nh * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, inter = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = DFlashMLP(c)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    """cos/sin of the target's full-attention RoPE at given positions (transformers' Llama rotary embedding,
    which implements every scaling type the targets use). Its buffers are not persistent: not saved."""

    def __init__(self, c: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        lc = LlamaConfig(hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                         head_dim=c["head_dim"], max_position_embeddings=c["max_position_embeddings"],
                         rope_parameters=full_attention_rope(c))
        self.rotary = LlamaRotaryEmbedding(lc)

    def forward(self, like: torch.Tensor, positions: torch.Tensor):
        return self.rotary(like, positions)


class DFlashDraft(nn.Module):
    """The DFlash drafter (see the module docstring). A method built on this backbone (DSpark) subclasses it with
    its own `config_class`."""

    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config.layer_config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        if config.reduced_vocab:  # the serving stacks' names: lm_head.weight, d2t, t2d
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(c)
        object.__setattr__(self, "_embed", None)  # the target's frozen modules, by reference
        object.__setattr__(self, "_head", None)

    @classmethod
    def from_target(cls, target_model, target_layers: list[int], num_layers: int, block_size: int,
                    mask_token_id: int, init_std: float = 0.02,
                    draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None, **extra) -> DFlashDraft:
        """A fresh draft for `target_model`; with `draft_vocab` = (d2t, t2d) (heads.vocab.draft_vocabulary) an own
        lm_head over those tokens, started as the target's rows of them (the draft then starts out reading its
        outputs the way the shared head would). `extra`: fields of a subclass's `config_class`."""
        tc = text_config(target_model.config)
        config = cls.config_class(tc.hidden_size, tc.vocab_size, list(target_layers), num_layers, block_size,
                                  mask_token_id, layer_config_dict(target_model.config),
                                  int(draft_vocab[0].numel()) if draft_vocab is not None else None, **extra)
        draft = cls(config)
        with torch.no_grad():  # the reference's init: normal(0, std) projections, unit norms
            for m in draft.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, init_std)
            draft.init_own()
            if draft_vocab is not None:
                d2t, t2d = draft_vocab
                check_draft_vocab(d2t, t2d)
                draft.d2t.copy_(d2t)
                draft.t2d.copy_(t2d)
                w = whole(lm_head(target_model)).weight
                draft.lm_head.weight.copy_(w[t2d.to(w.device)].to(draft.lm_head.weight))
        draft.attach_target(target_model)
        return draft

    def init_own(self) -> None:
        """Initialise what a subclass adds to the backbone (after the backbone's init); nothing here."""

    def attach_target(self, target_model) -> None:
        object.__setattr__(self, "_embed", whole(embeddings(target_model)))
        object.__setattr__(self, "_head", whole(lm_head(target_model)))

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise ConfigError("this DFlash draft has no target embedding: call attach_target(target_model) first")
        with torch.no_grad():
            return embedding_rows(self._embed, ids).to(self._dtype)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """[.., H] block outputs -> [.., V] through the final norm and the target's frozen lm_head, or [.., N]
        through the draft's own lm_head over its reduced vocabulary (`to_target_ids` maps their argmax)."""
        return self.head_logits(self.norm(z))

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """`logits` of states already through the final norm."""
        if self.config.reduced_vocab:
            return self.lm_head(h)
        if self._head is None:
            raise ConfigError("this DFlash draft has no target lm_head: call attach_target(target_model) first")
        w = self._head.weight
        return rows_linear(h.to(w.dtype), w)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids of `logits`' vocabulary -> target ids (target_id = draft_id + d2t[draft_id]; identity without a
        reduced vocabulary)."""
        return ids + self.d2t[ids] if self.config.reduced_vocab else ids

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its post-norm last hidden state (the KD teacher), over the vocabulary
        `logits` predicts: with a reduced one, the target's rows of its tokens (the teacher renormalised over
        them, as EAGLE-3's is)."""
        w = self._head.weight
        if self.config.reduced_vocab:
            w = w[self.t2d.to(w.device)]
        return rows_linear(last_hidden.to(w.dtype), w)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[.., K·H] target features -> [.., H] context states c."""
        return self.hidden_norm(self.fc(features.to(self._dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys/values the context states ctx [B, S, H] at positions [B, S] give."""
        cos, sin = self.rotary(ctx, positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def run_blocks(self, block_ids: torch.Tensor, positions: torch.Tensor,
                   ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """The layers over block tokens block_ids [B, Q] at positions [B, Q], attending ctx_kv and each other as
        `mask` (bool [B, 1, Q, S+Q], True = may attend; None = everything). Returns the outputs z [B, Q, H]."""
        x = self.embed(block_ids)
        cos, sin = self.rotary(x, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return x

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward: every row's blocks at once.

        input_ids [B, T]; features [B, T, K·H] (positions past a row's end may hold anything: they are never
        attended); anchors [B, n] long (-1 = no block). Returns z [B, n, block_size, H], or with `select`
        (bool [B, n, block_size], the slots the loss reads) their logits [n_selected, V]: computed inside the
        forward, where FSDP has the draft's parameters gathered (logits over every slot would not fit)."""
        B, T = input_ids.shape
        n, bs = anchors.shape[1], self.config.block_size
        device = input_ids.device
        live = anchors >= 0
        a = anchors.clamp(min=0)
        block_ids = torch.full((B, n, bs), self.config.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = torch.where(live, input_ids.gather(1, a), self.config.mask_token_id)
        positions = a[..., None] + torch.arange(bs, device=device)  # [B, n, bs]
        ctx_pos = torch.arange(T, device=device).expand(B, T)
        ctx_kv = self.context_kv(self.context(features), ctx_pos)
        out = self.run_blocks(block_ids.view(B, n * bs), positions.view(B, n * bs), ctx_kv,
                              block_mask(anchors, T, bs)[:, None]).view(B, n, bs, -1)
        return out if select is None else self.logits(out[select])


def block_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """bool [B, n·bs, T + n·bs]: block i's queries see context t < a_i and block i's keys (a block without an
    anchor, -1, sees only itself: its outputs are never used, and a row of -inf would make NaNs)."""
    B, n = anchors.shape
    device = anchors.device
    ctx = torch.arange(T, device=device)[None, None] < anchors[..., None]  # [B, n, T]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, n·bs, T]
    which = torch.arange(n, device=device).repeat_interleave(block_size)  # block of each query / key
    own = (which[:, None] == which[None, :]).expand(B, -1, -1)
    return torch.cat([ctx, own], dim=-1)


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, per_row: int,
                   generators: list[torch.Generator | None] | torch.Generator | None = None) -> torch.Tensor:
    """[B, per_row] random anchors per row (-1 where a row has fewer): positions a >= 1 whose next token is
    learned (loss_mask[a+1] = 1), so every block has a context and at least one labelled slot. Sorted.
    `generators`: one per row (draws that do not depend on which rows share a batch or a rank), or one."""
    B, T = loss_mask.shape
    out = torch.full((B, per_row), -1, dtype=torch.long)
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    for r in range(B):
        cand = nxt[r, 1: int(lengths[r]) - 1].nonzero().flatten().cpu() + 1
        if cand.numel() == 0:
            continue
        g = generators[r] if isinstance(generators, list) else generators
        pick = cand[torch.randperm(cand.numel(), generator=g)[:per_row]].sort().values
        out[r, : pick.numel()] = pick
    return out.to(loss_mask.device)


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, n, bs], valid [B, n, bs]): slot j of block a is x_{a+j}, valid where the block exists,
    j >= 1, a+j lies in the row and x_{a+j} is learned (loss_mask)."""
    B, T = input_ids.shape
    pos = anchors.clamp(min=0)[..., None] + torch.arange(block_size, device=anchors.device)
    inside = pos < T
    pos = pos.clamp(max=T - 1)
    flat = pos.view(B, -1)
    labels = input_ids.gather(1, flat).view(pos.shape)
    learned = loss_mask.gather(1, flat).view(pos.shape).bool()
    valid = (anchors >= 0)[..., None] & inside & learned
    valid[..., 0] = False
    return labels, valid


def dpace_weights(q: torch.Tensor, blocks: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights (Wu et al. 2026, "D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel
    Speculative Drafting", arXiv 2605.18810, Eq. 7-8; the default of speculators' DFlash trainer since
    vllm-project/speculators PR #980, and of NVIDIA/Model-Optimizer PR #1724).

    A block's expected accepted length is E = Σ_m Π_{i<=m} q_i (slot m is accepted only if every slot up to it
    is), q_i the draft's probability of the target's token at slot i. Its derivative in log q_j is
    w_j = Σ_{m>=j} Π_{i<=m} q_i: the weight that makes Σ_j w_j · CE_j follow E's gradient. A slot behind an
    unlikely one weighs little (it is rarely reached), and the weight moves to whichever slot now limits the
    block, unlike the fixed exp(-(j-1)/γ). q is smoothed towards 1, q̃ = (1-α)·q + α, so that slots behind a
    hard one keep some signal (α = 1 weighs slot j by the number of slots from j to the block's end).

    q [n]: one per True of `blocks` (bool [B, n_anchors, bs]), in order. A slot that is not learned (the
    anchor, past the row, a prompt token) passes the product through unchanged and adds no term. Returns [n],
    detached: the weights shape the cross-entropy's gradient and take none of their own (Eq. 9).
    """
    with torch.no_grad():
        smooth = torch.ones(blocks.shape, dtype=torch.float32, device=q.device)
        smooth[blocks] = alpha + (1.0 - alpha) * q.detach().float()
        reach = smooth.cumprod(-1) * blocks  # Π_{i<=m} q̃_i at the learned slots m
        return reach.flip(-1).cumsum(-1).flip(-1)[blocks]


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                teacher: torch.Tensor | None = None, vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
                blocks: torch.Tensor | None = None,
                dpace_alpha: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Position-weighted cross-entropy over the selected slots: logits [n, V'], labels [n] (target ids), slots
    [n] (the slot index j of each), weights [bs]. With `teacher` [n, V'] (the target's logits where slot j is
    verified, on the same vocabulary), the soft cross-entropy against its distribution replaces the hard label.
    With `dpace_alpha`, each slot weighs its D-PACE weight (`dpace_weights`, from the draft's probability of the
    label, needing `blocks`) instead of weights[j].

    `vocab` = (d2t, index) for logits over a reduced draft vocabulary (index: target id -> draft id or -1,
    heads.vocab.draft_index): a label outside it cannot be predicted, so with hard labels it leaves the loss
    (`outside`: the fraction of slots whose label is outside, as a draft it caps acceptance at; for D-PACE its q
    is 0, a certain rejection); the teacher, restricted to the draft vocabulary, still teaches there. Metrics:
    the loss, top-1 accuracy against the label (a label outside the vocabulary is a miss) overall and per slot
    (`slot{j}/acc`: what acceptance at depth j follows). With `blocks` (bool [B, n, bs], the `valid` mask whose
    True slots are the rows of `logits`, in order), `tau`: 1 + the mean run of correct slots from slot 1 on,
    over the blocks whose every slot is learned — the accepted length of the block's chain under greedy
    verification, held out here, where the per-slot accuracies say only how often each slot is right on its
    own."""
    draft_labels, inside = labels, torch.ones_like(labels, dtype=torch.bool)
    if vocab is not None:
        draft_labels = vocab[1].to(labels.device)[labels]
        inside = draft_labels >= 0
    logp = F.log_softmax(logits.float(), -1)
    w = weights.to(logits.device)[slots]
    if dpace_alpha is not None:
        if blocks is None:
            raise ValueError("dflash_loss: dpace_alpha needs `blocks`, the slots' places in their blocks")
        q = logp.detach().gather(-1, draft_labels.clamp(min=0)[:, None]).squeeze(-1).exp() * inside
        w = dpace_weights(q, blocks, dpace_alpha)
    if teacher is None:
        w = w * inside
        ce = -logp.gather(-1, draft_labels.clamp(min=0)[:, None]).squeeze(-1)
    else:
        ce = -(F.softmax(teacher.float(), -1) * logp).sum(-1)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-12)  # 0, with a graph, where no slot is learned
    learned = ce[w > 0]
    metrics = {"ce": float(learned.detach().mean()) if learned.numel() else 0.0}
    metrics.update(block_metrics(logits, labels, slots, weights.numel(), vocab, inside, blocks))
    return loss, metrics


def block_metrics(logits: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, block_size: int,
                  vocab: tuple[torch.Tensor, torch.Tensor] | None, inside: torch.Tensor,
                  blocks: torch.Tensor | None) -> dict[str, float]:
    """`dflash_loss`'s accuracy metrics: `acc`, `outside` (a reduced vocabulary), `slot{j}/acc`, `tau`."""
    metrics = {}
    with torch.no_grad():
        pred = logits.argmax(-1)
        right = (pred + vocab[0].to(pred.device)[pred] if vocab is not None else pred) == labels
        metrics["acc"] = float(right.float().mean()) if right.numel() else 0.0
        if vocab is not None:
            metrics["outside"] = float((~inside).float().mean()) if inside.numel() else 0.0
        for j in range(1, block_size):
            at = slots == j
            if at.any():
                metrics[f"slot{j}/acc"] = float(right[at].float().mean())
        if blocks is not None:
            tau = chain_tau(blocks, right)
            if tau is not None:
                metrics["tau"] = tau
    return metrics


def chain_tau(blocks: torch.Tensor, right: torch.Tensor) -> float | None:
    """1 + the mean number of leading correct slots (from slot 1) over the blocks of `blocks` (bool [B, n, bs])
    whose slots 1..bs-1 are all learned; `right` (bool, one per True of `blocks`, in order). None: no such block."""
    hit = torch.zeros(blocks.shape, dtype=torch.bool, device=right.device)
    hit[blocks] = right
    whole = blocks[..., 1:].all(-1)
    if not bool(whole.any()):
        return None
    run = hit[..., 1:][whole].int().cumprod(-1).sum(-1)
    return 1.0 + float(run.float().mean())


def load_dflash(path: str | Path, target=None, kind: str = "dflash", reader=None) -> tuple[DFlashDraft, dict]:
    """Draft and manifest of a DFlash artifact (or of a method on its backbone: `kind`, and `reader`, its
    config reader, e.g. DSpark's); with `target` (fingerprint checked) attached to it and moved to its device /
    dtype."""
    path = Path(path)
    manifest, state = artifact.load_artifact(path, kind=kind, target=target)
    config = (reader or read_config)(path, manifest)
    draft = module_of(config)(config)
    artifact.load_strict(draft, state, path)
    if target is not None:
        draft.to(device=target.device, dtype=target.dtype)
        draft.attach_target(target.model)
    return draft.eval().requires_grad_(False), manifest


def module_of(config: DFlashConfig) -> type[DFlashDraft]:
    """The module class a config builds: DFlash's, or the subclass whose `config_class` it is (DSpark)."""
    def walk(cls):
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)
    return next(c for c in walk(DFlashDraft) if c.config_class is type(config))


def read_config(path: str | Path, manifest: dict | None = None, make=DFlashConfig, extra=None) -> DFlashConfig:
    """The one reader of a DFlash artifact's config.json: every field typed and in range, and, with the
    artifact's `manifest`, against the target it was made for (vocabulary size, tapped layers inside its depth),
    or a FieldError naming the file and the field. A method on this backbone passes its config class (`make`)
    and `extra(cfg, where, fields)`, which reads its own fields into `fields`."""
    cfg, where, V, top = schema.head_config(path, manifest)
    fields = {"hidden_size": schema.get(cfg, "hidden_size", where, "int", lo=1, hi=schema.MAX_HIDDEN),
              "vocab_size": V, "target_layers": schema.get(cfg, "target_layers", where, "ints", lo=0, hi=top),
              "num_layers": schema.get(cfg, "num_layers", where, "int", lo=1, hi=16),
              "block_size": schema.get(cfg, "block_size", where, "int", lo=2, hi=64),
              "mask_token_id": schema.get(cfg, "mask_token_id", where, "int", lo=0, hi=V - 1),
              "layer_config": schema.get(cfg, "layer_config", where, "dict"),
              "draft_vocab_size": schema.get(cfg, "draft_vocab_size", where, "int", lo=1, hi=V - 1, null=True,
                                             default=None)}
    for name in LAYER_INTS:
        schema.get(cfg, f"layer_config.{name}", where, "int", lo=1, hi=schema.MAX_VOCAB)
    schema.get(cfg, "layer_config.rms_norm_eps", where, "number", lo=0, hi=1)
    if fields["layer_config"]["hidden_size"] != fields["hidden_size"]:
        raise schema.FieldError(f"{where}: field 'layer_config.hidden_size' is "
                                f"{fields['layer_config']['hidden_size']}, "
                                f"but 'hidden_size' is {fields['hidden_size']}")
    if extra is not None:
        extra(cfg, where, fields)
    return buildable(make, fields, where)


def buildable(make, fields: dict, where: Path) -> DFlashConfig:
    """`make(**fields)`, a config whose draft builds (on the meta device: no memory), or a FieldError naming
    `where`: transformers validates the layer's RoPE config with error types of its own."""
    try:
        config = make(**fields)
        with torch.device("meta"):
            module_of(config)(config)
    except Exception as e:  # transformers and huggingface_hub raise their own validation error types
        first = (str(e).splitlines() or [""])[0][:200]
        raise schema.FieldError(f"{where}: not a DFlash config ({type(e).__name__}: {first})") from None
    return config


# the draft layer's sizes (layer_config_dict): a module is built from them
LAYER_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings")


def artifact_tensors(path: str | Path, reader=None) -> tuple[dict, dict, list[str]]:
    """`Method.tensors`: name -> (shape, dtype or "") of the draft `config.json` describes, built on the meta
    device."""
    config = (reader or read_config)(path, artifact.load_manifest(path))
    with torch.device("meta"):
        module = module_of(config)(config)
    return schema.module_spec(module), {}, []
