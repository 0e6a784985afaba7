"""How draftsmith reads a file, whoever wrote it: JSON with its byte cap and its nesting depth counted before
parsing (`read_json`, the one reader of JSON files), JSON lines split at "\\n" alone (`jsonl_records`), an
integer as a JSON file spells one (`is_int`), and lines bounded by bytes, a `.gz` by its ratio
(`bounded_lines`, `gzip_budget`). Each refusal is one line naming the file; what a value must hold is the
schema of the reader that asked.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any


def is_int(value: Any, lo: int | None = None, hi: int | None = None) -> bool:
    """An integer as a JSON file spells one (never a bool, which Python counts as an int), in [lo, hi] where
    given: what the readers of draftsmith's files check a count, an id or a size with."""
    return (isinstance(value, int) and not isinstance(value, bool) and (lo is None or value >= lo)
            and (hi is None or value <= hi))


MAX_JSON_DEPTH = 64  # a manifest, report or policy nests under 10 deep; json.loads recurses once a level
MAX_JSON_BYTES = 256 << 20  # a JSON file draftsmith reads is kB to a few MB (a tokenizer.json: tens of MB)


# Reading lines of a file nobody here wrote (request logs, prompt files): bounded by bytes whatever it holds. A
# line is read at most `limit` bytes at a time before anything decodes it, and a longer one is skipped to its end
# in reads of at most LINE_CHUNK bytes without being held; a `.gz` gives at most MAX_GZIP_RATIO times its own size
# (never less than MIN_GZIP_BYTES), so a gzip bomb (4 MB holding a 4 GiB line) costs bounded memory and time.
LINE_CHUNK = 1 << 20
MAX_GZIP_RATIO = 100  # JSON lines compress 5-20x; a file giving more than this is a bomb, not data
MIN_GZIP_BYTES = 256 << 20  # a small .gz may always give this much (a short file of repeated prompts)


class TooMuch(Exception):  # noqa: N818 - read as "a .gz gave too much"
    """A .gz gave more bytes than its budget (gzip_budget): the rest of it is skipped."""


def bounded_lines(f, limit: int, budget: int | None = None) -> Iterator[bytes | None]:
    """Every line of binary file `f` (its newline kept), None for one longer than `limit` bytes, skipped to its
    end without being held; TooMuch once more than `budget` bytes were read (None: no budget)."""
    read = 0
    while True:
        raw = f.readline(limit + 1)
        read += len(raw)
        if budget is not None and read > budget:
            raise TooMuch(budget)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the over-long line, never held
            raw = f.readline(min(LINE_CHUNK, limit))
            read += len(raw)
            if budget is not None and read > budget:
                raise TooMuch(budget)
        yield None


def gzip_budget(path: str | os.PathLike) -> int | None:
    """The bytes a .gz may give (bounded_lines); None for a plain file (its bytes are on disk already)."""
    if not str(path).endswith(".gz"):
        return None
    return max(MIN_GZIP_BYTES, MAX_GZIP_RATIO * os.stat(path).st_size)


def json_depth(text: str) -> int:
    """How deep `text`'s arrays and objects nest (brackets inside strings do not count), in linear time and
    without recursion: what is counted before json.loads, which would hit the recursion limit."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    brackets = re.sub(r"[^\[\]{}]", "", outside)
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file from anywhere, the one reader of JSON files: a file that is missing (MissingFile, a
    FileNotFoundError too), a folder, unreadable, over `max_bytes`, not UTF-8, nested deeper than
    MAX_JSON_DEPTH or not JSON is one line naming it (FileFormatError, a ValueError too, for callers that treat
    any unreadable file alike). What the value must hold is the caller's schema."""
    from draftsmith.errors import FileFormatError, MissingFile

    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > max_bytes:
                raise FileFormatError(f"{path}: over {max_bytes >> 20} MiB, not a JSON file draftsmith reads")
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        what = "a symlink to nothing" if Path(path).is_symlink() else "no such file"
        raise MissingFile(f"{path}: {what}") from None
    except IsADirectoryError:
        raise FileFormatError(f"{path}: a folder, not a JSON file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileFormatError(f"{path}: a symlink loop, not a JSON file") from None
        raise FileFormatError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise FileFormatError(f"{path}: JSON nested {depth} deep (at most {MAX_JSON_DEPTH} is read)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise FileFormatError(f"{path}: not JSON draftsmith reads ({str(e)[:80]})") from None


def jsonl_records(text: str, where: str | os.PathLike) -> list[Any]:
    """The records of a JSON-lines text. A record ends at "\\n" only: `json.dumps(..., ensure_ascii=False)` writes
    U+2028, U+0085 and the other characters `str.splitlines()` also breaks at raw inside strings (a GSM8K question
    holds one). A line that is not JSON is a FileFormatError naming `where` and the line."""
    from draftsmith.errors import FileFormatError

    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise FileFormatError(f"{where}: line {n} is not JSON ({e.msg} at column {e.colno})") from None
    return out
