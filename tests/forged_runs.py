"""What a hostile run folder holds, for the tests of resuming (test_boundary_runs.py, test_trust.py): a pickle
whose loading leaves a mark, a sharded checkpoint built around it as its author would write it, and the tiny
training config and one-line error check those tests share."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.checksums import sha256_file
from draftsmith.errors import DraftsmithError
from draftsmith.training import TrainConfig
from draftsmith.training import checkpoint as ckpt


def train_cfg(out, **kw) -> TrainConfig:
    base = dict(batch_size=4, output_dir=str(out), save_every=0, eval_every=0, log_every=1, progress=False,
                loggers=["jsonl"], lr=1e-3)
    return TrainConfig(**{**base, **kw})


def one_line(e: BaseException) -> str:
    assert isinstance(e, DraftsmithError), f"{type(e).__name__}: {e}"
    message = str(e)
    assert message and "\n" not in message, message
    return message


class Payload:
    """Unpickling this creates `marker`: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def sharded_checkpoint(folder: Path, marker: Path, step: int) -> Path:
    """A sharded checkpoint at `step` whose `shards/.metadata` is a malicious pickle and whose own state.json
    records the matching sha256 of every file, as its author would write it."""
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    js, tensors = ckpt.capture_rng()
    save_file({f"rank0.{k}": v for k, v in tensors.items()}, str(folder / "rng.safetensors"))
    (folder / "log.jsonl").write_text("")
    sums = {n: sha256_file(folder / n) for n in ("shards/.metadata", "rng.safetensors", "log.jsonl")}
    state = {"step": step, "micro": step, "epoch": 0, "batch_in_epoch": step, "sampler_seed": 0,
             "micro_per_epoch": 8, "world_size": 1, "batch_size": 4, "nonfinite_total": 0, "nonfinite_in_row": 0,
             "tokens_total": 10, "last_eval": {}, "last_train": {}, "rng": [js], "format": "sharded",
             "checksums": sums, "metadata_sha256": sums["shards/.metadata"]}
    (folder / "state.json").write_text(json.dumps(state))
    return folder
