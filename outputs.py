"""What draftsmith writes: files written atomically, and output folders replaced only when they are ours.

Every file draftsmith writes goes to a temporary name in the same directory first and is renamed into
place, so a killed job leaves either the old file or the new one, never half of one. A user-facing output
folder (artifact, export, dataset) replaces an existing one only if that one is empty or a draftsmith output
of the same kind (`check_replaceable`), and only after the new one is complete and verified (`atomic_dir`).
Files get the mode the umask gives an ordinary open(), so a serving process of the group can read them. A
write that fails for lack of space is one line naming what was being written (`raise_if_full`).

Nothing is written through a link (draftsmith runs from cron on shared storage, where another user may plant
one): every file draftsmith writes is created anew (O_EXCL, O_NOFOLLOW) or opened by
`nofollow.open_regular`, and a symlink, hard link, FIFO, socket, device or folder where a file of ours goes
is refused in one line naming the path and what it is: never followed, truncated or read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.nofollow import open_regular, refuse_unless_regular
from draftsmith.reading import read_json


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in folder `path` durable (best effort: a folder that cannot be opened is
    skipped)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # a FIFO put in a folder's place is not waited on
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _as_umask_allows(path: str | os.PathLike, directory: bool = False) -> None:
    """mkstemp / mkdtemp create 0600 / 0700: give the file the mode an ordinary open() / mkdir() would
    (0666 / 0777 less the umask), so a serving process of the group can read what is written for it."""
    with contextlib.suppress(OSError):
        os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def _make_parent(path: Path) -> None:
    """Create the folder `path` goes in; a file where a folder must be is one line naming it."""
    from draftsmith.errors import OutputError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), path.parent)
        raise OutputError(f"{path}: cannot be written, {blocker} is a file, not a folder") from None


@contextlib.contextmanager
def open_output(path: str | os.PathLike, append: bool = False, encoding: str = "utf-8") -> Iterator[Any]:
    """A text file draftsmith streams into (a server's log, a training log), never through a link: without
    `append` a regular file of that name is replaced by a new one (created O_EXCL, so a link planted in
    between is refused); with `append` it is extended. A symlink, hard link (a file of ours has one name),
    FIFO, socket or folder there is one OutputError line."""
    path = Path(path)
    _make_parent(path)
    if append:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, what="output file", single=True)
    else:
        refuse_unless_regular(path, "output file", single=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="output file")
        except FileExistsError:
            refuse_unless_regular(path, "output file")
            raise
    with os.fdopen(fd, "w", encoding=encoding) as f:
        yield f


def save_figure(fig, path: str | os.PathLike, **kwargs) -> None:
    """A matplotlib figure written as `atomic_write_bytes` writes (savefig opens its path through links)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    atomic_write_bytes(path, buf.getvalue())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a new temporary file renamed into place. The temporary file is created
    O_CREAT|O_EXCL|O_NOFOLLOW (mkstemp's flags), and a `path` that is a symlink (or FIFO, socket, device,
    folder) is refused in one line: the rename would replace the link itself, but a link there is not ours."""
    path = Path(path)
    _make_parent(path)
    refuse_unless_regular(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        _as_umask_allows(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise_if_full(e, path)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


def json_default(obj: Any) -> Any:
    """What json.dumps writes for the values draftsmith's records hold beyond JSON's own: paths, arrays, sets."""
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


# ---- output folders: replaced only when they are ours ------------------------------------------------

# The file that marks a folder as a draftsmith output, and the fields that file must hold. A user's own
# folder with a file of the same name but other content is not taken for ours.
_MARKERS = (
    ("manifest.json", "artifact", ("kind", "format_version", "target")),
    ("draftsmith.json", "export", ("format", "stack", "target")),
    ("provenance.json", "dataset", ("target", "counts")),
    ("state.json", "checkpoint", ("step", "rng")),
    ("report.json", "report", ("domains", "settings")),
)


def output_kind(path: str | os.PathLike) -> str | None:
    """What draftsmith output a folder is (artifact, export, dataset, checkpoint, report), from its marker
    file; None for anything else (a user's folder, a file, an unreadable marker)."""
    path = Path(path)
    if not path.is_dir():
        return None
    for name, kind, fields in _MARKERS:
        try:
            data = read_json(path / name)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and all(f in data for f in fields):
            return kind
    return None


def check_replaceable(final: str | os.PathLike, kind: str, overwrite: bool = False,
                      hint: str = "choose another path, or pass --overwrite to replace it") -> None:
    """Refuse (one line, nothing touched) to replace `final` unless it is absent, an empty folder, or a
    draftsmith `kind` output (its marker file says so); `overwrite=True` is the user saying they mean it."""
    from draftsmith.errors import OutputError

    final = Path(final)
    if overwrite or not os.path.lexists(final):
        return
    if final.is_symlink() or not final.is_dir():
        what = "a symlink" if final.is_symlink() else "a file"
    else:
        from draftsmith.locks import INSIDE

        names = sorted(p.name for p in final.iterdir() if p.name != INSIDE)  # a writer's lock is not content
        if not names:
            return
        found = output_kind(final)
        if found == kind:
            return
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = f"a draftsmith {found}, not {_a(kind)}" if found else f"not a draftsmith {kind} (it holds {shown})"
    raise OutputError(f"{final} already exists and is {what}; draftsmith replaces only an empty folder or "
                      f"{_a(kind)} it wrote: {hint}")


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _sibling_pid(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):]
    head = rest.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def clean_stale(final: str | os.PathLike) -> list[Path]:
    """Tidy what an interrupted `atomic_dir` left beside `final`: temporary folders of processes that are
    gone are deleted, and a previous copy moved aside just before a crash (`final` itself missing) is put
    back. Folders of a live process, and every other name, are left alone."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    touched = []
    tmp_prefix, old_prefix = f".{final.name}.tmp-", f".{final.name}.old-"
    for p in sorted(final.parent.iterdir()):
        for prefix in (tmp_prefix, old_prefix):
            if not p.name.startswith(prefix) or p.is_symlink():  # a link is not a folder `atomic_dir` left
                continue
            pid = _sibling_pid(p.name, prefix)
            if pid is None or _pid_alive(pid):
                continue
            if prefix == old_prefix and not os.path.lexists(final):
                os.replace(p, final)  # the crash came between the two renames: this was the complete copy
            else:
                _remove(p)
            touched.append(p)
    return touched


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = False, kind: str | None = None,
               verify=None) -> Iterator[Path]:
    """`_atomic_dir` while holding `final`'s writer lock (locks.py): a second process writing the same folder
    is refused in one line instead of racing the first one's swap."""
    from draftsmith.locks import output_lock

    if overwrite:  # without --overwrite a link is refused as any existing `final` is
        _refuse_link_out(final)
    try:
        # the lock beside `final`: a lock inside it would be renamed away with the copy it replaces
        with output_lock(final, kind or "folder", inside=False), _atomic_dir(final, overwrite, kind, verify) as tmp:
            yield tmp
    except Exception as e:  # OSError, or a writer's own error type carrying one (safetensors: "os error 28")
        raise_if_full(e, final)
        raise


def _refuse_link_out(final: str | os.PathLike) -> None:
    """A symlink at an output folder's path is not replaced, even with --overwrite: it is not ours."""
    from draftsmith.errors import OutputError

    if os.path.islink(final):
        raise OutputError(f"{final} already exists and is a symlink (to {os.readlink(final)}); draftsmith "
                          "does not replace a link, even with --overwrite: remove it or choose another path")


FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, over quota, over the file size limit


def raise_if_full(e: BaseException, path: str | os.PathLike) -> None:
    """A write that failed for lack of space is one line naming what was being written (a raw OSError from
    write() names no file); the temporary copy is already gone and the previous `path` is untouched."""
    import re

    from draftsmith.errors import OutputError

    code = e.errno if isinstance(e, OSError) else None
    if code is None and (m := re.search(r"os error (\d+)", str(e))):
        code = int(m[1])
    if code in FULL:
        raise OutputError(f"{path}: cannot be written, {os.strerror(code)} (nothing replaced; free space and "
                          "rerun)") from None


@contextlib.contextmanager
def _atomic_dir(final: str | os.PathLike, overwrite: bool = False, kind: str | None = None,
                verify=None) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success (and after `verify(tmp)`, if given, returns
    without raising) rename it to `final`.

    The directory appears complete or not at all, and a write or a verification that fails leaves the
    previous `final` exactly as it was. With `kind` (a user-facing output: "artifact", "export", "dataset")
    an existing `final` is replaced only if `check_replaceable` allows it (empty, or a draftsmith output of
    that kind, or overwrite=True), checked before any work and again just before the swap. Without `kind`
    (draftsmith's own folders: checkpoints, caches) overwrite=True replaces and overwrite=False refuses.
    The replaced copy is moved aside first and deleted after the rename, so a complete copy is on disk at
    every moment except between two renames (and `clean_stale` puts it back after a crash there).
    """
    final = Path(final)
    _make_parent(final)
    clean_stale(final)

    def allowed() -> None:
        if overwrite:
            _refuse_link_out(final)
        if kind is not None:
            check_replaceable(final, kind, overwrite)
        elif os.path.lexists(final) and not overwrite:
            raise FileExistsError(f"{final} already exists")

    allowed()
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-{os.getpid()}-"))
    _as_umask_allows(tmp, directory=True)
    try:
        yield tmp
        if verify is not None:
            verify(tmp)
        for sub, dirs, files in os.walk(tmp):  # safetensors writes 0600 whatever the umask
            for name, directory in [(d, True) for d in dirs] + [(f, False) for f in files]:
                if not os.path.islink(p := os.path.join(sub, name)):  # chmod follows a link out of the folder
                    _as_umask_allows(p, directory=directory)
        allowed()
        old = None
        if os.path.lexists(final):
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            _remove(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            _remove(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
