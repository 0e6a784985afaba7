"""Hugging Face, the stack: how each head layout is used on the transformers side (Medusa's own
`MedusaModel` layout, the speculators EAGLE-3 model). A draft model's layout, an HF folder that every stack
takes, is the draft method's own (distill/export.py)."""

from __future__ import annotations

import json

from draftsmith.export.common import fenced


def serve(kind: str, out, target_ref: str, k: int, cfg: dict, tree: list | None) -> str:
    if kind == "medusa":
        return (f"FasterDecoding Medusa layout (`medusa_lm_head.safetensors`, the layout Medusa's own "
                f"`MedusaModel` and TensorRT-LLM's converter read), for base model `{target_ref}`.\n\n"
                f"Calibrated tree (`medusa_choices`): {json.dumps(tree)}\n")
    code = (f"from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig\n"
            f"config = Eagle3SpeculatorConfig.from_pretrained('{out}')\n"
            f"config.transformer_layer_config._attn_implementation = 'sdpa'  # flex attention needs a GPU\n"
            f"model = Eagle3DraftModel.from_pretrained('{out}', config=config)\n"
            f"model.load_verifier_weights()  # embeddings from the verifier: {target_ref}")
    return f"The speculators (transformers-based) EAGLE-3 format:\n\n{fenced(code, 'python')}\n"
