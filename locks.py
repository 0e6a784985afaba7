"""Exclusive writers, by an advisory `flock` that the kernel drops when its process dies however it dies
(SIGKILL included), so a killed holder never blocks the next one and exactly one contender wins.

- `output_lock`: one writer per output folder. A second process writing the same training output,
  dataset, export, artifact or evaluation folder is refused in one line while the first runs, whatever
  spelling of the folder it was given (a symlink, `..`, another case): the lock is `.draftsmith.lock`
  inside the folder it guards, plus `.<name>.lock` beside the folder's resolved path (the one lock of a
  folder that does not exist yet, or is replaced whole by `outputs.atomic_dir`). Held for the whole write
  and removed when the writer finishes (a lock file a killed writer left is taken over, then removed). A
  process that already holds a folder's lock may take it again (a dataset run saving into its own folder).
- `RunLock`: one retraining run per registry. Its file stays; it holds the owner's host, pid and start
  time (informational), emptied on a clean release, so a new owner that finds content knows it broke
  the lock of a run that died holding it.

A lock file is opened without following a link (`nofollow.open_regular`): a symlink, hard link, FIFO, socket,
device or folder in its place, a file of another user or one larger than any note, is not a lock draftsmith
made. It is refused in one line naming it (OutputError), never written into, truncated or read, so a link
planted on shared storage cannot make a run overwrite or copy the file it leads to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from draftsmith.errors import DraftsmithError, OutputError
from draftsmith.nofollow import open_regular


class OutputBusy(OutputError):
    """Another live process is writing the same output folder."""


class LockHeld(DraftsmithError):
    """Another live retraining run holds the registry's lock."""


MAX_NOTE = 4096  # a note is a pid or a one-line JSON object: a larger file there is not a lock of ours


def _open_lock(path: Path) -> int:
    """Open the lock file `path` (created if absent) for reading and writing, only when it is a lock
    draftsmith made: a regular file of this user with one name and at most a note's bytes; else OutputError,
    one line."""
    fd = open_regular(path, os.O_CREAT | os.O_RDWR, 0o644, what="lock file", owned=True, single=True)
    if (size := os.fstat(fd).st_size) > MAX_NOTE:
        os.close(fd)
        raise OutputError(f"{path}: a file of {size} bytes, not a lock file draftsmith writes (a note is "
                          f"under {MAX_NOTE}); refused, nothing written into it (remove it if it is yours)")
    return fd


def _try_flock(path: Path) -> tuple[int, bytes | None]:
    """Open the lock file `path` (`_open_lock`) and take its exclusive flock without waiting. Returns the open
    fd holding the lock and None, or -1 and what the file holds (the holder's note) when another
    open file holds it."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        note = os.pread(fd, MAX_NOTE, 0)
        os.close(fd)
        return -1, note
    except BaseException:
        os.close(fd)
        raise
    return fd, None


def _write_note(fd: int, note: str) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, note.encode())


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


_HELD: dict[tuple[int, int], int] = {}  # lock file (device, inode) -> how many times this process holds it
_GUARD = threading.Lock()

INSIDE = ".draftsmith.lock"  # the lock inside the folder it guards


def _resolved(folder: str | os.PathLike) -> Path:
    """The folder's one spelling: `~` expanded, symlinks and `..` resolved (as far as the path exists)."""
    return Path(folder).expanduser().resolve()


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock beside `folder` (in its parent), named after its resolved path: the lock of a folder that is
    replaced whole (outputs.atomic_dir renames a new copy onto it) or that does not exist yet."""
    folder = _resolved(folder)
    return folder.parent / f".{folder.name}.lock"


def _inode(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of `path` itself (a link is not followed to the file it names)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, what: str = "output", enabled: bool = True,
                inside: bool = True) -> Iterator[None]:
    """Hold `folder`'s writer lock for the block, or raise OutputBusy (nothing touched) when another
    process holds it. `enabled=False` (a non-main rank) holds nothing.

    Every spelling of a folder gets the same lock: a symlink, `..`, another case on a case-insensitive file
    system. The lock is `.draftsmith.lock` INSIDE an existing folder (it is the folder's own file, whatever
    path reached it, and needs no write access to the parent), and also the lock beside it (`lock_path`)
    where the parent is writable, which is what a writer of a folder that does not exist yet holds. With
    `inside=False` (a folder that is replaced whole, so a lock inside would be replaced with it) only the one
    beside it."""
    if not enabled:
        yield
        return
    resolved = _resolved(folder)
    with contextlib.ExitStack() as stack:
        if inside and resolved.is_dir():
            stack.enter_context(_holding(resolved / INSIDE, folder, what))
            with contextlib.suppress(PermissionError, _ReadOnly):  # a read-only parent: the lock inside holds
                stack.enter_context(_holding(lock_path(resolved), folder, what))
        else:
            _make_parent(resolved, folder)
            stack.enter_context(_holding(lock_path(resolved), folder, what))
        yield


class _ReadOnly(OSError):
    """The lock file cannot be created where it would go (a read-only file system)."""


def _make_parent(resolved: Path, folder) -> None:
    try:
        resolved.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [resolved.parent, *resolved.parent.parents] if p.exists() and not p.is_dir()),
                       resolved.parent)
        raise OutputError(f"{folder}: cannot be written, {blocker} is a file, not a folder") from None
    except PermissionError:
        raise OutputError(f"{folder}: cannot be written, no permission to create it in {resolved.parent}") from None


@contextlib.contextmanager
def _holding(path: Path, folder, what: str) -> Iterator[None]:
    """Hold the flock of the lock file `path`, or take it again when this process holds it already."""
    with _GUARD:
        key = _inode(path)
        reentered = key is not None and key in _HELD
        if reentered:
            _HELD[key] += 1
    if reentered:
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    fd = _acquire(path, folder, what)
    key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
    with _GUARD:
        _HELD[key] = 1
    try:
        yield
    finally:
        with _GUARD:
            _HELD.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            if _inode(path) == key:
                os.unlink(path)  # still holding the lock: a newcomer that opened this file re-checks and retries
        _unlock(fd)


def _acquire(path: Path, folder, what: str) -> int:
    for _ in range(100):
        try:
            fd, note = _try_flock(path)
        except OSError as e:
            if e.errno == errno.EROFS:
                raise _ReadOnly(e.errno, e.strerror, str(path)) from None
            raise
        if fd < 0:
            owner = note.decode(errors="replace").strip()
            raise OutputBusy(f"{folder}: another process{f' (pid {owner})' if owner.isdigit() else ''} is writing "
                             f"this {what} now; wait for it to finish or choose another folder")
        st = os.fstat(fd)
        same = _inode(path) == (st.st_dev, st.st_ino)
        if same:  # not a file its previous holder unlinked while we waited for it
            _write_note(fd, str(os.getpid()))
            return fd
        _unlock(fd)
    raise OutputBusy(f"{folder}: its lock {path} keeps changing hands; retry")


class RunLock:
    """The registry's retraining lock: `with RunLock(base / ".lock") as lock:`; `lock.broke_stale` holds
    the previous owner's note when that owner died holding it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None
        self.broke_stale: dict | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, note = _try_flock(self.path)
        if fd < 0:
            info = _read_note(note)
            who = f" (pid {info.get('pid')} on {info.get('host')})" if info else ""
            raise LockHeld(f"another retraining run holds {self.path}{who}")
        self.broke_stale = _stale_note(os.pread(fd, MAX_NOTE, 0))
        _write_note(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # an empty file means "released cleanly"
        _unlock(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_note(note: bytes) -> dict | None:
    """A RunLock file's owner note: the JSON object a run writes ({"host": str, "pid": int, "started":
    float}), exactly those fields; None for anything else (empty: released cleanly)."""
    with contextlib.suppress(ValueError):
        info = json.loads(note)
        if (isinstance(info, dict) and set(info) == {"host", "pid", "started"}
                and isinstance(info["host"], str) and len(info["host"]) <= 255
                and type(info["pid"]) is int and info["pid"] >= 1 and type(info["started"]) in (int, float)):
            return info
    return None


def _stale_note(note: bytes) -> dict | None:
    """What the run record keeps of a lock a run died holding: its note when it is a run's, else only that the
    file held something else and how much (a torn note; never its bytes, which the record would copy)."""
    if not note.strip():
        return None
    return _read_note(note) or {"unreadable_note_bytes": len(note)}
