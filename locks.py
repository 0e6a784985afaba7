"""One writer per output folder: a second process writing the same training output, dataset, export,
artifact or evaluation folder is refused in one line while the first runs.

The lock is an advisory `flock` on `.<name>.lock` beside the folder, held for the whole write. The kernel
drops it when its process dies however it dies, so a killed writer never blocks the next one; the file is
removed when the writer finishes (a lock file a killed writer left is taken over, then removed). A process
that already holds a folder's lock may take it again (a dataset run saving into its own folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from draftsmith.errors import OutputError


class OutputBusy(OutputError):
    """Another live process is writing the same output folder."""


_HELD: dict[str, int] = {}  # lock file -> how many times this process holds it
_GUARD = threading.Lock()


def lock_path(folder: str | os.PathLike) -> Path:
    folder = Path(folder).expanduser().absolute()
    return folder.parent / f".{folder.name}.lock"


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, what: str = "output", enabled: bool = True) -> Iterator[None]:
    """Hold `folder`'s writer lock for the block, or raise OutputBusy (nothing touched) when another
    process holds it. `enabled=False` (a non-main rank) holds nothing."""
    if not enabled:
        yield
        return
    path = lock_path(folder)
    key = str(path)
    with _GUARD:
        if _HELD.get(key):
            _HELD[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), path.parent)
        raise OutputError(f"{folder}: cannot be written, {blocker} is a file, not a folder") from None
    fd = _acquire(path, folder, what)
    with _GUARD:
        _HELD[key] = 1
    try:
        yield
    finally:
        with _GUARD:
            _HELD.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # still holding the lock: a newcomer that opened this file re-checks and retries
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _acquire(path: Path, folder, what: str) -> int:
    for _ in range(100):
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip()
            os.close(fd)
            raise OutputBusy(f"{folder}: another process{f' (pid {owner})' if owner.isdigit() else ''} is writing "
                             f"this {what} now; wait for it to finish or choose another folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file its previous holder unlinked while we waited for it
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return fd
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    raise OutputBusy(f"{folder}: its lock {path} keeps changing hands; retry")
