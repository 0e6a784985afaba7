"""The draft model: the three ways to build a draft that shares the target's tokenizer.

    fresh_draft(target, num_layers, hidden_size, ...)   a new, randomly initialised model of the target's
                                                        family (same model_type, vocab, special tokens,
                                                        rope, norms), with the sizes given; embeddings
                                                        copied from the target when the hidden sizes match
    truncated_draft(target, num_layers)                 the target's first N decoder layers plus its
                                                        embeddings, final norm and lm_head: a strong
                                                        initialisation (layer-skip / early-exit drafts)
    existing_draft(path, target)                        an HF model folder, refused unless its tokenizer
                                                        is the target's token for token

Every builder returns an ordinary `transformers` causal LM in train mode, float32, on the CPU; the job
moves it. The tokenizer is never the draft's own: the artifact copies the target's tokenizer files, so
vocabulary, special tokens and chat template are the target's by construction.

Size vs compute (`size_report`): for small models the embedding matrix dominates the parameter count
(SmolLM2-135M: 28.3M of its 134.5M parameters are the tied 49152×576 embedding), but a lookup costs no
FLOPs. What a draft step costs is, per token (Kaplan et al. 2020, §2.1, forward pass):

    C ≈ 2·N_nonembed + 2·d·V (lm_head matmul) + 2·n_layer·n_ctx·d (attention over the context)

so a "10× smaller" draft means 10× fewer NON-EMBEDDING parameters; its per-token FLOPs shrink by less
because the d·V lm_head stays (a 3-layer SmolLM2 truncation: 10.6M vs 106.2M non-embedding params, but
~78 vs ~269 MFLOPs per token at short context). For a mixture-of-experts model N_nonembed is its ACTIVE count
(the experts a token is routed to): Qwen3-30B-A3B computes like a 3B model, not a 30B one.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.targets.families import (
    attention_dims,
    decoder_layers,
    experts_per_token,
    inactive_params,
    text_config,
    text_state_dict,
)

log = logging.getLogger(__name__)

# Fields of a config that depend on the layer count and must be cut to the first N entries.
_PER_LAYER_LISTS = ("layer_types",)


def _config_for_layers(config, num_layers: int):
    cfg = copy.deepcopy(text_config(config))
    cfg.num_hidden_layers = num_layers
    for name in _PER_LAYER_LISTS:
        value = getattr(cfg, name, None)
        if isinstance(value, list | tuple):
            setattr(cfg, name, list(value)[:num_layers])
    for stale in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(cfg, stale):
            try:
                delattr(cfg, stale)
            except AttributeError:
                pass
    return cfg


def _new_model(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    return model


def _copy_generation_config(draft: nn.Module, target_model: nn.Module) -> None:
    gen = getattr(target_model, "generation_config", None)
    if gen is not None:
        draft.generation_config = copy.deepcopy(gen)


def fresh_draft(target, num_layers: int, hidden_size: int | None = None, num_attention_heads: int | None = None,
                num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                head_dim: int | None = None, init_embeddings: bool = True) -> nn.Module:
    """A new random model of the target's family: target config with the given sizes (None = target's).

    With `init_embeddings` and equal hidden sizes the input embeddings (and an untied lm_head) are copied
    from the target — the most expensive part of a tiny draft to learn from scratch.
    """
    tc = text_config(target.model.config)
    if num_layers < 1:
        raise ConfigError(f"draft num_layers must be >= 1, got {num_layers}")
    cfg = _config_for_layers(tc, num_layers)
    hidden = hidden_size or tc.hidden_size
    heads = num_attention_heads or tc.num_attention_heads
    kv = num_key_value_heads or min(getattr(tc, "num_key_value_heads", heads) or heads, heads)
    if hidden % heads:
        raise ConfigError(f"draft hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv:
        raise ConfigError(f"draft num_attention_heads {heads} is not divisible by num_key_value_heads {kv}")
    cfg.hidden_size = hidden
    cfg.num_attention_heads = heads
    cfg.num_key_value_heads = kv
    cfg.intermediate_size = intermediate_size or (tc.intermediate_size if hidden == tc.hidden_size else 4 * hidden)
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = head_dim or (tc.head_dim if (hidden, heads) == (tc.hidden_size, tc.num_attention_heads)
                                    and getattr(tc, "head_dim", None) else hidden // heads)
    model = _new_model(cfg)
    if init_embeddings and hidden == tc.hidden_size:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(target.model.get_input_embeddings().weight.float())
            out_t, out_d = target.model.get_output_embeddings(), model.get_output_embeddings()
            if out_d is not None and out_t is not None and out_d.weight is not model.get_input_embeddings().weight:
                out_d.weight.copy_(out_t.weight.float())
    _copy_generation_config(model, target.model)
    return model


def truncated_draft(target, num_layers: int) -> nn.Module:
    """The target's first `num_layers` decoder layers + embeddings, final norm and lm_head (exact copies)."""
    n_target = len(decoder_layers(target.model))
    if not 1 <= num_layers <= n_target:
        raise ConfigError(f"draft num_layers must be in 1..{n_target} for a truncated copy of this target, "
                          f"got {num_layers}")
    cfg = _config_for_layers(target.model.config, num_layers)
    model = _new_model(cfg)
    keep = {}
    for name, tensor in text_state_dict(target.model).items():
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= num_layers:
                continue
        keep[name] = tensor.detach().float().clone()
    missing, unexpected = model.load_state_dict(keep, strict=False)
    tied = getattr(cfg, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise DraftsmithError(f"truncated copy does not match the target's weights: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()
    _copy_generation_config(model, target.model)
    model.train()
    return model


def check_tokenizer(draft_tokenizer, target_tokenizer) -> None:
    """Raise DraftsmithError unless the draft's tokenizer maps every id to the target's token.

    The message names the FIRST differing id (or the size difference when one vocabulary extends the
    other), then the special tokens.
    """
    d_vocab = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    t_vocab = {i: t for t, i in target_tokenizer.get_vocab().items()}
    for i in range(min(len(d_vocab), len(t_vocab))):
        a, b = d_vocab.get(i), t_vocab.get(i)
        if a != b:
            raise DraftsmithError(f"draft tokenizer differs from the target's at id {i}: {a!r} vs {b!r}")
    if len(d_vocab) != len(t_vocab):
        raise DraftsmithError(f"draft tokenizer has {len(d_vocab)} tokens, the target's has {len(t_vocab)} "
                              f"(the first {min(len(d_vocab), len(t_vocab))} agree)")
    for name in ("bos", "eos", "pad", "unk"):
        a = getattr(draft_tokenizer, f"{name}_token", None)
        b = getattr(target_tokenizer, f"{name}_token", None)
        if a is not None and b is not None and str(a) != str(b):
            raise DraftsmithError(f"draft tokenizer's {name} token is {str(a)!r}, the target's is {str(b)!r}")


def check_vocab_size(draft: nn.Module, target) -> None:
    """Draft and target logits must have the same width for KD and for verification."""
    dv = text_config(draft.config).vocab_size
    if dv != target.vocab_size:
        raise DraftsmithError(f"draft vocab size {dv} differs from the target's {target.vocab_size}")


def existing_draft(path: str | Path, target, check_tokenizer_files: bool = True) -> nn.Module:
    """An HF causal-LM folder (or a draftsmith draft artifact) whose tokenizer must equal the target's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"{path}: not a Hugging Face model folder (no config.json)")
    if (path / "manifest.json").is_file():  # a draftsmith artifact: its weights are the ones it recorded
        from draftsmith.artifact import load_manifest, verify_weights

        verify_weights(path, load_manifest(path, kind="draft"))
    if check_tokenizer_files:
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise DraftsmithError(f"{path}: cannot load the draft's tokenizer "
                                  f"({str(e).splitlines()[0][:120]})") from None
        check_tokenizer(tok, target.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    check_vocab_size(model, target)
    model.train()
    return model


def build_draft(spec: dict[str, Any] | Any, target) -> nn.Module:
    """Dispatch on a `DraftSpec` (distill/job.py): init = fresh | truncated | existing."""
    init = spec.init
    if init == "truncated":
        return truncated_draft(target, spec.num_layers)
    if init == "fresh":
        return fresh_draft(target, spec.num_layers, spec.hidden_size, spec.num_attention_heads,
                           spec.num_key_value_heads, spec.intermediate_size, spec.head_dim, spec.init_embeddings)
    if init == "existing":
        if not spec.path:
            raise ConfigError("draft.init is 'existing' but draft.path is not set")
        return existing_draft(spec.path, target)
    raise ConfigError(f"unknown draft.init {init!r} (fresh, truncated or existing)")


# ---- size and compute ----------------------------------------------------------------------------

def size_report(model_or_config, context: int = 256) -> dict[str, Any]:
    """Parameters and forward FLOPs per token (module docstring). Works on a model or a bare config."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config))
    if not isinstance(model_or_config, nn.Module) and experts_per_token(cfg) is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # a mixture of experts: count its experts exactly, nothing allocated
            model_or_config = AutoModelForCausalLM.from_config(cfg)
    d, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    heads, kv, hd = attention_dims(cfg)
    ff = cfg.intermediate_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if isinstance(model_or_config, nn.Module):
        seen, total, emb = set(), 0, 0
        emb_ids = {id(model_or_config.get_input_embeddings().weight)}
        out = model_or_config.get_output_embeddings()
        if out is not None:
            emb_ids.add(id(out.weight))
        for p in model_or_config.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if id(p) in emb_ids:
                emb += p.numel()
    else:  # gated-MLP decoder estimate (Llama / Qwen / Gemma): attn q,k,v,o + 3 MLP mats + 2 norms per layer
        per_layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ff + 2 * d
        emb = V * d * (1 if tied else 2)
        total = emb + L * per_layer + d
    non_emb = total - emb
    # a mixture of experts computes each token with the experts it is routed to: its active parameters
    active = non_emb - (inactive_params(model_or_config) if isinstance(model_or_config, nn.Module) else 0)
    attn_ctx = 2 * L * context * heads * hd  # QK^T and AV over the context (Kaplan et al. 2020)
    flops = 2 * active + 2 * d * V + attn_ctx
    return {"params": total, "embedding_params": emb, "non_embedding_params": non_emb,
            "active_non_embedding_params": active, "flops_per_token": flops, "context": context, "num_layers": L,
            "hidden_size": d}
