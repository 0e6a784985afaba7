"""This user's key, and the signature it puts on a run's record of its own checkpoints.

A sharded checkpoint holds pickles (DCP's `shards/.metadata`, DeepSpeed's `.pt` partitions:
training/sharded.py), and `checkpoints/.written.json` (training/run_files.py) says which of them this run
wrote. A run folder received whole (a colleague's, a download, a shared-storage folder others can write)
brings that record along, and a record that vouches for itself vouches for nothing: its author wrote the
pickle and the line naming it. So the record carries an HMAC-SHA256 of its content under a key only this user
holds, and only a record that verifies with it vouches for a checkpoint. A folder from elsewhere resumes from
its safetensors and JSON only, until `draftsmith trust RUN` (checkpoint.trust_run) shows what it accepts and
signs it with this key.

The key: 32 random bytes, hex, in `trust.key` under `$DRAFTSMITH_CONFIG_HOME` (a cluster whose nodes share no
home points them all at one folder), else `$XDG_CONFIG_HOME/draftsmith/`, else `~/.config/draftsmith/`. It is
made on the first signature (never by a reader: a user who never signed has no record that verifies) as a
temporary file opened O_CREAT|O_EXCL|O_NOFOLLOW with mode 0600, hard-linked into place, so a concurrent reader
sees no key or the whole key, never half of one. A key file that is a link, not a regular file, readable by
group or others, or owned by another uid is refused in one line: whoever could plant or read it could sign
any record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from draftsmith.errors import ConfigError

ENV = "DRAFTSMITH_CONFIG_HOME"
KEY_FILE = "trust.key"
_KEY_BYTES = 32
_DOMAIN = b"draftsmith checkpoint record v1\n"  # a MAC of this record is never one of any other message


def config_home() -> Path:
    """The user's draftsmith config folder: $DRAFTSMITH_CONFIG_HOME, else $XDG_CONFIG_HOME/draftsmith, else
    ~/.config/draftsmith (XDG: a relative $XDG_CONFIG_HOME is ignored)."""
    own = os.environ.get(ENV)
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "draftsmith"
    return Path.home() / ".config" / "draftsmith"


def key_path() -> Path:
    return config_home() / KEY_FILE


def _refuse(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path}: {why}; draftsmith signs with it only as this user's private regular file "
                       "(mode 0600): delete it to have a new one made (runs signed with it then need "
                       f"`draftsmith trust RUN` again), or set {ENV} to another folder")


def _checked(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "not a regular file")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"owned by uid {st.st_uid}, not this user's ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise _refuse(path, f"open to group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _read(path: Path) -> bytes | None:
    """The key at `path`, or None when there is none (O_NONBLOCK: a FIFO is refused, not waited on)."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _refuse(path, f"cannot be read ({e.strerror or type(e).__name__})") from None
    _checked(path, before)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _refuse(path, f"cannot be opened ({e.strerror or type(e).__name__})") from None
    try:
        st = os.fstat(fd)
        _checked(path, st)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise _refuse(path, "replaced while it was read")
        text = os.read(fd, 4 * _KEY_BYTES)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != _KEY_BYTES:
        raise _refuse(path, f"not a key ({_KEY_BYTES} bytes as hex)")
    return key


def _create(path: Path) -> None:
    """Write a new key to `path` unless another process made one meanwhile (then that one is the key)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{path.parent}: cannot hold draftsmith's signing key "
                          f"({e.strerror or type(e).__name__}); set {ENV} to a folder of this user") from None
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, (secrets.token_hex(_KEY_BYTES) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process made it first: its key is the key
            os.link(tmp, path)
    except OSError as e:
        raise ConfigError(f"{path}: draftsmith's signing key cannot be written "
                          f"({e.strerror or type(e).__name__}); set {ENV} to a folder of this user") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def load_key(create: bool = False) -> bytes | None:
    """This user's key (ConfigError naming the file when it is not one to trust); None when there is none yet
    and `create` is False (a reader: nothing was ever signed here, so nothing verifies)."""
    path = key_path()
    key = _read(path)
    if key is None and create:
        _create(path)
        key = _read(path)
    return key


def key_id(key: bytes) -> str:
    """A short name of a key, stored beside a signature: a record signed with another key is told apart from
    an edited one. One-way: it tells nothing of the key."""
    return hashlib.sha256(b"draftsmith key id\n" + key).hexdigest()[:16]


def _message(content: dict) -> bytes:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _DOMAIN + text.encode("ascii")


def sign(content: dict, key: bytes) -> dict[str, str]:
    """The signature fields of a record whose other fields are `content` (JSON): {"mac", "key_id"}."""
    return {"mac": hmac.new(key, _message(content), hashlib.sha256).hexdigest(), "key_id": key_id(key)}


def signature_problem(content: dict, mac: object, signer: object, key: bytes | None) -> str | None:
    """Why a record with `content`, `mac` and `key_id` is not this user's (a few words), or None when its MAC
    verifies with `key`."""
    if mac is None:
        return "it is not signed (written by hand, or by a draftsmith from before records were signed)"
    if key is None:
        return (f"it is signed with another key than this user's (a run folder from elsewhere; this user has "
                f"none yet at {key_path()})")
    good = isinstance(mac, str) and mac.isascii() and hmac.compare_digest(mac, sign(content, key)["mac"])
    if good:
        return None
    if signer != key_id(key):
        return f"it is signed with another key than this user's {key_path()} (a run folder from elsewhere)"
    return "it was changed after it was signed with this user's key"
