"""Checkpoints: atomic, pickle-free, complete enough that a killed run resumes bit-for-bit.

Layout of `<output_dir>/checkpoints/step-00000100/`:

    model.safetensors       the trainable module's full state dict (unwrapped, gathered on rank 0)
    optimizer.safetensors   every tensor of optimizer.state_dict(), keyed by its path in the structure
    optimizer.json          the rest of that structure (param_groups, step counts that are not tensors)
    rng.safetensors         torch CPU (and CUDA) generator states, one entry per rank
    state.json              step, micro-batch count, data position (epoch, batch index within the epoch,
                            sampler seed), nonfinite counters, scheduler state, python/numpy RNG per rank,
                            the open logging window, best/last eval metrics
    log.jsonl               the training log up to this step (restored on resume, so the final log
                            of a resumed run equals the uninterrupted one)

Why not `accelerator.save_state`: in accelerate 1.15 it writes RNG states, samplers and custom objects
as pickles (`random_states_<rank>.pkl`, `sampler.bin`, `custom_checkpoint_<i>.pkl`) and loads custom
objects with `weights_only=False`, i.e. arbitrary code on load. Here nothing is a pickle: tensors go to
safetensors, everything else to JSON, so no `torch.load` is ever called.

Trust: a run resumes only from its own checkpoints (`trust_problem`): a `step-N` folder of its own
`checkpoints/` (symlinks and `..` resolved), or a copy whose state.json sha256 `checkpoints/.written.json` (the
record of every checkpoint this run wrote, training/run_files.py) holds. Nothing here is a pickle, but a sharded
checkpoint's engine files are (training/sharded.py): those are loaded only when that record names them.

Atomicity: rank 0 writes into `.step-00000100.tmp-<random>` and renames it to `step-00000100` only after
every file is fsynced; `state.json` is written last. `list_checkpoints` only returns `step-N` dirs with a
`state.json`, and leftover `.tmp-` dirs from a killed save are deleted by `clean_temp`. `state.json` records
the sha256 of every other file (tensors and JSON); a checkpoint whose files differ (torn by a full disk, a bad copy, a
flipped bit) is not resumed from: `resume: auto` falls back to the newest intact one and says so. Per-rank state
(RNG) is gathered to rank 0 over the process group, so only rank 0 ever writes files.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import FileFormatError, TrainingError
from draftsmith.storage import (
    atomic_dir,
    atomic_write_json,
    atomic_write_text,
    checksum_problems,
    read_json,
    sha256_file,
    weight_checksums,
)
from draftsmith.training.run_files import (
    log_records,
    read_log_text,
    read_state,
    read_written,
    record_written,
    written_path,
)

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CKPT_DIR


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first. Temp dirs and dirs without state.json are ignored."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def checkpoint_problems(path: str | Path) -> list[str]:
    """Why a checkpoint cannot be resumed from, one line per file (empty when it is intact): state.json
    unreadable or not in its schema (run_files.read_state), a file missing, truncated or different from the
    sha256 state.json recorded."""
    from draftsmith.layouts.verify import VerificationError, read_header

    path = Path(path)
    try:
        state = read_state(path / "state.json")
    except FileFormatError as e:
        return [str(e)]
    sums = state.get("checksums")
    if sums:
        return checksum_problems(path, sums, "state.json")
    problems = []  # written before checksums were recorded: the files must at least be whole
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        try:
            read_header(path / name)
        except VerificationError as e:
            problems.append(str(e))
    return problems


PICKLED = ("shards", "deepspeed")  # DCP's and DeepSpeed's folders in a sharded checkpoint: they hold pickles


def holds_pickles(path: str | Path) -> bool:
    return any((Path(path) / name).is_dir() for name in PICKLED)


def trust_problem(path: str | Path, output_dir: str | Path) -> str | None:
    """Why this run may not resume from `path` (one line), or None. A run resumes from its own checkpoints:
    a folder in its own `checkpoints/` (symlinks and `..` resolved), or one whose state.json this run's
    `checkpoints/.written.json` recorded (a copy it made elsewhere). A checkpoint holding pickles needs the
    record in every case: its own state.json vouches for nothing, whoever wrote the folder wrote that too."""
    path, root = Path(path), checkpoints_root(output_dir)
    inside = path.resolve().parent == root.resolve()
    if inside and not holds_pickles(path):
        return None  # safetensors and JSON only: nothing in it can run code
    try:
        written = read_written(root)
    except FileFormatError as e:
        return f"{path}: cannot be trusted, {e}"
    state = path / "state.json"
    if state.is_file() and sha256_file(state) in written:
        return None
    if not inside:
        return (f"train.resume: {path} is not a checkpoint of this run's output folder {output_dir} (resolved: "
                f"{path.resolve()}), nor one {written_path(root)} records: draftsmith resumes only from checkpoints "
                "it wrote there; set train.output_dir to the run that wrote it")
    return (f"{path} holds pickles (shards/ or deepspeed/) that this run did not write ({written_path(root)} does "
            "not record it): they are never loaded; delete it, or set train.resume=never")


def latest_intact(output_dir: str | Path) -> Path | None:
    """The newest checkpoint this run may resume from (`trust_problem`) that passes `checkpoint_problems`,
    logging each newer one that does not."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = trust_problem(path, output_dir) or next(iter(checkpoint_problems(path)), None)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged or not this run's, not used: %s", path.name, problem)
    return None


def clean_temp(output_dir: str | Path) -> list[Path]:
    """Delete temp dirs a killed save left behind (rank 0 only, before training starts)."""
    root = checkpoints_root(output_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def prune(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` complete checkpoints, delete older ones (oldest first)."""
    ckpts = list_checkpoints(output_dir)
    doomed = ckpts[:-keep_last] if keep_last > 0 else ckpts
    for p in doomed:
        # rename first so a crash mid-delete never leaves a partial dir under a step-N name
        trash = p.parent / f".{p.name}.tmp-delete"
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


# ---- pickle-free (de)serialisation of nested state dicts -----------------------------------------

def flatten_state(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested dict/list structure into a JSON skeleton and a flat {path: tensor} dict.

    Tensors are replaced by {"__tensor__": path}; dict keys keep their type ({"__int__": ...} for ints,
    which optimizer state dicts use as parameter ids).
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().to("cpu").contiguous().clone()
            return {"__tensor__": path}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TrainingError(f"cannot checkpoint a state key of type {type(k).__name__}")
                items.append([k if isinstance(k, str) else {"__int__": k}, walk(v, f"{path}.{k}" if path else str(k))])
            return {"__dict__": items}
        if isinstance(x, list | tuple):
            out = [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
            return out if isinstance(x, list) else {"__tuple__": out}
        if isinstance(x, float) and not np.isfinite(x):
            return {"__float__": repr(x)}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, np.generic):
            return x.item()
        raise TrainingError(f"cannot checkpoint a state value of type {type(x).__name__} at '{path}'")

    return walk(obj, prefix), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                return tensors[x["__tensor__"]]
            if "__tuple__" in x:
                return tuple(walk(v) for v in x["__tuple__"])
            if "__float__" in x:
                return float(x["__float__"])
            if "__dict__" in x:
                return {(k["__int__"] if isinstance(k, dict) else k): walk(v) for k, v in x["__dict__"]}
        return x

    return walk(skeleton)


# ---- RNG state ------------------------------------------------------------------------------------

def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-able python/numpy state, tensors for torch/cuda) of the calling process."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    js = {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    return js, tensors


def restore_rng(js: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


# ---- save / load ----------------------------------------------------------------------------------

@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict  # state.json
    model: dict[str, torch.Tensor]
    optimizer: dict
    rng_json: list[dict]  # per rank
    rng_tensors: list[dict[str, torch.Tensor]]
    log_lines: list[str]


def save_checkpoint(output_dir: str | Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                    state: dict, rng_per_rank: list[tuple[dict, dict[str, torch.Tensor]]], log_text: str,
                    keep_last: int) -> Path:
    """Write one checkpoint atomically (call on rank 0 only) and prune old ones."""
    final = checkpoints_root(output_dir) / checkpoint_name(step)
    with atomic_dir(final, overwrite=True) as tmp:
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in model_state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        skeleton, tensors = flatten_state(optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        atomic_write_json(tmp / "optimizer.json", skeleton)
        rng_tensors = {f"rank{r}.{k}": v for r, (_, ts) in enumerate(rng_per_rank) for k, v in ts.items()}
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        atomic_write_text(tmp / "log.jsonl", log_text)
        # every file a resume reads, JSON included: a changed digit in optimizer.json is a wrong optimizer
        sums = {**weight_checksums(tmp), **{n: sha256_file(tmp / n) for n in ("optimizer.json", "log.jsonl")}}
        full = {**state, "step": step, "rng": [js for js, _ in rng_per_rank], "checksums": sums}
        atomic_write_json(tmp / "state.json", full)  # last: its presence marks a complete checkpoint
        record_written(final.parent, tmp / "state.json", final.name)  # before the rename gives it its name
    prune(output_dir, keep_last)
    return final


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    path = Path(path)
    if not (path / "state.json").is_file():
        raise TrainingError(f"{path}: not a complete checkpoint (no state.json)")
    problems = checkpoint_problems(path)
    if problems:
        raise TrainingError(f"checkpoint {path} is damaged: {problems[0]}")
    state = read_state(path / "state.json")
    model = load_file(str(path / "model.safetensors"))
    try:
        optimizer = unflatten_state(read_json(path / "optimizer.json"), load_file(str(path / "optimizer.safetensors")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TrainingError(f"checkpoint {path / 'optimizer.json'}: not the optimizer state it wrote "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(optimizer, dict):
        raise TrainingError(f"checkpoint {path / 'optimizer.json'}: not an optimizer state (not an object)")
    rng_json, rng_tensors, log_lines = read_rng_and_log(path, state)
    return LoadedCheckpoint(path, state, model, optimizer, rng_json, rng_tensors, log_lines)


_RNG_KEY = re.compile(r"^rank(\d{1,5})\.(torch|cuda\.\d{1,3})$")


def read_rng_and_log(path: Path, state: dict) -> tuple[list[dict], list[dict[str, torch.Tensor]], list[str]]:
    """A checkpoint's per-rank RNG (state.json's python/numpy, rng.safetensors' torch/cuda tensors) and its
    log's lines, each checked: a key of another shape or a rank state.json has no entry for, or a log line
    that is not a record, is one line naming the file."""
    rng_tensors: list[dict[str, torch.Tensor]] = [{} for _ in state["rng"]]
    for k, v in load_file(str(path / "rng.safetensors")).items():
        m = _RNG_KEY.match(k)
        if m is None or int(m[1]) >= len(rng_tensors) or v.dtype != torch.uint8 or v.dim() != 1:
            raise TrainingError(f"checkpoint {path / 'rng.safetensors'}: tensor '{k}' is not a generator state of "
                                f"one of the {len(rng_tensors)} ranks state.json lists")
        rng_tensors[int(m[1])][m[2]] = v
    if any("torch" not in t for t in rng_tensors):
        raise TrainingError(f"checkpoint {path / 'rng.safetensors'}: a rank's torch generator state is missing")
    try:
        text = read_log_text(path / "log.jsonl")
        log_records(text, path / "log.jsonl", torn_tail=False)  # a checkpoint's log was written whole
    except FileFormatError as e:
        raise TrainingError(f"checkpoint {path} is damaged: {e}") from None
    return state["rng"], rng_tensors, text.splitlines(keepends=True)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """'never' -> None; 'auto' -> newest complete checkpoint or None; else that path (must be complete, and a
    checkpoint of this run: `trust_problem`)."""
    if resume == "never":
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        found = latest_intact(output_dir)
        if ckpts and found is None:
            newest = ckpts[-1]
            why = trust_problem(newest, output_dir) or next(iter(checkpoint_problems(newest)), "damaged")
            raise TrainingError(f"no checkpoint under {checkpoints_root(output_dir)} can be resumed (the newest: "
                                f"{why}); restore one, or set train.resume=never to start over")
        if found is not None and found != ckpts[-1]:
            log.warning("resuming from %s, the newest intact checkpoint (newer ones are damaged)", found)
        return found
    path = Path(resume).expanduser()
    problem = trust_problem(path, output_dir)  # first: nothing of a folder of unknown origin is read
    if problem:
        raise TrainingError(problem)
    if not (path / "state.json").is_file():
        raise TrainingError(f"train.resume: {path} is not a complete checkpoint directory")
    problems = checkpoint_problems(path)
    if problems:
        raise TrainingError(f"train.resume: checkpoint {path} is damaged: {problems[0]}")
    return path


def read_log(path: str | Path) -> list[dict]:
    """A training log's records (run_files.read_log: a torn last line dropped, any other fault named)."""
    from draftsmith.training.run_files import read_log as read

    return read(path)
