"""Recent traffic: a folder of request/response logs, the shape a serving gateway can dump.

Each `*.jsonl` (or `*.jsonl.gz`) line is one request:
    {"prompt": "..." | [{"role": "user", "content": "..."}, ...],
     "response": "...",            optional: what was served
     "domain": "code",             optional: else the router / "unknown"
     "timestamp": "2026-11-20T10:00:00Z" | 1763632800,   optional: else the file's mtime
     "id": "cmpl-..."}             optional: the API response id (fleet/middleware.py logs it), which joins the
                                   row to the hidden states a capture replica kept of it (data/served.py)
Rows older than the window (relative to the newest row) are left out and counted (`outside_window`); malformed
lines (not JSON, not UTF-8, no prompt, a field of the wrong type, a timestamp that is not a finite time or lies
in the future) are counted, and the first few are named (`file:line: why`) in `TrafficSample.bad`; a partly
written `.gz` gives the rows before the damage and counts as one bad row naming the file, and an entry of a
log's name that is no file (a dangling symlink, a folder) is named and skipped (planning/logs.py reads the
files; this module checks the rows).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.config import show
from draftsmith.errors import ConfigError, DataError
from draftsmith.planning.logs import log_files, records


@dataclass
class TrafficRow:
    prompt: str
    domain: str
    timestamp: float
    response: str | None = None
    messages: list[dict] | None = None
    request_id: str | None = None  # the API response id


@dataclass
class TrafficSample:
    rows: list[TrafficRow]
    per_domain: dict[str, int]
    malformed: int = 0
    window: tuple[float, float] | None = None
    files: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # the first logs.MAX_NAMED malformed lines, "file:line: why"
    outside_window: int = 0  # readable rows older than the window (measured back from the newest row)

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
        try:
            ts, what = parsed.timestamp(), "timestamp"
        except (OverflowError, OSError, ValueError):  # year 1 in local time lies before the epoch's range
            raise ValueError(f"timestamp {str(value)[:80]!r} is not a finite time") from None
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


def _check_sampling(window_days, max_per_domain) -> None:
    """The window and the per-domain cap as read_traffic needs them (the config checks them too; a caller
    passing them directly is checked here): a NaN window kept no row and said nothing."""
    if isinstance(window_days, bool) or not isinstance(window_days, int | float) or not (
            math.isfinite(window_days) and window_days > 0):
        raise ConfigError(f"traffic.window_days is {show(window_days)}: expected a finite number of days > 0")
    if max_per_domain is not None and (isinstance(max_per_domain, bool) or not isinstance(max_per_domain, int)
                                       or max_per_domain < 1):
        raise ConfigError(f"traffic.max_per_domain is {show(max_per_domain)}: expected an int >= 1 (or null)")


def _message_text(messages: list) -> str:
    """The last user message's content of a chat prompt; a ValueError naming what is wrong with a message."""
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError(f"prompt: a message is {show(m)}, expected {{role, content}}")
        if "content" not in m:
            raise ValueError("prompt: a message without content")
        if not isinstance(m["content"], str):
            raise ValueError(f"prompt: a message's content is {show(m['content'])}, expected a string")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"prompt: a message's role is {show(m.get('role'))}, expected a string")
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError("prompt: no user message")
    return users[-1]


def _row(obj: dict, mtime: float, now: float, classify) -> TrafficRow:
    """One traffic row of a log line's object (module docstring), or a ValueError saying which field is wrong."""
    if "prompt" not in obj:
        raise ValueError("missing field 'prompt'")
    raw = obj["prompt"]
    if isinstance(raw, str):
        prompt, messages = raw, None
    elif isinstance(raw, list):
        prompt, messages = _message_text(raw), raw
    else:
        raise ValueError(f"prompt is {show(raw)}, expected a string or a list of messages")
    if not prompt.strip():
        raise ValueError("empty prompt")
    domain, response = obj.get("domain"), obj.get("response")
    if domain is not None and not isinstance(domain, str):
        raise ValueError(f"domain is {show(domain)}, expected a string")
    if response is not None and not isinstance(response, str):
        raise ValueError(f"response is {show(response)}, expected a string or null")
    rid = obj.get("id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= 200 and rid.isprintable()):
        raise ValueError(f"id is {show(rid)}, expected the response id (text of at most 200 characters)")
    domain = domain or (classify(prompt) if classify else "unknown")
    return TrafficRow(prompt, str(domain), _timestamp(obj.get("timestamp"), mtime, now), response, messages, rid)


def read_traffic(folder: str | Path, window_days: float = 7.0, max_per_domain: int | None = None,
                 seed: int = 0, classify=None) -> TrafficSample:
    """Rows of the last `window_days` (relative to the newest row), sampled to `max_per_domain` per domain.

    `classify(prompt) -> domain` labels rows without a domain (default: "unknown"). The files are read by
    planning/logs.py (what cannot be read is named in `bad` and skipped); each row's fields are checked here.
    """
    _check_sampling(window_days, max_per_domain)
    logs = log_files(folder, "traffic logs")
    rows: list[TrafficRow] = []
    now = time.time()
    for path, number, obj, mtime in records(logs):
        try:
            rows.append(_row(obj, mtime, now, classify))
        except ValueError as e:
            logs.reject(f"{path}:{number}", str(e).splitlines()[0] if str(e) else type(e).__name__)
    if not rows:
        raise DataError(f"traffic logs in {folder} hold no readable rows ({logs.malformed} malformed"
                        f"{logs.first_bad()})")
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
    return TrafficSample(picked, dict(Counter(r.domain for r in picked)), logs.malformed, (start, newest),
                         [str(p) for p in logs.files], logs.bad, len(rows) - len(recent))


def write_prompt_file(rows: list[TrafficRow], path: str | Path) -> Path:
    """Traffic rows as an evaluator / data-pipeline prompt file (`turns` + `category`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"question_id": i, "category": r.domain, "turns": [r.prompt]}) + "\n")
    return path
