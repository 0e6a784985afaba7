"""Sharded checkpoints (FSDP, DeepSpeed ZeRO): every rank writes and reads its own part of the module and
optimizer state.

Under FSDP full-shard or ZeRO no rank holds the whole trainable module's optimizer state (ZeRO-3 and FSDP not
even its weights), and at 8B scale gathering them on rank 0 (training/checkpoint.py's layout) does not fit.
A sharded checkpoint is the engine's own per-rank format next to our JSON / safetensors files:

    checkpoints/step-00000100/
        shards/__0_0.distcp, __1_0.distcp, ...   FSDP: each rank's own slice of model + optimizer tensors
        shards/.metadata                         (torch.distributed.checkpoint, DCP) and DCP's index of them
        deepspeed/zero_pp_rank_R_*_states.pt     DeepSpeed: each rank's ZeRO partition (engine.save_checkpoint)
        rng.safetensors, log.jsonl               as in a full checkpoint
        state.json                               the loop state, "format": "sharded" | "deepspeed", the
                                                 sha256 of every file above; written last, by rank 0

PICKLE. Two files are Python pickles, read by their engines with `pickle.load` / `torch.load` and with no
pickle-free reader: DCP's `.metadata` and DeepSpeed's `.pt` partitions (ZeRO's optimizer state holds Python
objects: loss scaler, fragment maps). So before anything is unpickled, every file's sha256 must be the one
`state.json` recorded when this code wrote it (`load_sharded`, `load_deepspeed`): a file that is not is
refused, and so is a file in `shards/` or `deepspeed/` it does not list. And since whoever writes a folder
writes its state.json too, that state.json must itself be one this run wrote: rank 0 records its sha256 in the
output folder's `checkpoints/.written.json` before the checkpoint gets its name, signed with this user's key
(training/run_files.py, training/trust.py), and a checkpoint's pickles are loaded only when a record that
verifies names it and its state.json says it is sharded (checkpoint.judge before anything of the folder is
read, checkpoint.vouched_state again in each loader here), never because a folder of that name is there. A
sharded checkpoint of unknown origin is never loaded (`draftsmith trust RUN` accepts one the user checked);
the final artifact is always one consolidated safetensors folder (rank 0).

World size. DCP reshards on load: a checkpoint written by 2 ranks loads into 1 process (or 4), since every
slice is keyed by its offset in the full tensor; the loop translates the data position the same way
(training/loop.py `_restore`). DeepSpeed's partitions are cut for the world size that wrote them: a resume
with another number of processes is refused in one line (DeepSpeed reshards only through its offline
universal-checkpoint conversion).

Atomicity: rank 0 creates `.step-N.tmp-<random>`, every rank writes its part into it, rank 0 writes
`state.json` last and renames the folder to `step-N`; a rank killed mid-save leaves a `.tmp-` folder,
which `clean_temp` removes at the next start. A torn or corrupted part fails `state.json`'s checksums, and
resume falls back to the previous intact checkpoint (checkpoint.latest_intact).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.checksums import sha256_file
from draftsmith.errors import TrainingError
from draftsmith.outputs import atomic_write_json, atomic_write_text
from draftsmith.training.checkpoint import (
    PICKLED,
    checkpoint_name,
    checkpoints_root,
    prune,
    vouched_state,
)
from draftsmith.training.run_files import read_state, record_written

SHARDS, DS_TAG = PICKLED  # DCP's and DeepSpeed's checkpoint folders inside step-N
FORMAT = "sharded"
DS_FORMAT = "deepspeed"


def _broadcast_str(value: str | None) -> str:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _temp_folder(accelerator, final: Path) -> Path:
    """Rank 0 creates the temporary sibling of `final` every rank writes into; every rank gets its path."""
    tmp = None
    if accelerator.is_main_process:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-")
    return Path(_broadcast_str(tmp))


def _commit(accelerator, output_dir, tmp: Path, final: Path, step: int, state: dict, fmt: str, weights: list[Path],
            rng_per_rank, log_text: str, keep_last: int) -> None:
    """Rank 0, after every rank wrote its files into `tmp`: RNG, log, state.json (last, with the sha256 of every
    file a resume reads, so a torn or flipped shard sends resume to the previous checkpoint like a damaged full
    checkpoint, checkpoint.checkpoint_problems) and the rename to step-N."""
    if not accelerator.is_main_process:
        return
    rng_tensors = {f"rank{r}.{k}": v for r, (_, ts) in enumerate(rng_per_rank) for k, v in ts.items()}
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    atomic_write_text(tmp / "log.jsonl", log_text)
    files = sorted([*weights, tmp / "rng.safetensors", tmp / "log.jsonl"])  # every file a resume reads
    sums = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in files}
    full = {**state, "step": step, "rng": [js for js, _ in rng_per_rank], "format": fmt, "checksums": sums}
    if fmt == FORMAT:
        full["metadata_sha256"] = sums[f"{SHARDS}/.metadata"]
    atomic_write_json(tmp / "state.json", full)  # last: its presence marks a complete checkpoint
    record_written(final.parent, tmp / "state.json", final.name)  # before the rename gives it its name
    if final.exists():  # a re-save of the same step (resumed run): keep a complete copy until the rename
        old = final.parent / f".{final.name}.tmp-old"
        os.replace(final, old)
        os.replace(tmp, final)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    prune(output_dir, keep_last)


def save_sharded(accelerator, output_dir: str | Path, step: int, model, optimizer, state: dict,
                 rng_per_rank: list[tuple[dict, dict[str, torch.Tensor]]], log_text: str, keep_last: int) -> Path:
    """Collective: call on every rank. Each rank writes its shard; rank 0 the rest (see module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoints_root(output_dir) / checkpoint_name(step)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # each rank's own shards (DTensors), no gather
    tmp = _temp_folder(accelerator, final)
    dcp.save({"model": model_sd, "optimizer": optim_sd},
             storage_writer=dcp.FileSystemWriter(str(tmp / SHARDS), sync_files=True))
    accelerator.wait_for_everyone()
    weights = sorted(p for p in (tmp / SHARDS).iterdir() if p.is_file()) if accelerator.is_main_process else []
    _commit(accelerator, output_dir, tmp, final, step, state, FORMAT, weights, rng_per_rank, log_text, keep_last)
    accelerator.wait_for_everyone()
    return final


def save_deepspeed(accelerator, output_dir: str | Path, step: int, engine, state: dict,
                   rng_per_rank: list[tuple[dict, dict[str, torch.Tensor]]], log_text: str, keep_last: int) -> Path:
    """Collective: DeepSpeed's own checkpoint, each rank writing its ZeRO partition (see module docstring)."""
    final = checkpoints_root(output_dir) / checkpoint_name(step)
    tmp = _temp_folder(accelerator, final)
    engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False)
    accelerator.wait_for_everyone()
    weights = sorted(p for p in (tmp / DS_TAG).rglob("*") if p.is_file()) if accelerator.is_main_process else []
    _commit(accelerator, output_dir, tmp, final, step, state, DS_FORMAT, weights, rng_per_rank, log_text, keep_last)
    accelerator.wait_for_everyone()
    return final


def load_deepspeed(path: str | Path, engine, world: int, output_dir: str | Path) -> None:
    """Load a DeepSpeed checkpoint into a prepared engine: one this user's signed record of the run in
    `output_dir` vouches for, every file intact (checkpoint.vouched_state), and of the same world size only
    (ZeRO partitions are cut for it)."""
    path = Path(path)
    written = vouched_state(path, output_dir)["world_size"]
    if written != world:
        raise TrainingError(f"checkpoint {path} holds DeepSpeed ZeRO partitions of {written} ranks; this run has "
                            f"{world}: resume with {written} processes (DeepSpeed reshards only through its "
                            "universal-checkpoint conversion), or set train.resume=never")
    load_path, _ = engine.load_checkpoint(str(path), tag=DS_TAG, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=False)
    if load_path is None:
        raise TrainingError(f"{path / DS_TAG}: DeepSpeed found no checkpoint to load there")


def load_sharded(path: str | Path, model, optimizer, output_dir: str | Path) -> None:
    """Load a sharded checkpoint into a prepared `model` / `optimizer`, whatever this run's world size
    (every rank reads the slices it owns now): one this user's signed record of the run in `output_dir`
    vouches for, every file intact (checkpoint.vouched_state), `.metadata`'s sha256 checked before DCP
    unpickles it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = path / SHARDS / ".metadata"
    want = vouched_state(path, output_dir).get("metadata_sha256")
    if not meta.is_file() or want is None or sha256_file(meta) != want:
        raise TrainingError(f"{meta}: missing or not the file this checkpoint recorded (sha256 mismatch); "
                            "it is a pickle and is only loaded when it is")
    from torch.distributed.checkpoint.api import CheckpointException

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / SHARDS)))
    except CheckpointException as e:  # a BaseException: it would escape every `except Exception`
        first = next((ln.strip() for ln in str(e).splitlines()[::-1] if ln.strip()), type(e).__name__)
        raise TrainingError(f"{path / SHARDS}: cannot be loaded into this run's module ({first})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_meta(path: str | Path):
    """A sharded checkpoint's loop state (state.json, RNG, log) as a `LoadedCheckpoint` with no tensors: the
    module and optimizer are read after `accelerator.prepare`, by `load_sharded`."""
    from draftsmith.training.checkpoint import LoadedCheckpoint, read_rng_and_log

    path = Path(path)
    state = read_state(path / "state.json")
    rng_json, rng_tensors, lines = read_rng_and_log(path, state)
    return LoadedCheckpoint(path, state, {}, {}, rng_json, rng_tensors, lines)
