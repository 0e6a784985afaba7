"""TensorRT-LLM: the LLM-API YAML for each layout a method exports to it (the layouts per stack are declared
by the methods' exporters: medusa/export.py, eagle/export.py, distill/export.py).

draft -> HF folder (`DraftTarget`); medusa -> FasterDecoding `medusa_lm_head.safetensors` (`Medusa`, with
the calibrated tree as `medusa_choices`, served by the TensorRT engine flow: the PyTorch backend refuses
Medusa); eagle3 -> `midlayer.*` with `draft_vocab_size`,
`tie_word_embeddings: false` and the dtype set (`Eagle3`); eagle1 -> the original EAGLE layout with
fc bias. TensorRT-LLM's `eagle3_layers_to_capture` takes output-of-layer ids (= draftsmith's).
"""

from __future__ import annotations

import json

from draftsmith.eagle import export as eagle
from draftsmith.export.common import fenced

STACK = "trtllm"


def refuse(kind: str, cfg: dict) -> str | None:
    """Why TensorRT-LLM would load this head but compute something else (None: it computes the head as trained)."""
    on = [k for k in eagle.EAGLE31 if cfg.get(k)]
    if kind == "eagle3" and on:
        return (f"this EAGLE-3.1 head ({', '.join(on)}) needs norms the midlayer layout TensorRT-LLM reads does not "
                "carry: export it for vllm or hf (speculators layout)")
    return None


def serve(kind: str, out, target_ref: str, k: int, cfg: dict, tree: list | None) -> str:
    if kind == "medusa":
        return medusa_engine_flow(out, target_ref, cfg, tree)
    lines = ["speculative_config:"]
    if kind == "eagle3":
        lines += ["  decoding_type: Eagle3", f"  max_draft_len: {k}",
                  f"  eagle3_layers_to_capture: {json.dumps(eagle.aux_ids(cfg, STACK))}"]
    else:
        lines += ["  decoding_type: Eagle", f"  max_draft_len: {k}"]
    lines.append(f"  speculative_model_dir: {out}")
    yaml = "\n".join(lines)
    return (f"TensorRT-LLM (PyTorch backend / LLM API), save as `spec.yaml`:\n\n{fenced(yaml, 'yaml')}\n\n"
            f"{fenced(f'trtllm-serve {target_ref} --extra_llm_api_options spec.yaml')}\n")


def medusa_engine_flow(out, target_ref: str, cfg: dict, tree: list | None) -> str:
    """TensorRT-LLM's PyTorch backend (`trtllm-serve`, the LLM API's default) refuses Medusa; its TensorRT
    engine flow serves it: convert the base model with the heads into a TensorRT-LLM checkpoint, build an
    engine with Medusa decoding, run it with the calibrated tree."""
    K = cfg["num_heads"]
    choices = json.dumps(tree or [[0] * d for d in range(1, K + 1)])
    convert = (f"python examples/medusa/convert_checkpoint.py --model_dir {target_ref} \\\n"
               f"  --medusa_model_dir {out} --num_medusa_heads {K} \\\n"
               f"  --output_dir ckpt-medusa --dtype bfloat16")
    build = ("trtllm-build --checkpoint_dir ckpt-medusa --output_dir engine-medusa \\\n"
             "  --gemm_plugin bfloat16 --speculative_decoding_mode medusa --max_batch_size 8")
    run = (f"python examples/run.py --engine_dir engine-medusa --tokenizer_dir {target_ref} \\\n"
           f"  --max_output_len 256 --medusa_choices='{choices}'")
    return ("TensorRT-LLM's PyTorch backend (`trtllm-serve`, the LLM API) does not serve Medusa heads. Its "
            "TensorRT engine flow does (the `examples/medusa` converter of the TensorRT-LLM releases that ship "
            "the TensorRT backend), from this folder (`medusa_lm_head.safetensors` + config.json), run from a "
            "TensorRT-LLM checkout:\n\n"
            f"{fenced(convert)}\n\n{fenced(build)}\n\n"
            "TensorRT-LLM verifies Medusa drafts greedily; `medusa_choices` is the tree draftsmith calibrated (tree.json):\n\n"
            f"{fenced(run)}\n")
