"""Where draftsmith's files are found: the cache root (`$DRAFTSMITH_CACHE`), the public prompt sets shipped
in the package (`$DRAFTSMITH_DATA`, else prompts/), a configured data path whose leading `prompts/` means
those, and a data file's stem and bytes (`.gz` read decompressed).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of draftsmith's cache: `$DRAFTSMITH_CACHE`, else `~/.cache/draftsmith`."""
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(Path.home(), ".cache", "draftsmith")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_data_dir() -> Path:
    """The public prompt sets (train/, eval/dev/, eval/test/): `$DRAFTSMITH_DATA` when set, else the
    `prompts/` folder shipped inside the package (prompts/README.md)."""
    env = os.environ.get("DRAFTSMITH_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent / "prompts"  # the package directory is the repository root


_SETS_PREFIX = "prompts"


def open_data(path: str | os.PathLike):
    """A data file opened for reading bytes, gzip-decompressed when its name ends in `.gz`."""
    import gzip

    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def data_stem(path: str | os.PathLike) -> str:
    """A data file's name without its format and compression suffixes: `prompts/eval/dev/gsm8k.jsonl` and
    `gsm8k.jsonl.gz` are both `gsm8k`."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def data_path(path: str | os.PathLike) -> Path:
    """A configured data path, with a leading `prompts/` read as `shared_data_dir()`.

    Presets name the shipped prompt sets as `prompts/...`; this lets them work from any directory and under
    `$DRAFTSMITH_DATA`. Every other path is taken as given (relative to the working directory).
    """
    p = Path(path).expanduser()
    if not p.is_absolute() and p.parts[:1] == (_SETS_PREFIX,):
        return shared_data_dir().joinpath(*p.parts[1:])
    return p
