"""What one optimizer step of each training job costs, side by side: the exchange rate between methods that
makes "equal CPU-hours" a number of steps.

    draftsmith bench train-step CONFIG_A CONFIG_B [...] [--set NAME key=value ...] [--batches N] [--repeats R]
        [--reference-steps S] [--out DIR]

Each CONFIG is a job preset (`kind:` picks the method; `NAME=CONFIG` names it, default its kind). Every job is
loaded as `draftsmith train` loads it (its target placed, its rows split with its seed) and takes the same N
batches of length-sorted rows of its training split; each batch is one full step (loss, backward, gradient
clipping, AdamW) per job, the jobs interleaved batch by batch, R times over. A burst of load on the machine
then falls on every job alike, so the ratio of the per-step medians holds where the absolute seconds do
not. With --reference-steps S, the first job's S steps are converted into the steps each other job takes in
the same time (`steps_at_equal_time`): how a comparison "at equal CPU-hours" chooses its step counts.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path


def _load_job(config: str, overrides: list[str]):
    """(method name, job, trainable module, optimizer, job config) of a preset, as `draftsmith train` builds it."""
    import torch

    from draftsmith import methods
    from draftsmith.config import load_config, read_yaml
    from draftsmith.training.launch import load_target_for, make_accelerator
    from draftsmith.training.loop import param_groups

    kind = read_yaml(config).get("kind")  # the bounded loader: an alias bomb is one line naming the file
    method = methods.get(str(kind), what=f"kind of {config}")
    cfg = load_config(config, overrides, cls=method.get("config"))
    accelerator = make_accelerator(cfg.train)
    job = method.get("job")(cfg, load_target_for(cfg.target, accelerator), None)
    job.setup(accelerator)
    module = job.build_module().to(accelerator.device)
    optimizer = torch.optim.AdamW(param_groups(module, cfg.train.weight_decay, job.lr_scale), lr=cfg.train.lr)
    return method.name, job, module, optimizer, cfg


def _named(spec: str) -> tuple[str, str]:
    """`NAME=CONFIG` or `CONFIG` (named by its kind) -> (name, config path)."""
    from draftsmith.config import read_yaml

    if "=" in spec:
        name, _, path = spec.partition("=")
        return name, path
    return str(read_yaml(spec).get("kind")), spec


def _row_batches(rows, batch_size: int, n: int, seed: int) -> list[list[int]]:
    """n batches of row indices, each a run of length-sorted rows (what `group_by_length` makes)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    firsts = random.Random(seed).sample(range(0, max(len(order) - batch_size, 1), batch_size), n)
    return [order[f:f + batch_size] for f in firsts]


def _step(job, module, optimizer, batch, max_grad_norm: float) -> tuple[float, float]:
    """One full optimizer step: (seconds, loss)."""
    import torch

    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss, _ = job.loss(module, batch)
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], max_norm=max_grad_norm)
    optimizer.step()
    return time.perf_counter() - t0, float(loss.detach())


def run(configs: list[str], sets: dict[str, list[str]] | None = None, batches: int = 6, repeats: int = 3,
        reference_steps: int | None = None, out: str | Path | None = None) -> dict:
    """Time one step of every job in `configs` (`[NAME=]PATH`), interleaved; prints and returns the result."""
    from draftsmith.decoding.cost import CpuShare
    from draftsmith.errors import ConfigError

    if len(configs) < 2:
        raise ConfigError("bench train-step compares jobs: give two presets or more")
    jobs = {}
    for spec in configs:
        name, path = _named(spec)
        if name in jobs:
            raise ConfigError(f"bench train-step: two jobs named {name!r}; name them NAME=CONFIG")
        jobs[name] = (path, *_load_job(path, list((sets or {}).get(name, []))))
    unknown = sorted(set(sets or {}) - set(jobs))
    if unknown:
        raise ConfigError(f"bench train-step --set names {unknown}, the jobs are {sorted(jobs)}")
    first = next(iter(jobs.values()))
    picks = _row_batches(first[2].train_rows(), first[5].train.batch_size, batches, first[5].train.seed)
    staged = {name: [j.collate([j.train_rows()[i] for i in idx]) for idx in picks]
              for name, (_, _, j, *_) in jobs.items()}
    times: dict[str, list[float]] = {name: [] for name in jobs}
    losses: dict[str, list[float]] = {name: [] for name in jobs}
    with CpuShare() as share:
        for _ in range(repeats):
            for b in range(len(picks)):
                for name, (_, _, job, module, optimizer, cfg) in jobs.items():
                    s, loss = _step(job, module, optimizer, staged[name][b], cfg.train.max_grad_norm)
                    times[name].append(s)
                    losses[name].append(loss)
    ref = next(iter(jobs))
    result = {
        "configs": {name: {"config": path, "method": method, "overrides": list((sets or {}).get(name, []))}
                    for name, (path, method, *_) in jobs.items()},
        "batches": len(picks), "repeats": repeats, "rows_per_batch": first[5].train.batch_size,
        "steps": {name: {"median_s": statistics.median(v), "mean_s": statistics.mean(v),
                         "first_loss": losses[name][0], "last_loss": losses[name][-1]} for name, v in times.items()},
        "cost_vs_" + ref: {name: statistics.median(times[name]) / statistics.median(times[ref]) for name in jobs},
        "other_cpu_share": share.others,
    }
    if reference_steps:
        result["reference_steps"] = reference_steps
        result["steps_at_equal_time"] = {
            name: int(round(reference_steps * statistics.median(times[ref]) / statistics.median(times[name])))
            for name in jobs}
    print(json.dumps(result, indent=1))
    if out is not None:
        from draftsmith.outputs import atomic_write_text

        atomic_write_text(Path(out) / "report.json", json.dumps(result, indent=1) + "\n")
    return result
