"""One runner for every method's training job: `run(method, cfg)`.

Every job goes the same way, so it is written once: the Accelerator first (the launcher decides this rank's
device), the frozen target on it, the method's `Job` (methods.py `Method.job`) over the rows, the one loop
(training/loop.py), the process group left, and the end-of-training evaluation written into the artifact
on the main process. A method differs only by its `Job`; `train_method` loads a method's config and calls this.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith import artifact, methods


@dataclass
class RunResult:
    artifact: Path | None  # the artifact folder; None on a rank that wrote none
    train_seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    eval: dict | None = None  # the manifest's `eval` summary, when the job evaluated its artifact


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run(method: str | methods.Method, cfg, *, target=None, rows=None, accelerator=None, init_only: bool = False,
        command: str | None = None) -> RunResult:
    """Train `method`'s job on `cfg` (its job config) and evaluate what it wrote (cfg.evaluate).

    `target`, `rows` and `accelerator` are reused when given (a caller that already holds them: retraining,
    on-policy rounds, tests). `init_only` saves the module as built, before any training, under
    `train.output_dir`/artifact: the untrained baseline a trained one is compared with.
    """
    from draftsmith.evaluation.after_training import evaluate_into_artifact
    from draftsmith.targets import load_target
    from draftsmith.training.launch import (
        evaluation_target,
        leave_process_group,
        load_target_for,
        make_accelerator,
    )
    from draftsmith.training.loop import train

    method = methods.get(method) if isinstance(method, str) else method
    job_class = method.get("job")
    if accelerator is None and not init_only:
        accelerator = make_accelerator(cfg.train)  # first: the launcher decides this rank's device
    if accelerator is not None:
        job_class.check_launch(cfg, accelerator)  # before the target is loaded: a refused layout costs nothing
    if target is None:
        target = load_target_for(cfg.target, accelerator) if accelerator is not None else load_target(cfg.target)
    job = job_class(cfg, target, rows)
    job.announce()
    t0 = time.perf_counter()
    if init_only:
        path = job.save_artifact(job.build_module(), Path(cfg.train.output_dir) / "artifact", {"steps": 0})
        out = RunResult(Path(path), 0.0, {"steps": 0})
    else:
        result = train(job, cfg.train, accelerator)
        leave_process_group(accelerator)  # training was the last collective work
        out = RunResult(Path(result.artifact) if result.artifact is not None else None,
                        time.perf_counter() - t0, result.metrics)
    if out.artifact is not None:  # a resumed run: its own seconds, and the loop's over every run that trained it
        resumed = out.metrics.get("steps_this_run", 0) != out.metrics.get("steps", 0)
        artifact.update_manifest(out.artifact, train_seconds=out.metrics.get("train_seconds") if resumed
                                 else out.train_seconds, train_seconds_this_run=out.train_seconds)
    if out.artifact is not None and cfg.evaluate.enabled and _is_main_process():
        eval_target = evaluation_target(target, cfg.target, accelerator) if accelerator is not None else target
        evaluate_into_artifact(out.artifact, eval_target, method.name, cfg.evaluate, command=command)
        out.eval = artifact.load_manifest(out.artifact)["eval"]
    return out


def train_method(method: str | methods.Method, config_path: str | None, overrides: list[str]) -> Path | None:
    """Train `method` through `run` from a preset (the method's default without one) and `key=value`
    overrides (`draftsmith train`, retraining, the thin scripts). Returns the artifact folder; off the main
    process, where no artifact is written, the configured output folder (None for a method whose config names
    none)."""
    from draftsmith.config import load_config

    method = methods.get(method) if isinstance(method, str) else method
    cfg = load_config(config_path or method.default_config, overrides, cls=method.get("config"))
    out = run(method, cfg)
    if out.artifact is None and method.output_key is not None:
        return Path(getattr(cfg, method.output_key))
    return out.artifact
