"""The target families draftsmith knows, as one table: where each keeps what the drafters read.

Every method reads the same few parts of a target: its decoder layers (features, EAGLE's fusion layers),
its final norm and lm_head (Medusa's input and projection, EAGLE-1's logits, EAGLE-3's initial lm_head),
its token embedding (EAGLE's second input), its text config (sizes, vocabulary; a multimodal checkpoint
nests it) and its RoPE parameters (the EAGLE draft layer runs on the target's positions). A family is
one row here; a model_type outside the table is refused with one line naming what is missing, never
guessed at, so no head is trained against the wrong module.

    family        checkpoint classes                      decoder layers / final norm / embedding
    llama         LlamaForCausalLM (Llama 2/3/3.x, SmolLM)  model.layers / model.norm / model.embed_tokens
    mistral       MistralForCausalLM                        the same
    qwen2         Qwen2ForCausalLM (Qwen2, Qwen2.5)         the same
    qwen3         Qwen3ForCausalLM                          the same
    phi3          Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4-mini)  the same
    gemma3_text   Gemma3ForCausalLM (270M, 1B)             the same (the embedding scales by sqrt(H))
    gemma3        Gemma3ForConditionalGeneration (4B+)      model.language_model.{layers,norm,embed_tokens}
    qwen3_moe     Qwen3MoeForCausalLM (30B-A3B, 235B-A22B)  model.layers / model.norm / model.embed_tokens
    gpt_oss       GptOssForCausalLM (gpt-oss-20b, -120b)    the same
    llama4_text   Llama4ForCausalLM (Llama 4 text decoder)  the same
    deepseek_v3   DeepseekV3ForCausalLM (DeepSeek-V3, R1)   the same

The lm_head is `lm_head` everywhere (tied to the embedding where the config says so).

EAGLE draft layer (eagle/model.py): whatever the family, the default is a Llama decoder layer with the
target's shapes — the layer vLLM's, SGLang's, TensorRT-LLM's and speculators' EAGLE drafters build. The
`eagle_layer` column names the family's own decoder layer for `draft_layer: target`; `llama_layer` says
whether that layer IS a Llama layer for the serving stacks (same parameter names, same computation), so
a head of that family exports either way.

Mixture-of-experts families (`experts`: the config fields of the routed experts per layer and of the experts
each token goes through): the drafters read the decoder layer's output, where the experts' sum is already
added, so nothing of the routing reaches a head; the target is frozen, so no router auxiliary loss is ever
computed. What differs is the memory plan (memory/serving.py: every expert is held, only the routed ones
compute) and the draft layer: `draft_layer: target` would put a router and its experts in a one-layer
draft, which no serving stack's EAGLE drafter builds, so the Llama layer is the one offered. DeepSeek-V3's
multi-head latent attention runs inside transformers' own attention module: what it caches per layer and token
is one normed latent (kv_lora_rank) and one rotated key shared by every head (qk_rope_head_dim), from which it
expands per-head K and V (qk_nope + qk_rope, v_head_dim wide) after reading the cache. The drafters never see
that; the batched data engine keeps whatever a layer caches, each tensor in a buffer of its own shape
(data/engines/continuous.py), and the decoder's rollback crops the sequence axis whatever the width
(targets/kvcache.py).

Embedding: the serving stacks' EAGLE drafters look a token up in the target's embedding table and use
the row as is (vLLM and SGLang share the table, speculators loads it); Gemma's model multiplies by
sqrt(H) inside its own forward only. `embedding_rows` is that plain lookup, for every family.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.errors import ConfigError


@dataclass(frozen=True)
class Family:
    model_type: str
    checkpoints: str  # what users bring, for messages and docs
    base: str  # attribute path from the causal LM to the module holding layers / norm / embed_tokens
    # (module, decoder layer class, rotary class, rotary layer type) of the family's own decoder layer, for
    # EAGLE's `draft_layer: target`; None where EAGLE-3's widened attention cannot be built from it
    eagle_layer: tuple[str, str, str, str | None] | None
    llama_layer: bool = False  # the family's decoder layer is a Llama layer to the serving stacks
    embed_scale: bool = False  # the model scales embeddings by sqrt(hidden) inside its forward
    # mixture of experts: (config field of the routed experts per MoE layer, field of those each token uses)
    experts: tuple[str, str] | None = None


def _hf(model: str, prefix: str, layer_type: str | None = None) -> tuple[str, str, str, str | None]:
    return (f"transformers.models.{model}.modeling_{model}", f"{prefix}DecoderLayer", f"{prefix}RotaryEmbedding",
            layer_type)


FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("llama", "Llama 2 / 3 / 3.1 / 3.2 / 3.3, SmolLM2, TinyLlama", "model", _hf("llama", "Llama"),
           llama_layer=True),
    Family("mistral", "Mistral 7B, Mistral Nemo, Ministral", "model", _hf("mistral", "Mistral"), llama_layer=True),
    Family("qwen2", "Qwen2, Qwen2.5 (and -Instruct / -Coder / -Math)", "model", _hf("qwen2", "Qwen2")),
    Family("qwen3", "Qwen3 dense", "model", _hf("qwen3", "Qwen3")),
    Family("phi3", "Phi-3, Phi-3.5, Phi-4-mini", "model", None),  # fused qkv_proj: no widened EAGLE-3 attention
    Family("gemma3_text", "Gemma 3 270M / 1B", "model", _hf("gemma3", "Gemma3", "full_attention"),
           embed_scale=True),
    Family("gemma3", "Gemma 3 4B / 12B / 27B (image-text checkpoints)", "model.language_model",
           _hf("gemma3", "Gemma3", "full_attention"), embed_scale=True),
    Family("qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B (and -Instruct / -Thinking / -Coder)", "model", None,
           experts=("num_experts", "num_experts_per_tok")),
    Family("gpt_oss", "gpt-oss-20b, gpt-oss-120b", "model", None, experts=("num_local_experts", "num_experts_per_tok")),
    Family("llama4_text", "Llama 4 Scout / Maverick text decoder (Llama4ForCausalLM)", "model", None,
           experts=("num_local_experts", "num_experts_per_tok")),
    Family("deepseek_v3", "DeepSeek-V3, DeepSeek-V3.1, DeepSeek-R1 (DeepseekV3ForCausalLM)",
           "model", None, experts=("n_routed_experts", "num_experts_per_tok")),
]}


def text_config(config):
    """The decoder's config: a multimodal checkpoint nests it (`text_config`), a causal LM is its own."""
    config = getattr(config, "config", config)  # a model was passed
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def attention_dims(c) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a decoder config, an object or a dict (config.json): a
    config without num_key_value_heads has one KV head per query head (no GQA), one without head_dim
    splits hidden_size evenly across the heads."""
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k, None)
    heads = get("num_attention_heads")
    return heads, get("num_key_value_heads") or heads, get("head_dim") or get("hidden_size") // heads


def model_type(config) -> str | None:
    """The checkpoint's own model_type (the outer one for multimodal checkpoints: that is the family)."""
    config = getattr(config, "config", config)
    return getattr(config, "model_type", None)


def family(config) -> Family:
    """The table row of a target (model or config), or a ConfigError naming what is missing."""
    mt = model_type(config)
    fam = FAMILIES.get(mt)
    if fam is None:
        raise ConfigError(f"target family '{mt}' is not in draftsmith's table (targets/families.py knows "
                          f"{', '.join(FAMILIES)}): it needs a row naming its decoder layers, final norm, "
                          "embedding and lm_head before heads can be trained on it")
    return fam


def experts_per_token(config) -> tuple[int, int] | None:
    """(routed experts per MoE layer, routed experts each token goes through) of a mixture-of-experts target
    (model or config), None for a dense one or a family outside the table."""
    fam = FAMILIES.get(model_type(config))
    if fam is None or fam.experts is None:
        return None
    tc = text_config(getattr(config, "config", config))
    routed, per_token = (getattr(tc, name, None) for name in fam.experts)
    if not routed or not per_token:
        raise ConfigError(f"{fam.model_type} config: no '{fam.experts[0]}' / '{fam.experts[1]}' (its routed experts)")
    return int(routed), int(per_token)


def inactive_params(model: nn.Module) -> int:
    """Parameters of a mixture-of-experts model that one token does not compute with: each layer's routed
    experts (the module named `experts`, every family of the table; shared experts and routers are named
    otherwise and always run) times the share of them the router leaves out. 0 for a dense model. Works on
    the meta device, so a plan counts a 120B model without allocating it."""
    share = experts_per_token(model)
    if share is None:
        return 0
    routed, per_token = share
    expert_params = sum(p.numel() for name, mod in unwrap(model).named_modules() if name.rsplit(".", 1)[-1] == "experts"
                        for p in mod.parameters())
    return expert_params * (routed - per_token) // routed


def unwrap(model) -> nn.Module:
    """The causal LM inside a PEFT / DDP wrapper."""
    for _ in range(4):
        inner = (model.get_base_model() if callable(getattr(model, "get_base_model", None)) else
            getattr(model, "module", None))
        if not isinstance(inner, nn.Module) or inner is model:
            break
        model = inner
    return model


def _base(model) -> nn.Module:
    model = unwrap(model)
    fam = family(model.config)
    node = model
    for part in fam.base.split("."):
        node = getattr(node, part, None)
        if node is None:
            raise ConfigError(f"{type(model).__name__} ({fam.model_type}) has no '{fam.base}' module, where its "
                              "family keeps its decoder layers")
    return node


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layer list of a target."""
    layers = getattr(_base(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(unwrap(model)).__name__}: no decoder layer list where its family keeps one")
    return layers


def final_norm(model) -> nn.Module:
    """The norm between the last decoder layer and the lm_head."""
    norm = getattr(_base(model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ConfigError(f"{type(unwrap(model)).__name__}: no final norm where its family keeps one")
    return norm


def embeddings(model) -> nn.Module:
    """The token embedding module (Gemma's scales its output; `embedding_rows` does not)."""
    return unwrap(model).get_input_embeddings()


def lm_head(model) -> nn.Module:
    return unwrap(model).get_output_embeddings()


def text_state_dict(model) -> dict[str, torch.Tensor]:
    """The target's text decoder under a causal LM's names (`model.layers.0...`, `model.norm.weight`,
    `lm_head.weight`): what a draft of the family's text class loads, for image-text checkpoints too."""
    out = {f"model.{k}": v for k, v in _base(model).state_dict().items()}
    head = lm_head(model)
    if head is not None:
        out["lm_head.weight"] = head.weight
    return out


_WHOLE: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def whole(module: nn.Module) -> nn.Module:
    """`module` itself, or, when DeepSpeed ZeRO-3 partitions its parameters across ranks (an inference engine
    around a sharded target, targets/frozen.py), a whole copy of it held by this rank: the same class and
    buffers, plain frozen parameters, no ZeRO hooks. EAGLE heads read the target's embedding (and EAGLE-1 its
    final norm and lm_head) outside the target's forward, where ZeRO-3 gathers nothing; the copy is made once
    per module, as FSDP keeps these modules whole. Collective the first time (an all-gather): every rank
    calls it at the same point."""
    params = list(module.parameters(recurse=False))
    if not any(hasattr(p, "ds_id") for p in params):
        return module
    if module in _WHOLE:
        return _WHOLE[module]
    import copy
    from collections import OrderedDict

    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        gathered = {name: p.data.detach().clone() for name, p in module.named_parameters(recurse=False)}
    shadow = copy.copy(module)
    shadow.__dict__ = dict(module.__dict__)
    shadow._parameters = {name: nn.Parameter(t, requires_grad=False) for name, t in gathered.items()}
    shadow._forward_pre_hooks, shadow._forward_hooks = OrderedDict(), OrderedDict()
    _WHOLE[module] = shadow
    return shadow


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The plain table lookup the serving stacks' EAGLE drafters do (module docstring)."""
    return torch.nn.functional.embedding(ids, embedding.weight)


def full_attention_rope(config) -> dict:
    """The RoPE parameters of the full-attention layers of a config (object or dict): {"rope_type", "rope_theta", ...}.

    transformers 5 keeps them in `rope_parameters` (per layer type for Gemma 3), older configs in
    `rope_theta` + `rope_scaling`; the base is 10000 only where the config says nothing at all."""
    if isinstance(config, dict):
        get = config.get
    else:
        tc = text_config(config)

        def get(key):
            return getattr(tc, key, None)
    params = get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    out = dict(params) if isinstance(params, dict) else {}
    scaling = get("rope_scaling")
    if not out and isinstance(scaling, dict):
        out = dict(scaling)
    theta = out.get("rope_theta", get("rope_theta"))
    out["rope_theta"] = float(theta if theta is not None else 10000.0)
    out.setdefault("rope_type", out.pop("type", None) or "default")
    out.pop("partial_rotary_factor", None)  # the draft layer rotates its whole head
    return out


def rope_fields(rope: dict) -> dict:
    """A Llama config's RoPE fields in every spelling a reader may look for: `rope_theta` (SGLang's Llama
    layer reads it and falls back to 10000 without it), `rope_parameters` (transformers 5) and
    `rope_scaling` (vLLM, transformers 4; null for plain RoPE)."""
    scaled = rope.get("rope_type", "default") != "default"
    return {"rope_theta": float(rope["rope_theta"]), "rope_parameters": dict(rope),
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None}


def pad_token_id(target) -> int:
    """The id padding batches of a target: its tokenizer's pad token, else its first end-of-sequence id
    (Llama 3 and Mistral tokenizers have no pad token; padded positions are masked out either way)."""
    tok = target.tokenizer
    if getattr(tok, "pad_token_id", None) is not None:
        return int(tok.pad_token_id)
    eos = target.eos_token_ids
    if not eos:
        raise ConfigError(f"target {target.name}: its tokenizer has neither a pad nor an end-of-sequence token")
    return int(eos[0])
