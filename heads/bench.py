"""Time one EAGLE training step side by side: steps >= 1 skipping the bases no loss can reach vs every base.

    python -m draftsmith.heads.bench [CONFIG] [key=value ...] [--batches N] [--repeats R]

Loads the job as `draftsmith train eagle` does (default config: configs/smollm2-135m/eagle3.yaml), takes N
batches of length-sorted rows (what `group_by_length` makes) from the training split, and times loss +
backward on each with `EagleHead.forward(skip=True)` and `skip=False`, interleaved, R times. One process,
the threads torch picks; the same /proc/stat contention check as the evaluator.
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
    from draftsmith.config import load_config
    from draftsmith.data import load_distilled
    from draftsmith.evaluation.cost import CpuShare
    from draftsmith.heads.eagle import EagleHead
    from draftsmith.heads.eagle_job import EagleJob, EagleJobConfig
    from draftsmith.targets import load_target

    argv = list(argv)
    opts = {"--batches": 6, "--repeats": 2}
    for name in list(opts):
        if name in argv:
            i = argv.index(name)
            opts[name] = int(argv[i + 1])
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
    times: dict[str, list[float]] = {"skip": [], "every_base": []}
    with CpuShare() as share:
        for _ in range(opts["--repeats"]):
            for batch in batches:
                for name in times:
                    head.forward = functools.partial(EagleHead.forward, head, skip=name == "skip")
                    head.zero_grad()
                    t0 = time.perf_counter()
                    loss, _ = job.loss(head, batch)
                    loss.backward()
                    times[name].append(time.perf_counter() - t0)
    result = {
        "config": config, "overrides": argv, "batches": len(batches), "repeats": opts["--repeats"],
        "columns": [int(b["input_ids"].shape[1]) for b in batches],
        **{name: {"mean_s": statistics.mean(v), "median_s": statistics.median(v)} for name, v in times.items()},
        "speedup": sum(times["every_base"]) / sum(times["skip"]),
        "other_cpu_share": share.others,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
