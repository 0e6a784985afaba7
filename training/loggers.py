"""Training logs: JSONL always; experiment trackers through accelerate's tracker integration when asked. Rank 0 only.

Every record is one JSON object per line in `<output_dir>/log.jsonl`:
`{"type": "train"|"eval"|"summary", "step": N, ...metrics}`. The JSONL text is also kept in memory so a
checkpoint can carry "the log so far" and a resumed run rewrites the file to exactly that prefix.

`train.loggers` may add any of TRACKERS (accelerate.tracking's TensorBoardTracker, WandBTracker, MLflowTracker,
TrackioTracker), each where its package is installed (a named tracker that is not installed is skipped with a
warning). The run's identity — its name and each tracker's run id — lives in `state`, which every checkpoint
keeps: a resumed job continues the same wandb run (its id, `resume="allow"`), the same MLflow run (its run_id)
and the same trackio run (its name), and TensorBoard's writer purges what the killed job logged after the
checkpoint it resumes from. wandb and MLflow keep the points logged after that checkpoint; the resumed job logs
those steps again (the JSONL log is the exact record).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.outputs import atomic_write_text, open_output

log = logging.getLogger(__name__)

# where each tracker reads its settings, for the line that says one could not start
_HINT = {"mlflow": " (MLFLOW_TRACKING_URI)", "wandb": " (WANDB_API_KEY, WANDB_MODE=offline)",
         "trackio": " (the trackio project)", "tensorboard": " (train.output_dir)"}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _check_ours(path: Path) -> None:
    """A log.jsonl that is not a draftsmith training log (its first line is not a record of ours, or it is a
    folder or a symlink) belongs to the user: it is not overwritten."""
    from draftsmith.errors import OutputError

    _check_kind(path, "file")
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


def _check_kind(path: Path, kind: str) -> None:
    """`path`, where the run writes a `kind` ("file" or "folder") of its own, is absent or that kind: anything
    else (a folder where the log goes, a file where TensorBoard's folder goes, a symlink) is the user's and is
    named in one line instead of failing inside a writer."""
    from draftsmith.errors import OutputError

    if not os.path.lexists(path):
        return
    found = ("a symlink" if path.is_symlink() else "a folder" if path.is_dir() else "a file" if path.is_file()
        else "not a regular file")
    if found != f"a {kind}":
        raise OutputError(f"{path}: is {found}, where the run writes its {path.name} {kind}: set train.output_dir "
                          "to another folder, or move it")


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as one level of dotted keys with the simple values every tracker stores (lists and
    None as their JSON text)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = _clean(v)
        else:
            out[key] = json.dumps(v, default=str)
    return out


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(_PACKAGE[name]) is not None


class RunLogger:
    """The run's logs. `state` (run name and tracker run ids) goes into every checkpoint; a resumed job passes
    it back with `resume_step`, the step of the checkpoint it resumes from."""

    def __init__(self, output_dir: Path, loggers: list[str], config: dict, active: bool,
                 project: str | None = None, initial_text: str = "", state: dict | None = None,
                 resume_step: int | None = None) -> None:
        self.active = active
        self.path = Path(output_dir) / "log.jsonl"
        self.text = initial_text
        self.trackers: list = []
        self.state: dict[str, Any] = dict(state or {})
        self._env: list[str] = []  # environment variables this logger set (unset again by close)
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _check_ours(self.path)
        # rewrite the file to the checkpointed prefix (drops lines logged after the checkpoint)
        atomic_write_text(self.path, initial_text)
        names = [n for n in loggers if n in TRACKERS]
        if not names:
            return
        self.state.setdefault("run_name", f"{Path(output_dir).name}-{uuid_hex(8)}")
        flat = flat_config(config)
        for name in names:
            if not _installed(name):
                log.warning("train.loggers has %r but %s is not installed: skipped", name, _PACKAGE[name])
                continue
            try:
                tracker, fresh = self._start(name, Path(output_dir), project or "draftsmith", resume_step)
            except DraftsmithError:
                raise
            except Exception as e:  # a tracker's own error (a store it cannot reach, a bad key): one line
                self.close()
                first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
                raise ConfigError(f"train.loggers: {name} could not start ({type(e).__name__}: {first}); fix its "
                                  f"settings{_HINT.get(name, '')} or drop {name} from train.loggers") from None
            if fresh:
                tracker.store_init_configuration(flat)
            self.trackers.append(tracker)

    def _start(self, name: str, out: Path, project: str, resume_step: int | None):
        """One started accelerate tracker, and whether its run is new (its configuration is stored once)."""
        from accelerate import tracking

        run_name = self.state["run_name"]
        if name == "tensorboard":
            _check_kind(out / "tensorboard", "folder")
            fresh = "tensorboard" not in self.state
            kw = {"purge_step": resume_step + 1} if resume_step is not None and not fresh else {}
            tracker = tracking.TensorBoardTracker("tensorboard", out, **kw)  # writes out/tensorboard
            tracker.start()
            self.state["tensorboard"] = str(out / "tensorboard")
        elif name == "wandb":
            fresh = "wandb_id" not in self.state
            run_id = self.state.setdefault("wandb_id", uuid_hex(12))
            tracker = tracking.WandBTracker(project, id=run_id, name=run_name, resume="allow", dir=str(out))
            tracker.start()
        elif name == "mlflow":
            self._mlflow_default(out)
            fresh = "mlflow_run_id" not in self.state
            tracker = tracking.MLflowTracker(experiment_name=project, run_id=self.state.get("mlflow_run_id"),
                                             run_name=run_name)
            tracker.start()
            self.state["mlflow_run_id"] = tracker.active_run.info.run_id
        else:  # trackio: a run is its name within the project
            fresh = "trackio" not in self.state
            tracker = tracking.TrackioTracker(project, name=run_name, resume="allow")
            tracker.start()
            self.state["trackio"] = run_name
        return tracker, fresh

    def _mlflow_default(self, out: Path) -> None:
        """Without MLFLOW_TRACKING_URI, the run tracks into `<output_dir>/mlruns`, a file store, as TensorBoard
        and wandb keep their files in the output folder: the run's record travels with the run. mlflow's own
        default (`sqlite:///mlflow.db` in the working directory) needs SQLAlchemy, which mlflow-skinny lacks,
        and would mix every run started from one directory. mlflow keeps the file store behind
        MLFLOW_ALLOW_FILE_STORE: set for this run only, as the tracking URI is."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return
        defaults = {"MLFLOW_TRACKING_URI": (out / "mlruns").absolute().as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
        for key, value in defaults.items():
            if key not in os.environ:
                os.environ[key] = value
                self._env.append(key)
        log.info("mlflow: MLFLOW_TRACKING_URI is not set: tracking into %s", out / "mlruns")

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        self.text += line
        with open_output(self.path, append=True) as f:  # a link put there since the run began is refused
            f.write(line)
        if not self.trackers:
            return
        step = int(record.get("step", 0))
        prefix = record.get("type", "train")
        scalars = {f"{prefix}/{k}": v for k, v in record.items()
                   if k not in ("type", "step") and isinstance(v, int | float) and not isinstance(v, bool)
                   and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(scalars, step=step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        for key in self._env:
            os.environ.pop(key, None)
        self._env = []


def uuid_hex(n: int) -> str:
    import uuid

    return uuid.uuid4().hex[:n]
