"""The one validating reader for what a training run reads back from its own folder: a checkpoint's
`state.json`, the JSON-lines training log (`log.jsonl`) and `checkpoints/.written.json`, the record of every
checkpoint this run wrote.

Everything is checked here, once, when it is read: the schema, each field's type and range. A file that
fails is refused in one line naming the file and the field (a FileFormatError, or a TrainingError where a
checkpoint cannot be resumed), so the loop behind it trusts what it gets and never meets a raw KeyError,
TypeError or ValueError from a hostile or corrupted file.

`.written.json` is what makes resuming safe: DCP's `shards/.metadata` and DeepSpeed's `.pt` partitions are
pickles (training/sharded.py), and a checkpoint's own `state.json` can record any sha256 its author likes. The
run records the sha256 of each `state.json` it writes in its own output folder, outside the checkpoint, before
the checkpoint gets its name; a checkpoint holding pickles is loaded only when that record names it. And since
a run folder received whole brings its record along, the record is signed with this user's key
(training/trust.py): one that does not verify (another user's, an edited one, one from before records were
signed) vouches for nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.checksums import sha256_file
from draftsmith.errors import FileFormatError, show
from draftsmith.outputs import atomic_write_json
from draftsmith.reading import is_int, read_json
from draftsmith.training import trust

log = logging.getLogger(__name__)

WRITTEN = ".written.json"  # in <output_dir>/checkpoints/ (hidden: the folder lists checkpoints)
_SHA = re.compile(r"^[0-9a-f]{64}$")
_U32 = 2**32


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _ints(v: Any, n: int, hi: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(is_int(x, 0, hi) for x in v)


def _rng_ok(r: Any) -> bool:
    """One rank's python/numpy generator state, as checkpoint.capture_rng writes it (Mersenne Twister: 624
    words and a position, python's with its position as a 625th word)."""
    if not isinstance(r, dict) or not isinstance(r.get("python"), list) or not isinstance(r.get("numpy"), list):
        return False
    py, np_ = r["python"], r["numpy"]
    if len(py) != 3 or not is_int(py[0], 2, 3) or not _ints(py[1], 625, _U32 - 1) or py[1][-1] > 624:
        return False
    if py[2] is not None and not (isinstance(py[2], float) and math.isfinite(py[2])):
        return False
    return (len(np_) == 5 and np_[0] == "MT19937" and _ints(np_[1], 624, _U32 - 1) and is_int(np_[2], 0, 624)
            and np_[3] in (0, 1) and _number(np_[4]) and math.isfinite(np_[4]))


def _scalars(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and (x is None or isinstance(x, str | bool | int | float))
                                       for k, x in v.items())


def _optional_dict(v: Any) -> bool:
    return v is None or isinstance(v, dict)


# field -> (required, check, what a valid value is)
_STATE = {
    "step": (True, lambda v: is_int(v, 0), "an integer >= 0"),
    "micro": (True, lambda v: is_int(v, 0), "an integer >= 0"),
    "world_size": (True, lambda v: is_int(v, 1), "an integer >= 1"),
    "batch_size": (True, lambda v: is_int(v, 1), "an integer >= 1"),
    "nonfinite_total": (True, lambda v: is_int(v, 0), "an integer >= 0"),
    "nonfinite_in_row": (True, lambda v: is_int(v, 0), "an integer >= 0"),
    "tokens_total": (True, lambda v: is_int(v, 0), "an integer >= 0"),
    "last_eval": (True, _scalars, "an object of metric -> number"),
    "last_train": (True, _scalars, "an object of metric -> number"),
    "rng": (True, lambda v: isinstance(v, list) and 0 < len(v) <= 65536 and all(_rng_ok(r) for r in v),
            "a list of per-rank python/numpy generator states"),
    "micro_per_epoch": (False, lambda v: is_int(v, 1), "an integer >= 1"),
    "sampler_seed": (False, lambda v: is_int(v, -(2**63), 2**64), "an integer"),
    "empty_total": (False, lambda v: is_int(v, 0), "an integer >= 0"),
    "updates_total": (False, lambda v: is_int(v, 0), "an integer >= 0"),
    "length_group": (False, lambda v: is_int(v, 1), "an integer >= 1"),
    "train_seconds": (False, lambda v: v is None or (_number(v) and math.isfinite(v) and v >= 0),
                      "a number of seconds >= 0 or null"),
    "data": (False, lambda v: v is None or (isinstance(v, dict) and set(v) == {"path", "rows"} and is_int(v["rows"], 0)
                                            and (v["path"] is None or isinstance(v["path"], str))),
             "null or {path, rows}"),
    "config": (False, _optional_dict, "an object"),
    "job_config": (False, _optional_dict, "an object"),
    "trackers": (False, lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
                 "an object of tracker -> run name or id"),
    "checksums": (False, lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                               and _SHA.match(x) for k, x in v.items()),
                  "an object of file -> sha256"),
    "format": (False, lambda v: v in ("sharded", "deepspeed"), "'sharded' or 'deepspeed'"),
    "metadata_sha256": (False, lambda v: isinstance(v, str) and bool(_SHA.match(v)), "a sha256"),
}
STATE_FIELDS = tuple(k for k, (required, _, _) in _STATE.items() if required)


def state_problem(state: Any, where: str | os.PathLike) -> str | None:
    """Why a parsed state.json is not one the loop can resume from (one line naming `where` and the field), or
    None. Fields of a newer draftsmith are ignored."""
    if not isinstance(state, dict):
        return f"{where}: not a JSON object"
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"{where}: missing field '{missing[0]}'{more}"
    for key, (_, check, want) in _STATE.items():
        if key in state and not check(state[key]):
            return f"{where}: field '{key}' must be {want}, got {show(state[key])}"
    return None


def read_state(path: str | os.PathLike) -> dict:
    """A checkpoint's state.json, validated (`state_problem`); FileFormatError naming the file and the field."""
    state = _read(path)
    problem = state_problem(state, path)
    if problem:
        raise FileFormatError(problem)
    return state


def _read(path: str | os.PathLike) -> Any:
    """Parse a JSON file of the run folder: an unreadable one (a folder, a dangling link, too deep a nesting)
    is one line naming it."""
    try:
        return read_json(path)
    except FileFormatError as e:  # not UTF-8, not JSON
        raise FileFormatError(f"{path}: unreadable: {str(e).removeprefix(f'{path}: ')}") from None
    except OSError as e:
        raise FileFormatError(f"{path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None
    except RecursionError:
        raise FileFormatError(f"{path}: not valid JSON (nested too deep)") from None


# ---- the training log ------------------------------------------------------------------------------

def log_records(text: str, where: str | os.PathLike, torn_tail: bool = True) -> list[dict]:
    """The records of a training log's text: one JSON object per line, each with a string `type` and an
    integer `step` >= 0. A last line without its newline is what a kill mid-write leaves: dropped when
    `torn_tail`. Anything else is a FileFormatError naming `where`, the line and the field."""
    lines = text.split("\n")
    if torn_tail and lines and lines[-1]:
        lines = lines[:-1]  # a write cut short: the record was never whole
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
            raise FileFormatError(f"{where}: line {n} is not JSON ({msg})") from None
        if not isinstance(rec, dict):
            raise FileFormatError(f"{where}: line {n} is not a JSON object")
        if not isinstance(rec.get("type"), str):
            raise FileFormatError(f"{where}: line {n}: field 'type' must be a string, got "
                                  f"{show(rec.get('type'))}")
        if not is_int(rec.get("step"), 0):
            raise FileFormatError(f"{where}: line {n}: field 'step' must be an integer >= 0, got "
                                  f"{show(rec.get('step'))}")
        out.append(rec)
    return out


def read_log_text(path: str | os.PathLike) -> str:
    """A training log's text, UTF-8; absent is empty. Unreadable (a folder, not UTF-8) is one line naming it."""
    path = Path(path)
    if not os.path.lexists(path):
        return ""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise FileFormatError(f"{path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None


def read_log(path: str | os.PathLike) -> list[dict]:
    """A training log's records (`log_records`): a torn last line is dropped, any other fault named."""
    return log_records(read_log_text(path), path)


# ---- the record of the checkpoints this run wrote -------------------------------------------------------

@dataclass(frozen=True)
class Written:
    """A run's `.written.json` as read: the checkpoints it lists and, when it does not verify with this user's
    key, why (then it vouches for none of them)."""

    path: Path
    listed: dict[str, str]  # sha256 of a state.json -> the checkpoint name it was written as
    problem: str | None = None

    @property
    def vouched(self) -> dict[str, str]:
        """What this user's signature vouches for: every listed checkpoint, or none."""
        return {} if self.problem else self.listed


def written_path(checkpoints_root: str | os.PathLike) -> Path:
    return Path(checkpoints_root) / WRITTEN


def read_written(checkpoints_root: str | os.PathLike) -> Written:
    """The record of the checkpoints a run wrote (none listed when it wrote none yet), checked against this
    user's key (`Written.problem`). A record that is not in its schema is one line naming it
    (FileFormatError); a key file that is not this user's private file, one line naming that (ConfigError)."""
    path = written_path(checkpoints_root)
    if not os.path.lexists(path):
        return Written(path, {})
    data = _read(path)
    states = data.get("states") if isinstance(data, dict) else None
    if not isinstance(states, dict) or not all(isinstance(k, str) and _SHA.match(k) and isinstance(v, str)
                                               for k, v in states.items()):
        raise FileFormatError(f"{path}: field 'states' must be an object of state.json sha256 -> checkpoint "
                              "name")
    why = trust.signature_problem({"states": states}, data.get("mac"), data.get("key_id"), trust.load_key())
    return Written(path, states, why)


def record_written(checkpoints_root: str | os.PathLike, state_json: str | os.PathLike, name: str) -> None:
    """Record that this run wrote the checkpoint whose state.json is `state_json` (called before the checkpoint
    is renamed to `name`, so a checkpoint under its name is always on record), signed with this user's key.
    A record that is unreadable or not this user's is started over: signing its lines would vouch for what
    another wrote."""
    try:
        written = read_written(checkpoints_root)
        states = dict(written.vouched)
        if written.problem and written.listed:
            log.warning("%s vouches for nothing (%s); starting it over with this run's own checkpoints only",
                        written.path, written.problem)
    except FileFormatError as e:
        log.warning("%s; starting it over", e)
        states = {}
    states[sha256_file(state_json)] = name
    write_written(checkpoints_root, states)


def write_written(checkpoints_root: str | os.PathLike, states: dict[str, str]) -> Path:
    """Write the record listing exactly `states`, signed with this user's key (made on its first use)."""
    key = trust.load_key(create=True)
    content = {"states": states}
    path = written_path(checkpoints_root)
    atomic_write_json(path, {**content, **trust.sign(content, key)})
    return path
