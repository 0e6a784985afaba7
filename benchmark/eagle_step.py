"""Time one EAGLE training step two ways, side by side.

    draftsmith bench eagle-step [CONFIG] [key=value ...] [--batches N] [--repeats R] [--compare WHAT]

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
import time

DEFAULT_CONFIG = "configs/smollm2-135m/eagle3.yaml"


# --compare: the two ways of each comparison, name -> (skip, bf16 autocast)
WAYS = {"skip": {"skip": (True, False), "every_base": (False, False)},
        "precision": {"bf16_autocast": (True, True), "float32": (True, False)}}


def _batches(job, cfg, n: int) -> list:
    """n batches of length-sorted rows of the job's training split (what `group_by_length` makes)."""
    rows = job.train_set
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    bs = cfg.train.batch_size
    firsts = random.Random(cfg.train.seed).sample(range(0, max(len(order) - bs, 1), bs), n)
    return [job.collate([rows[i] for i in order[f:f + bs]]) for f in firsts]


def _time_steps(job, head, batches: list, ways: dict, repeats: int) -> tuple[dict, dict, object]:
    """Loss + backward of every batch each way, interleaved, `repeats` times: (seconds, losses, CPU share)."""
    import torch

    from draftsmith.decoding.cost import CpuShare
    from draftsmith.eagle.model import EagleHead

    times: dict[str, list[float]] = {name: [] for name in ways}
    losses: dict[str, list[float]] = {name: [] for name in ways}
    with CpuShare() as share:
        for _ in range(repeats):
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
    return times, losses, share


def run(config: str | None = None, overrides: list[str] | None = None, batches: int = 6, repeats: int = 2,
        compare: str = "skip") -> dict:
    """Time the two ways of `compare` on the job `config` + `overrides` loads; prints and returns the result."""
    from draftsmith.config import load_config
    from draftsmith.data import load_distilled
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.errors import ConfigError
    from draftsmith.targets import load_target

    if compare not in WAYS:
        raise ConfigError(f"bench eagle-step --compare must be skip or precision, got {compare!r}")
    config, overrides = config or DEFAULT_CONFIG, list(overrides or [])
    cfg = load_config(config, overrides, cls=EagleJobConfig)
    target = load_target(cfg.target)
    job = EagleJob(cfg, target, load_distilled(cfg.data, target))
    head = job.build_module()
    steps = _batches(job, cfg, batches)
    ways = WAYS[compare]
    times, losses, share = _time_steps(job, head, steps, ways, repeats)
    first, second = ways
    result = {
        "config": config, "overrides": overrides, "batches": len(steps), "repeats": repeats,
        "columns": [int(b["input_ids"].shape[1]) for b in steps],
        **{name: {"mean_s": statistics.mean(v), "median_s": statistics.median(v),
                  "mean_loss": statistics.mean(losses[name])} for name, v in times.items()},
        "speedup": sum(times[second]) / sum(times[first]),
        "other_cpu_share": share.others,
    }
    print(json.dumps(result, indent=1))
    return result
