"""EAGLE heads: a one-layer feature-level drafter on a frozen target (EAGLE-1 and EAGLE-3).

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (EAGLE-1);
Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (the tree, in
`eagle/proposer.py`); Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test" (multi-layer fusion, training-time test, reduced draft vocabulary).

Notation: x_0..x_{T-1} the tokens, f_t the target's features after reading x_0..x_t (layer convention of
`capture/layers.py`: pre-norm decoder-layer outputs), e(x) the target's (frozen, shared) token embedding.
The draft at base position t reads (feature of t, embedding of x_{t+1}) and predicts x_{t+2}:

  EAGLE-1   u_t = fc([e(x_{t+1}); f_t])                    fc: 2H -> H          (f = last layer, pre-norm)
            a_t = DecoderLayer(u)_t                        predicts the NEXT FEATURE f_{t+1}
            logits = lm_head_target(norm_target(a_t))      the target's frozen final norm and lm_head
            L = SmoothL1(a_t, f_{t+1}) + w_cls · CE(p_target(·|x_{≤t+1}), softmax(logits))   (EAGLE §3.2)

  EAGLE-3   g_t = fc([f^low_t; f^mid_t; f^high_t])         fc: 3H -> H          (EAGLE-3 §3.2, fusion)
            a_t = DecoderLayer3(g, e)_t                    attention input [norm_e(e(x_{t+1})); norm_h(g_t)] (2H:
                                                           q/k/v take 2H), residual over g (or norm_h(g) with
                                                           norm_before_residual)
            logits = lm_head_draft(norm(a_t))              over the draft vocabulary (N << V tokens)
            L = Σ_j 0.8^j · CE(p̃_target at step j, softmax(logits_j))     p̃ = target softmax restricted to the
                                                                          draft vocabulary (renormalised)

Training-time test (EAGLE-3 §3.3): the forward is unrolled n steps. Step 0 is the above. Step j >= 1 at base
t feeds back the head's OWN previous output a^{j-1}_t as the feature (no fc), with the embedding of
x_{t+1+j} (`ttt_tokens="target"`: the token verification would have accepted — the draft's later steps
only matter when its earlier tokens were accepted, i.e. equal the target's) or of the draft's own argmax
(`ttt_tokens="draft"`), at position id t+j, and predicts x_{t+2+j}. The attention of step j at base t sees

    step-0 keys at positions s <= t  (the real context, computed from real target features)
    the step-i key at base t, for 1 <= i <= j  (its own chain)

exactly what inference sees when the committed context ends at t and the draft is j tokens deep (the
draft's KV cache holds step-0 entries for committed positions only; chain/tree entries are scratch). The
mask over the concatenated keys [K^0 | K^1 | ... | K^j] is therefore [causal | I | ... | I].

The decoder layer is a Llama decoder layer sized from the target (hidden, heads, kv heads, head_dim, MLP,
the target's full-attention RoPE) for every target family — what vLLM's, SGLang's, TensorRT-LLM's and
speculators' EAGLE drafters build — or, with `draft_layer: target`, the target family's own layer
(targets/families.py; built from its config class with layer_idx 0, full attention). EAGLE-1 runs it as
is, minus its input norm (as the original EAGLE-1 does); EAGLE-3 widens its q/k/v projections to 2H and runs its
submodules with the EAGLE-3 residual layout, under the serving stacks' names (layer.input_layernorm normalises
the embedding, layer.hidden_norm the feature), so `eagle/export.py` maps them one to one.
The target's embedding (and, for EAGLE-1, its final norm and lm_head) is attached by reference
(`attach_target`): it is not a parameter, not trained, not saved. The head reads the embedding table's
plain rows (no Gemma sqrt(H) scale), as the serving stacks' drafters do. Export writers take
`embed_tokens` from the target the manifest's fingerprint names (config.json says `"embeddings": "target"`).

Draft vocabulary (EAGLE-3): the N most frequent target-written tokens (loss-masked positions) of the
training data, sorted by target id; `d2t[d] = target_id - d` (int64) and `t2d` (bool over the target
vocabulary) are buffers, so they live in model.safetensors. Invariant: nonzero(t2d) == arange(N) + d2t.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import artifact, schema
from draftsmith.eagle.variants import VARIANTS, Variant, variant
from draftsmith.errors import ConfigError
from draftsmith.heads.vocab import check_draft_vocab
from draftsmith.targets.families import (
    FAMILIES,
    Family,
    attention_dims,
    embedding_rows,
    embeddings,
    family,
    final_norm,
    full_attention_rope,
    lm_head,
    rope_fields,
    text_config,
    whole,
)
from draftsmith.targets.gemm import rows_linear


@dataclass
class EagleConfig:
    """Shape of an EAGLE head (stored as the artifact's config.json, with the decoder layer's HF config)."""

    version: int  # the variant's number (eagle/variants.py): 1 = EAGLE-1, 3 = EAGLE-3, as the layouts read it
    hidden_size: int
    vocab_size: int  # the target's
    target_layers: list[int]  # resolved (non-negative) feature layers: [last] for EAGLE-1, [low, mid, high]
    draft_vocab_size: int | None = None  # variants with a draft vocabulary (EAGLE-3); None = the target's
    ttt_steps: int = 1
    ttt_tokens: Literal["target", "draft"] = "target"
    norm_before_residual: bool = False
    # EAGLE-3.1 options (as vLLM and speculators read them): an RMS norm over the concatenated features before
    # fc (`input_norm`), or one per fused layer (`fc_norm.k`); the next test-time step reads the draft's
    # normalised output rather than its residual stream (`norm_output`)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    layer_config: dict = field(default_factory=dict)  # the target's text config (to_dict), model_type included

    def __post_init__(self):
        v = self.variant  # a ConfigError for a version no variant declares
        if len(self.target_layers) != v.feature_layers:
            raise ValueError(f"{v.name} reads {v.feature_layers} target layer(s), got {self.target_layers}")
        if v.draft_vocab and (self.draft_vocab_size is None or not 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if not 1 <= self.ttt_steps <= 16:
            raise ValueError(f"ttt_steps must be in 1..16, got {self.ttt_steps}")
        if (self.norm_before_fc or self.fc_norm) and not v.fuse_layers:
            raise ValueError(f"norm_before_fc / fc_norm normalise fused target layers, which {v.name} does not fuse")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are two alternatives (one norm over the concatenation, or "
                             "one per layer): speculators refuses both at once")
        if self.norm_output and not v.draft_vocab:
            raise ValueError(f"norm_output feeds back the head's own final norm, which {v.name} does not have")

    @property
    def variant(self) -> Variant:
        return variant(self.version)

    @property
    def model_type(self) -> str:
        return self.layer_config.get("model_type", "?")


def layer_config_dict(target_config, draft_layer: str = "llama") -> dict:
    """The decoder layer's HF config as a plain dict (what config.json stores to rebuild it).

    draft_layer "llama" (default): a Llama decoder layer with the target's shapes (hidden, heads, kv heads,
    head_dim, MLP width, norm eps, the full-attention RoPE of the target) — the layer the serving stacks'
    EAGLE drafters are built from (vLLM `llama_eagle3`, SGLang `LlamaForCausalLMEagle3`, TensorRT-LLM,
    speculators) whatever the target family. "target": the target family's own decoder layer
    (targets/families.py `eagle_layer`), which draftsmith's decoder runs but only Llama-layer families export.
    """
    fam = family(target_config)
    tc = text_config(target_config)
    if draft_layer == "target":
        if fam.eagle_layer is None:
            why = ("a mixture-of-experts layer, which no serving stack's EAGLE drafter builds" if fam.experts else
                   "its decoder layer cannot take EAGLE-3's widened attention")
            raise ConfigError(f"draft_layer: target is not available for {fam.model_type} targets ({why}): "
                              "use draft_layer: llama")
        d = tc.to_dict()
        d.pop("quantization_config", None)
        return d
    if draft_layer != "llama":
        raise ConfigError(f"draft_layer must be 'target' or 'llama', got {draft_layer!r}")
    heads, kv_heads, head_dim = attention_dims(tc)
    return {"model_type": "llama", "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6),
            **rope_fields(full_attention_rope(tc)),
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 8192),
            "vocab_size": tc.vocab_size, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "num_hidden_layers": 1, "tie_word_embeddings": False}


def _layer_family(layer_config: dict) -> Family:
    mt = layer_config.get("model_type")
    fam = FAMILIES.get(mt)
    if fam is None or fam.eagle_layer is None:
        known = sorted(k for k, f in FAMILIES.items() if f.eagle_layer is not None)
        raise ConfigError(f"EAGLE heads cannot build a '{mt}' decoder layer (draft layers: {', '.join(known)})")
    return fam


def _hf_layer_config(layer_config: dict):
    """Rebuild the HF config object of the draft's decoder layer (full attention, sdpa)."""
    from transformers import AutoConfig

    _layer_family(layer_config)
    d = dict(layer_config)
    model_type = d.pop("model_type")
    for k in ("architectures", "auto_map", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    params = d.get("rope_parameters")
    if not (isinstance(params, dict) and "full_attention" in params):  # one RoPE, in transformers 5's spelling
        d["rope_parameters"] = full_attention_rope(layer_config)  # (from rope_theta + rope_scaling if need be)
        d.pop("rope_theta", None)
        d.pop("rope_scaling", None)
    cfg = text_config(AutoConfig.for_model(model_type, **d))
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    cfg._attn_implementation = "sdpa"
    return cfg


def check_architecture(target_config, draft_layer: str = "llama") -> str:
    """The model_type of a target whose EAGLE head can be built with `draft_layer`, or a ConfigError."""
    fam = family(target_config)
    if draft_layer == "target":
        layer_config_dict(target_config, "target")  # raises its one line where the family has no such layer
    return fam.model_type


def exportable(target_config, draft_layer: str) -> bool:
    """Whether the serving stacks load an EAGLE head with this draft layer on this target."""
    return draft_layer == "llama" or family(target_config).llama_layer


class DraftKV:
    """K/V of the draft's one layer ([B, kv_heads, S, head_dim], post-rotary). The HF attention module
    appends through `update` (the Cache method it calls); `crop` rolls back to a length."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]


def _after_attention(layer: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after its attention, in the target architecture's residual layout."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: sandwich norms around attention and MLP
        h = residual + layer.post_attention_layernorm(attn_out)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    h = residual + attn_out  # Llama
    return h + layer.mlp(layer.post_attention_layernorm(h))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [q, kv] or [B, q, kv] (True = may attend) -> additive float [1|B, 1, q, kv]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


def ttt_mask(T: int, step: int, device=None, start: int = 0) -> torch.Tensor:
    """bool [T', T + step·T'] with T' = T - start: step `step`'s queries (bases start..T-1) over the keys
    [K^0 | K^1 | ... | K^step] (module docstring), K^0 over every base, K^i (i >= 1) over bases start..T-1."""
    if not 0 <= start < T:
        raise ValueError(f"ttt_mask: start must be in 0..{T - 1}, got {start}")
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[start:]
    eye = torch.eye(T - start, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


@dataclass
class EagleOutput:
    hidden: list[torch.Tensor]  # per TTT step: [B, T, H] output features a^j (steps >= 1: zeros left of `start`)
    logits: list[torch.Tensor | None]  # per step: logits at the selected positions [n_j, V'] (None if not asked)
    tokens: list[torch.Tensor]  # per step: the token ids whose embedding step j read [B, T]
    start: int = 0  # steps >= 1 ran on bases start..T-1 only (`EagleHead.forward`)


class EagleHead(nn.Module):
    """The EAGLE drafter (one decoder layer: a Llama layer sized from the target by default). See the module
    docstring."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        lc = _hf_layer_config(config.layer_config)
        mod_name, layer_cls, rotary_cls, self._rope_type = _layer_family(config.layer_config).eagle_layer
        module = importlib.import_module(mod_name)
        H = config.hidden_size
        self.layer = getattr(module, layer_cls)(lc, layer_idx=0)
        norm_cls = type(self.layer.input_layernorm)
        eps = lc.rms_norm_eps
        v = config.variant
        fc_in, fc_out, fc_bias = v.fc_shape(H)
        self.fc = nn.Linear(fc_in, fc_out, bias=fc_bias)
        if config.norm_before_fc:
            self.input_norm = norm_cls(fc_in, eps=eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(norm_cls(H, eps=eps) for _ in config.target_layers)
        if v.attention_input == "concat":
            attn = self.layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding; feature]
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(v.attention_width(H), old.out_features, bias=old.bias is not None))
            # the serving stacks' names: layer.input_layernorm normalises the EMBEDDING, layer.hidden_norm the
            # feature
            self.layer.hidden_norm = norm_cls(H, eps=eps)
        else:
            self.layer.input_layernorm = nn.Identity()  # EAGLE-1 feeds fc's output to attention un-normed
        if v.draft_vocab:
            self.norm = norm_cls(H, eps=eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = getattr(module, rotary_cls)(lc)  # buffers are non-persistent: not in the artifact
        # frozen target modules, by reference (outside the module tree: not trained, saved or DDP-synced)
        object.__setattr__(self, "_embed", None)
        object.__setattr__(self, "_target_norm", None)
        object.__setattr__(self, "_target_head", None)

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, version: str | int = "eagle3", target_layers: list[int] | None = None,
                    draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None, ttt_steps: int | None = None,
                    ttt_tokens: str = "target", norm_before_residual: bool = False,
                    draft_layer: str = "llama", norm_before_fc: bool = False, fc_norm: bool = False,
                    norm_output: bool = False) -> EagleHead:
        """A fresh head shaped for `target_model` (an HF causal LM), target modules attached.

        A variant with a draft vocabulary (EAGLE-3) needs `draft_vocab = (d2t, t2d)` (`heads.vocab.draft_vocabulary`);
        its lm_head and final norm start
        as copies of the target's rows / norm, so the draft starts out reading features like the target does.
        `draft_layer`: "llama" (default) or "target" (the target family's decoder layer; `layer_config_dict`).
        """
        from draftsmith.capture.layers import resolve_layers
        from draftsmith.targets.families import decoder_layers

        check_architecture(target_model.config, draft_layer)
        v = variant(version)
        tc = text_config(target_model.config)
        L = len(decoder_layers(target_model))
        layers = resolve_layers(list(target_layers or v.default_layers(L)), L)
        d2t, t2d = draft_vocab if draft_vocab is not None else (None, None)
        config = EagleConfig(
            version=v.number, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, target_layers=layers,
            draft_vocab_size=int(d2t.numel()) if (v.draft_vocab and d2t is not None) else None,
            ttt_steps=ttt_steps or v.default_ttt_steps, ttt_tokens=ttt_tokens,
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, fc_norm=fc_norm,
            norm_output=norm_output, layer_config=layer_config_dict(target_model.config, draft_layer),
        )
        head = cls(config)
        if v.draft_vocab:
            head.set_draft_vocab(d2t, t2d)
            with torch.no_grad():
                w = lm_head(target_model).weight
                head.lm_head.weight.copy_(w[t2d.to(w.device)].to(head.lm_head.weight))
                tn = final_norm(target_model)
                if type(tn) is type(head.norm):
                    head.norm.load_state_dict(tn.state_dict())
        head.attach_target(target_model)
        return head

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        check_draft_vocab(d2t, t2d)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def attach_target(self, target_model) -> None:
        """Keep references to the target's frozen embedding (and, reading logits through the target's head,
        its final norm and lm_head)."""
        # whole(): the module itself, or a whole copy where ZeRO-3 partitions the target (targets/families.py)
        object.__setattr__(self, "_embed", whole(embeddings(target_model)))
        if not self.config.variant.draft_vocab:
            object.__setattr__(self, "_target_norm", whole(final_norm(target_model)))
            object.__setattr__(self, "_target_head", whole(lm_head(target_model)))

    # --- pieces -----------------------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise ConfigError("this EAGLE head has no target embedding: call attach_target(target_model) first")
        with torch.no_grad():  # the plain table row, as the serving stacks' drafters read it (families.py)
            return embedding_rows(self._embed, ids).to(self._dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Step-0 feature from the target's: fused by fc (EAGLE-3: [low; mid; high], 3H -> H; EAGLE-3.1 normalises
        the concatenation or each layer first) or f itself."""
        x = features.to(self._dtype)
        if not self.config.variant.fuse_layers:
            return x
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def next_feature(self, out: torch.Tensor) -> torch.Tensor:
        """What the next test-time step reads from this step's output: the residual stream, or (EAGLE-3.1
        `norm_output`) its normalised form, the one the logits are read from."""
        return self.norm(out) if self.config.norm_output else out

    def layer_step(self, feature: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, kv: DraftKV,
                   allowed: torch.Tensor) -> torch.Tensor:
        """One application of the draft layer to q new entries.

        feature, emb: [B, q, H]; positions: [1|B, q] position ids; kv: the keys/values so far (the new
        ones are appended); allowed: bool [q, len(kv)+q] or [B, q, len(kv)+q]. Returns a [B, q, H].
        """
        mask = additive_mask(allowed, feature.dtype)
        pe = (self.rotary(feature, positions) if self._rope_type is None else
            self.rotary(feature, positions, self._rope_type))
        if self.config.variant.attention_input == "fc":  # EAGLE-1: u = fc([e(x_{t+1}); f_t]) through the layer
            x = self.fc(torch.cat([emb, feature], dim=-1))
            out = self.layer(hidden_states=x, attention_mask=mask, position_ids=positions, past_key_values=kv,
                             position_embeddings=pe)
            return out[0] if isinstance(out, tuple) else out
        # "concat" (EAGLE-3): attention over [norm_e(e); norm_h(g)] (2H), residual over g (or norm_h(g))
        layer = self.layer
        normed = layer.hidden_norm(feature)
        residual = normed if self.config.norm_before_residual else feature
        attn_in = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        attn_out, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=pe, attention_mask=mask,
                                      position_ids=positions, past_key_values=kv)
        return _after_attention(layer, residual, attn_out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., H] -> [.., N] draft-vocab logits (EAGLE-3) or [.., V] via the target's frozen head (EAGLE-1)."""
        if self.config.variant.draft_vocab:
            return self.lm_head(self.norm(hidden))
        if self._target_head is None:
            raise ConfigError("EAGLE-1 head has no target lm_head: call attach_target(target_model) first")
        w = self._target_head.weight
        return rows_linear(self._target_norm(hidden.to(w.dtype)), w)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (target_id = d + d2t[d]); identity for EAGLE-1."""
        return draft_ids + self.d2t[draft_ids] if self.config.variant.draft_vocab else draft_ids

    @torch.no_grad()
    def argmax_target_ids(self, hidden: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """Target ids of the draft's argmax at every position of hidden [B, T, H] (chunked, no grad)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.cat([self.logits(flat[i:i + chunk]).argmax(-1) for i in range(0, flat.shape[0], chunk)])
        return self.to_target_ids(out).view(hidden.shape[:-1])

    # --- training-time test -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int | None = None,
                select: list[torch.Tensor] | None = None, skip: bool = True) -> EagleOutput:
        """TTT-unrolled forward over a right-padded batch.

        input_ids: [B, T]; features: [B, T, F] (EAGLE-3: the 3 layers concatenated, F = 3H; EAGLE-1: the last
        layer, F = H). select: per step a bool [B, T] of positions whose logits to return (the loss
        positions; logits over [B, T, V] for every step would not fit in memory). Returns per step the
        output features a^j [B, T, H], the selected logits and the token ids each step read.

        With `select`, steps >= 1 skip the bases left of the first one any row selects at a step >= 1: a
        step-j output at base t feeds only base t's later steps and its own logits (its key is seen by base
        t alone), so those bases cannot reach the loss. With prompt context they are most of the prompt: 24%
        of the step >= 1 columns of the SmolLM2 set. Step 0 still runs every base (its keys are the
        context). Skipped columns of hidden[j >= 1] and tokens[j >= 1] are zeros; `start` says where they end.
        skip=False runs every base at every step (`draftsmith bench eagle-step` times both).
        """
        steps = steps or self.config.ttt_steps
        B, T = input_ids.shape
        device = input_ids.device
        kv = DraftKV()
        feat = self.fuse(features)
        base = torch.arange(T, device=device)[None]
        start = 0
        if skip and select is not None and steps > 1:
            later = torch.stack([sel.any(0) for sel in select[1:steps]]).any(0).nonzero()
            start = min(int(later[0]) if later.numel() else T - 1, T - 1)
        hidden, logits, tokens = [], [], []
        prev = feat  # the previous step's output (set by step 0 before any step reads it)
        for j in range(steps):
            c = start if j else 0  # this step's first base
            if j == 0 or self.config.ttt_tokens == "target":
                tok = shift_left(input_ids, 1 + j)[:, c:]  # x_{t+1+j}
            else:  # the draft's own previous token (greedy), as at inference
                tok = self.argmax_target_ids(prev)
            h = self.layer_step(feat, self.embed(tok), base[:, c:] + j, kv, ttt_mask(T, j, device, c))
            if select is not None:
                if c and select[j][:, :c].any():
                    raise ValueError("EagleHead.forward: a selected position lies left of the skipped bases")
                logits.append(self.logits(h[select[j][:, c:]]))
            else:
                logits.append(None)
            hidden.append(_pad_left(h, c))
            tokens.append(_pad_left(tok, c))
            prev = h[:, start - c:] if j == 0 else h  # this step's output at the next step's bases
            feat = self.next_feature(prev)  # what step j+1 reads of it
        return EagleOutput(hidden, logits, tokens, start)


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T', ...] with n zero columns in front: [B, n + T', ...]."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros((x.shape[0], n) + tuple(x.shape[2:])), x], dim=1)


def shift_left(x: torch.Tensor, k: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t + k] at t (fill beyond the end). x: [B, T, ...]."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


# ---------------------------------------------------------------------------------------------------
# Losses (pure functions over the selected positions of each TTT step)
# ---------------------------------------------------------------------------------------------------


def step_weights(steps: int, decay: float) -> list[float]:
    """EAGLE-3 weighs TTT step j by decay**j (later steps are harder and matter only after earlier accepts)."""
    return [decay**j for j in range(steps)]


def soft_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over rows of -Σ_v softmax(teacher)_v · log softmax(student)_v. Both [n, V']. `weights` [n]: each
    row's cross-entropy is multiplied by its weight before the mean (1 everywhere = the plain mean)."""
    p = F.softmax(teacher_logits.float(), dim=-1)
    ce = -(p * F.log_softmax(student_logits.float(), dim=-1)).sum(-1)
    return (ce if weights is None else ce * weights.to(ce.dtype)).mean()


def lk_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target_logprobs: torch.Tensor,
            kind: Literal["lk_alpha", "lk_lambda"], eta: float = 3.0,
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LK losses (Samarin et al. 2026, "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding",
    arXiv 2602.23881; SpecForge's EAGLE-3 trainer since sgl-project/SpecForge PR #492, speculators' `nla` and
    `lk_hybrid`): train the draft for the acceptance rate itself, not for KL, a proxy a small draft cannot drive
    to zero and whose minimum under limited capacity need not be the acceptance's maximum.

    α = Σ_v min(q_v, p_v) (= 1 − TV(q, p)) per row: the probability that speculative sampling accepts a token
    drafted from q = softmax(student) [n, N] against the target's p, given as log-probabilities [n, N]
    (`target_logprobs`: over a reduced draft vocabulary, the target's full-vocabulary probabilities of those
    tokens; the mass outside is never drafted, so it is never accepted).
      lk_alpha   -log α: its gradient is TV's scaled by 1/α, large where the draft is far off (a cold start)
      lk_lambda  λ·KL(p̃ ‖ q) + (1 − λ)·(1 − α), λ = exp(-eta·sg[α]) per row: KL's strong gradient while the
                 row's acceptance is low, the acceptance itself as it rises (p̃ = softmax(teacher_logits), the
                 target renormalised over the draft vocabulary, as `soft_ce` reads it; λ is not differentiated)
    Mean over rows, each multiplied by its `weights` [n] first. Returns (loss, α [n] detached).
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    alpha = sampling_acceptance(student_logits, target_logprobs)
    if kind == "lk_alpha":
        per_row = -torch.log(alpha.clamp(min=1e-8))
    elif kind == "lk_lambda":
        kl = F.kl_div(logq, F.log_softmax(teacher_logits.float(), dim=-1), log_target=True, reduction="none").sum(-1)
        lam = torch.exp(-eta * alpha.detach())
        per_row = lam * kl + (1.0 - lam) * (1.0 - alpha)
    else:
        raise ValueError(f"lk_loss: kind must be lk_alpha or lk_lambda, got {kind!r}")
    loss = (per_row if weights is None else per_row * weights.to(per_row.dtype)).mean()
    return loss, alpha.detach()


def eagle3_loss(logits: list[torch.Tensor], teacher: list[torch.Tensor], target_ids: list[torch.Tensor],
                d2t: torch.Tensor, weights: list[float], replay: list[torch.Tensor] | None = None,
                replay_weight: float = 0.0, target_logprobs: list[torch.Tensor] | None = None,
                objective: Literal["kl", "lk_alpha", "lk_lambda"] = "kl",
                lk_eta: float = 3.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_j w_j · soft-CE(p̃_target, draft) over the selected positions of step j; with `objective` lk_alpha or
    lk_lambda, Σ_j w_j · `lk_loss` instead (it needs `target_logprobs`).

    replay[j] (bool [n_j], optional): the positions where an on-policy rollout's draft was rejected at step j
    (data/engines/rollout.py); their loss counts 1 + replay_weight times. `replay/acc` is the draft's
    top-1 accuracy on them (on a head's own rollouts it starts at 0: the draft was rejected there).

    logits[j]: [n_j, N] draft logits; teacher[j]: [n_j, N] the target's logits restricted to the draft
    vocabulary (softmax renormalises over it); target_ids[j]: [n_j] the target's argmax over its FULL
    vocabulary (step{j}/acc = the draft's argmax mapped through d2t equals it: a miss when the target's
    token is outside the draft vocabulary — an honest acceptance proxy); target_logprobs[j] (optional):
    [n_j, N] the target's full-vocabulary log-probabilities of the draft vocabulary's tokens, which give
    `step{j}/alpha`, the expected acceptance of a token sampled from the draft (`lk_loss`'s α).
    """
    if objective != "kl" and target_logprobs is None:
        raise ValueError(f"eagle3_loss: objective {objective} needs target_logprobs")
    total = None
    metrics: dict[str, float] = {}
    hits = seen = 0
    for j, (lg, te, ti) in enumerate(zip(logits, teacher, target_ids)):
        if lg.shape[0] == 0:
            metrics[f"step{j}/loss"], metrics[f"step{j}/acc"] = 0.0, 0.0
            loss_j = lg.sum() * 0.0
        else:
            rj = replay[j] if replay is not None else None
            w = 1.0 + replay_weight * rj.float() if rj is not None and replay_weight else None
            lp = target_logprobs[j] if target_logprobs is not None else None
            loss_j = step_loss(lg, te, lp, w, objective, lk_eta, metrics, j)
            with torch.no_grad():
                pred = lg.argmax(-1)
                right = pred + d2t[pred] == ti
                if rj is not None:
                    hits, seen = hits + int(right[rj].sum()), seen + int(rj.sum())
            metrics[f"step{j}/loss"], metrics[f"step{j}/acc"] = float(loss_j.detach()), float(right.float().mean())
        total = weights[j] * loss_j if total is None else total + weights[j] * loss_j
    if replay is not None:
        metrics["replay/n"] = float(seen)
        metrics["replay/acc"] = hits / seen if seen else 0.0
    return total, metrics


def step_loss(logits: torch.Tensor, teacher: torch.Tensor, target_logprobs: torch.Tensor | None,
              weights: torch.Tensor | None, objective: str, lk_eta: float, metrics: dict[str, float],
              j: int) -> torch.Tensor:
    """One TTT step's loss for `eagle3_loss` (soft-CE, or `lk_loss`); logs `step{j}/alpha` where it can."""
    if objective == "kl":
        loss = soft_ce(logits, teacher, weights)
        if target_logprobs is not None:
            with torch.no_grad():
                alpha = sampling_acceptance(logits, target_logprobs)
            metrics[f"step{j}/alpha"] = float(alpha.mean())
        return loss
    loss, alpha = lk_loss(logits, teacher, target_logprobs, objective, lk_eta, weights)
    metrics[f"step{j}/alpha"] = float(alpha.mean())
    return loss


def sampling_acceptance(student_logits: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    """[n] Σ_v min(softmax(student)_v, p_v), p = exp(target_logprobs): `lk_loss`'s α (differentiable)."""
    return torch.minimum(F.softmax(student_logits.float(), -1), target_logprobs.float().exp()).sum(-1)


def eagle1_loss(pred_features: list[torch.Tensor], target_features: list[torch.Tensor], logits: list[torch.Tensor],
                teacher: list[torch.Tensor], weights: list[float], w_cls: float = 0.1
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_j w_j · (SmoothL1(a^j, f_{t+1+j}) + w_cls · soft-CE(p_target, draft))   (EAGLE §3.2: w_cls = 0.1).

    pred_features/target_features: [n_j, H]; logits/teacher: [n_j, V] (both through the target's final
    norm and lm_head). step{j}/acc = draft argmax equals the target's argmax.
    """
    total = None
    metrics: dict[str, float] = {}
    for j, (pf, tf, lg, te) in enumerate(zip(pred_features, target_features, logits, teacher)):
        if pf.shape[0] == 0:
            loss_j = pf.sum() * 0.0
            metrics.update({f"step{j}/reg": 0.0, f"step{j}/ce": 0.0, f"step{j}/acc": 0.0})
        else:
            reg = F.smooth_l1_loss(pf.float(), tf.float())
            ce = soft_ce(lg, te)
            loss_j = reg + w_cls * ce
            with torch.no_grad():
                acc = (lg.argmax(-1) == te.argmax(-1)).float().mean()
            metrics.update({f"step{j}/reg": float(reg.detach()), f"step{j}/ce": float(ce.detach()),
                            f"step{j}/acc": float(acc)})
        total = weights[j] * loss_j if total is None else total + weights[j] * loss_j
    return total, metrics


def read_config(path: str | Path, manifest: dict | None = None) -> EagleConfig:
    """The one reader of an EAGLE artifact's config.json: every field typed and in range, and, with the
    artifact's `manifest`, against the target it was made for (vocabulary size, feature layers inside its
    depth); the decoder layer's config must build. A FieldError names the file and the field."""
    cfg, where, V, top = schema.head_config(path, manifest)
    versions = tuple(x for v in VARIANTS.values() for x in (v.number, v.name))
    fields = {"version": schema.get(cfg, "version", where, "str" if isinstance(cfg.get("version"), str) else "int",
                                    choices=versions),
              "hidden_size": schema.get(cfg, "hidden_size", where, "int", lo=1, hi=schema.MAX_HIDDEN),
              "vocab_size": V, "target_layers": schema.get(cfg, "target_layers", where, "ints", lo=0, hi=top),
              "draft_vocab_size": schema.get(cfg, "draft_vocab_size", where, "int", lo=1, hi=V, null=True,
                                             default=None),
              "ttt_steps": schema.get(cfg, "ttt_steps", where, "int", lo=1, hi=16, default=1),
              "ttt_tokens": schema.get(cfg, "ttt_tokens", where, "str", default="target", choices=("target", "draft")),
              "layer_config": schema.get(cfg, "layer_config", where, "dict")}
    for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        fields[name] = schema.get(cfg, name, where, "bool", default=False)
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings"):
        schema.get(cfg, f"layer_config.{name}", where, "int", lo=1, hi=schema.MAX_VOCAB)
    try:
        config = EagleConfig(**fields)
        with torch.device("meta"):  # the head must build from it: transformers validates the layer's config
            EagleHead(config)
    except Exception as e:  # transformers and huggingface_hub raise their own validation error types
        first = (str(e).splitlines() or [""])[0][:200]
        raise schema.FieldError(f"{where}: not an EAGLE head config ({type(e).__name__}: {first})") from None
    return config


def load_eagle(path: str | Path, target=None) -> tuple[EagleHead, dict]:
    """Head and manifest of an EAGLE artifact; with `target` (fingerprint checked) the head is attached to it
    and moved to its device / dtype."""
    path = Path(path)
    manifest, state = artifact.load_artifact(path, kind="eagle", target=target)
    head = EagleHead(read_config(path, manifest))
    artifact.load_strict(head, state, path)
    if target is not None:
        head.to(device=target.device, dtype=target.dtype)
        head.attach_target(target.model)
    return head.eval().requires_grad_(False), manifest


def artifact_tensors(path: str | Path) -> tuple[dict, dict, list[str]]:
    """`Method.tensors`: (required, optional) name -> (shape, dtype or "") of the head `config.json` describes,
    built on the meta device."""
    config = read_config(path, artifact.load_manifest(path))
    with torch.device("meta"):
        module = EagleHead(config)
    return schema.module_spec(module), {}, []
