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

Atomicity: rank 0 writes into `.step-00000100.tmp-<random>` and renames it to `step-00000100` only after
every file is fsynced; `state.json` is written last. `list_checkpoints` only returns `step-N` dirs with a
`state.json`, and leftover `.tmp-` dirs from a killed save are deleted by `clean_temp`. `state.json` records
the sha256 of every other file (tensors and JSON); a checkpoint whose files differ (torn by a full disk, a bad copy, a
flipped bit) is not resumed from: `resume: auto` falls back to the newest intact one and says so. Per-rank state
(RNG) is gathered to rank 0 over the process group, so only rank 0 ever writes files.
"""

from __future__ import annotations

import contextlib
import json
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
    unreadable, a safetensors file missing, truncated or different from the sha256 state.json recorded."""
    from draftsmith.layouts.verify import VerificationError, read_header

    path = Path(path)
    try:
        state = read_json(path / "state.json")
    except FileFormatError as e:
        return [f"{path / 'state.json'}: unreadable: {str(e).removeprefix(str(path / 'state.json') + ': ')}"]
    except OSError as e:
        return [f"{path / 'state.json'}: unreadable ({type(e).__name__}: {e.strerror})"]
    if not isinstance(state, dict):
        return [f"{path / 'state.json'}: not a JSON object"]
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        return [f"{path / 'state.json'}: missing field '{missing[0]}'" + (f" (and {len(missing) - 1} more)"
                                                                           if len(missing) > 1 else "")]
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


STATE_FIELDS = ("step", "micro", "world_size", "batch_size", "nonfinite_total", "nonfinite_in_row", "tokens_total",
                "last_eval", "last_train", "rng")


def latest_intact(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes `checkpoint_problems`, logging each newer one that does not."""
    for path in reversed(list_checkpoints(output_dir)):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        log.warning("checkpoint %s is damaged, not used: %s", path.name, problems[0])
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
    prune(output_dir, keep_last)
    return final


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    path = Path(path)
    if not (path / "state.json").is_file():
        raise TrainingError(f"{path}: not a complete checkpoint (no state.json)")
    problems = checkpoint_problems(path)
    if problems:
        raise TrainingError(f"checkpoint {path} is damaged: {problems[0]}")
    state = read_json(path / "state.json")
    model = load_file(str(path / "model.safetensors"))
    optimizer = unflatten_state(read_json(path / "optimizer.json"), load_file(str(path / "optimizer.safetensors")))
    rng_flat = load_file(str(path / "rng.safetensors"))
    n = len(state["rng"])
    rng_tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for k, v in rng_flat.items():
        rank, name = k.split(".", 1)
        rng_tensors[int(rank[4:])][name] = v
    log_lines = (path / "log.jsonl").read_text(encoding="utf-8").splitlines(keepends=True) \
        if (path / "log.jsonl").is_file() else []
    return LoadedCheckpoint(path, state, model, optimizer, state["rng"], rng_tensors, log_lines)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """'never' -> None; 'auto' -> newest complete checkpoint or None; else that path (must be complete)."""
    if resume == "never":
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        found = latest_intact(output_dir)
        if ckpts and found is None:
            raise TrainingError(f"every checkpoint under {checkpoints_root(output_dir)} is damaged (see the warnings "
                                "above): restore one, or set train.resume=never to start over")
        if found is not None and found != ckpts[-1]:
            log.warning("resuming from %s, the newest intact checkpoint (newer ones are damaged)", found)
        return found
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise TrainingError(f"train.resume: {path} is not a complete checkpoint directory")
    problems = checkpoint_problems(path)
    if problems:
        raise TrainingError(f"train.resume: checkpoint {path} is damaged: {problems[0]}")
    return path


def read_log(path: str | Path) -> list[dict]:
    """Parse a JSONL log (ignoring a torn last line)."""
    out = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out
