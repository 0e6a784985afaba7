"""Benchmark the decode engines on the same prompts in one process.

    nice draftsmith bench engine 32 128 cb:32,cap:32,hf:16,cb:1 [TARGET] [--json OUT]

cb:B = continuous batching at batch B (cb:1 = one prompt at a time), np:B = the same without prefilling the
prompts' shared prefix once, sd:B = the same with one SDPA call per decode step over every used column (no
row ranges, `ContinuousBatcher(decode_spans=0)`), cap:B = the same with capture of
the EAGLE-3 layers (low/middle/high, capture.layers.bench_layers) + last hidden + top-64 logits from
the last prompt position on (what `draftsmith data generate` keeps for a single-turn row: `Request.logits_from`;
capall:B = top-64 logits of every prompt position too), hf:B = transformers `generate` on static
length-sorted batches. A third field picks the target's dtype: `cap:128:bf16` (bf16 body, float32 logits, as
`generation.dtype: bfloat16` writes), `cap:128:bf16-all` (bf16 logits too); the default is float32.
Prompts: the first N/2 GSM8K questions and the first N/2 self-instruct seed tasks, chat-formatted.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from draftsmith.capture.layers import bench_layers
from draftsmith.data.engines.base import Request
from draftsmith.data.engines.continuous import CaptureSpec, ContinuousBatcher
from draftsmith.data.engines.hf import HFEngine
from draftsmith.data.masks import tokenize_conversation
from draftsmith.decoding.cost import CpuShare
from draftsmith.errors import ConfigError
from draftsmith.outputs import atomic_write_json
from draftsmith.paths import open_data, shared_data_dir
from draftsmith.targets import load_target
from draftsmith.targets.families import pad_token_id
from draftsmith.targets.precision import inference_copy

TRAIN = shared_data_dir() / "train"
PRECISIONS = ("fp32", "bf16", "bf16-all")


def read_rows(path, n: int) -> list[dict]:
    """The first `n` rows of a (possibly gzip-compressed) jsonl file."""
    rows = []
    with open_data(path) as f:
        for line in f:
            if len(rows) >= n:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """The timing jobs' prompts: the first n/2 GSM8K questions and the first n - n/2 self-instruct seed tasks,
    chat-formatted token ids."""
    rows = read_rows(TRAIN / "gsm8k_train.jsonl.gz", n // 2)
    rows += read_rows(TRAIN / "self_instruct_seed_tasks.jsonl.gz", n - n // 2)
    texts = [r.get("question") or (r["instruction"] + "\n\n" + r["instances"][0]["input"]).strip() for r in rows]
    return [tokenize_conversation(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True)[0]
            for q in texts]


def _run_engine(kind: str, bs: int, t, reqs: list[Request], learned_only: list[Request], pad: int, layers,
                done) -> tuple[str, dict]:
    """One engine spec's run: (its result name, the engine's stats)."""
    if kind == "cb":
        return f"continuous_b{bs}", ContinuousBatcher(t.model, t.eos_token_ids, pad, bs).run(reqs, done)
    if kind == "np":
        return (f"continuous_b{bs}_no_shared_prefix",
                ContinuousBatcher(t.model, t.eos_token_ids, pad, bs, shared_prefix=False).run(reqs, done))
    if kind == "sd":
        return (f"continuous_b{bs}_one_sdpa_call",
                ContinuousBatcher(t.model, t.eos_token_ids, pad, bs, decode_spans=0).run(reqs, done))
    if kind in ("cap", "capall"):
        cap = CaptureSpec(layers=layers, topk=64, last_hidden=True)
        name = f"continuous_b{bs}_capture" + ("_all_prompt_logits" if kind == "capall" else "")
        return name, ContinuousBatcher(t.model, t.eos_token_ids, pad, bs, capture=cap).run(
            reqs if kind == "capall" else learned_only, done)
    return f"hf_generate_b{bs}", HFEngine(t.model, t.eos_token_ids, pad, bs).run(reqs, done)


def _timing(st: dict, share: CpuShare) -> dict:
    """What the report keeps of an engine's stats."""
    out = {"tokens": st["generated_tokens"], "seconds": round(st["seconds"], 1), "tok_s": round(st["tokens_per_s"], 1)}
    for key in ("prompt_tokens", "prefill_seconds", "mean_batch"):
        if key in st:
            out[key] = round(st[key], 1)
    if share.others is not None:
        out["other_cpu_share"] = round(share.others, 3)
    return out


def run(n: int, max_new: int, specs: str, target_spec: str = "smollm2-135m", json_out: str | None = None) -> dict:
    """Every engine of `specs` (comma-separated KIND:BATCH[:PRECISION]) on the same n prompts, one after the
    other; prints each as it finishes and the whole as JSON, and writes it to `json_out` when given."""
    torch.set_num_threads(2)
    t = load_target(target_spec)
    layers = bench_layers(t.num_layers)
    prompts = bench_prompts(t.tokenizer, n)
    reqs = [Request(i, ids, max_new) for i, ids in enumerate(prompts)]
    # as data generation asks: top-k logits from the position that predicts the first learned token on
    learned_only = [Request(i, ids, max_new, logits_from=len(ids) - 1) for i, ids in enumerate(prompts)]
    pad = pad_token_id(t)
    res = {}
    models = {"fp32": t.model}
    for spec in specs.split(","):
        kind, bs, *rest = spec.split(":")
        bs, prec = int(bs), (rest[0] if rest else "fp32")
        if prec not in models:
            if prec not in PRECISIONS:
                raise ConfigError(f"bench engine: unknown precision {prec!r} in {spec!r} ({', '.join(PRECISIONS)})")
            models[prec] = inference_copy(t.model, torch.bfloat16, fp32_logits=prec == "bf16")
        t = dataclasses.replace(t, model=models[prec])
        out: dict = {}
        done = lambda c, out=out: out.__setitem__(c.key, c.tokens)  # noqa: E731
        with CpuShare() as share:  # how quiet the machine was during this engine's run
            name, st = _run_engine(kind, bs, t, reqs, learned_only, pad, layers, done)
        name += "" if prec == "fp32" else f"_{prec}"
        res[name] = _timing(st, share)
        print(name, res[name], flush=True)
    print(json.dumps(res))
    if json_out:
        atomic_write_json(json_out, {"target": target_spec, "prompts": n, "max_new_tokens": max_new, "engines": res})
    return res


def emit(res: dict, json_out: str | None) -> dict:
    """A benchmark's result: printed as JSON, and written to `json_out` when given."""
    print(json.dumps(res, indent=1))
    if json_out:
        atomic_write_json(json_out, res)
    return res
