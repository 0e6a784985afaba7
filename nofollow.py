"""Opening the files draftsmith writes without following a link.

draftsmith runs inside the user's production: retraining from cron on shared storage, evaluations and
exports into folders others can write. A symlink, hard link, FIFO, socket or device planted where draftsmith
puts a lock, a record, a log or a report would make a plain open() write, truncate or read the file it leads
to (or block on a FIFO). Every writer that opens an existing name goes through `open_regular`, which refuses
anything but a regular file in one line naming the path and what it is; `refuse_unless_regular` is the same
look for a writer that replaces the name by a rename (outputs.py's atomic writers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from draftsmith.errors import OutputError


def what_is(st: os.stat_result) -> str:
    """What an lstat result is, in the words a refusal uses."""
    mode = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else f"a file of type {stat.S_IFMT(mode):o}"


def _refusal(path: str | os.PathLike, st: os.stat_result, owned: bool, single: bool) -> str | None:
    """Why the file `st` describes is not one draftsmith may write into: None for a regular file (of ours,
    when `owned`; with no other name, when `single`), else what it is."""
    if not stat.S_ISREG(st.st_mode):
        what = what_is(st)
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                what += f" (to {os.readlink(path)})"
        return what
    if owned and st.st_uid != os.geteuid():
        return f"a file owned by uid {st.st_uid} (draftsmith runs as uid {os.geteuid()})"
    if single and st.st_nlink != 1:
        return f"a file with {st.st_nlink} names (a hard link to another file)"
    return None


def _refuse(path: str | os.PathLike, why: str, what: str) -> OutputError:
    return OutputError(f"{path}: {why}, not a {what} draftsmith writes; refused, nothing written through it "
                       "(remove it if it is yours)")


def refuse_unless_regular(path: str | os.PathLike, what: str = "file", owned: bool = False,
                          single: bool = False) -> None:
    """Raise OutputError (one line: the path and what it is) when `path` exists and is not a regular file —
    a symlink (dangling or not), FIFO, socket, device or folder — nothing opened, followed or read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (why := _refusal(path, st, owned, single)) is not None:
        raise _refuse(path, why, what)


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o666, what: str = "file",
                 owned: bool = False, single: bool = False) -> int:
    """`os.open(path, flags)` for a file draftsmith writes, never through a link: O_NOFOLLOW (a symlink is
    not followed), O_NONBLOCK (a FIFO does not block the open) and O_CLOEXEC are added, and anything that
    is not a regular file is refused in one line (OutputError naming the path and what it is) — looked at
    before the open (a device or FIFO is never opened), and again on the open file (whatever was swapped in
    between). `owned`: the file must belong to this user; `single`: it must have no other name (a hard link
    would let a write land in the file it shares its inode with). Other OSErrors are raised as they are."""
    refuse_unless_regular(path, what, owned, single)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
            refuse_unless_regular(path, what, owned, single)  # swapped in since the look: say what it is now
            raise OutputError(f"{path}: cannot be opened as a {what} ({e.strerror}); refused") from None
        raise
    try:
        if (why := _refusal(path, os.fstat(fd), owned, single)) is not None:
            raise _refuse(path, why, what)
    except BaseException:
        os.close(fd)
        raise
    return fd
