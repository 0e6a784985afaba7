"""Teacher-forced capture against generation with capture, on the same rows, in one process.

    nice draftsmith bench capture 96 128 [TARGET] [--batch 96] [--json OUT]

N prompts (the first N/2 GSM8K questions and N/2 self-instruct seed tasks, chat-formatted, as benchmark/engine.py
takes them) are answered by the continuous-batching engine keeping what `data generate` keeps with
`capture.enabled` (the EAGLE-3 layers, the last hidden state, top-64 logits from the position before the
first learned token). The finished rows are then read once more by `data capture`'s prefill
(capture/offline.py) keeping the same tensors. Both run in the dtype `auto` picks (bf16 where native, float32
logits). The learned tokens are the same in both, so the ratio of the two times is the ratio of throughputs.
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from draftsmith.benchmark.engine import bench_prompts, emit
from draftsmith.capture.config import CaptureConfig
from draftsmith.capture.layers import bench_layers
from draftsmith.capture.offline import capture_rows
from draftsmith.data.engines.base import Request
from draftsmith.data.engines.continuous import CaptureSpec, ContinuousBatcher
from draftsmith.decoding.cost import CpuShare
from draftsmith.targets import load_target
from draftsmith.targets.device import dtype_name
from draftsmith.targets.precision import inference_copy, inference_dtype


def run(n: int, max_new: int, spec: str = "smollm2-135m", batch: int = 96, json_out: str | None = None) -> dict:
    """Generation with capture at `batch`, then teacher-forced capture of the same rows; the two timings."""
    torch.set_num_threads(2)
    target = load_target(spec)
    dtype = inference_dtype(target.device, "auto")
    writing = dataclasses.replace(target, model=inference_copy(target.model, dtype, True))
    layers = bench_layers(target.num_layers)
    prompts = bench_prompts(target.tokenizer, n)
    reqs = [Request(i, ids, max_new, logits_from=len(ids) - 1) for i, ids in enumerate(prompts)]
    pad = target.tokenizer.pad_token_id
    records: dict[int, dict] = {}

    def done(c):
        records[c.key] = {"row_id": c.key, "input_ids": list(c.prompt_ids) + list(c.tokens),
                          "loss_mask": [0] * len(c.prompt_ids) + [1] * len(c.tokens)}

    engine = ContinuousBatcher(writing.model, target.eos_token_ids, pad, batch,
                               capture=CaptureSpec(layers=layers, topk=64, last_hidden=True))
    with CpuShare() as gen_share:
        st = engine.run(reqs, done)
    rows_out = [records[i] for i in sorted(records)]
    row_tokens = sum(len(r["input_ids"]) for r in rows_out)
    learned = sum(sum(r["loss_mask"]) for r in rows_out)
    cc = CaptureConfig(layers=layers, topk=64, last_hidden=True)
    with tempfile.TemporaryDirectory() as tmp, CpuShare() as cap_share:
        cap = capture_rows(target, rows_out, tmp, cc, progress=False)
    res = {
        "target": spec, "rows": len(rows_out), "max_new_tokens": max_new, "dtype": dtype_name(dtype),
        "row_tokens": row_tokens, "learned_tokens": learned,
        "generate_with_capture": {"batch": batch, "seconds": round(st["seconds"], 2),
                                  "generated_tok_s": round(st["generated_tokens"] / st["seconds"], 1),
                                  "row_tok_s": round(row_tokens / st["seconds"], 1),
                                  "other_cpu_share": gen_share.others},
        "teacher_forced_capture": {"batch_tokens": cc.batch_tokens, "seconds": cap["seconds"],
                                   "row_tok_s": cap["tokens_per_s"],
                                   "learned_tok_s": round(learned / cap["seconds"], 1),
                                   "other_cpu_share": cap_share.others},
    }
    res["speedup"] = round(st["seconds"] / cap["seconds"], 2)
    return emit(res, json_out)

