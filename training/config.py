"""`TrainConfig`: the settings of the one training loop, embedded as the `train:` section of every job config;
`EvalAfterTraining`: the `evaluate:` section, what the runner's end-of-training evaluation runs
(evaluation/after_training.py).

It is not a registered config kind by itself: `MedusaConfig`, `EagleConfig` and `DistillConfig` each carry a
`train: TrainConfig` field, so `draftsmith train-medusa --config x.yaml train.lr=3e-4` reaches it through
the ordinary dotted overrides. Bad values fail here, at load time.

Step vocabulary used everywhere in `training/`: a *micro-batch* is one `batch_size` batch on one rank; a
*step* is one optimizer update = `grad_accum` micro-batches on every rank, i.e. an effective batch of
`batch_size * grad_accum * world_size` rows. `max_steps`, `warmup_steps`, `eval_every`, `save_every`
and `log_every` all count steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

from draftsmith.config import (
    DRAFT_TOKENS,
    FRACTION,
    HELD_OUT,
    MAX_BATCH,
    ROWS,
    SEED,
    STEPS,
    TOKENS,
    Range,
    validated,
)

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")  # training/loggers.py


def check_output_folders(output: str, output_dir: str) -> None:
    """A job's artifact folder (`output`) and its training folder (`train.output_dir`: checkpoints, logs)
    must differ and neither may hold the other's artifact swap: the artifact replaces `output` whole, so an
    `output` equal to or above `train.output_dir` would take the checkpoints with it (refused at load, not
    after training)."""
    import os
    from pathlib import Path

    out, run = (Path(os.path.abspath(Path(p).expanduser())) for p in (output, output_dir))
    if out == run or out in run.parents:
        raise ValueError(f"output {output} would replace train.output_dir {output_dir} (its checkpoints and log) "
                         "when the artifact is written: give them different folders (e.g. output inside it)")


@validated
@dataclass
class TrainConfig:
    # optimiser: AdamW (Loshchilov & Hutter 2019, decoupled weight decay)
    lr: Annotated[float, Range(gt=0, le=10)] = 1e-4
    weight_decay: Annotated[float, Range(ge=0, le=10)] = 0.0
    betas: tuple[Annotated[float, Range(ge=0, lt=1)], Annotated[float, Range(ge=0, lt=1)]] = (0.9, 0.999)
    eps: Annotated[float, Range(gt=0, le=1)] = 1e-8
    # schedule: linear warmup from 0 to lr over the warmup steps, then cosine / linear decay to
    # min_lr_ratio * lr at the last step, or constant.
    warmup_steps: Annotated[int, STEPS] = 0
    warmup_ratio: Annotated[float, HELD_OUT] = 0.0  # used when warmup_steps == 0: warmup = round(ratio * total steps)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, FRACTION] = 0.0
    # length: max_steps wins when both are given; otherwise epochs over the training rows
    max_steps: Annotated[int, Range(ge=1, le=10**9)] | None = None
    epochs: Annotated[float, Range(gt=0, le=10_000)] = 1.0
    batch_size: Annotated[int, Range(ge=1, le=MAX_BATCH)] = 8  # rows per micro-batch per rank
    # batches of rows of similar length (less padding; the order is still a function of seed and epoch,
    # data/batching.py)
    group_by_length: bool = False
    grad_accum: Annotated[int, Range(ge=1, le=MAX_BATCH)] = 1
    max_grad_norm: Annotated[float, Range(gt=0, le=1e6)] | None = 1.0  # null disables clipping
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # evaluation on the held-out split: every eval_every steps (0 = only at the end), eval_batches
    # micro-batches per rank each time (null = the whole split)
    eval_every: Annotated[int, STEPS] = 0
    eval_batches: Annotated[int, Range(ge=1, le=10**9)] | None = None
    # checkpoints: every save_every steps (0 = none), newest keep_last kept
    save_every: Annotated[int, STEPS] = 0
    keep_last: Annotated[int, Range(ge=1, le=1000)] = 2
    log_every: Annotated[int, Range(ge=1, le=10**9)] = 10
    seed: Annotated[int, SEED] = 0
    # train on only the first N rows of the training split, in its seeded order (data/batching.py
    # split_rows): the held-out split is the same whatever N, and a smaller N's rows are a subset of a
    # larger N's, so runs with growing N are the points of one learning curve. None = every training row
    train_rows: Annotated[int, ROWS] | None = None
    output_dir: str = "runs/train"
    resume: str = "auto"  # "auto" (newest complete checkpoint if any) | "never" | a checkpoint dir
    warm_start: str | None = None  # an artifact dir whose weights initialise the module (weights only)
    max_nonfinite_in_row: Annotated[int, Range(ge=1, le=10**6)] = 10
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # + tensorboard, wandb, mlflow, trackio
    project: str | None = None  # the trackers' project / experiment name (default "draftsmith")
    wandb_project: str | None = None  # the older name of `project`
    num_workers: Annotated[int, Range(ge=0, le=256)] = 0
    progress: bool = True  # tqdm bar on rank 0

    def __post_init__(self) -> None:  # each field's own range is in its annotation (config.Range)
        cpus = os.cpu_count() or 1  # loader workers are processes of this machine, forked per rank
        if self.num_workers > cpus:
            raise ValueError(f"train.num_workers {self.num_workers} is more than this machine's {cpus} CPUs")
        unknown = [lg for lg in self.loggers if lg not in LOGGERS]
        if unknown:
            raise ValueError(f"train.loggers: unknown logger {unknown[0]!r} (known: {', '.join(LOGGERS)})")
        if "jsonl" not in self.loggers:  # the JSONL log is what resume and the summary read: always on
            self.loggers = ["jsonl", *self.loggers]
        if not self.resume:
            raise ValueError("train.resume must be 'auto', 'never' or a checkpoint directory")

    def resolved_mixed_precision(self) -> str:
        """'auto' -> bf16 on a CUDA device that supports it, or on a CPU with native bf16 (AVX512-BF16 / AMX:
        bf16 matrix products at more than twice the float32 rate, BENCHMARKS.md), else 'no'."""
        from draftsmith.targets.precision import cpu_native_bf16

        if self.mixed_precision != "auto":
            return self.mixed_precision
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        return "bf16" if cpu_native_bf16() else "no"

    def resolved_warmup(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else round(self.warmup_ratio * total_steps)


@validated
@dataclass
class EvalAfterTraining:
    enabled: bool = True
    prompts: list[str] = field(default_factory=list)  # empty = the evaluator's default eval sets of `split`
    split: str = "dev"  # the end-of-training evaluation chooses (checkpoints, recipes): never the test split
    domains: list[str] = field(default_factory=list)  # only these domains of the eval sets (empty = all)
    limit_per_domain: Annotated[int, ROWS] | None = 8
    max_new_tokens: Annotated[int, TOKENS] = 64
    k: Annotated[int, DRAFT_TOKENS] = 4  # chain length (draft models, and heads when tree is false)
    tree: bool = True  # verify the artifact's own shape (Medusa calibrated tree, EAGLE-2 budget, DFlash's block)
    hf_reference: bool = True  # HF generate beside: the independent reference `lossless` is judged against
    cost_model: bool = True  # measure v(k) and c on this machine -> recommended k

    def __post_init__(self):
        if self.split not in ("dev", "test"):
            raise ValueError(f"evaluate.split must be dev or test, got {self.split!r}")
