"""One vLLM engine run for `draftsmith serve-check`, executed by the python of `.venv-vllm` (`make setup-vllm`).

This file is a script for the OTHER environment: it imports the standard library and vllm only, never
draftsmith (the two environments pin different transformers). draftsmith writes a job JSON, starts

    .venv-vllm/bin/python export/vllm_run.py JOB.json RESULT.json

and reads RESULT.json back; nothing else crosses between them. The job:

    target                 HF folder of the target (vLLM cannot read GGUF-dequantised weights otherwise)
    dtype                  the target's dtype in vLLM (float32: the dtype draftsmith evaluates in)
    speculative_config     vLLM's dict ({"method": "eagle3", "model": EXPORT, "num_speculative_tokens": 4}) or null
    prompts                token ids per prompt (chat-templated by draftsmith, so both engines read the same ids)
    max_new_tokens, max_model_len, batch (the prompts decoded together for the batched timing), seed
    patches                fixes of vLLM's code to apply first, each {"name", "file"}: an entry of the
                           PATCHES table of a method folder's vllm_patches.py, loaded by path (each a measured
                           CPU-kernel defect; the result lists what was applied)

The result: loaded (and vLLM's own last error line when not), greedy outputs (token ids) of the prompts
decoded one at a time, the spec-decode counters of that one-at-a-time pass (so per-position acceptance is
counted on the same sequences draftsmith decodes one at a time), and tokens/s one at a time and as a batch
(with the batched outputs, which must equal the one-at-a-time ones).

vLLM starts its engine core in a spawned process, so everything runs under the `__main__` guard.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback


def _counters(llm) -> dict:
    """vLLM's spec-decode counters, summed over its metric labels (one engine here)."""
    out: dict = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if not name.startswith("spec_decode_"):
            continue
        if hasattr(m, "values"):  # a vector: one count per draft position
            prev = out.get(name) or [0] * len(m.values)
            out[name] = [a + b for a, b in zip(prev, m.values)]
        elif hasattr(m, "value"):
            out[name] = out.get(name, 0) + m.value
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or [0] * len(v)
            out[k] = [x - y for x, y in zip(v, b)]
        else:
            out[k] = v - (b or 0)
    return out


def _last_error_line(exc: BaseException) -> str:
    """The line that names the cause: the innermost exception's message (vLLM wraps engine start-up errors)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = f"{type(exc).__name__}: {exc}".strip()
    # pydantic's "1 validation error for ModelConfig" says which field only on the lines after it
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return " | ".join(lines[:3])[:600] if lines else type(exc).__name__


def apply_patches(patches: list[dict]) -> list[str]:
    """Apply fixes of vLLM's own code before the engine starts: each `{"name", "file"}` is an entry of the
    PATCHES table of a file in a method's folder (its serving entry names both: `layouts.serving.VllmPatch`),
    loaded here by path, since this script cannot import draftsmith. Returns what each patch says it replaced,
    leaving out the ones that found nothing to do."""
    applied, loaded = [], {}
    for patch in patches:
        path = patch["file"]
        if path not in loaded:
            spec = importlib.util.spec_from_file_location(f"_vllm_patches_{len(loaded)}", path)
            if spec is None or spec.loader is None:
                raise ValueError(f"{path}: not a python file the runner can load patches from")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[path] = getattr(module, "PATCHES", {})
        table = loaded[path]
        if patch["name"] not in table:
            have = ", ".join(table)
            raise ValueError(f"{path}: no patch {patch['name']!r} in its PATCHES (it has: {have})")
        what = table[patch["name"]]()
        if what:
            applied.append(what)
    return applied


def run(job: dict) -> dict:
    if job.get("patches"):  # a patch of vLLM's own code must run where the model runs: the engine in-process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    result: dict = {"vllm_version": __version__, "speculative_config": job.get("speculative_config")}
    applied = apply_patches(job.get("patches") or [])
    if applied:
        result["patches"] = applied
    t0 = time.perf_counter()
    try:
        llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"),
                  speculative_config=job.get("speculative_config"), max_model_len=job.get("max_model_len", 2048),
                  enforce_eager=True, disable_log_stats=False, seed=job.get("seed", 0),
                  max_num_seqs=max(job.get("batch", 1), 1))
    except Exception as e:  # the export did not load: the report says why, in vLLM's words
        result.update(loaded=False, error=_last_error_line(e), traceback=traceback.format_exc()[-4000:])
        return result
    result["loaded"] = True
    result["load_seconds"] = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], seed=job.get("seed", 0))
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up, not counted

    before = _counters(llm)
    outputs, tokens, seconds = [], 0, 0.0
    for p in prompts:  # one at a time: batch-1 speed, and acceptance on the sequences draftsmith decodes alike
        t = time.perf_counter()
        out = llm.generate([p], greedy, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t
        outputs.append(list(out.token_ids))
        tokens += len(out.token_ids)
    result["counters"] = _delta(_counters(llm), before)
    result["outputs"] = outputs
    result["batch1"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}

    n = max(1, min(job.get("batch", len(prompts)), len(prompts)))
    batch_outputs, tokens, seconds = [], 0, 0.0
    for i in range(0, len(prompts), n):
        t = time.perf_counter()
        outs = llm.generate(prompts[i:i + n], greedy, use_tqdm=False)
        seconds += time.perf_counter() - t
        for o in outs:
            batch_outputs.append(list(o.outputs[0].token_ids))
            tokens += len(o.outputs[0].token_ids)
    result["batched"] = {"batch": n, "tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds if seconds else None, "outputs": batch_outputs}
    _shutdown(llm)
    return result


def _shutdown(llm) -> None:
    """Stop vLLM's engine-core process: this script leaves with os._exit, which would orphan it (draftsmith
    also kills the whole process group, but a runner started by hand has no one to do that)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # an engine that is already gone, or another vLLM layout: nothing left to stop
        print(f"vllm_run: engine shutdown: {e}", file=sys.stderr)


if __name__ == "__main__":
    # Python puts this file's folder first on sys.path, and it holds draftsmith's own vllm.py: drop it, or
    # `import vllm` would find that module instead of vLLM
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:  # a failure after loading (decoding, metrics): reported the same way
        result = {"loaded": None, "error": _last_error_line(e), "traceback": traceback.format_exc()[-4000:]}
    tmp = result_path + ".tmp"  # created anew (O_EXCL, O_NOFOLLOW): never written through a link left there
    if os.path.lexists(tmp):
        os.unlink(tmp)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w",
                   encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    # vLLM's engine core is a child process: leave without waiting on its atexit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
