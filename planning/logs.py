"""Request logs on disk: the `*.jsonl` / `*.jsonl.gz` files a serving gateway writes into a folder, read line
by line as JSON objects — among them the fleet's traffic folder, which fleet/middleware.py writes inside vLLM
(`traffic-<time>-<pid>.jsonl`, with vLLM's per-request speculative-decoding counters). The one reader of that
layout: every reader of traffic — production acceptance (planning/production.py), retraining's traffic and the
held-out prompts evaluation measures on (retrain/traffic.py) — takes its rows from `traffic`, which checks
each line once against the one definition of a traffic line (fleet/traffic_record.py): a refused request
(a status other than 200, or an error) is counted in `refused`, a row holding text UTF-8 cannot encode (a
lone surrogate) in `unencodable`, neither ever used; a field of the wrong type is a malformed row.

A log folder is written while it is read (a file rotated away, a writer killed half-way), and what is in it
came from clients, so what cannot be read is named and skipped and the rest is used: a dangling symlink
(`current.jsonl` pointing at a rotated file), a folder with a log's name, a file that cannot be opened, a `.gz`
cut short (its rows before the damage are kept), a line that is not UTF-8, not JSON or not a JSON object. Each
counts once in `malformed`; the first MAX_NAMED are named in `bad` (`file: why` or `file:line: why`).

Bounded by bytes, whatever a file holds: a line is read at most MAX_LINE_BYTES at a time before anything is
decoded, and a longer one is skipped to its end without being held (one bad row; reading.bounded_lines); a `.gz`
gives at most MAX_GZIP_RATIO times its own size (never less than MIN_GZIP_BYTES) before the rest of it is
skipped as one bad file, so a gzip bomb (4 MB holding a 4 GiB line) costs bounded memory and time. A line
that still cannot be held in memory is one bad row, and a file that fails is one bad file: no read error,
MemoryError included, stops the scan of the others.

Clients name domains: `cap_domains` keeps the MAX_DOMAINS largest by volume under their names and folds the
rest into OTHER, so inventing thousands of one-row domains splits nothing into pieces too small to use.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DataError
from draftsmith.fleet.traffic_record import MALFORMED, REFUSED, TrafficRecord, Unusable, parse_record
from draftsmith.reading import MAX_GZIP_RATIO, MIN_GZIP_BYTES, TooMuch, bounded_lines, gzip_budget, json_depth

MAX_NAMED = 20
# a log row nests about 5 deep (a chat's content parts); a deeper line is a bad line, never a RecursionError
MAX_DEPTH = 32
PATTERNS = ("*.jsonl", "*.jsonl.gz")
# a middleware line holds a request and a response of at most 8 MiB each (fleet/middleware.py's body cap), escaped
MAX_LINE_BYTES = 32 << 20
MAX_DOMAINS = 32  # domains kept under their own name (cap_domains); the rest are OTHER
OTHER = "other"


@dataclass
class Logs:
    """The readable log files of a folder (or the one file given), and what could not be read so far."""

    source: Path
    files: list[Path] = field(default_factory=list)
    malformed: int = 0
    bad: list[str] = field(default_factory=list)
    refused: int = 0  # requests the server refused (status != 200, or an error): read, never used
    unencodable: int = 0  # rows holding text UTF-8 cannot encode (a lone surrogate): dropped

    def reject(self, where: str | Path, why: str) -> None:
        """Count one entry that cannot be used, and name it while fewer than MAX_NAMED are named."""
        self.malformed += 1
        if len(self.bad) < MAX_NAMED:
            self.bad.append(f"{where}: {why}")

    def skip(self, where: str, e: Unusable) -> None:
        """Count a row fleet/traffic_record.py found unusable under its kind (a malformed one is named too)."""
        if e.kind == MALFORMED:
            self.reject(where, str(e))
        elif e.kind == REFUSED:
            self.refused += 1
        else:
            self.unencodable += 1

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
    seen: dict[tuple[int, int], Path] = {}  # a file under two names (`current.jsonl` linked to the live file)
    for path in entries:
        if not path.is_file():
            logs.reject(path, _not_a_file(path))
            continue
        try:
            st = path.stat()
        except OSError as e:
            logs.reject(path, f"cannot be read ({e.strerror or type(e).__name__}), skipped")
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:  # read once: counting its rows twice would double its domain's requests
            continue
        seen[key] = path
        logs.files.append(path)
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
    limit = MAX_LINE_BYTES
    for path in logs.files:
        number = 0
        try:
            mtime = path.stat().st_mtime
            budget = gzip_budget(path)
            with _open(path) as f:
                for number, raw in enumerate(bounded_lines(f, limit, budget), 1):
                    if raw is None:
                        logs.reject(f"{path}:{number}", f"a line longer than {limit} bytes, skipped")
                        continue
                    if not raw.strip():
                        continue
                    try:
                        obj = parse_line(raw)
                    except ValueError as e:
                        logs.reject(f"{path}:{number}", str(e))
                        continue
                    except MemoryError:
                        logs.reject(f"{path}:{number}", f"{len(raw)} bytes of JSON too large to hold in memory")
                        continue
                    yield path, number, obj, mtime
        except TooMuch as e:
            logs.reject(path, f"gives more than {e.args[0]} bytes decompressed ({MAX_GZIP_RATIO}x its own size, at "
                              f"least {MIN_GZIP_BYTES}): not a log (a gzip bomb?), skipped after line {number}")
        except (EOFError, OSError, zlib.error, MemoryError) as e:  # a partly written .gz: its readable rows are kept
            first = str(e).splitlines()[0] if str(e) else ""
            logs.reject(path, f"damaged or partly written, the rest of the file skipped ({type(e).__name__}: "
                              f"{first[:120]})")


def traffic(logs: Logs) -> Iterator[tuple[Path, int, TrafficRecord, float]]:
    """`records`, each checked once against the traffic line's definition (fleet/traffic_record.py): (file, line
    number, the typed record, the file's modification time); refused, unencodable and malformed rows are counted
    on `logs` and never given."""
    for path, number, obj, mtime in records(logs):
        try:
            record = parse_record(obj)
        except Unusable as e:
            logs.skip(f"{path}:{number}", e)
            continue
        except MemoryError:
            logs.reject(f"{path}:{number}", "a row too large to check in memory")
            continue
        yield path, number, record, mtime


def cap_domains(volume: Counter, max_domains: int | None = MAX_DOMAINS) -> dict[str, str]:
    """Each domain's name in a table of at most `max_domains` named domains: the largest by `volume` (ties by
    name) keep theirs, the rest become OTHER (None: every domain keeps its name)."""
    ranked = sorted(volume, key=lambda d: (-volume[d], d))
    keep = set(ranked if max_domains is None else ranked[:max_domains])
    return {d: d if d in keep else OTHER for d in ranked}
