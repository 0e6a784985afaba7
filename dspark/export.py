"""DSpark exports: the layout vLLM's `Qwen3DSparkForCausalLM` loads (vllm/model_executor/models/qwen3_dspark.py,
method `dspark`), which is DFlash's layout (dflash/export.py: the backbone's tensors and config, shared code)
plus the two heads:

    config.json   DFlash's Qwen3 draft config with `architectures: [Qwen3DSparkModel]`, and
                  markov_rank, markov_head_type: vanilla, enable_confidence_head, confidence_head_with_markov,
                  sample_from_anchor: false, dspark_bonus_anchor: true (the block is DFlash's [anchor, M, ...,
                  M], the anchor being the bonus token: block_size - 1 speculative tokens), target_layer_ids
                  (output-of-layer ids, as in dflash_config)
    model.safetensors   DFlash's tensors, and markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight
                  [N, r], confidence_head.proj.weight [1, H + r] / .bias [1] (vLLM prefixes `model.`)

vLLM's loader keeps the names as they are (it adds `model.` to every tensor but lm_head, maps d2t to
draft_id_to_target_id and skips t2d), shares the target's embedding, and, for a draft without an own lm_head,
the target's lm_head too. The speculators format (`speculators_model_type: dspark`) describes the same tensors
with `aux_hidden_state_layer_ids` (= these ids + 1); vLLM converts it to this config, so one layout serves both
readers.

vLLM 0.32 drafts DSpark only in its V2 model runner (v1/worker/gpu/spec_decode/dspark/, which needs Triton); its CPU
build refuses the method when the config is validated ("Model Runner V1 does not support: dspark speculative
decoding"). tests/vllm_scripts/dspark_reference.py, run in vLLM's environment, loads an export through vLLM's
own loader (`load_dspark_model`: `Qwen3DSparkForCausalLM.load_weights`, the target's embedding shared) on a
CPU and computes what vLLM's speculator computes, which tests/test_vllm_dspark.py compares with draftsmith's.

`num_speculative_tokens` must be given: without it vLLM drafts `block_size` tokens for DSpark (its
`sample_from_anchor: true` convention), one slot past the block this layout was trained on.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import artifact, schema
from draftsmith.dflash import export as backbone
from draftsmith.dspark.model import DSparkConfig, dspark_extra, read_dspark_config
from draftsmith.errors import ConfigError
from draftsmith.layouts.serving import Served, Serving, VllmServe, vllm_serve
from draftsmith.layouts.verify import read_tensors, register_verifier

FORMAT = "dspark"
STACK_FORMATS = {"vllm": FORMAT}
UNSUPPORTED = {
    "sglang": "SGLang has no DSpark drafter loader in the versions draftsmith knows; export DSpark drafts for vllm",
    "trtllm": "TensorRT-LLM has no DSpark drafter loader here; export DSpark drafts for vllm",
    "hf": "Hugging Face assisted generation has no block drafter; export DSpark drafts for vllm",
}


def layout_config(config: DSparkConfig, dtype, num_target_layers: int, target_max_positions: int,
                  target_folder: str, target_arch: list[str]) -> dict:
    out = backbone.layout_config(config, dtype, num_target_layers, target_max_positions, target_folder, target_arch)
    out.update({"architectures": ["Qwen3DSparkModel"], "markov_rank": config.markov_rank,
                "markov_head_type": "vanilla", "enable_confidence_head": config.confidence_head,
                "confidence_head_with_markov": config.confidence_with_markov,
                "sample_from_anchor": False, "dspark_bonus_anchor": True,
                "target_layer_ids": list(config.target_layers)})
    return out


def _layout_extra(config: dict, where: Path, fields: dict) -> None:
    """An export's own names for DSpark's fields -> the artifact's (dspark_extra reads those)."""
    if config.get("sample_from_anchor", True) is not False:
        raise schema.FieldError(f"{where}: field 'sample_from_anchor' is {config.get('sample_from_anchor', True)}: "
                                "draftsmith's DSpark drafts the DFlash block [anchor, M, ...] (false)")
    renamed = {"markov_rank": config.get("markov_rank"),
               "confidence_head": config.get("enable_confidence_head", False),
               "confidence_with_markov": config.get("confidence_head_with_markov", False)}
    dspark_extra(renamed, where, fields)


def read_layout_config(out: str | Path):
    return backbone.read_layout_config(out, make=DSparkConfig, extra=_layout_extra)


def served(engine: str, artifact_dir: Path, k: int | None, options: dict) -> Served:
    """`Serving.shape`: vLLM drafts DSpark's block (DFlash's, corrected left to right by the Markov head, each slot's
    argmax); with the confidence head, `enable_adaptive_verification` (on by default here, as serve.md launches it;
    `adaptive_verification: false` turns it off) verifies the prefix whose survival (the running product of the
    confidences) pays for its verification (vLLM's AdaptiveVerificationManager; draftsmith's confidence cut,
    decoding/budget.py, the same rule with this machine's verify cost)."""
    from dataclasses import replace

    shape = backbone.served(engine, artifact_dir, k, options, backbone=BACKBONE)
    has_head = read_dspark_config(artifact_dir, artifact.load_manifest(artifact_dir, kind="dspark")).confidence_head
    adaptive = bool(options.get("adaptive_verification", has_head))
    if adaptive and not has_head:
        raise ConfigError(f"--as-served {engine}: {artifact_dir}: adaptive verification without a confidence head "
                          "(vLLM would estimate acceptance from the draft's logits, which draftsmith does not model)")
    return replace(shape, adaptive_verification=adaptive,
                   params={**shape.params, "enable_adaptive_verification": adaptive},
                   opts={**shape.opts, "confidence_cut": adaptive})


def serve(stack: str, out: Path, target_ref: str, k: int, shape: Served | None = None) -> str:
    extra = {"enable_adaptive_verification": True} if shape is not None and shape.adaptive_verification else None
    return (f"{vllm_serve(target_ref, 'dspark', out, k, extra)}\n\n"
            f"`num_speculative_tokens` = block size - 1 ({k}): the anchor and {k} mask slots, drafted in one parallel "
            "pass and corrected left to right by the Markov head. With the confidence head, vLLM's "
            "`enable_adaptive_verification` sizes each request's verification by it. vLLM drafts DSpark in its GPU "
            "model runner only (its CPU build refuses the method). Always pass `num_speculative_tokens`: without it "
            f"vLLM drafts block_size ({k + 1}) tokens, one past the trained block. The target must hand out the tapped "
            "layers (vLLM's EAGLE-3 interface).\n")


BACKBONE = backbone.Backbone("dspark", "DSpark", "a DSpark block drafter", read_dspark_config, layout_config,
                             STACK_FORMATS, UNSUPPORTED, serve, served)


def export(artifact_dir, stack, out, target=None, num_speculative_tokens=None, verify=True, *, overwrite=False,
           verifier=None):
    """`Method.export` of DSpark drafts: DFlash's export with DSpark's layout."""
    return backbone.export(artifact_dir, stack, out, target, num_speculative_tokens, verify, overwrite=overwrite,
                           verifier=verifier, backbone=BACKBONE)


def vllm_block_problem(export_dir: Path, k: int) -> str | None:
    return backbone.vllm_block_problem(export_dir, k, read=read_layout_config, title="DSpark")


# `Method.serving`: what serve-check would run; vLLM 0.32's CPU build refuses the method (see the docstring)
SERVING = Serving(vllm={FORMAT: VllmServe("dspark", check=vllm_block_problem,
                                          patches=(backbone.CONTEXT_KNORM,))}, shape=served)


@register_verifier(FORMAT)
def _verify(out, target=None) -> list[str]:
    out = Path(out)
    checks = backbone.verify_layout(out, target, read=read_layout_config, architectures=("Qwen3DSparkModel",),
                                    title="DSpark")
    cfg = read_layout_config(out)[1]
    checks.append(f"Markov head rank {cfg.markov_rank} over {cfg.out_vocab} draft tokens; confidence head "
                  + ("[h; e]" if cfg.confidence_with_markov else "[h]") if cfg.confidence_head else "none")
    return checks + [backbone.reload_check(out, read=read_layout_config, title="DSpark")]


def reimport(export_dir: Path, guard: dict):
    """`Method.reimport`: (config, state, None) of a DSpark export; None when `export_dir` is not one."""
    export_dir = Path(export_dir)
    if guard.get("format") not in (None, FORMAT) or not (export_dir / "config.json").is_file():
        return None
    config = schema.read_doc(export_dir / "config.json")
    if "markov_rank" not in config or "dflash_config" not in config:
        return None
    cfg = read_layout_config(export_dir)[1]
    from dataclasses import asdict

    return {**asdict(cfg), "architecture": "dspark", "embeddings": "target",
            "lm_head": "draft" if cfg.reduced_vocab else "target"}, read_tensors(export_dir / "model.safetensors"), None
