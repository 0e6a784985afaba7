"""vLLM: the `vllm serve` command for each layout a method exports to it (the layouts per stack are declared
by the methods' exporters: export/medusa.py, export/eagle.py, export/hf.py).

draft -> HF folder (`method: draft_model`); medusa -> `model_type: medusa` (`method: medusa`, top-1 chain:
vLLM's Medusa proposes from each head's top-1 token only, so the calibrated tree is recorded in
draftsmith.json but not used); eagle3 -> the speculators format (`method: eagle3`); eagle1 -> the
bias-free EAGLE-1 layout (`method: eagle`).
"""

from __future__ import annotations

import json

from draftsmith.export import eagle
from draftsmith.export.common import fenced

STACK = "vllm"
METHODS = {"medusa": "medusa", "eagle3": "eagle3", "eagle1": "eagle"}


def serve(kind: str, out, target_ref: str, k: int, cfg: dict, tree: list | None) -> str:
    spec = json.dumps({"method": METHODS[kind], "model": str(out), "num_speculative_tokens": k})
    text = f"{fenced(f'vllm serve {target_ref} --speculative-config {chr(39)}{spec}{chr(39)}')}\n"
    if kind == "eagle3":
        text += (f"\nThe target's aux hidden states are taken at vLLM layer ids "
                 f"{eagle.aux_ids(cfg, STACK)} (config.json `eagle_aux_hidden_state_layer_ids`; vLLM id = "
                 f"draftsmith id + 1: vLLM captures the residual stream entering a layer; draftsmith ids "
                 f"{cfg['aux_layers']} name layer outputs).\n")
    if kind == "medusa":
        text += ("\nvLLM's Medusa proposes a top-1 chain (one token per head); the calibrated tree is in "
                 "draftsmith.json (`medusa_choices`) for stacks that take one (TensorRT-LLM).\n")
    return text
