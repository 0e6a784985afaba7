"""Request logs on disk: the `*.jsonl` / `*.jsonl.gz` files a serving gateway writes into a folder, read line
by line as JSON objects — among them the fleet's traffic folder, which fleet/middleware.py writes inside vLLM
(`traffic-<time>-<pid>.jsonl`, with vLLM's per-request speculative-decoding counters). The one reader of that
layout: retraining's traffic (retrain/traffic.py: prompts, domains, timestamps) and production acceptance from
per-request counters (planning/production.py) both take their rows from `records`, and check the fields they
read themselves.

A log folder is written while it is read (a file rotated away, a writer killed half-way), so what cannot be
read is named and skipped and the rest is used: a dangling symlink (`current.jsonl` pointing at a rotated
file), a folder with a log's name, a file that cannot be opened, a `.gz` cut short (its rows before the
damage are kept), a line that is not UTF-8, not JSON or not a JSON object. Each counts once in
`malformed`; the first MAX_NAMED are named in `bad` (`file: why` or `file:line: why`).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DataError
from draftsmith.storage import json_depth

MAX_NAMED = 20
MAX_DEPTH = 32  # a log row nests about 5 deep (a chat's content parts); a deeper line is a bad line, never a RecursionError
PATTERNS = ("*.jsonl", "*.jsonl.gz")


@dataclass
class Logs:
    """The readable log files of a folder (or the one file given), and what could not be read so far."""

    source: Path
    files: list[Path] = field(default_factory=list)
    malformed: int = 0
    bad: list[str] = field(default_factory=list)

    def reject(self, where: str | Path, why: str) -> None:
        """Count one entry that cannot be used, and name it while fewer than MAX_NAMED are named."""
        self.malformed += 1
        if len(self.bad) < MAX_NAMED:
            self.bad.append(f"{where}: {why}")

    def first_bad(self) -> str:
        return f"; first: {self.bad[0]}" if self.bad else ""


def _not_a_file(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a dangling symlink (its file was moved or deleted), skipped"
    return "a folder, not a log file, skipped" if path.is_dir() else "not a regular file, skipped"


def log_files(source: str | Path, what: str = "request logs") -> Logs:
    """The log files of folder `source` (`*.jsonl`, `*.jsonl.gz`), or `source` itself when it is a file; an entry
    of a log's name that is no readable file is named and skipped. No log file at all is a DataError."""
    source = Path(source)
    logs = Logs(source)
    if source.is_dir():
        entries = sorted({p for pattern in PATTERNS for p in source.glob(pattern)})
    else:
        entries = [source] if source.is_file() else []
    for path in entries:
        if path.is_file():
            logs.files.append(path)
        else:
            logs.reject(path, _not_a_file(path))
    if not logs.files:
        raise DataError(f"no {what} ({', '.join(PATTERNS)}) in {source}{logs.first_bad()}")
    return logs


def _open(path: Path):
    """Bytes, line by line: a line that is not UTF-8 is one bad row, not the end of the file."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def parse_line(raw: bytes) -> dict:
    """One log line as a JSON object, or a ValueError saying in a few words why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start})") from None
    if json_depth(text) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object ({type(obj).__name__})")
    return obj


def records(logs: Logs) -> Iterator[tuple[Path, int, dict[str, Any], float]]:
    """(file, line number, the line's JSON object, the file's modification time) for every line of every log
    file that is one; the others are rejected on `logs` (module docstring)."""
    for path in logs.files:
        try:
            mtime = path.stat().st_mtime
            with _open(path) as f:
                for number, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        obj = parse_line(raw)
                    except ValueError as e:
                        logs.reject(f"{path}:{number}", str(e))
                        continue
                    yield path, number, obj, mtime
        except (EOFError, OSError, zlib.error) as e:  # a partly written .gz: its readable rows are kept
            first = str(e).splitlines()[0] if str(e) else ""
            logs.reject(path, f"damaged or partly written, the rest of the file skipped ({type(e).__name__}: "
                              f"{first[:120]})")
