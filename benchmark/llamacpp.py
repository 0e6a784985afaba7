"""llama.cpp beside our plain decoding: the CPU engine a user would pick instead, on the same prompts.

    make setup-llamacpp                                    # builds llama-cpp-python from its source package
    draftsmith bench llamacpp [TARGET] [--limit-per-domain N] [--max-new-tokens N] [--json F]

The target must come from a GGUF file (an embedded target, or a .gguf path): llama.cpp decodes that file as
it is (quantised weights, its own kernels), while draftsmith decodes the float32 weights dequantised from it.
Both decode greedily, one prompt at a time, from the same chat-templated token ids, interleaved prompt by
prompt in one process so that machine load hits both alike; tokens/s counts new tokens over the whole
request (prefill included), as the evaluator does. The outputs are not expected to be identical (other
weights' precision, other arithmetic): the share of prompts whose tokens agree and the mean common prefix
are reported as a sanity check that both decode the same model, not as a losslessness claim.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from draftsmith.errors import ConfigError


def gguf_of(target) -> Path:
    """The GGUF file a target was loaded from (targets.loading.materialize_gguf records it)."""
    src = Path(target.folder or "") / "draftsmith_source.json"
    if not target.folder or not src.is_file():
        raise ConfigError(f"target {target.spec}: llama.cpp needs a target loaded from a GGUF file (an embedded "
                          f"target or a .gguf path); this one is an HF folder")
    return Path(json.loads(src.read_text())["gguf"])


def run(target, limit_per_domain: int = 2, max_new_tokens: int = 96, seed: int = 0,
        threads: int | None = None, split: str = "dev") -> dict:
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ConfigError("llama-cpp-python is not installed: run `make setup-llamacpp`") from None
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.evaluation.domains import default_prompt_files, format_prompt, load_prompts
    from draftsmith.targets import gemm

    gguf = gguf_of(target)
    threads = threads or torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    eos = set(target.eos_token_ids) | {llm.token_eos()}
    rows = load_prompts([str(p) for p in default_prompt_files(split)], limit_per_domain, seed)
    prompts = [format_prompt(target.tokenizer, r.text) for r in rows]

    def ours(ids: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = speculative_generate(target, None, [ids], max_new_tokens, k=0)
        return out.tokens[0], time.perf_counter() - t0

    def theirs(ids: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0

    ours(prompts[0][:32])  # warm-up, not counted
    theirs(prompts[0][:32])
    totals = {"draftsmith": [0, 0.0], "llama.cpp": [0, 0.0]}
    agree, prefix = 0, []
    for i, ids in enumerate(prompts):
        runs = {}
        for name, fn in (("draftsmith", ours), ("llama.cpp", theirs))[:: 1 if i % 2 == 0 else -1]:
            runs[name] = fn(ids)
            totals[name][0] += len(runs[name][0])
            totals[name][1] += runs[name][1]
        a, b = runs["draftsmith"][0], runs["llama.cpp"][0]
        agree += a == b
        prefix.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    import llama_cpp

    return {"target": target.name, "gguf": gguf.name, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "threads": threads, "llama_cpp_version": llama_cpp.__version__,
            "tokens_per_s": {n: t / s if s > 0 else None for n, (t, s) in totals.items()},
            "new_tokens": {n: t for n, (t, _) in totals.items()},
            "same_output_share": agree / len(prompts), "mean_common_prefix": sum(prefix) / len(prefix),
            "draftsmith_kernels": gemm.describe()}


def describe(r: dict) -> str:
    """The result of `run` in one line."""
    tps = r["tokens_per_s"]
    return (f"{r['target']} ({r['gguf']}), {r['prompts']} prompts, {r['threads']} threads: draftsmith plain decoding "
            f"{tps['draftsmith']:.1f} tok/s, llama.cpp {r['llama_cpp_version']} {tps['llama.cpp']:.1f} tok/s; same "
            f"output on {100 * r['same_output_share']:.0f}% of prompts, mean common prefix "
            f"{r['mean_common_prefix']:.1f}")
