"""A lock so that two retraining runs never train at once; a killed run's lock is detected and broken.

The lock file holds an advisory `flock` for as long as its owner lives. The kernel drops a flock when
its process dies, however it dies (SIGKILL included), so a lock left by a killed run is free at once
and there is no race between two contenders breaking it: exactly one `flock(LOCK_EX | LOCK_NB)` wins.
The file's content (host, pid, start time) is informational: when a new owner finds content from an
owner that never released, it records that it broke a stale lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from draftsmith.errors import DraftsmithError


class LockHeld(DraftsmithError):
    """Another live run holds the lock."""


class RunLock:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None
        self.broke_stale: dict | None = None  # the previous owner's info when it died holding the lock

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = self.owner()
            who = f" (pid {info.get('pid')} on {info.get('host')})" if info else ""
            raise LockHeld(f"another retraining run holds {self.path}{who}") from None
        previous = os.read(fd, 4096)
        if previous.strip():
            try:
                self.broke_stale = json.loads(previous)
            except json.JSONDecodeError:
                self.broke_stale = {"raw": previous.decode(errors="replace")}
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode())
        os.fsync(fd)
        self.fd = fd

    def owner(self) -> dict | None:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else None
        except (OSError, ValueError):  # gone, or not the JSON a run writes (informational only)
            return None

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # an empty file means "released cleanly"
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
