"""SGLang: the `sglang.launch_server` command for each layout a method exports to it (the layouts per stack are declared
by the methods' exporters: medusa/export.py, eagle/export.py, distill/export.py).

draft -> HF folder (`STANDALONE`); eagle3 -> `LlamaForCausalLMEagle3` (`midlayer.*`, `EAGLE3`);
eagle1 -> `LlamaForCausalLMEagle` (fc with bias, `EAGLE`). SGLang has no Medusa.
"""

from __future__ import annotations

from draftsmith.eagle import export as eagle
from draftsmith.export.common import fenced

STACK = "sglang"


def refuse(kind: str, cfg: dict) -> str | None:
    """Why SGLang would load this head but compute something else (None: it computes the head as trained)."""
    if kind == "eagle3" and cfg.get("norm_before_residual"):
        return ("this EAGLE-3 head was trained with norm_before_residual: true, which SGLang's EAGLE-3 layer "
                "does not honour (it adds the un-normalised feature): export it for vllm or hf, or retrain "
                "with norm_before_residual: false")
    on = [k for k in eagle.EAGLE31 if cfg.get(k)]
    if kind == "eagle3" and on:
        return (f"this EAGLE-3.1 head ({', '.join(on)}) needs the norms in SGLang's EAGLE-3 layer, which its midlayer "
                "layout does not carry: export it for vllm or hf (speculators layout)")
    return None


def serve(kind: str, out, target_ref: str, k: int, cfg: dict, tree: list | None) -> str:
    algo = "EAGLE3" if kind == "eagle3" else "EAGLE"
    cmd = (f"python -m sglang.launch_server --model-path {target_ref} \\\n  --speculative-algorithm {algo} "
           f"--speculative-draft-model-path {out} \\\n  --speculative-num-steps {k} --speculative-eagle-topk 4 "
           f"--speculative-num-draft-tokens {2 * k + 2}")
    text = f"{fenced(cmd)}\n"
    if kind == "eagle3":
        text += (f"\nAux hidden states at SGLang layer ids {eagle.aux_ids(cfg, STACK)} (config.json "
                 f"`eagle_config.eagle_aux_hidden_state_layer_ids`; SGLang takes output-of-layer ids and adds "
                 f"1 internally, so they equal draftsmith's; vLLM's ids are one higher).\n")
    return text
