"""DFlash exports: the layout vLLM (`DFlashDraftModel`, vllm/model_executor/models/qwen3_dflash.py) and SGLang
(`models/dflash.py`) both load — one layout for both stacks.

    config.json   a Qwen3 config of the draft layers (`model_type: qwen3`, `architectures: [DFlashDraftModel]`,
                  num_hidden_layers = draft layers, the target's RoPE and max_position_embeddings), and
                  `dflash_config: {target_layer_ids, mask_token_id}`, `block_size`, `num_target_layers`
    model.safetensors   layers.{i}.* (q/k norms included), fc.weight [H, K·H], hidden_norm.weight,
                  norm.weight — no embed_tokens and no lm_head: both stacks share the target's

A draft with a reduced vocabulary (`draft_vocab_size` N) adds lm_head.weight [N, H], d2t [N] int64
(target_id = draft_id + d2t[draft_id]) and t2d [V] bool, and `draft_vocab_size` to config.json: vLLM's
`DFlashQwen3ForCausalLM` builds its lm_head N wide, loads d2t as `draft_id_to_target_id`, skips t2d (kept for
the readers that want it: speculators ships it, draftsmith's reimport reads it) and scatters the N logits into
the target's vocabulary. SGLang's DFlash loader ignores lm_head and d2t silently and would decode with the
target's lm_head, a head the draft was not trained to feed: such a draft is refused for SGLang.

Layer ids: `target_layer_ids` are output-of-layer ids (HF hidden_states[i + 1]), draftsmith's own convention;
vLLM adds 1 to capture the residual stream entering layer i + 1, SGLang does the same internally. Both
concatenate the taps in ascending order, the order draftsmith trains with.

vLLM serves the block with `num_speculative_tokens = block_size - 1` (the anchor plus that many mask slots:
the block the draft was trained on); SGLang reads `block_size` from config.json.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith import artifact, schema
from draftsmith.dflash.model import DFlashConfig, buildable, module_of, read_config
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.layouts.common import state_dtype
from draftsmith.layouts.serving import (
    ENGINE_NAMES,
    Served,
    Serving,
    VllmPatch,
    VllmServe,
    sglang_serve,
    vllm_serve,
)
from draftsmith.layouts.verify import (
    VerificationError,
    check,
    compare,
    guard_vocab_size,
    read_header,
    read_tensors,
    register_verifier,
    vocab_map_problems,
)
from draftsmith.outputs import atomic_write_json
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import full_attention_rope, rope_fields

log = logging.getLogger(__name__)

FORMAT = "dflash"
STACK_FORMATS = {"vllm": FORMAT, "sglang": FORMAT}
UNSUPPORTED = {
    "trtllm": "TensorRT-LLM has no DFlash drafter loader here; export DFlash drafts for vllm or sglang",
    "hf": "Hugging Face assisted generation has no block drafter; export DFlash drafts for vllm or sglang",
}


def sglang_refusal(artifact_dir: Path, config: DFlashConfig) -> str:
    return (f"{artifact_dir}/config.json: draft_vocab_size {config.draft_vocab_size}: SGLang's DFlash drafter ignores "
            "an own lm_head and d2t and would decode with the target's lm_head; export it for vllm, or train with "
            "draft_vocab_size: null for SGLang")


def layout_config(config: DFlashConfig, dtype: torch.dtype, num_target_layers: int, target_max_positions: int,
                  target_folder: str, target_arch: list[str]) -> dict:
    c = config.layer_config
    reduced = {"draft_vocab_size": config.draft_vocab_size} if config.reduced_vocab else {}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "rms_norm_eps": c["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        **rope_fields(full_attention_rope(c)),
        # vLLM does not raise a DFlash draft's positions to the target's context: the draft must cover it
        "max_position_embeddings": max(int(c["max_position_embeddings"]), int(target_max_positions)),
        "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_layers,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(config.target_layers), "mask_token_id": config.mask_token_id},
        "verifier": {"name_or_path": target_folder, "architectures": target_arch},
        "torch_dtype": dtype_name(dtype),
        **reduced,
    }


def export(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
           num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
           verifier: str | None = None, backbone=None):
    """`Method.export` of DFlash drafts (layouts/heads.py does the rest); `backbone`: a method on DFlash's backbone
    (DSpark) exports through this with its own `Backbone` (kind, config reader, layout, formats, serve text)."""
    from draftsmith.layouts.heads import HeadExport, export_heads

    bb = backbone or DFLASH
    artifact_dir = Path(artifact_dir)
    manifest, state = artifact.load_artifact(artifact_dir, kind=bb.kind, target=target)
    config = bb.read(artifact_dir, manifest)
    arch = (manifest["target"].get("architecture") or {})
    n_target = arch.get("num_hidden_layers") or (target.num_layers if target is not None else None)
    if n_target is None:
        raise ConfigError(f"{artifact_dir}: the manifest names no target depth and no target was given")
    k = config.block_size - 1
    if num_speculative_tokens is not None and num_speculative_tokens != k:
        raise ConfigError(f"num_speculative_tokens: a {bb.title} draft of block {config.block_size} drafts {k} "
                          f"tokens per forward (the block it was trained on), got {num_speculative_tokens}")
    max_pos = arch.get("max_position_embeddings") or (
        getattr(target.text_config, "max_position_embeddings", 0) if target is not None else 0)

    def write(tmp: Path, fmt: str, target, target_ref: str, out: Path, k: int) -> str:
        target_arch = list(getattr(target.config, "architectures", None) or []) if target is not None else []
        save_file(artifact.contiguous_state(state), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", bb.layout(config, state_dtype(state), n_target, max_pos or 0,
                                                         target_ref, target_arch))
        return target_ref

    formats, unsupported = bb.formats, {s: f"{artifact_dir}: {why}" for s, why in bb.unsupported.items()}
    if config.reduced_vocab and "sglang" in formats:
        formats = {k: v for k, v in formats.items() if k != "sglang"}
        unsupported = {**unsupported, "sglang": sglang_refusal(artifact_dir, config)}
    def serve(stack: str, out: Path, target_ref: str, k: int) -> str:
        # the shape that engine serves (`evaluate --as-served` decodes it), stated under its launch command
        shape = bb.served(stack, artifact_dir, k, {}) if stack in ENGINE_NAMES else None
        return bb.serve(stack, out, target_ref, k, shape) + (f"\n{shape.text()}\n" if shape else "")

    plan = HeadExport(bb.kind, bb.what, formats, manifest, write, serve,
                      guard={bb.kind: {"block_size": config.block_size}}, unsupported=unsupported)
    return export_heads(plan, artifact_dir, stack, out, target, k, verify, overwrite=overwrite, verifier=verifier)


def serve(stack: str, out: Path, target_ref: str, k: int, shape: Served | None = None) -> str:
    """serve.md's body: how `stack` launches the drafter (`shape`: how that engine serves it, see `served`)."""
    if stack == "vllm":
        return (f"{vllm_serve(target_ref, 'dflash', out, k)}\n\n"
                f"`num_speculative_tokens` = block size - 1: the anchor and {k} mask slots, the block the draft was "
                "trained on. The target must implement vLLM's EAGLE-3 interface (it hands out the tapped layers).\n")
    return f"{sglang_serve(target_ref, 'DFLASH', out)}\n\nSGLang reads the block size ({k + 1}) from config.json.\n"


@dataclass(frozen=True)
class Backbone:
    """How a method on DFlash's backbone exports: its artifact kind, title, config reader, layout writer, formats
    per stack, refusals, and serve.md's text."""

    kind: str
    title: str
    what: str
    read: Callable
    layout: Callable
    formats: dict
    unsupported: dict
    serve: Callable
    served: Callable  # `Serving.shape` of the method: how each engine serves its artifacts


def served(engine: str, artifact_dir: Path, k: int | None, options: dict, backbone: Backbone | None = None) -> Served:
    """`Serving.shape`: vLLM (`dflash`) and SGLang (`DFLASH`) draft the block the draft was trained on, block_size - 1
    slots in one pass, each slot's argmax; TensorRT-LLM serves no block drafter. `backbone`: a method on this
    backbone (its kind, reader and refusals)."""
    bb = backbone or DFLASH
    if engine not in bb.formats:
        raise ConfigError(f"--as-served {engine}: {artifact_dir}: {bb.unsupported.get(engine, 'not served')}")
    config = bb.read(artifact_dir, artifact.load_manifest(artifact_dir, kind=bb.kind))
    if engine == "sglang" and config.reduced_vocab:
        raise ConfigError(f"--as-served sglang: {sglang_refusal(artifact_dir, config)}")
    block = config.block_size - 1
    if k is not None and k != block:
        raise ConfigError(f"--as-served {engine}: {artifact_dir}: a {bb.title} draft of block {config.block_size} is "
                          f"served as {block} draft tokens a step (the block it was trained on), got k {k}")
    params = {"num_speculative_tokens": block} if engine == "vllm" else {"block_size": config.block_size}
    return Served(engine, bb.kind if engine == "vllm" else "DFLASH", "block", block, params=params,
                  opts={"tree": False, "depth": block})


DFLASH = Backbone("dflash", "DFlash", "a DFlash block drafter", read_config, layout_config, STACK_FORMATS, UNSUPPORTED,
                  serve, served)


def vllm_block_problem(export_dir: Path, k: int, read=None, title: str = "DFlash") -> str | None:
    """vLLM serves a DFlash block of `block_size` as `block_size - 1` speculative tokens: any other k is another
    block than the one the draft was trained on (`read`/`title`: a method on this backbone's reader and name)."""
    block = (read or read_layout_config)(export_dir)[1].block_size
    if k != block - 1:
        return (f"{export_dir / 'config.json'}: a {title} draft of block {block} serves {block - 1} speculative tokens "
                f"(the block it was trained on), got k {k}")
    return None


# vLLM 0.32's CPU build normalises the context keys of all draft layers with the first layer's k_norm, so
# serve-check applies the measured fix in dflash/vllm_patches.py (DSpark, on this backbone, names it too)
CONTEXT_KNORM = VllmPatch("dflash-context-knorm", Path(__file__).with_name("vllm_patches.py"))
# `Method.serving`
SERVING = Serving(vllm={FORMAT: VllmServe("dflash", check=vllm_block_problem, patches=(CONTEXT_KNORM,))}, shape=served)


# --- verification --------------------------------------------------------------------------------------
def config_from_layout(config: dict, where: Path, make=DFlashConfig, extra=None) -> DFlashConfig:
    """A written config.json -> the DFlashConfig it describes (the draft draftsmith would build from it), every
    field typed and in range, or a FieldError naming the file and the field."""
    f = Path(where) / "config.json"
    V = schema.get(config, "vocab_size", f, "int", lo=1, hi=schema.MAX_VOCAB)
    layer = {k: schema.get(config, k, f, "int", lo=1, hi=schema.MAX_VOCAB) for k in LAYER_INTS}
    layer["rms_norm_eps"] = schema.get(config, "rms_norm_eps", f, "number", lo=0, hi=1)
    layer["vocab_size"] = V
    try:
        layer.update(rope_fields(full_attention_rope(config)), model_type="qwen3", hidden_act="silu",
                     attention_bias=False)
    except (KeyError, TypeError, ValueError) as e:
        raise schema.FieldError(f"{f}: its RoPE fields are not a RoPE configuration "
                                f"({type(e).__name__}: {e})") from None
    fields = {"hidden_size": layer["hidden_size"], "vocab_size": V,
              "target_layers": schema.get(config, "dflash_config.target_layer_ids", f, "ints", lo=0, hi=1023),
              "num_layers": schema.get(config, "num_hidden_layers", f, "int", lo=1, hi=16),
              "block_size": schema.get(config, "block_size", f, "int", lo=2, hi=64),
              "mask_token_id": schema.get(config, "dflash_config.mask_token_id", f, "int", lo=0, hi=V - 1),
              "layer_config": layer,
              "draft_vocab_size": schema.get(config, "draft_vocab_size", f, "int", lo=1, hi=V - 1, null=True,
                                             default=None)}
    if extra is not None:
        extra(config, f, fields)
    return buildable(make, fields, f)


LAYER_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings")


def read_layout_config(out: str | Path, make=DFlashConfig, extra=None) -> tuple[dict, DFlashConfig]:
    """The one reader of a DFlash export's config.json: the file and the draft it describes (`config_from_layout`;
    `make`/`extra`: a method on this backbone, as for `read_config`)."""
    config = schema.read_doc(Path(out) / "config.json")
    schema.get(config, "num_target_layers", Path(out) / "config.json", "int", lo=1, hi=1024, null=True, default=None)
    return config, config_from_layout(config, Path(out), make, extra)


def verify_layout(out: Path, target=None, read=read_layout_config, architectures=("DFlashDraftModel",),
                  title: str = "DFlash") -> list[str]:
    config, cfg = read(out)
    problems = []
    if config.get("architectures") != list(architectures):
        problems.append(f"architectures {config.get('architectures')} != {list(architectures)} (vLLM's registry name)")
    vocab = guard_vocab_size(out)
    if vocab is not None and cfg.vocab_size != vocab:
        problems.append(f"config vocab_size {cfg.vocab_size} != target vocab_size {vocab}")
    n_target = config.get("num_target_layers")
    if n_target is not None and max(cfg.target_layers) > n_target - 2:
        problems.append(f"target_layer_ids {cfg.target_layers} name the last layer's output of a {n_target}-layer "
                        "target, which vLLM captures before the final norm and HF after it")
    if target is not None and config["max_position_embeddings"] < getattr(target.text_config,
                                                                           "max_position_embeddings", 0):
        problems.append("max_position_embeddings below the target's: vLLM would index RoPE past the draft's table")
    check(out, problems)
    with torch.device("meta"):
        spec_module = module_of(cfg)(cfg)
    dt = read_header(out / "model.safetensors")
    st = (dt.get("fc.weight") or next(iter(dt.values())))[1]  # the weights' dtype (d2t / t2d keep their own)
    spec = {k: (tuple(v.shape), {torch.long: "I64", torch.bool: "BOOL"}.get(v.dtype, st))
            for k, v in spec_module.state_dict().items()}
    problems += compare(dt, spec)
    check(out, problems)
    checks = [f"{len(spec)} tensors match the {title} layout (names, shapes, dtype); no embed_tokens"
              + (f", an own lm_head over {cfg.draft_vocab_size} tokens" if cfg.reduced_vocab else " or lm_head"),
              f"dflash_config: taps {cfg.target_layers} (output-of-layer ids, ascending), mask token "
              f"{cfg.mask_token_id}, block {cfg.block_size}"]
    if cfg.reduced_vocab:
        t = read_tensors(out / "model.safetensors", ["d2t", "t2d"])
        check(out, vocab_map_problems(t["d2t"], t["t2d"], cfg.vocab_size, cfg.draft_vocab_size))
        checks.append(f"d2t/t2d consistent: nonzero(t2d) == arange({cfg.draft_vocab_size}) + d2t")
    return checks


def reload_check(out: Path, read=read_layout_config, title: str = "DFlash") -> str:
    """The export loads back into draftsmith's own module, strictly, tensor for tensor."""
    cfg = read(out)[1]
    draft = module_of(cfg)(cfg)
    tensors = read_tensors(out / "model.safetensors")
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise VerificationError(f"{out}/model.safetensors: does not load into a {title} draft (missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]})")
    return f"reloads strictly into draftsmith's {title} draft"


@register_verifier(FORMAT)
def _verify(out, target=None) -> list[str]:
    out = Path(out)
    return verify_layout(out, target) + [reload_check(out)]


def reimport(export_dir: Path, guard: dict):
    """`Method.reimport`: (config, state, None) of a DFlash export (draftsmith's or another tool's in the same
    layout); None when `export_dir` is not one."""
    export_dir = Path(export_dir)
    if guard.get("format") not in (None, FORMAT) or not (export_dir / "config.json").is_file():
        return None
    config = schema.read_doc(export_dir / "config.json")
    if "dflash_config" not in config or "markov_rank" in config:  # a DSpark export is dspark/export.py's
        return None
    cfg = read_layout_config(export_dir)[1]
    state = read_tensors(export_dir / "model.safetensors")
    if "fc.weight" not in state:
        raise ArtifactError(f"{export_dir}/model.safetensors: missing tensor 'fc.weight' "
                            "(the DFlash feature projection)")
    from dataclasses import asdict

    return {**asdict(cfg), "architecture": "dflash", "embeddings": "target",
            "lm_head": "draft" if cfg.reduced_vocab else "target"}, state, None
