"""Training logs: JSONL always; TensorBoard and Weights & Biases when asked. Rank 0 only.

Every record is one JSON object per line in `<output_dir>/log.jsonl`:
`{"type": "train"|"eval"|"summary", "step": N, ...metrics}`. The JSONL text is also kept in memory so a
checkpoint can carry "the log so far" and a resumed run rewrites the file to exactly that prefix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _check_ours(path: Path) -> None:
    """A log.jsonl that is not a draftsmith training log (its first line is not a record of ours) belongs to
    the user: it is not overwritten."""
    from draftsmith.errors import OutputError

    try:
        with open(path, "rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return
    if not first.strip():
        return
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not (isinstance(record, dict) and "type" in record and "step" in record):
        raise OutputError(f"{path} exists and is not a draftsmith training log: set train.output_dir to another "
                          "folder, or move it")


class RunLogger:
    def __init__(self, output_dir: Path, loggers: list[str], config: dict, active: bool,
                 wandb_project: str | None = None, initial_text: str = "") -> None:
        self.active = active
        self.path = Path(output_dir) / "log.jsonl"
        self.text = initial_text
        self._tb = None
        self._wandb = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _check_ours(self.path)
        # rewrite the file to the checkpointed prefix (drops lines logged after the checkpoint)
        self.path.write_text(initial_text, encoding="utf-8")
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                import logging

                logging.getLogger(__name__).warning("train.loggers has 'wandb' but wandb is not installed: skipped")
            else:
                self._wandb = wandb.init(project=wandb_project or "draftsmith", config=config,
                                         dir=str(output_dir), resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        self.text += line
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
        step = int(record.get("step", 0))
        prefix = record.get("type", "train")
        scalars = {f"{prefix}/{k}": v for k, v in record.items()
                   if k not in ("type", "step") and isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
