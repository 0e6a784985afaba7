"""A registry of artifact versions per (target, kind), with an atomically switched `current` pointer.

    <root>/<target>/<kind>/
        versions/v0001/          immutable artifact directories (complete or absent: atomic rename)
        versions/v0002/
        data/v0002/              the dataset v0002 was trained on (replayed by later retraining runs)
        current.json             {"version": "v0002", ...}; replaced with os.replace, so a reader sees
                                 the old pointer or the new one, never a torn write
        runs/<timestamp>.json    one record per retraining run
        exports/v0002/           the version's vLLM export, which the fleet serves (serve-checked by vLLM)
        promotions/<time>.json   one record per swap into running servers: the swap, the canary, a rollback
        policy.json              per-domain enable/disable, read by the serving layer
        .lock                    held while a run trains (see locks.py RunLock)

Every file here is the registry's own: a symlink (or FIFO, socket, folder) in the place of current.json,
policy.json, a run record or the lock is refused in one line, never followed, read or written through, and a
version folder that is a symlink is not a version (publish renames real folders in).

A version's manifest carries its lineage (`parent`, the data it was trained on, its metrics, the target
fingerprint). A version is published by renaming a finished artifact directory into versions/ and only
then switching `current`: a run killed at any point leaves `current` on a complete version.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith import net
from draftsmith.artifact import load_manifest, now_iso, update_manifest, verify_weights
from draftsmith.errors import ArtifactError, OutputError, show
from draftsmith.nofollow import refuse_unless_regular
from draftsmith.outputs import atomic_write_json
from draftsmith.reading import read_json

_VERSION = re.compile(r"^v(\d{4,})$")


def _pointer_version(pointer: Path) -> str:
    """The version current.json names, checked: a JSON object whose `version` is a version folder's name
    (`v0001`), never a path to follow (`../../etc`); else one ArtifactError naming the file and the field.
    A current.json that is a symlink (or no regular file) is not read: the registry writes it as a file."""
    try:
        refuse_unless_regular(pointer, "registry pointer")
    except OutputError as e:
        raise ArtifactError(str(e)) from None
    try:
        doc = read_json(pointer)
    except ValueError as e:  # reading's FileFormatError: not UTF-8 or not JSON, the file named
        raise ArtifactError(str(e)) from None
    except (OSError, RecursionError) as e:
        raise ArtifactError(f"{pointer}: cannot be read ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{pointer}: expected a JSON object {{\"version\": \"v0001\", ...}}, got {show(doc)}")
    if "version" not in doc:
        raise ArtifactError(f"{pointer}: version is missing (the version current points at, e.g. v0001)")
    version = doc["version"]
    if not (isinstance(version, str) and _VERSION.fullmatch(version)):
        raise ArtifactError(f"{pointer}: version is {show(version)}: expected a version name such as v0001")
    return version


@dataclass
class Registry:
    root: Path
    target: str
    kind: str

    def __post_init__(self):
        self.root = Path(self.root)
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "versions").mkdir(exist_ok=True)
        (self.base / "runs").mkdir(exist_ok=True)

    @property
    def base(self) -> Path:
        return self.root / self.target / self.kind

    @property
    def staging(self) -> Path:
        """Where candidates are trained; never read as a version."""
        path = self.base / "staging"
        path.mkdir(exist_ok=True)
        return path

    def versions(self) -> list[str]:
        names = [p.name for p in (self.base / "versions").iterdir()  # a link: not a version published here
                 if _VERSION.match(p.name) and p.is_dir() and not p.is_symlink()]
        return sorted(names, key=lambda n: int(_VERSION.match(n).group(1)))

    def path(self, version: str) -> Path:
        return self.base / "versions" / version

    def current(self) -> str | None:
        pointer = self.base / "current.json"
        if not os.path.lexists(pointer):
            return None
        version = _pointer_version(pointer)
        if not self._complete(version):
            raise ArtifactError(f"{pointer}: current points at missing version {version} (no "
                                f"{self.path(version) / 'manifest.json'})")
        return version

    def _complete(self, version: str) -> bool:
        """Whether `version` is a published version folder with its manifest; a symlink in versions/ is
        refused in one line (publish renames folders in: a link there was put by someone else)."""
        folder = self.path(version)
        if folder.is_symlink():
            raise ArtifactError(f"{folder}: a symlink (to {os.readlink(folder)}), not a version this registry "
                                "published; refused")
        return (folder / "manifest.json").is_file()

    def current_path(self) -> Path | None:
        version = self.current()
        return None if version is None else self.path(version)

    def next_version(self) -> str:
        """The version after every name in versions/, whatever it is (a planted link is not renamed over)."""
        taken = [int(m.group(1)) for p in (self.base / "versions").iterdir() if (m := _VERSION.match(p.name))]
        return f"v{max(taken, default=0) + 1:04d}"

    def publish(self, candidate: Path, lineage: dict) -> str:
        """Move a finished artifact directory into versions/ (atomic rename) with its lineage recorded."""
        # refuses a directory that is not a complete artifact, or whose weights differ from their checksums
        verify_weights(candidate, load_manifest(candidate))
        update_manifest(candidate, lineage=lineage, parent=lineage.get("parent"))
        version = self.next_version()
        os.replace(candidate, self.path(version))
        return version

    def set_current(self, version: str, reason: str) -> None:
        if not self._complete(version):
            raise ArtifactError(f"cannot point current at {version}: not a complete version")
        atomic_write_json(self.base / "current.json", {"version": version, "since": now_iso(), "reason": reason})

    def manifest(self, version: str) -> dict:
        return load_manifest(self.path(version))

    def keep_data(self, version: str, data_path: str | Path) -> Path | None:
        """Move the dataset a version was trained on to data/<version>/ (beside versions/, never cleaned)
        and point the version's manifest at it: the next retraining replays it after `staging` is gone,
        and so on after any number of promotions. Returns the new location (None: no such folder)."""
        data_path = Path(data_path)
        if not data_path.is_dir():
            return None
        dest = self.base / "data" / version
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            raise ArtifactError(f"registry {self.base}: {dest} already exists (a version's data is never replaced)")
        os.replace(data_path, dest)
        manifest = self.manifest(version)
        data = {**(manifest.get("data") or {}), "path": str(dest), "trained_from": str(data_path)}
        update_manifest(self.path(version), data=data)
        return dest

    def clean_staging(self) -> None:
        shutil.rmtree(self.base / "staging", ignore_errors=True)

    def write_run_record(self, record: dict) -> Path:
        stamp = record.get("started", now_iso()).replace(":", "").replace("+", "_")
        path = self.base / "runs" / f"{stamp}-{os.getpid()}-{time.time_ns() % 10**9:09d}.json"  # unique per run
        # its config (a /metrics URL and its key), its error (a server's words): outside text, redacted
        atomic_write_json(path, net.redact_all(record))
        return path

    def write_promotion(self, record: dict) -> Path:
        """A promotion's record (retrain/promote.py): promotions/<time>-<pid>-<ns>.json, its URLs' secrets
        redacted; time-ordered names, so the last one is the latest."""
        folder = self.base / "promotions"
        folder.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        path = folder / f"{stamp}-{time.time_ns() % 10**9:09d}-{os.getpid()}.json"
        atomic_write_json(path, net.redact_all(record))
        return path

    def last_promotion(self) -> dict | None:
        """The latest promotion record, read as the registry's own file (never through a link), with
        `record_path` naming that file."""
        folder = self.base / "promotions"
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".json")) if folder.is_dir() else []
        if not names:
            return None
        path = folder / names[-1]
        try:
            refuse_unless_regular(path, "promotion record")
            doc = read_json(path)
        except (OutputError, ValueError, OSError) as e:
            raise ArtifactError(f"{path}: cannot be read ({e})") from None
        if not isinstance(doc, dict):
            raise ArtifactError(f"{path}: expected a JSON object, got {show(doc)}")
        return {**doc, "record_path": str(path)}

    def write_policy(self, policy: dict) -> Path:
        path = self.base / "policy.json"
        atomic_write_json(path, policy)
        return path
