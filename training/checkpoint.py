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

Trust (`judge`): `checkpoints/.written.json` (training/run_files.py) records the state.json sha256 of every
checkpoint the run wrote, signed with a key only this user holds (training/trust.py): a run folder received
whole brings its record along, and a record that verifies with no key of this user's vouches for nothing. A
checkpoint the signed record vouches for resumes in full; a sharded one's engine files are pickles
(training/sharded.py), and they are loaded only then (`vouched_state`, checked again by each loader). Any
other `step-N` folder of the run's own `checkpoints/` resumes from its safetensors and JSON only, with one
warning, and a sharded one (nothing else to resume from) is refused; `draftsmith trust RUN` (`trust_run`)
shows what it accepts and signs it.

Atomicity: rank 0 writes into `.step-00000100.tmp-<random>` and renames it to `step-00000100` only after
every file is fsynced; `state.json` is written last. `list_checkpoints` only returns `step-N` dirs with a
`state.json`, and leftover `.tmp-` dirs from a killed save are deleted by `clean_temp`. `state.json` records
the sha256 of every other file (tensors and JSON); a checkpoint whose files differ (torn by a full disk, a bad copy, a
flipped bit) is not resumed from: `resume: auto` falls back to the newest intact one and says so. Per-rank state
(RNG) is gathered to rank 0 over the process group, so only rank 0 ever writes files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftsmith.checksums import checksum_problems, sha256_file, weight_checksums
from draftsmith.errors import FileFormatError, TrainingError
from draftsmith.outputs import atomic_dir, atomic_write_json, atomic_write_text
from draftsmith.reading import read_json
from draftsmith.training import trust
from draftsmith.training.run_files import (
    log_records,
    read_log_text,
    read_state,
    read_written,
    record_written,
    state_problem,
    write_written,
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


@dataclass(frozen=True)
class Verdict:
    """What a run may read of a checkpoint (`judge`)."""

    problem: str | None = None  # why it may not be resumed at all (one line)
    pickled: bool = False  # its engine state comes from its pickles: this user's signed record vouches for it
    unvouched: str | None = None  # why no signed record vouches for it: read from safetensors and JSON only


def _vouched(path: Path, root: Path) -> tuple[bool, str]:
    """Whether this user's signed record of the run (`root`/.written.json) lists the checkpoint's state.json,
    and why not."""
    try:
        written = read_written(root)
    except FileFormatError as e:
        return False, str(e)
    if written.problem:
        return False, f"{written.path} vouches for nothing: {written.problem}"
    state = path / "state.json"
    if state.is_file() and sha256_file(state) in written.listed:
        return True, ""
    if not os.path.lexists(written.path):
        return False, f"there is no {written.path}"
    return False, f"{written.path} does not list it"


def _declared_format(path: Path) -> str | None:
    """'sharded' / 'deepspeed' when state.json says the engine state is in pickles, None for a full checkpoint
    (or an unreadable state.json, which checkpoint_problems names)."""
    try:
        return read_state(path / "state.json").get("format")
    except FileFormatError:
        return None


def judge(path: str | Path, output_dir: str | Path) -> Verdict:
    """What this run may read of the checkpoint at `path`. Whoever wrote a folder wrote its state.json too,
    and whoever sent a run folder sent its `.written.json`: only a record signed with this user's key vouches
    (training/trust.py). A checkpoint it vouches for is read whole, its pickles included when its (vouched)
    state.json says it is sharded, never because a folder of that name is there. Any other checkpoint of the
    run's own `checkpoints/` (symlinks and `..` resolved) is read from its safetensors and JSON only; a
    sharded one has nothing else to resume from and is refused, and so is one outside the run that no signed
    record lists."""
    path, root = Path(path), checkpoints_root(output_dir)
    vouched, why = _vouched(path, root)
    if vouched:
        return Verdict(pickled=_declared_format(path) is not None)
    if path.resolve().parent != root.resolve():
        return Verdict(f"train.resume: {path} is not a checkpoint of this run's output folder {output_dir} "
                       f"(resolved: {path.resolve()}), nor one {written_path(root)} records and this user "
                       f"signed ({why}): draftsmith resumes only from checkpoints it wrote there; set "
                       "train.output_dir to the run that wrote it")
    fmt = _declared_format(path)
    if fmt is not None:
        return Verdict(f"{path} holds pickles ({fmt}: shards/ or deepspeed/) that no record signed by this "
                       f"user vouches for ({why}): they are never loaded, and it has no safetensors weights "
                       f"to resume from instead; if you checked it, `draftsmith trust {output_dir}` accepts "
                       "it, else delete it or set train.resume=never")
    return Verdict(unvouched=why)


def trust_problem(path: str | Path, output_dir: str | Path) -> str | None:
    """Why this run may not resume from `path` (one line), or None (`judge`)."""
    return judge(path, output_dir).problem


def vouched_state(path: str | Path, output_dir: str | Path) -> dict:
    """The state.json of a checkpoint whose pickles are about to be loaded, read once: the sha256 of these
    very bytes listed by this user's signed record of the run in `output_dir`, every file it lists intact,
    and every file in its pickled folders one it lists (DCP and DeepSpeed read whatever their folder holds).
    Anything else is a TrainingError naming the file, and nothing of the checkpoint is unpickled. Called by
    each loader of pickles (training/sharded.py), whatever decided to call it."""
    path = Path(path)
    state_file = path / "state.json"
    never = "its checkpoint's pickles are never loaded"
    try:
        if not stat.S_ISREG(os.stat(state_file).st_mode):
            raise TrainingError(f"{state_file}: not a regular file; {never}")
        raw = state_file.read_bytes()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise TrainingError(f"{state_file}: cannot be read ({why}); {never}") from None
    try:
        written = read_written(checkpoints_root(output_dir))
    except FileFormatError as e:
        raise TrainingError(f"{path}: its pickles are never loaded, {e}") from None
    if written.problem or hashlib.sha256(raw).hexdigest() not in written.listed:
        why = (f"{written.path} vouches for nothing: {written.problem}" if written.problem
               else f"{written.path} does not list its state.json")
        raise TrainingError(f"{path}: its pickles are never loaded, {why}; `draftsmith trust {output_dir}` "
                            "accepts it if you checked it")
    try:
        state = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise TrainingError(f"{state_file}: not valid JSON; {never}") from None
    problem = state_problem(state, state_file)
    if problem:
        raise TrainingError(problem)
    sums = state.get("checksums") or {}
    problems = checksum_problems(path, sums, str(state_file)) if sums else [f"{state_file}: no checksums"]
    problems += [f"{path / rel}: not a file this checkpoint wrote ({state_file} does not list it)"
                 for rel in _files_under(path, PICKLED) if rel not in sums]
    if problems:
        raise TrainingError(f"{problems[0]}; these files are pickles and are only loaded when they are the "
                            "ones this code wrote")
    return state


def _files_under(path: Path, folders: tuple[str, ...]) -> list[str]:
    """Every entry but a real folder (files, links, FIFOs) under `path`/folder, relative to `path`, no link
    followed."""
    found = []
    for name in folders:
        for top, dirs, files in os.walk(path / name):
            found += [Path(top, n).relative_to(path).as_posix() for n in files]
            found += [Path(top, n).relative_to(path).as_posix() for n in dirs if os.path.islink(Path(top, n))]
    return sorted(found)


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
    js = {"python": [version, list(internal), gauss],
          "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
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


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from (`plan_resume`)."""

    path: Path
    pickled: bool  # its module and optimizer come from its engine's pickles (training/sharded.py)


def plan_resume(resume: str, output_dir: str | Path) -> Resume | None:
    """'never' -> None; 'auto' -> the newest complete checkpoint this run may resume from, or None; else that
    path (complete, and one this run may resume from: `judge`). A checkpoint no record signed by this user
    vouches for (a run folder received whole) is resumed from its safetensors and JSON only, with one warning
    saying so."""
    if resume == "never":
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        found = latest_intact(output_dir)
        if ckpts and found is None:
            newest = ckpts[-1]
            why = trust_problem(newest, output_dir) or next(iter(checkpoint_problems(newest)), "damaged")
            raise TrainingError(f"no checkpoint under {checkpoints_root(output_dir)} can be resumed (the "
                                f"newest: {why}); restore one, or set train.resume=never to start over")
        if found is None:
            return None
        if found != ckpts[-1]:
            log.warning("resuming from %s, the newest intact checkpoint (newer ones are damaged or not this "
                        "run's)", found)
        path, verdict = found, judge(found, output_dir)  # intact and allowed: latest_intact checked both
    else:
        path = Path(resume).expanduser()
        verdict = judge(path, output_dir)  # first: nothing of a folder of unknown origin is read
        if verdict.problem:
            raise TrainingError(verdict.problem)
        if not (path / "state.json").is_file():
            raise TrainingError(f"train.resume: {path} is not a complete checkpoint directory")
        problems = checkpoint_problems(path)
        if problems:
            raise TrainingError(f"train.resume: checkpoint {path} is damaged: {problems[0]}")
    if verdict.unvouched:
        log.warning("resuming %s weights-only (its safetensors and JSON state: weights, optimizer, RNG, data "
                    "position; nothing pickled): no record signed by this user vouches for it (%s); if it is "
                    "yours, `draftsmith trust %s` signs it with this user's key", path, verdict.unvouched,
                    output_dir)
    return Resume(path, verdict.pickled)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """The path `plan_resume` resumes from, or None."""
    plan = plan_resume(resume, output_dir)
    return plan.path if plan is not None else None


def trust_run(output_dir: str | Path) -> list[str]:
    """`draftsmith trust RUN`: accept the intact checkpoints of the run in `output_dir` as this user's and
    sign the run's record of exactly those with this user's key (training/trust.py), so they resume in full,
    pickles included. Returns the lines saying what was accepted (each checkpoint and its state.json sha256)
    and what was not (a damaged one, a link out of the folder). A copy elsewhere that the old record listed is
    no longer vouched for: only what is shown is signed."""
    from draftsmith.locks import output_lock

    out = Path(output_dir)
    root = checkpoints_root(out)
    if not list_checkpoints(out):
        raise TrainingError(f"{out}: no checkpoints under {root} to trust (give its train.output_dir)")
    with output_lock(out, "training output"):  # not while a training writes checkpoints there
        return _sign_checkpoints(root, list_checkpoints(out))


def _sign_checkpoints(root: Path, found: list[Path]) -> list[str]:
    states: dict[str, str] = {}
    lines = [f"{root}: accepting, with this user's key {trust.key_path()}:"]
    for path in found:
        if path.is_symlink() or path.resolve().parent != root.resolve():
            lines.append(f"  {path.name}  not accepted: a link to {path.resolve()}, not this run's")
            continue
        sha = sha256_file(path / "state.json")  # the bytes checked are the bytes signed
        problem = next(iter(checkpoint_problems(path)), None)
        if problem is None and sha256_file(path / "state.json") != sha:
            problem = f"{path / 'state.json'} changed while it was checked"
        if problem is not None:
            lines.append(f"  {path.name}  not accepted: damaged ({problem})")
            continue
        fmt = _declared_format(path)
        what = f"holds pickles ({fmt}), loaded on resume" if fmt else "safetensors and JSON"
        states[sha] = path.name
        lines.append(f"  {path.name}  state.json sha256 {sha}  {what}")
    if not states:
        raise TrainingError(f"{root}: none of its {len(found)} checkpoints can be accepted "
                            f"({lines[-1].strip()})")
    plural = "s" if len(states) > 1 else ""
    lines.append(f"signed {write_written(root, states)} ({len(states)} checkpoint{plural})")
    return lines


def read_log(path: str | Path) -> list[dict]:
    """A training log's records (run_files.read_log: a torn last line dropped, any other fault named)."""
    from draftsmith.training.run_files import read_log as read

    return read(path)
