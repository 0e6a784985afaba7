"""TensorRT-LLM: which layout each artifact kind takes, and the LLM-API YAML for it.

draft -> HF folder (`DraftTarget`); medusa -> FasterDecoding `medusa_lm_head.safetensors` (`Medusa`, with
the calibrated tree as `medusa_choices`); eagle3 -> `midlayer.*` with `draft_vocab_size`,
`tie_word_embeddings: false` and the dtype set (`Eagle3`); eagle1 -> the original EAGLE layout with
fc bias. TensorRT-LLM's `eagle3_layers_to_capture` takes output-of-layer ids (= draftsmith's).
"""

from __future__ import annotations

import json

from draftsmith.export import eagle, medusa
from draftsmith.export.common import fenced

STACK = "trtllm"
FORMATS = {"medusa": medusa.MEDUSA_FORMAT, "eagle3": eagle.MIDLAYER, "eagle1": eagle.EAGLE1}


def serve(kind: str, out, target_ref: str, k: int, cfg: dict, tree: list | None) -> str:
    lines = ["speculative_config:"]
    if kind == "medusa":
        choices = json.dumps(tree or [[0] * d for d in range(1, cfg["num_heads"] + 1)])
        lines += ["  decoding_type: Medusa", f"  max_draft_len: {len(tree) if tree else cfg['num_heads']}",
                  f"  num_medusa_heads: {cfg['num_heads']}", f"  medusa_choices: {choices}"]
    elif kind == "eagle3":
        lines += ["  decoding_type: Eagle3", f"  max_draft_len: {k}",
                  f"  eagle3_layers_to_capture: {json.dumps(eagle.aux_ids(cfg, STACK))}"]
    else:
        lines += ["  decoding_type: Eagle", f"  max_draft_len: {k}"]
    lines.append(f"  speculative_model_dir: {out}")
    yaml = "\n".join(lines)
    return (f"TensorRT-LLM (PyTorch backend / LLM API), save as `spec.yaml`:\n\n{fenced(yaml, 'yaml')}\n\n"
            f"{fenced(f'trtllm-serve {target_ref} --extra_llm_api_options spec.yaml')}\n")
