"""vLLM: the `vllm serve` command for each layout a method exports to it (the layouts per stack are declared
by the methods' exporters: medusa/export.py, eagle/export.py, distill/export.py).

draft -> HF folder (`method: draft_model`); medusa -> `model_type: medusa` (`method: medusa`, top-1 chain:
vLLM's Medusa proposes from each head's top-1 token only, so the calibrated tree is recorded in
draftsmith.json but not used); eagle3 -> the speculators format (`method: eagle3`); eagle1 -> the
bias-free EAGLE-1 layout (`method: eagle`).
"""

from __future__ import annotations

import json

from draftsmith.eagle import export as eagle
from draftsmith.export.common import fenced

STACK = "vllm"
METHODS = {"medusa": "medusa", "eagle3": "eagle3", "eagle1": "eagle"}

# What vLLM refuses to serve, per (target model_type, export kind), measured by loading a tiny random target of
# each family with each kind of head in the real vLLM (scripts/vllm_families.py; its committed report is
# bench/results/vllm-families/report.json, and tests/test_vllm_families.py keeps this table equal to it).
# Exporting such a head still works (another stack, or a later vLLM, may serve it); the export warns.
VLLM_VERSION = "0.32.0"
VLLM_REFUSES: dict[tuple[str, str], str] = {
    # Gemma3ForCausalLM does not implement vLLM's SupportsEagle3 (it cannot hand its aux hidden states out)
    ("gemma3_text", "eagle3"): "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs "
                               "was requested",
}


def refusal(model_type: str | None, kind: str) -> str | None:
    """The warning an export for vLLM carries when the measured vLLM refuses this family and kind, or None."""
    why = VLLM_REFUSES.get((model_type or "", kind))
    if why is None:
        return None
    return (f"vLLM {VLLM_VERSION} refuses a {kind} head for a {model_type} target (measured: {why}); "
            "serve it with another stack or check a newer vLLM with `draftsmith serve-check`")


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
