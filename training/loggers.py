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
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _check_ours(self.path)
        # rewrite the file to the checkpointed prefix (drops lines logged after the checkpoint)
        self.path.write_text(initial_text, encoding="utf-8")
        names = [n for n in loggers if n in TRACKERS]
        if not names:
            return
        self.state.setdefault("run_name", f"{Path(output_dir).name}-{uuid_hex(8)}")
        flat = flat_config(config)
        for name in names:
            if not _installed(name):
                log.warning("train.loggers has %r but %s is not installed: skipped", name, _PACKAGE[name])
                continue
            tracker, fresh = self._start(name, Path(output_dir), project or "draftsmith", resume_step)
            if fresh:
                tracker.store_init_configuration(flat)
            self.trackers.append(tracker)

    def _start(self, name: str, out: Path, project: str, resume_step: int | None):
        """One started accelerate tracker, and whether its run is new (its configuration is stored once)."""
        from accelerate import tracking

        run_name = self.state["run_name"]
        if name == "tensorboard":
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

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        self.text += line
        with open(self.path, "a", encoding="utf-8") as f:
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


def uuid_hex(n: int) -> str:
    import uuid

    return uuid.uuid4().hex[:n]
