"""Memory planning for a target + speculative artifact on a given accelerator.

    draftsmith plan --target CONFIG --artifact PATH --gpu H100-80GB --batch 32 --context 8192 --dtype bf16

What is counted (bytes; GiB = 2**30 in the printout):
  weights      exact parameter counts (the model built on the `meta` device from its config, so nothing is
               allocated) × dtype size, for the target and the artifact (a draft model's config; Medusa /
               EAGLE heads from their safetensors header, without reading the tensors; shared target
               embeddings are not counted twice). A mixture-of-experts target holds every expert: its
               TOTAL parameters are its weights (Qwen3-30B-A3B: 30.5B), while one token computes with its
               ACTIVE ones (3.35B: the routed experts it goes through, targets/families.py `inactive_params`),
               which the plan reports beside them and the activations are sized from. Both embeddings count
               as active here, as Qwen counts them; OpenAI's gpt-oss figures (20b: 3.6B, 120b: 5.1B active)
               leave the input embedding out, a lookup rather than a product.
  KV cache     2 (K and V) × layers × kv_heads × head_dim × dtype size per token and sequence; sliding-
               window layers (Gemma 3, gpt-oss local layers) hold min(context, window) tokens, Llama 4's
               chunked layers min(context, chunk); DeepSeek-V3's latent attention caches one latent of
               kv_lora_rank + qk_rope_head_dim per layer and token (what vLLM's MLA keeps). Target over
               `context` tokens; a draft model the same; an EAGLE head one layer of its own shape; Medusa none.
               Speculation also caches the k+1 in-flight positions of every sequence.
  activations  the transient workspace of one forward, which inference frees layer by layer: the largest
               layer's residual, q/k/v, attention output and MLP intermediates (a mixture of experts: those
               of the experts a token is routed to, and of its shared experts) for every token in flight,
               plus fp32 logits for the positions that are sampled/verified. Tokens in flight = max(batch ×
               (k+1) verified tokens, the prefill chunk).
  overhead     CUDA context, allocator fragmentation, graphs: a fixed allowance (default 1.5 GiB on a GPU).
Budget = device memory × utilisation (vLLM's gpu_memory_utilization, default 0.9). The largest batch that
fits solves  fixed + batch × per_sequence <= budget  with per_sequence = KV (target + draft) + activations.

`measure_cpu` checks the arithmetic here on this machine: it builds the real models on CPU, counts the
bytes of the parameters and of the filled KV caches (exact), and reports the peak RSS increase of a
prefill + verify step next to the planned total.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import ConfigError
from draftsmith.targets.families import attention_dims, experts_per_token, inactive_params, text_config

GIB = 2**30
GPUS = {  # usable device memory in bytes (marketing GB -> bytes as the driver reports them)
    "H100-80GB": 80 * 10**9, "H100-94GB": 94 * 10**9, "H200-141GB": 141 * 10**9,
    "A100-40GB": 40 * 10**9, "A100-80GB": 80 * 10**9, "L40S-48GB": 48 * 10**9, "A10G-24GB": 24 * 10**9,
    "L4-24GB": 24 * 10**9, "RTX4090-24GB": 24 * 10**9, "T4-16GB": 16 * 10**9,
}
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp8": 1, "int8": 1}


def load_target_config(spec: str | Path):
    """An HF config from a config.json, a model folder, or an embedded target name (no weights loaded)."""
    from transformers import AutoConfig

    path = Path(str(spec)).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return (AutoConfig.from_pretrained(path.parent) if path.name == "config.json" else
            AutoConfig.for_model(**json.loads(path.read_text())))
    if path.is_dir() and (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    from draftsmith.targets.embedded import EMBEDDED

    if str(spec) in EMBEDDED:
        from draftsmith.targets.loading import materialize_gguf

        return AutoConfig.from_pretrained(materialize_gguf(EMBEDDED[str(spec)].gguf_path(), name=str(spec)))
    if "/" in str(spec) and not str(spec).startswith((".", "/", "~")):  # a hub id: its config.json only
        try:
            return AutoConfig.from_pretrained(str(spec))
        except OSError as e:
            raise ConfigError(f"--target {spec}: cannot read its config from the hub ({str(e).splitlines()[0][:120]}); "
                              "give a config.json (configs/<preset>/target-config.json) or a model folder") from None
    raise ConfigError(f"--target {spec}: give a config.json, an HF model folder, a hub id or an embedded target name")


def count_params(config) -> int:
    """Exact parameter count of the causal LM `config` describes (built on the meta device; tied weights once)."""
    return param_counts(config)[0]


def param_counts(config) -> tuple[int, int]:
    """(total, active) parameters of the causal LM `config` describes, built on the meta device: a dense model's
    are equal, a mixture of experts computes each token with its active ones only (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return total, total - inactive_params(model)


def mlp_width(c) -> int:
    """The MLP intermediates one token computes with: a dense model's intermediate_size; a mixture of experts'
    routed experts it goes through (each moe_intermediate_size wide; gpt-oss's and Llama 4's experts are
    intermediate_size wide) plus its shared experts, or its dense layers' width where that is larger."""
    dense = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    moe = experts_per_token(c)
    if moe is None:
        return dense
    width = getattr(c, "moe_intermediate_size", None) or dense
    shared = (getattr(c, "n_shared_experts", None) or 0) * width
    return max(moe[1] * width + shared, getattr(c, "intermediate_size_mlp", None) or 0, dense)


def kv_bytes_per_token(config, dtype_bytes: int, context: int) -> float:
    """KV bytes one sequence of `context` tokens holds, divided by context (sliding layers hold less)."""
    c = text_config(config)
    layers = c.num_hidden_layers
    _, kv_heads, head_dim = attention_dims(c)
    per_layer_token = 2 * kv_heads * head_dim * dtype_bytes
    if getattr(c, "kv_lora_rank", None):  # multi-head latent attention: one latent per token, K and V expand from it
        per_layer_token = (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes
    held = {"sliding_attention": getattr(c, "sliding_window", None),
            "chunked_attention": getattr(c, "attention_chunk_size", None)}
    types = getattr(c, "layer_types", None)
    if types:
        return sum(per_layer_token * min(context, held.get(t) or context) for t in types) / context
    return layers * per_layer_token


def _attention_width(c, heads: int, kv_heads: int, head_dim: int) -> int:
    """Values per token of one layer's q, k, v and attention output. Multi-head latent attention (DeepSeek-V3)
    expands every head's query and key to qk_nope + qk_rope dims and its value to v_head_dim from the latents it
    also holds (q_lora_rank, kv_lora_rank + qk_rope_head_dim): wider than head_dim says (192 / 128 against 64)."""
    if not getattr(c, "kv_lora_rank", None):
        return (heads + 2 * kv_heads) * head_dim + heads * head_dim
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    latents = (getattr(c, "q_lora_rank", None) or 0) + c.kv_lora_rank + c.qk_rope_head_dim
    return heads * (2 * qk + 2 * c.v_head_dim) + latents


def activation_bytes(config, tokens: int, sampled: int, dtype_bytes: int) -> int:
    """One forward's transient workspace for `tokens` tokens in flight, `sampled` of them through lm_head."""
    c = text_config(config)
    h = c.hidden_size
    heads, kv_heads, head_dim = attention_dims(c)
    inter = mlp_width(c)
    per_token = (2 * h  # residual + normed input
                 + _attention_width(c, heads, kv_heads, head_dim)  # q, k, v and the attention output
                 + 3 * inter)  # gate, up, act(gate) * up
    return tokens * per_token * dtype_bytes + sampled * c.vocab_size * 4  # logits in fp32


@dataclass
class ArtifactShape:
    kind: str  # none | draft | medusa | eagle
    params: int = 0  # parameters not shared with the target
    kv_config: object | None = None  # the config whose KV formula applies (a draft; an EAGLE layer), or None
    kv_layers: int = 0
    separate_model: bool = False  # a whole model beside the target (its weights are not the target's)


def artifact_shape(path: str | Path | None, target_config) -> ArtifactShape:
    """What an artifact adds to the target's memory; its method (methods.py) says how to count it. A folder
    without a draftsmith manifest is an HF draft model."""
    if path is None:
        return ArtifactShape("none")
    from draftsmith import methods

    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
    method = methods.get(manifest.get("kind", "draft"))
    shape = method.get("memory")(path, target_config) if method.memory is not None else head_shape(path, target_config)
    return dataclasses.replace(shape, kind=method.name)


def head_shape(path: Path, target_config) -> ArtifactShape:
    """Heads on the target's features (Medusa; the default): the parameters in model.safetensors, no cache."""
    return ArtifactShape("heads", weights_params(path))


def weights_params(path: Path) -> int:
    from safetensors import safe_open

    if not (path / "model.safetensors").is_file():
        raise ConfigError(f"{path}: missing model.safetensors")
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # header only
        for name in f.keys():
            total += math.prod(f.get_slice(name).get_shape())
    return total


def plan(target_config, artifact: ArtifactShape, gpu: str | int, batch: int, context: int, dtype: str = "bf16",
         k: int = 4, prefill_chunk: int = 8192, utilization: float = 0.9, overhead_bytes: int | None = None) -> dict:
    """The memory plan (module docstring). `gpu`: a name from GPUS, "cpu", or a byte count."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BYTES))}")
    if batch < 1 or context < 1 or k < 0:
        raise ConfigError("batch and context must be >= 1 and k >= 0")
    b = DTYPE_BYTES[dtype]
    if isinstance(gpu, int):
        device_bytes, gpu_name = gpu, f"{gpu / GIB:.1f} GiB"
    elif gpu.lower() == "cpu":
        import psutil

        device_bytes, gpu_name = psutil.virtual_memory().total, "cpu"
    elif gpu in GPUS:
        device_bytes, gpu_name = GPUS[gpu], gpu
    else:
        raise ConfigError(f"unknown --gpu {gpu!r}: one of {', '.join(GPUS)}, cpu, or a size like 80e9")
    overhead = overhead_bytes if overhead_bytes is not None else (0 if gpu_name == "cpu" else int(1.5 * GIB))
    budget = device_bytes * utilization

    t_params, t_active = param_counts(target_config)
    weights = {"target": t_params * b, "artifact": artifact.params * b}
    in_flight = context + (k + 1 if artifact.kind != "none" else 0)
    kv_t = kv_bytes_per_token(target_config, b, in_flight) * in_flight
    kv_d = kv_bytes_per_token(artifact.kv_config, b, in_flight) * in_flight if artifact.kv_config is not None else 0
    verify_tokens = k + 1 if artifact.kind != "none" else 1

    def act(n_seq: int) -> float:
        tokens = max(n_seq * verify_tokens, min(prefill_chunk, n_seq * context))
        return activation_bytes(target_config, tokens, n_seq * verify_tokens, b)

    fixed = weights["target"] + weights["artifact"] + overhead
    per_seq = kv_t + kv_d
    total = fixed + batch * per_seq + act(batch)
    # largest batch: fixed + n·per_seq + act(n) <= budget (act is monotone in n: bisect)
    lo, hi = 0, 1
    while fixed + hi * per_seq + act(hi) <= budget and hi < 1 << 20:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fixed + mid * per_seq + act(mid) <= budget else (lo, mid)
    return {
        "gpu": gpu_name, "device_bytes": device_bytes, "utilization": utilization, "budget_bytes": budget,
        "dtype": dtype, "batch": batch, "context": context, "k": k, "artifact_kind": artifact.kind,
        "params": {"target": t_params, "target_active": t_active, "artifact": artifact.params},
        "weights_bytes": weights,
        "kv_bytes": {"target": batch * kv_t, "artifact": batch * kv_d,
                     "per_sequence_target": kv_t, "per_sequence_artifact": kv_d},
        "activation_bytes": act(batch), "overhead_bytes": overhead,
        "total_bytes": total, "headroom_bytes": budget - total, "fits": total <= budget,
        "max_batch": lo,
    }


def render(p: dict) -> str:
    g = lambda x: f"{x / GIB:8.2f} GiB"  # noqa: E731
    lines = [f"memory plan: {p['gpu']} ({p['utilization']:.0%} of {p['device_bytes'] / GIB:.1f} GiB = "
             f"{p['budget_bytes'] / GIB:.1f} GiB), {p['dtype']}, batch {p['batch']}, context {p['context']}, "
             f"k {p['k']}, artifact {p['artifact_kind']}",
             f"  weights   target   {g(p['weights_bytes']['target'])}  ({_params(p['params'])})",
             f"  weights   artifact {g(p['weights_bytes']['artifact'])}  ({p['params']['artifact'] / 1e6:.1f}M params)",
             f"  KV cache  target   {g(p['kv_bytes']['target'])}  "
             f"({p['kv_bytes']['per_sequence_target'] / 2**20:.1f} MiB/seq)",
             f"  KV cache  artifact {g(p['kv_bytes']['artifact'])}",
             f"  activations        {g(p['activation_bytes'])}",
             f"  overhead           {g(p['overhead_bytes'])}",
             f"  total              {g(p['total_bytes'])}",
             f"  headroom           {g(p['headroom_bytes'])}  -> {'fits' if p['fits'] else 'DOES NOT FIT'}",
             f"  largest batch that fits at this context: {p['max_batch']}"]
    return "\n".join(lines)


def _params(params: dict) -> str:
    total, active = params["target"], params.get("target_active", params["target"])
    text = f"{total / 1e6:.1f}M params"
    return text if active == total else f"{text}, {active / 1e6:.1f}M active per token: a mixture of experts"


def measure_cpu(target_spec: str, artifact_path: str | None, batch: int, context: int, k: int = 4) -> dict:
    """Build the real target (and draft) on CPU in fp32, prefill `batch` × `context` tokens, run one verify
    step of k+1 tokens; count parameter and KV-cache bytes exactly and the peak RSS increase. Meant to run in
    a fresh process (`draftsmith plan --measure`) so that peak RSS belongs to this measurement."""
    import resource

    import torch

    from draftsmith.targets import kvcache, load_target

    def rss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0

    target = load_target(target_spec, device="cpu", dtype="float32")
    model = target.model
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    draft = None
    if artifact_path is not None and artifact_shape(artifact_path, target.config).separate_model:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(artifact_path, dtype=torch.float32).eval()
        weights += sum(p.numel() * p.element_size() for p in draft.parameters())
    with torch.no_grad():  # warm-up: lazy kernels, thread pools and allocator state are not the plan's business
        for m in [model] + ([draft] if draft is not None else []):
            m(input_ids=torch.zeros(1, 4, dtype=torch.long), logits_to_keep=1)
    before = rss()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (batch, context), generator=g)
    kv_bytes = 0
    with torch.no_grad():
        for m in [model] + ([draft] if draft is not None else []):
            cache = kvcache.new_cache(m)
            m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step = torch.randint(0, target.vocab_size, (batch, k + 1), generator=g)
            pos = torch.arange(context, context + k + 1)[None].expand(batch, -1)
            m(input_ids=step, past_key_values=cache, position_ids=pos, use_cache=True)
            kv_bytes += _cache_bytes(cache)
    peak = rss() - before
    return {"weights_bytes": weights, "kv_bytes": kv_bytes, "peak_rss_increase_bytes": peak,
            "batch": batch, "context": context, "k": k}


def _cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total
