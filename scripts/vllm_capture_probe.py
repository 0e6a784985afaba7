"""Does vLLM's hidden-state extraction run on this build? (speculators' data generation uses it)

Run by the python of .venv-vllm (`make setup-vllm`): it imports the standard library, torch, safetensors and vllm
only. vLLM's `extract_hidden_states` speculative method with the ExampleHiddenStatesConnector KV connector is
asked for the residual stream entering the given decoder layers (vLLM ids) of every prompt token; each
request's tensors come back as a safetensors file. The probe prints one JSON line: ok, or vLLM's own error
line, and where the files are.

    .venv-vllm/bin/python scripts/vllm_capture_probe.py TARGET_FOLDER OUT_DIR '[1, 2, 3]' '[[1, 2, 3], [4, 5]]'

draftsmith compares what it wrote with its own capture (capture/layers.py: draftsmith id = vLLM id - 1):
tests/test_vllm_serving.py::test_vllm_hidden_state_extraction.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback


def _last_error_line(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def probe(target: str, out: str, layer_ids: list[int], prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    store = os.path.join(out, "hidden")
    os.makedirs(store, exist_ok=True)
    try:
        llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {
                                          "eagle_aux_hidden_state_layer_ids": layer_ids}}},
                  kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": store}})
    except Exception as e:
        return {"ok": False, "stage": "load", "error": _last_error_line(e), "traceback": traceback.format_exc()[-3000:]}
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        files = []
        for i, o in enumerate(outs):
            params = getattr(o, "kv_transfer_params", None) or {}
            path = params.get("hidden_states_path")
            if path is None:
                return {"ok": False, "stage": "generate", "error": f"request {i}: no hidden_states_path in "
                                                                   f"kv_transfer_params ({params})"}
            from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
                load_hidden_states,
            )
            load_hidden_states(path)  # waits for the asynchronous write
            dest = os.path.join(out, f"prompt-{i}.safetensors")
            shutil.copyfile(path, dest)
            files.append(dest)
    except Exception as e:
        return {"ok": False, "stage": "generate", "error": _last_error_line(e),
                "traceback": traceback.format_exc()[-3000:]}
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: S110 (an engine already gone: nothing left to stop)
        pass
    return {"ok": True, "files": files}


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    res = probe(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]))
    with open(os.path.join(sys.argv[2], "probe.json"), "w", encoding="utf-8") as f:
        json.dump(res, f)
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}), flush=True)
    sys.stdout.flush()
    os._exit(0)
