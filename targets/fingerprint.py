"""Target fingerprints: what an artifact must agree on with the target it is used with.

A fingerprint is a plain dict stored in every manifest:

    tokenizer_hash      sha256 of the sorted (token, id) vocabulary, added tokens included
    vocab_size          the model's embedding rows (config.vocab_size)
    special_tokens      bos / eos / pad / unk token strings and ids
    chat_template_hash  sha256 of the chat template text ("" when the tokenizer has none)
    config_hash         sha256 of the architecture fields of the model config
    weights_hash        sha256 of a strided sample of every parameter (detects a retrained target)
    architecture        model_type and layer/hidden sizes, for messages

`check_compatible` compares everything but `weights_hash` (a Medusa-2 adapted or retrained target is
still the same target for loading purposes); retraining compares `weights_hash` on its own.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.checksums import sha256_json, sha256_text
from draftsmith.errors import FingerprintMismatch
from draftsmith.targets.families import text_config

# Fields of a HF config that define the computation. Names, dtypes and bookkeeping are left out so that
# the GGUF-loaded model and its cached safetensors copy hash the same.
ARCH_FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "sliding_window", "layer_types", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping",
]

CHECKED_FIELDS = ["vocab_size", "tokenizer_hash", "special_tokens", "chat_template_hash", "config_hash"]


def config_summary(config) -> dict[str, Any]:
    return summary_of(text_config(config).to_dict())


def summary_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """config_summary of a text config given as its dict: the form a fleet capture records the serving
    model's config in (fleet/capture_file.model_identity): `sha256_json(summary_of(it))` is a config_hash."""
    out = {}
    for key in ARCH_FIELDS:
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if isinstance(value, float):
                value = float(f"{value:.6g}")  # GGUF stores eps as float32
            out[key] = value
    return out


def tokenizer_hash(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    return sha256_json(sorted(vocab.items(), key=lambda kv: kv[1]))


def special_tokens(tokenizer) -> dict[str, Any]:
    out = {}
    for name in ("bos", "eos", "pad", "unk"):
        token = getattr(tokenizer, f"{name}_token", None)
        out[name] = None if token is None else [str(token), getattr(tokenizer, f"{name}_token_id", None)]
    return out


@torch.no_grad()
def weights_hash(model: torch.nn.Module, samples: int = 64) -> str:
    """Hash a strided sample of each parameter, rounded to bf16 precision so dtype does not matter."""
    parts = []
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].to(torch.float32).cpu()
        rounded = sample.to(torch.bfloat16).to(torch.float32)
        parts.append([name, list(p.shape), [round(float(v), 4) for v in rounded]])
    return sha256_json(parts)


def fingerprint(model, tokenizer) -> dict[str, Any]:
    config = model.config if hasattr(model, "config") else model
    summary = config_summary(config)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = sha256_json(template)
    fp = {
        "vocab_size": summary.get("vocab_size"),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "special_tokens": special_tokens(tokenizer),
        "chat_template_hash": sha256_text(template) if template else "",
        "config_hash": sha256_json(summary),
        "architecture": {k: summary.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size")},
    }
    if isinstance(model, torch.nn.Module):
        fp["weights_hash"] = weights_hash(model)
    return fp


def differences(expected: dict[str, Any], actual: dict[str, Any], fields=CHECKED_FIELDS) -> list[str]:
    return [f for f in fields if expected.get(f) != actual.get(f)]


def check_compatible(expected: dict[str, Any], actual: dict[str, Any], what: str = "artifact") -> None:
    """Raise FingerprintMismatch naming the first differing field (and listing the others)."""
    diffs = differences(expected, actual)
    if not diffs:
        return
    first = diffs[0]
    a, b = expected.get(first), actual.get(first)
    if isinstance(a, str) and len(a) > 16:
        a, b = a[:12] + "…", (b or "")[:12] + "…"
    arch_a = (expected.get("architecture") or {}).get("model_type")
    arch_b = (actual.get("architecture") or {}).get("model_type")
    more = f" (also differs: {', '.join(diffs[1:])})" if len(diffs) > 1 else ""
    raise FingerprintMismatch(
        f"{what} was made for a different target: {first} is {a} there but {b} for this target "
        f"({arch_a} vs {arch_b}){more}"
    )
