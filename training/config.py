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

from dataclasses import dataclass, field
from typing import Literal

import torch

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")  # training/loggers.py


MAX_BATCH = 1 << 16  # rows in one batch; more is a typo (1e8), never a batch that fits a device


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


@dataclass
class TrainConfig:
    # optimiser: AdamW (Loshchilov & Hutter 2019, decoupled weight decay)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # schedule: linear warmup from 0 to lr over the warmup steps, then cosine / linear decay to
    # min_lr_ratio * lr at the last step, or constant.
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps == 0: warmup = round(ratio * total steps)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0
    # length: max_steps wins when both are given; otherwise epochs over the training rows
    max_steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 8  # rows per micro-batch per rank
    # batches of rows of similar length (less padding; the order is still a function of seed and epoch,
    # data/batching.py)
    group_by_length: bool = False
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0  # null disables clipping
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # evaluation on the held-out split: every eval_every steps (0 = only at the end), eval_batches
    # micro-batches per rank each time (null = the whole split)
    eval_every: int = 0
    eval_batches: int | None = None
    # checkpoints: every save_every steps (0 = none), newest keep_last kept
    save_every: int = 0
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0
    # train on only the first N rows of the training split, in its seeded order (data/batching.py
    # split_rows): the held-out split is the same whatever N, and a smaller N's rows are a subset of a
    # larger N's, so runs with growing N are the points of one learning curve. None = every training row
    train_rows: int | None = None
    output_dir: str = "runs/train"
    resume: str = "auto"  # "auto" (newest complete checkpoint if any) | "never" | a checkpoint dir
    warm_start: str | None = None  # an artifact dir whose weights initialise the module (weights only)
    max_nonfinite_in_row: int = 10
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # + tensorboard, wandb, mlflow, trackio
    project: str | None = None  # the trackers' project / experiment name (default "draftsmith")
    wandb_project: str | None = None  # the older name of `project`
    num_workers: int = 0
    progress: bool = True  # tqdm bar on rank 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.train_rows is not None and self.train_rows < 1:
            raise ValueError(f"train.train_rows must be >= 1 or null, got {self.train_rows}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1, got {self.max_steps}")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"train.epochs must be > 0 when max_steps is not set, got {self.epochs}")
        for name in ("batch_size", "grad_accum", "keep_last", "log_every", "max_nonfinite_in_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size > MAX_BATCH:
            raise ValueError(f"train.batch_size must be at most {MAX_BATCH} rows, got {self.batch_size}")
        for name in ("eval_every", "save_every", "num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches must be >= 1 or null, got {self.eval_batches}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"train.max_grad_norm must be > 0 or null, got {self.max_grad_norm}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"train.mixed_precision must be auto|no|bf16|fp16, got {self.mixed_precision!r}")
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


@dataclass
class EvalAfterTraining:
    enabled: bool = True
    prompts: list[str] = field(default_factory=list)  # empty = the evaluator's default eval sets of `split`
    split: str = "dev"  # the end-of-training evaluation chooses (checkpoints, recipes): never the test split
    domains: list[str] = field(default_factory=list)  # only these domains of the eval sets (empty = all)
    limit_per_domain: int | None = 8
    max_new_tokens: int = 64
    k: int = 4  # chain length (draft models, and heads when tree is false)
    tree: bool = True  # verify the artifact's own shape (Medusa calibrated tree, EAGLE-2 budget, DFlash's block)
    hf_reference: bool = True  # HF generate beside: the independent reference `lossless` is judged against
    cost_model: bool = True  # measure v(k) and c on this machine -> recommended k

    def __post_init__(self):
        if self.limit_per_domain is not None and self.limit_per_domain < 1:
            raise ValueError("evaluate.limit_per_domain must be >= 1 or null")
        if self.split not in ("dev", "test"):
            raise ValueError(f"evaluate.split must be dev or test, got {self.split!r}")
        if self.max_new_tokens < 1 or self.k < 1:
            raise ValueError("evaluate.max_new_tokens and evaluate.k must be >= 1")
