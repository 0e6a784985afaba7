"""Recent traffic: a folder of request/response logs, the shape a serving gateway can dump — retraining's
training prompts and the held-out prompts evaluation measures the drafter on.

Each `*.jsonl` (or `*.jsonl.gz`) line is one request, the traffic line fleet/middleware.py writes
(fleet/traffic_record.py defines it; a gateway's own logs need only a few of its fields):
    {"prompt": "..." | [{"role": "user", "content": "..." | [{"type": "text", "text": "..."}, ...]}, ...],
     "response": "...",            optional: what was served
     "domain": "code",             optional: else the router / "unknown"
     "timestamp": "2026-11-20T10:00:00Z" | 1763632800,   optional: else the file's mtime
     "id": "cmpl-...",             optional: the API response id (fleet/middleware.py logs it), which joins the
                                   row to the hidden states a capture replica kept of it (data/served.py)
     "status": 200, "error": ...}  optional: a refused request (status != 200, or an error) never trains
A row's text is a completion prompt, or a chat's last user message (its text parts joined; a tool-call or
image-only message in the chat is kept as a message without text). planning/logs.py reads the files and checks
each line once (fleet/traffic_record.py): refused requests are counted (`refused`), rows holding text UTF-8
cannot encode (a lone surrogate) are dropped and counted (`unencodable`) so no prompt file written from the
rows carries one, and malformed lines (not JSON, not UTF-8, over the line cap, a field of the wrong type, no
prompt text, a timestamp that is not a finite time or lies in the future) are counted, the first few named
(`file:line: why`) in `TrafficSample.bad`; a partly written `.gz` gives the rows before the damage and counts
as one bad row naming the file. Rows older than the window (relative to the newest row) are left out and
counted (`outside_window`). At most `max_domains` domains keep their name (the largest by volume; the rest
are "other", `merged_domains` of them), so clients inventing domains cannot split the traffic into groups
too small to train on; each domain is then sampled to `max_per_domain`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import ConfigError, DataError, show
from draftsmith.fleet.traffic_record import TrafficRecord
from draftsmith.planning.logs import MAX_DOMAINS, cap_domains, log_files, traffic

log = logging.getLogger(__name__)


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
    refused: int = 0  # requests the server refused (status != 200, or an error): never trained on
    unencodable: int = 0  # rows holding text UTF-8 cannot encode (a lone surrogate): dropped
    merged_domains: int = 0  # domain names folded into "other" (beyond the max_domains largest)

    def by_domain(self) -> dict[str, list[TrafficRow]]:
        out: dict[str, list[TrafficRow]] = defaultdict(list)
        for r in self.rows:
            out[r.domain].append(r)
        return dict(out)


FUTURE_SKEW_S = 3600.0  # a gateway's clock may run this far ahead of ours; a later timestamp is a bad row


def _timestamp(record: TrafficRecord, fallback: float, now: float) -> float:
    """The row's time (the record's timestamp, parsed and finite, else the file's modification time), not
    beyond now + FUTURE_SKEW_S: the window is measured back from the newest row, so one row dated 2099 would
    otherwise hide every other row."""
    ts = fallback if record.seconds is None else record.seconds
    if ts > now + FUTURE_SKEW_S:
        what = "the file's modification time" if record.seconds is None else f"timestamp {show(record.timestamp)}"
        raise ValueError(f"{what} is in the future ({(ts - now) / 86400:.1f} days ahead of this machine's clock)")
    return ts


def _check_sampling(window_days, max_per_domain, max_domains) -> None:
    """The window and the caps as read_traffic needs them (the config checks them too; a caller passing them
    directly is checked here): a NaN window kept no row and said nothing."""
    if isinstance(window_days, bool) or not isinstance(window_days, int | float) or not (
            math.isfinite(window_days) and window_days > 0):
        raise ConfigError(f"traffic.window_days is {show(window_days)}: expected a finite number of days > 0")
    if max_per_domain is not None and (isinstance(max_per_domain, bool) or not isinstance(max_per_domain, int)
                                       or max_per_domain < 1):
        raise ConfigError(f"traffic.max_per_domain is {show(max_per_domain)}: expected an int >= 1 (or null)")
    if max_domains is not None and (isinstance(max_domains, bool) or not isinstance(max_domains, int)
                                    or max_domains < 1):
        raise ConfigError(f"traffic.max_domains is {show(max_domains)}: expected an int >= 1 (or null)")


def _no_text(record: TrafficRecord) -> str:
    """Why a record with a prompt gives no text to train on (fleet/traffic_record.py read its shape)."""
    if record.messages is not None:
        if not any(m["role"] == "user" for m in record.messages):
            return "prompt: no user message"
        return "prompt: the last user message has no text (only images, audio or files, or no content)"
    if not record.prompt:
        return "prompt is an empty list"
    if all(isinstance(t, int) for t in record.prompt):
        return "prompt is token ids: no text to train on"
    return f"prompt is a batch of {len(record.prompt)} prompts: no one text to train on"


def _row(record: TrafficRecord, mtime: float, now: float, classify) -> TrafficRow:
    """One traffic row of a checked record (module docstring), or a ValueError saying what it lacks."""
    if record.prompt is None:
        raise ValueError("missing field 'prompt'")
    if record.text is None:
        raise ValueError(_no_text(record))
    if not record.text.strip():
        raise ValueError("empty prompt")
    domain = record.domain or (classify(record.text) if classify else "unknown")
    response = record.response if isinstance(record.response, str) else None  # n > 1: no one answer
    return TrafficRow(record.text, str(domain), _timestamp(record, mtime, now), response, record.messages,
                      record.id)


def read_traffic(folder: str | Path, window_days: float = 7.0, max_per_domain: int | None = None,
                 seed: int = 0, classify=None, max_domains: int | None = MAX_DOMAINS) -> TrafficSample:
    """Rows of the last `window_days` (relative to the newest row), the `max_domains` largest domains under
    their name and the rest as "other", each sampled to `max_per_domain`.

    `classify(prompt) -> domain` labels rows without a domain (default: "unknown"). planning/logs.py reads the
    files and checks each line (module docstring); what a row needs to train on is checked here.
    """
    _check_sampling(window_days, max_per_domain, max_domains)
    logs = log_files(folder, "traffic logs")
    rows: list[TrafficRow] = []
    now = time.time()
    for path, number, record, mtime in traffic(logs):
        try:
            rows.append(_row(record, mtime, now, classify))
        except ValueError as e:
            logs.reject(f"{path}:{number}", str(e).splitlines()[0] if str(e) else type(e).__name__)
    if not rows:
        raise DataError(f"traffic logs in {folder} hold no readable rows ({logs.malformed} malformed, "
                        f"{logs.refused} refused, {logs.unencodable} unencodable{logs.first_bad()})")
    newest = max(r.timestamp for r in rows)
    start = newest - window_days * 86400
    recent = [r for r in rows if r.timestamp >= start]
    names = cap_domains(Counter(r.domain for r in recent), max_domains)
    rng = random.Random(seed)
    by_domain: dict[str, list[TrafficRow]] = defaultdict(list)
    for r in recent:
        r.domain = names[r.domain]
        by_domain[r.domain].append(r)
    picked: list[TrafficRow] = []
    for domain in sorted(by_domain):
        group = by_domain[domain]
        if max_per_domain is not None and len(group) > max_per_domain:
            group = rng.sample(group, max_per_domain)
        picked.extend(group)
    return TrafficSample(picked, dict(Counter(r.domain for r in picked)), logs.malformed, (start, newest),
                         [str(p) for p in logs.files], logs.bad, len(rows) - len(recent), logs.refused,
                         logs.unencodable, sum(1 for d, n in names.items() if n != d))


def _encodable(*texts: str) -> bool:
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def write_prompt_file(rows: list[TrafficRow], path: str | Path) -> Path:
    """Traffic rows as an evaluator / data-pipeline prompt file (`turns` + `category`). A row whose text
    UTF-8 cannot encode (a lone surrogate: the reader drops such rows, this catches one built elsewhere) is
    left out with a warning, never written: the evaluator would refuse the whole file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from draftsmith.outputs import open_output

    written = left_out = 0
    with open_output(path) as f:  # never through a link planted at the file's name
        for r in rows:
            if not _encodable(r.prompt, r.domain):
                left_out += 1
                continue
            f.write(json.dumps({"question_id": written, "category": r.domain, "turns": [r.prompt]}) + "\n")
            written += 1
    if left_out:
        log.warning("%s: %d traffic rows left out, their text cannot be encoded (a lone surrogate)", path, left_out)
    return path
