"""Atomic file and directory writes, hashing, and the cache location.

Every file draftsmith writes goes to a temporary name in the same directory first and is renamed into
place, so a killed job leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Root of draftsmith's cache: `$DRAFTSMITH_CACHE`, else `~/.cache/draftsmith`."""
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(Path.home(), ".cache", "draftsmith")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success rename it to `final`.

    The directory appears complete or not at all. With overwrite=True an existing `final` is replaced
    (moved aside first, deleted after the rename) so there is no moment without a complete copy on disk
    except between two renames.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        old = None
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"{final} already exists")
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shared_data_dir() -> Path:
    """The public prompt sets (train/ and eval/): `$DRAFTSMITH_DATA`, else `shared/data` beside the checkout.

    Presets name them as `../shared/data/...`; `data_path` maps that prefix here.
    """
    env = os.environ.get("DRAFTSMITH_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parent  # the package directory is the repository root
    for candidate in (repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared" / "data"


_SHARED_PREFIX = ("..", "shared", "data")


def data_path(path: str | os.PathLike) -> Path:
    """A configured data path, with a leading `../shared/data` read as `shared_data_dir()`.

    Presets name the public prompt sets as `../shared/data/...`; this lets them work from any directory
    and under `$DRAFTSMITH_DATA`. Every other path is taken as given (relative to the working directory).
    """
    p = Path(path).expanduser()
    parts = p.parts
    if parts[: len(_SHARED_PREFIX)] == _SHARED_PREFIX:
        return shared_data_dir().joinpath(*parts[len(_SHARED_PREFIX):])
    return p
