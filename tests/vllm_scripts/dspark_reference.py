"""vLLM's own DSpark reader, run on a CPU: what `Qwen3DSparkForCausalLM` loads from a draftsmith export and what it
computes from it, written out tensor by tensor for draftsmith to compare with its own DSpark
(tests/test_vllm_dspark.py).

This file is a script for the OTHER environment (.venv-vllm, like export/vllm_run.py): it imports the standard
library, torch, safetensors and vllm only, never draftsmith. Only a test runs it, so it lives under tests/,
not in the dspark/ folder the package ships.

    .venv-vllm/bin/python tests/vllm_scripts/dspark_reference.py EXPORT TARGET INPUTS.safetensors OUT

vLLM 0.32's CPU build refuses the method when its config is validated ("Model Runner V1 does not support: dspark
speculative decoding": DSpark drafts only in the V2 GPU model runner, which needs Triton). The model class does not
depend on the runner, so this script lifts exactly that one entry of the runner's refusal list while the config is
built, then loads the draft the way vLLM's DSpark speculator does (`load_dspark_model`: the target first, the
export through vLLM's loader and `Qwen3DSparkForCausalLM.load_weights`, the target's embedding and, for a full
vocabulary, its lm_head shared) and calls the model's own methods. Nothing here drafts: no engine, no scheduler;
the one block forward runs over KV caches of its own.

INPUTS (written by draftsmith):
    head_hidden [n, H]   block states after the final norm (what vLLM's speculator samples from)
    prev        [n]      int64, the token before each slot (target ids: the anchor, then the drafted tokens)
    features    [m, K·H] optional: the target's tapped layers at the context's positions, concatenated
    positions   [m]      int64, with features: those positions
    block_ids   [B]      optional, with features: one block [anchor, M, ..., M]
    block_positions [B]  int64, its positions (after the context's)

OUT (safetensors; its metadata `reference` is a JSON object: vLLM's version, the model class, which modules are
the target's, the parameters vLLM's loader left unloaded, whether the block forward ran (or why not), seconds):
    logits      compute_draft_logits(head_hidden)        [n, N] draft vocabulary (N = V without a reduced one)
    embed       markov_embed(prev)                       [n, r]
    bias        markov_bias(embed)                       [n, N]
    confidence  compute_confidence(head_hidden, embed)   [n], σ applied (when the export has the head)
    ids         map_draft_to_target(argmax(logits + bias))  [n] target ids, what the speculator drafts greedily
    d2t_ids     map_draft_to_target(arange(N))           [N]
    fc          combine_hidden_states(features)          [m, H] (with features)
    ctx_k.{i}, ctx_v.{i}  what precompute_and_store_context_kv writes into layer i's KV cache: hidden_norm,
                the layer's k/v projection, k_norm and RoPE of the keys   [m, kv_heads, head_dim] (with features)
    block_hidden  the model's forward over the block, after the final norm [B, H] (with block_ids, where vLLM's
                CPU attention takes the draft's head size: 32 and up)
    loaded.{name}  every parameter of the draft as `load_weights` left it (before vLLM's CPU post-processing,
                which moves linear weights into packed kernels and empties `.weight`)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager

# the runner feature vLLM's config validation refuses the method with on a CPU build (vllm/config/vllm.py)
RUNNER_REFUSAL = "dspark speculative decoding"
INT_SENTINEL = -7  # an integer parameter (d2t) that still holds this after loading was not loaded


@contextmanager
def runner_check_without_dspark():
    """VllmConfig's V1-runner check, less the one entry that refuses DSpark: any other unsupported feature still
    refuses (the model is built, never run by that runner)."""
    from vllm.config import VllmConfig

    original = VllmConfig._get_v1_model_runner_unsupported_features

    def unsupported(self):
        return [f for f in original(self) if f != RUNNER_REFUSAL]

    VllmConfig._get_v1_model_runner_unsupported_features = unsupported
    try:
        yield
    finally:
        VllmConfig._get_v1_model_runner_unsupported_features = original


@contextmanager
def recording_loads(cls, record: dict):
    """`cls.load_weights` as it is, with every parameter set to NaN (integers: INT_SENTINEL) before it runs and
    copied into `record` after: a parameter still all NaN was not loaded, one partly NaN was loaded in part."""
    import torch

    original = cls.load_weights

    def load_weights(self, weights):
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(float("nan") if p.is_floating_point() else INT_SENTINEL)
        out = original(self, weights)
        record.update({name: p.detach().clone() for name, p in self.named_parameters()})
        return out

    cls.load_weights = load_weights
    try:
        yield
    finally:
        cls.load_weights = original


def engine_config(export: str, target: str, dtype: str, max_model_len: int):
    """vLLM's config of the target with the export as its DSpark drafter (num_speculative_tokens = block - 1: the
    DFlash block [anchor, M, ..., M] the export's `sample_from_anchor: false` asks for)."""
    from vllm.engine.arg_utils import EngineArgs

    with open(os.path.join(export, "config.json"), encoding="utf-8") as f:
        block = json.load(f)["block_size"]
    spec = {"method": "dspark", "model": export, "num_speculative_tokens": block - 1}
    args = EngineArgs(model=target, tokenizer=target, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                      speculative_config=spec)
    with runner_check_without_dspark():
        return args.create_engine_config()


def build(export: str, target: str, dtype: str = "float32", max_model_len: int = 512):
    """(vLLM config, the target model, the DSpark draft, its parameters as loaded) — vLLM's own loading path."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    config = engine_config(export, target, dtype, max_model_len)
    _set_torch_accelerator_to_noop()  # what vLLM's CPU runner does first: the loader empties an accelerator cache
    loaded: dict = {}
    # load_dspark_model validates a copy of the config again (the draft's own parallel and attention settings)
    with (set_current_vllm_config(config), runner_check_without_dspark(),
          tempfile.TemporaryDirectory(prefix="vllm-reference-") as rendezvous):
        # the linear layers ask for their tensor-parallel group: one process, gloo, a rendezvous file of our own
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}/store")
        initialize_model_parallel(1, 1)
        target_model = get_model(vllm_config=config)
        with recording_loads(Qwen3DSparkForCausalLM, loaded):
            draft = load_dspark_model(target_model, config)
    return config, target_model, draft.eval(), loaded


def heads(draft, head_hidden, prev) -> dict:
    """The speculator's greedy step through the model's own methods (v1/worker/gpu/spec_decode/dspark)."""
    import torch

    logits = draft.compute_draft_logits(head_hidden)
    embed = draft.markov_embed(prev)
    bias = draft.markov_bias(embed)
    out = {"logits": logits, "embed": embed, "bias": bias,
           "ids": draft.map_draft_to_target((logits + bias).argmax(-1)),
           "d2t_ids": draft.map_draft_to_target(torch.arange(logits.shape[-1]))}
    if draft.model.confidence_head is not None:
        out["confidence"] = draft.compute_confidence(head_hidden, embed)
    return out


class _CacheWrite:
    """Stands in for one attention layer's KV-cache write (`impl.do_kv_cache_update`): keeps the keys and values
    vLLM would store instead of storing them."""

    def __init__(self):
        self.impl, self.kv_cache, self.k, self.v = self, None, None, None

    def do_kv_cache_update(self, layer, k, v, kv_cache, slot_mapping):
        self.k, self.v = k.clone(), v.clone()


def context(draft, features, positions) -> dict:
    """vLLM's combine step (fc) and the context keys/values its precompute writes for each draft layer."""
    fc = draft.combine_hidden_states(features)
    model = draft.model
    kept, model._attn_layers = model._attn_layers, [_CacheWrite() for _ in model._attn_layers]
    try:  # a slot mapping that is not None makes the precompute write; the stand-ins keep what it writes
        draft.precompute_and_store_context_kv(fc, positions, positions)
        writes = model._attn_layers
    finally:
        model._attn_layers = kept
    out = {"fc": fc}
    for i, w in enumerate(writes):
        out[f"ctx_k.{i}"], out[f"ctx_v.{i}"] = w.k, w.v
    return out


def kv_caches(config, draft, positions: int):
    """(attention-metadata builder, blocks per cache) of the draft's attention layers, each given a zeroed cache of
    its own large enough for `positions` positions, in the CPU backend's layout ([blocks, kv_heads, block,
    2·head_dim])."""
    import torch

    layers = [layer.self_attn.attn for layer in draft.model.layers]
    spec = layers[0].get_kv_cache_spec(config)
    blocks = -(-positions // spec.block_size)
    for layer in layers:
        layer.kv_cache = torch.zeros(blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=spec.dtype)
    backend = layers[0].attn_backend
    # the builder also tells each layer its kernel's ISA, which the cache writes read: made before any write
    builder = backend.get_builder_cls()(spec, [a.layer_name for a in layers], config, torch.device("cpu"))
    return builder, blocks


def block_forward(config, draft, inputs: dict) -> tuple[dict, str | None]:
    """The backbone over one block as vLLM's speculator runs it: the context's keys/values precomputed into the
    cache (slot = position), then the block's queries, non-causal, through the model's forward. Returns
    ({"block_hidden": [B, H] after the final norm}, None), or ({}, why it could not run here)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    attn = draft.model.layers[0].self_attn.attn
    sizes = attn.attn_backend.get_supported_head_sizes()
    if attn.head_size not in sizes:
        return {}, (f"block forward not run: vLLM's CPU attention ({attn.attn_backend.get_name()}) takes head sizes "
                    f"{sizes}, the draft's is {attn.head_size}")
    ids, where = inputs["block_ids"], inputs["block_positions"]
    n = int(where.max()) + 1
    with set_current_vllm_config(config):
        builder, blocks = kv_caches(config, draft, n)
        context = draft.combine_hidden_states(inputs["features"])
        draft.precompute_and_store_context_kv(context, inputs["positions"], inputs["positions"])
        q = int(ids.numel())
        starts = torch.tensor([0, q], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor([n], dtype=torch.int32),
            num_reqs=1, num_actual_tokens=q, max_query_len=q, max_seq_len=n,
            block_table_tensor=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=where, causal=False)
        metadata = builder.build(0, common)
        names = [layer.self_attn.attn.layer_name for layer in draft.model.layers]
        with set_forward_context({k: metadata for k in names}, config, slot_mapping={k: where for k in names}):
            return {"block_hidden": draft.model(ids, where)}, None


def unloaded(loaded: dict) -> tuple[list[str], list[str]]:
    """(names left wholly unloaded, names loaded only in part) of a `recording_loads` record."""
    import torch

    def missing(t):
        return torch.isnan(t) if t.is_floating_point() else t == INT_SENTINEL

    whole = sorted(n for n, t in loaded.items() if t.numel() and bool(missing(t).all()))
    part = sorted(n for n, t in loaded.items() if t.numel() and bool(missing(t).any()) and n not in whole)
    return whole, part


def reference(export: str, target: str, inputs: dict, dtype: str = "float32") -> tuple[dict, dict]:
    """(tensors, metadata) of OUT (see the module docstring)."""
    import torch
    import vllm

    t0 = time.perf_counter()
    config, target_model, draft, loaded = build(export, target, dtype)
    block_status = "not asked (no block_ids)"
    with torch.no_grad():
        out = heads(draft, inputs["head_hidden"], inputs["prev"])
        if "features" in inputs:
            out.update(context(draft, inputs["features"], inputs["positions"]))
        if "block_ids" in inputs:
            block, skipped = block_forward(config, draft, inputs)
            out.update(block)
            block_status = skipped or "run"
    out.update({f"loaded.{name}": t for name, t in loaded.items()})
    whole, part = unloaded(loaded)
    meta = {"vllm_version": vllm.__version__, "class": type(draft).__name__,
            "lm_head_shared": _shared(draft, target_model, "lm_head.weight"),
            "embed_shared": _shared(draft, target_model, "model.embed_tokens.weight"),
            "unloaded": whole, "partly_loaded": part, "block_forward": block_status,
            "seconds": time.perf_counter() - t0}
    return {k: v.detach().contiguous() for k, v in out.items()}, meta


def _shared(draft, target_model, name: str) -> bool:
    """Whether the draft's module `name` is the target's own (vLLM shares embedding and lm_head by reference)."""
    module = name.rsplit(".", 1)[0]
    mine = draft.get_submodule(module)
    return any(mine is m for m in target_model.modules())


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: dspark_reference.py EXPORT TARGET INPUTS.safetensors OUT.safetensors", file=sys.stderr)
        return 2
    from safetensors.torch import load_file, save_file

    export, target, inputs_path, out_path = argv
    tensors, meta = reference(export, target, load_file(inputs_path))
    save_file(tensors, out_path + ".tmp", metadata={"reference": json.dumps(meta)})
    os.replace(out_path + ".tmp", out_path)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    # Python puts this file's folder first on sys.path: drop it, so that vLLM's imports find only the vLLM
    # environment's packages (never a sibling script of the same name as one of them)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv[1:]))
