"""The job protocol: what a draft-distillation, Medusa or EAGLE trainer hands to the one loop.

A job differs from its siblings only by its module, its batches and its loss (the habit of Medusa's and
TRL's trainers, which override `compute_loss` and nothing else). The loop owns everything else:
devices, mixed precision, accumulation, clipping, schedule, eval, logging, checkpoints, resume, NaN
handling, distributed launch and the rank-0-only file writes.

    class MedusaJob:                                   # sketch of a complete job (~100 lines in full)
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
  frozen target there (`training.frozen.place_frozen`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Job(Protocol):
    """What the one loop needs from a job. See the module docstring for the contract."""

    kind: str  # artifact kind: "draft" | "medusa" | "eagle"

    def build_module(self) -> nn.Module: ...

    def train_rows(self) -> Sequence[Any]: ...

    def eval_rows(self) -> Sequence[Any] | None: ...

    def collate(self, rows: list[Any]) -> dict[str, torch.Tensor]: ...

    def loss(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def save_artifact(self, module: nn.Module, out_dir: Path, metrics: dict[str, float]) -> Path: ...


def count_tokens(job: Any, batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch, for tokens/s: the job's own count if it has one, else the attention mask."""
    if hasattr(job, "count_tokens"):
        return int(job.count_tokens(batch))
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "input_ids" in batch:
        return int(batch["input_ids"].numel())
    first = next(iter(batch.values()))
    return int(first.shape[0])
