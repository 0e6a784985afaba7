"""The job protocol: what every registered method's trainer (`Method.job`) hands to the one loop.

A job differs from its siblings only by its module, its batches and its loss (the habit of Medusa's and
TRL's trainers, which override `compute_loss` and nothing else). The loop owns everything else:
devices, mixed precision, accumulation, clipping, schedule, eval, logging, checkpoints, resume, NaN
handling, distributed launch and the rank-0-only file writes.

    class MedusaJob(Job):                              # sketch of a complete job (~100 lines in full)
        kind = "medusa"
        def __init__(self, cfg, target, data):
            self.cfg, self.target, self.data = cfg, target, data
            self.features = CaptureSource(target, layers=[], topk=0, want_last_hidden=True,
                                          cache_dir=cfg.capture_cache)        # online or offline
        def build_module(self):
            return MedusaHeads.from_target(self.target.config, num_heads=self.cfg.num_heads)
        def setup(self, accelerator):                  # optional: place the frozen target
            self.features.place(accelerator)
        def train_rows(self): return self.data["train"]
        def eval_rows(self): return self.data["eval"]
        def collate(self, rows): return pad_rows(rows, pad_id=...)   # must keep "row_id" for the cache
        def loss(self, module, batch):
            feats = self.features(batch)               # {"last_hidden": [B, T, H], ...}
            logits = module(feats["last_hidden"])      # [heads, B, T, V]
            ... cross-entropy of head i against the token i+2 ahead, masked ...
            return loss, {f"head{i}/top1": acc_i for i in ...}
        def save_artifact(self, module, out_dir, metrics):
            return artifact.save_artifact(out_dir, make_manifest("medusa", ...), module.state_dict(), ...)

Rules the loop relies on:
- `build_module()` returns the TRAINABLE module only; the frozen target is never inside it (it is not
  DDP-wrapped, has no optimizer state and is not checkpointed). It must be deterministic given the
  torch seed (the loop seeds before calling it) so resumed and fresh runs start identically.
- `collate(rows)` returns a dict of tensors (the loop moves them to the device). `count_tokens` is
  optional; by default the loop counts `attention_mask.sum()` (else `input_ids.numel()`, else rows).
- `loss(module, batch)` returns a scalar loss tensor and a dict of float metrics. The metric names must
  be the same on every call (they are averaged across ranks by position). The loop runs it under
  autocast; in eval mode under `torch.no_grad()` with `module.eval()`.
- `save_artifact(module, out_dir, metrics)` gets the unwrapped module on rank 0 only. Anything it needs from
  the frozen target belongs in `before_artifact()` (optional), which every rank runs first: under FSDP /
  ZeRO-3 the target is sharded and its forward is collective, so rank 0 cannot run it alone.
- `setup(accelerator)` (optional) runs once on every rank after the Accelerator exists: place the
  frozen target there (`targets.frozen.place_frozen`).
- A job subclasses `Job`: the optional hooks are methods of the base class with the loop's defaults
  (`setup`, `data_path`, `row_lengths`, `lr_scale`, `count_tokens`, `learned_tokens`, `warm_start_module`,
  `artifact_dest`, `before_artifact`), so the loop calls them without asking whether they exist.
- A job that learns from self-distilled rows (every built-in method's) subclasses `RowsJob` and calls its
  `use_rows` once: the rows, the batches and the rows' lengths are then the same for every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from draftsmith.data.batching import pad_rows, row_lengths, split_rows
from draftsmith.targets.families import pad_token_id

if TYPE_CHECKING:
    from draftsmith.training.config import TrainConfig


def unwrap(module: nn.Module) -> nn.Module:
    """The job's own module under a DDP / accelerate wrapper (they keep it in `.module`)."""
    return getattr(module, "module", module)


class Job:
    """What the one loop needs from a job (module docstring). A job subclasses this and implements the six
    required methods; every optional hook below has the loop's default, so the loop never probes a job."""

    kind: str = ""  # artifact kind: a registered method's name ("draft", "medusa", "eagle", ...)
    target: Any = None  # the frozen Target, when the job has one (a warm start checks its fingerprint)
    # the epoch of the micro-batch being trained, set by the loop before it hands the batch over: a job that
    # draws at random per row seeds by (row, epoch), the same on any number of ranks and after a resume
    epoch: int = 0

    # --- required -------------------------------------------------------------------------------------
    def build_module(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_module")

    def train_rows(self) -> Sequence[Any]:
        raise NotImplementedError(f"{type(self).__name__}.train_rows")

    def eval_rows(self) -> Sequence[Any] | None:
        return None

    def collate(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.collate")

    def loss(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def save_artifact(self, module: nn.Module, out_dir: Path, metrics: dict[str, float]) -> Path:
        raise NotImplementedError(f"{type(self).__name__}.save_artifact")

    # --- optional hooks, with the loop's defaults ------------------------------------------------------
    @classmethod
    def check_launch(cls, cfg: Any, accelerator) -> None:
        """Refuse a launch layout the job cannot run under (one line), before the runner loads the target."""

    def announce(self) -> None:
        """Once before training (runner/train.py): log what the job trains."""

    def setup(self, accelerator) -> None:
        """Once on every rank after the Accelerator exists: place the frozen target (targets.frozen)."""

    def config(self) -> Any:
        """The job's own settings (a dataclass), recorded in checkpoints: a resume names what changed."""
        return getattr(self, "cfg", None)

    def data_path(self) -> str | None:
        """The training data's path, recorded in checkpoints (a resume on other data is refused)."""
        return None

    def row_lengths(self) -> list[int] | None:
        """Each training row's length for `group_by_length` (None: the rows' own lengths)."""
        return None

    def lr_scale(self, name: str) -> float:
        """A multiple of the base lr for the parameter `name` (Medusa-2's adapter learns slower)."""
        return 1.0

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens in a batch, for tokens/s: by default the attention mask."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        if "input_ids" in batch:
            return int(batch["input_ids"].numel())
        first = next(iter(batch.values()))
        return int(first.shape[0])

    def learned_tokens(self, batch: dict[str, Any]) -> int | None:
        """Learned (loss) tokens in a batch (0: the batch is skipped and counted); by default the loss mask's
        positions a next-token prediction learns (every position but the first); None without a mask."""
        mask = batch.get("loss_mask")
        if not isinstance(mask, torch.Tensor):
            return None
        return int(mask[:, 1:].sum())

    # artifact kinds besides its own whose weights a warm start takes (DSpark: DFlash's, the backbone it extends)
    warm_start_kinds: tuple[str, ...] = ()

    def warm_start_module(self, module: nn.Module) -> nn.Module:
        """The part of the module an artifact's weights belong to (Medusa-2: its heads)."""
        return module

    def warm_start_weights(self, weights: dict, module: nn.Module) -> dict:
        """The weights a warm start loads into `module` (the part warm_start_module gave), made to fit what this
        job built (EAGLE-3: its own draft vocabulary); as they are by default."""
        return weights

    def artifact_dest(self, default: Path) -> Path:
        """Where the artifact goes (default: <train.output_dir>/artifact)."""
        return default

    def before_artifact(self) -> None:
        """Every rank, before rank 0's `save_artifact`: work on a target that may be sharded across ranks."""


class RowsJob(Job):
    """A job that learns from self-distilled rows (data/batching.py): every built-in method's. Its `__init__`
    calls `use_rows` once; the loop's training and held-out rows, its batches (each row's window of at most
    `max_length` tokens, `prompt_context` of them before the first learned one, right-padded) and the rows'
    lengths for `group_by_length` then come from here, the same for every method."""

    train_set: Sequence[Any] = ()
    eval_set: Sequence[Any] | None = None
    pad_id: int = 0
    max_length: int | None = None
    prompt_context: int | None = None

    def use_rows(self, rows: Sequence[Any], target, eval_fraction: float, train: TrainConfig, max_length: int,
                 prompt_context: int | None = None) -> None:
        """Split `rows` into training and held-out rows (data/batching.split_rows: by `train.seed`, the first
        `train.train_rows` kept), padded with the target's pad token, each cut to its window."""
        self.train_set, self.eval_set = split_rows(rows, eval_fraction, train.seed, train.train_rows)
        self.pad_id = pad_token_id(target)
        self.max_length, self.prompt_context = max_length, prompt_context

    def train_rows(self) -> Sequence[Any]:
        return self.train_set

    def eval_rows(self) -> Sequence[Any] | None:
        return self.eval_set

    def collate(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        return pad_rows(rows, self.pad_id, self.max_length, prompt_context=self.prompt_context)

    def row_lengths(self) -> list[int]:
        return row_lengths(self.train_set, self.max_length, self.prompt_context)
