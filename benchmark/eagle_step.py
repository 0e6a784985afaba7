"""Time one EAGLE training step two ways, side by side.

    python -m draftsmith.benchmark.eagle_step [CONFIG] [key=value ...] [--batches N] [--repeats R] [--compare WHAT]

Loads the job as `draftsmith train eagle` does (default config: configs/smollm2-135m/eagle3.yaml), takes N
batches of length-sorted rows (what `group_by_length` makes) from the training split, and times loss +
backward on each both ways, interleaved, R times. `--compare skip` (default): `EagleHead.forward(skip=True)`
(steps >= 1 skip the bases no loss can reach) vs `skip=False`. `--compare precision`: float32 vs bf16 autocast
on the CPU (what `train.mixed_precision: bf16` runs), the target's rows in the job's dtype either way. One
process, the threads torch picks; the same /proc/stat contention check as the evaluator.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import sys
import time

DEFAULT_CONFIG = "configs/smollm2-135m/eagle3.yaml"


def main(argv: list[str]) -> dict:
    import torch

    from draftsmith.config import load_config
    from draftsmith.data import load_distilled
    from draftsmith.decoding.cost import CpuShare
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.eagle.model import EagleHead
    from draftsmith.targets import load_target

    argv = list(argv)
    opts: dict = {"--batches": 6, "--repeats": 2, "--compare": "skip"}
    for name in list(opts):
        if name in argv:
            i = argv.index(name)
            opts[name] = argv[i + 1] if name == "--compare" else int(argv[i + 1])
            del argv[i:i + 2]
    config = argv.pop(0) if argv and "=" not in argv[0] else DEFAULT_CONFIG
    cfg = load_config(config, argv, cls=EagleJobConfig)
    target = load_target(cfg.target)
    job = EagleJob(cfg, target, load_distilled(cfg.data, target))
    head = job.build_module()
    rows = job.train_set
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    bs = cfg.train.batch_size
    firsts = random.Random(cfg.train.seed).sample(range(0, max(len(order) - bs, 1), bs), opts["--batches"])
    batches = [job.collate([rows[i] for i in order[f:f + bs]]) for f in firsts]
    if opts["--compare"] == "skip":
        ways = {"skip": (True, False), "every_base": (False, False)}  # name -> (skip, bf16 autocast)
    elif opts["--compare"] == "precision":
        ways = {"bf16_autocast": (True, True), "float32": (True, False)}
    else:
        raise SystemExit(f"--compare must be skip or precision, got {opts['--compare']!r}")
    times: dict[str, list[float]] = {name: [] for name in ways}
    losses: dict[str, list[float]] = {name: [] for name in ways}
    with CpuShare() as share:
        for _ in range(opts["--repeats"]):
            for batch in batches:
                for name, (skip, bf16) in ways.items():
                    head.forward = functools.partial(EagleHead.forward, head, skip=skip)
                    head.zero_grad()
                    t0 = time.perf_counter()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss, _ = job.loss(head, batch)
                    loss.backward()
                    times[name].append(time.perf_counter() - t0)
                    losses[name].append(float(loss.detach()))
    first, second = ways
    result = {
        "config": config, "overrides": argv, "batches": len(batches), "repeats": opts["--repeats"],
        "columns": [int(b["input_ids"].shape[1]) for b in batches],
        **{name: {"mean_s": statistics.mean(v), "median_s": statistics.median(v),
                  "mean_loss": statistics.mean(losses[name])} for name, v in times.items()},
        "speedup": sum(times[second]) / sum(times[first]),
        "other_cpu_share": share.others,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
