"""Recent traffic: a folder of request/response logs, the shape a serving gateway can dump.

Each `*.jsonl` (or `*.jsonl.gz`) line is one request:
    {"prompt": "..." | [{"role": "user", "content": "..."}, ...],
     "response": "...",            optional: what was served
     "domain": "code",             optional: else the router / "unknown"
     "timestamp": "2026-11-20T10:00:00Z" | 1763632800}   optional: else the file's mtime
Rows older than the window (relative to the newest row) are ignored; malformed lines (not JSON, not UTF-8, no
prompt, a timestamp that is not a finite time or lies in the future) are counted, and the first few are named
(`file:line: why`) in `TrafficSample.bad`; a partly written `.gz` gives the rows before the damage and counts
as one bad row naming the file.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import math
import random
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DataError


@dataclass
class TrafficRow:
    prompt: str
    domain: str
    timestamp: float
    response: str | None = None
    messages: list[dict] | None = None


@dataclass
class TrafficSample:
    rows: list[TrafficRow]
    per_domain: dict[str, int]
    malformed: int = 0
    window: tuple[float, float] | None = None
    files: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # the first MAX_NAMED malformed lines, "file:line: why"

    def by_domain(self) -> dict[str, list[TrafficRow]]:
        out: dict[str, list[TrafficRow]] = defaultdict(list)
        for r in self.rows:
            out[r.domain].append(r)
        return dict(out)


FUTURE_SKEW_S = 3600.0  # a gateway's clock may run this far ahead of ours; a later timestamp is a bad row


def _timestamp(value, fallback: float, now: float) -> float:
    """Seconds since the epoch: finite and not beyond now + FUTURE_SKEW_S. The window is measured back from
    the newest row, so one row dated 2099 (or Infinity) would otherwise hide every other row."""
    if value is None:
        ts, what = fallback, "the file's modification time"
    elif isinstance(value, bool):
        raise ValueError(f"unreadable timestamp {value!r}")
    elif isinstance(value, int | float):
        ts, what = value, "timestamp"
    else:
        try:
            parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"unreadable timestamp {str(value)[:80]!r}") from None
        ts, what = parsed.timestamp(), "timestamp"
    try:
        ts = float(ts)
    except OverflowError:
        ts = float("inf")
    if not math.isfinite(ts):
        raise ValueError(f"{what} {str(value)[:80]} is not a finite time")
    if ts > now + FUTURE_SKEW_S:
        raise ValueError(f"{what} {str(value if value is not None else ts)[:80]} is in the future "
                         f"({(ts - now) / 86400:.1f} days ahead of this machine's clock)")
    return ts


MAX_NAMED = 20


def _open(path: Path):
    """Bytes, line by line: a line that is not UTF-8 is one bad row, not the end of the file."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _row(raw_line: bytes, mtime: float, now: float, classify) -> TrafficRow:
    line = raw_line.decode("utf-8")
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object ({type(obj).__name__})")
    if "prompt" not in obj:
        raise ValueError("missing field 'prompt'")
    raw = obj["prompt"]
    messages = raw if isinstance(raw, list) else None
    prompt = raw if isinstance(raw, str) else next(m["content"] for m in reversed(raw) if m.get("role") == "user")
    if not prompt.strip():
        raise ValueError("empty prompt")
    domain = obj.get("domain") or (classify(prompt) if classify else "unknown")
    return TrafficRow(prompt, str(domain), _timestamp(obj.get("timestamp"), mtime, now), obj.get("response"), messages)


def _why(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg})"
    first = str(e).splitlines()[0] if str(e) else ""
    return first if isinstance(e, ValueError) and first else f"{type(e).__name__}: {first}"


def read_traffic(folder: str | Path, window_days: float = 7.0, max_per_domain: int | None = None,
                 seed: int = 0, classify=None) -> TrafficSample:
    """Rows of the last `window_days` (relative to the newest row), sampled to `max_per_domain` per domain.

    `classify(prompt) -> domain` labels rows without a domain (default: "unknown").
    """
    folder = Path(folder)
    files = sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.gz")]) if folder.is_dir() else []
    if not files:
        raise DataError(f"no traffic logs (*.jsonl) in {folder}")
    rows: list[TrafficRow] = []
    malformed = 0
    bad: list[str] = []
    now = time.time()
    for path in files:
        mtime = path.stat().st_mtime
        try:
            with _open(path) as f:
                for number, raw_line in enumerate(f, 1):
                    if not raw_line.strip():
                        continue
                    try:
                        rows.append(_row(raw_line, mtime, now, classify))
                    except (json.JSONDecodeError, KeyError, TypeError, ValueError, StopIteration, AttributeError) as e:
                        malformed += 1
                        if len(bad) < MAX_NAMED:
                            bad.append(f"{path}:{number}: {_why(e)}")
        except (EOFError, OSError, zlib.error) as e:  # a partly written .gz: its readable rows are kept
            malformed += 1
            if len(bad) < MAX_NAMED:
                bad.append(f"{path}: damaged or partly written, the rest of the file skipped "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if not rows:
        first = f"; first: {bad[0]}" if bad else ""
        raise DataError(f"traffic logs in {folder} hold no readable rows ({malformed} malformed{first})")
    newest = max(r.timestamp for r in rows)
    start = newest - window_days * 86400
    recent = [r for r in rows if r.timestamp >= start]
    rng = random.Random(seed)
    by_domain: dict[str, list[TrafficRow]] = defaultdict(list)
    for r in recent:
        by_domain[r.domain].append(r)
    picked: list[TrafficRow] = []
    for domain in sorted(by_domain):
        group = by_domain[domain]
        if max_per_domain is not None and len(group) > max_per_domain:
            group = rng.sample(group, max_per_domain)
        picked.extend(group)
    return TrafficSample(picked, dict(Counter(r.domain for r in picked)), malformed, (start, newest),
                         [str(p) for p in files], bad)


def write_prompt_file(rows: list[TrafficRow], path: str | Path) -> Path:
    """Traffic rows as an evaluator / data-pipeline prompt file (`turns` + `category`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"question_id": i, "category": r.domain, "turns": [r.prompt]}) + "\n")
    return path
