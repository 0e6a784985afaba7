"""The fleet's traffic, logged by vLLM's own API server: an ASGI middleware that writes one JSON line per
completion request, with vLLM's per-request speculative-decoding counters, for draftsmith to read back as
acceptance per domain (planning/production.py) and as retraining's recent traffic (retrain/traffic.py).

    DRAFTSMITH_TRAFFIC_DIR=/data/traffic vllm serve MODEL --speculative-config '{...}' \\
        --per-request-spec-decode-metrics detailed --middleware draftsmith.fleet.middleware.TrafficLog

vLLM adds a middleware class with `app.add_middleware(cls)` (entrypoints/serve/middleware/register.py): no
constructor arguments, so it is configured by environment variables, read once at start (a bad value, or a
folder that is a file, a symbolic link or not writable, stops the server there with one ValueError line
naming the variable, never a request):

    DRAFTSMITH_TRAFFIC_DIR              the folder (required; created; never a link, and no file in it is
                                        opened through one)
    DRAFTSMITH_TRAFFIC_MAX_FILE_BYTES   a file is closed and a new one opened past this (default 64 MiB)
    DRAFTSMITH_TRAFFIC_MAX_FILES        files of this process kept; its oldest is deleted past it (default
                                        100)
    DRAFTSMITH_TRAFFIC_QUEUE            records waiting for the writer thread (default 1024)
    DRAFTSMITH_TRAFFIC_QUEUE_BYTES      bytes the logging path may hold at once: the bodies kept by requests
                                        in flight and by records waiting for the writer (default 32 MiB)
    DRAFTSMITH_TRAFFIC_MAX_BODY_BYTES   a request or a response longer than this is passed on, not logged
                                        (default 4 MiB; at most QUEUE_BYTES)
    DRAFTSMITH_TRAFFIC_SHUTDOWN_S       how long shutdown waits for queued records to be written (default 5)
    DRAFTSMITH_TRAFFIC_DOMAIN_HEADER    the header a client names its domain in (default X-Draftsmith-Domain)
    DRAFTSMITH_TRAFFIC_TEST_STALL_S     for tests only: the writer sleeps this long before each record (a
                                        stalled disk); never set it in production

Logged: POST /v1/completions and /v1/chat/completions. One line per request, in
`<dir>/traffic-<UTC time>-<pid>.jsonl` (each API server process writes its own files); the line is a
fleet/traffic_record.py TrafficRecord, the one definition its readers share:
    {"timestamp": ISO UTC (arrival), "id": the response id, "request_id": X-Request-Id, "endpoint",
     "model", "prompt": the completion prompt (text or token ids) or the chat messages, "domain": the body's
     own `domain` field, else the domain header, else absent, "response": the answer text (a list for n > 1),
     "output_token_ids" (with `return_token_ids`), "usage", "finish_reason", "stream", "status",
     "speculative_decoding": vLLM's `metrics.speculative_decoding`, verbatim, "error" (vLLM's message),
     "drafter_version": the drafter version that served it (fleet/drafter_route.py's label), or
     "drafter_swapped": true when a swap happened while it ran}
vLLM reports `metrics.speculative_decoding` only with `--per-request-spec-decode-metrics summary|detailed`,
only for one prompt with n == 1, and in a stream only on its final usage chunk, which vLLM sends only when the
client asks `stream_options: {"include_usage": true}` or the server runs with `--enable-force-include-usage`:
a stream without it is logged without counters (the reader counts such rows as `uncounted`).

A guest in the server (docs: DESIGN "A guest in the user's server"). The request never waits for the log and
never fails because of it: the request's and the response's bytes pass through unchanged (vLLM accepts the
unknown `domain` field: its request models allow extra fields); the one thing added is an `X-Request-Id`
header (a uuid4 hex) where the client sent none and no body `request_id`, so that the id vLLM builds the
engine's request id from (`cmpl-<id>-0-<8 hex>`, `chatcmpl-<id>-<8 hex>`) is set here — the response `id`
logged is what fleet/vllm_capture.py's files, named by engine request id, are joined on. Bodies are kept as
bytes up to the cap (nothing is parsed on the event loop), and every kept byte is reserved in one budget of
QUEUE_BYTES shared by the requests in flight and the records queued, so memory is bounded in bytes, not in
requests: a request that finds the budget spent stops keeping (its bytes pass on all the same) and is counted.
One background thread parses each finished exchange and appends its line with unbuffered writes, so a reader
sees whole lines; the bytes are released when the line is written.

Every exchange of a logged endpoint is counted exactly once (`TrafficLog.counts`, Counts.OUTCOMES; a warning
in vLLM's log at the 1st, 2nd, 4th, 8th ... of each kind other than written):
    written             its whole line is on disk
    dropped_queue_full  QUEUE records were already waiting
    dropped_bytes       the byte budget was spent while its bodies were being kept
    over_cap            a body passed MAX_BODY_BYTES
    incomplete          the response ended before its last body message (the app raised, the client left)
    errors              the logging path failed on it (a body that is not JSON, a status that is no int)
    lost                the write failed (a full disk, an I/O error): a partly written line is taken back
                        (truncated; where that fails, ended by a newline of its own, no record in it; where
                        that fails too, the file is closed and the next record opens a new one), never glued
                        onto
    lost_at_shutdown    still queued (or in a stalled write) when shutdown's time ran out, or arrived after
so the lines on disk are exactly the records counted written. Before each record the writer checks that its
file is still the one the folder names (fstat against the name's stat: a file deleted or moved away by the
operator's rotation) and opens a new one when not; files and the folder are opened without following links
(O_NOFOLLOW, O_EXCL). A process deletes only files it created itself (matching its own name pattern and pid);
files of earlier processes stay for the operator's retention.

Shutdown: the server's ASGI lifespan.shutdown (Starlette passes the lifespan scope through its middleware)
and, where no lifespan runs, `atexit` write what is queued within SHUTDOWN_S, count the rest
`lost_at_shutdown` and log one summary line of the counts; the writer is a daemon thread, so a stalled disk
never holds the process's exit longer than that. The module's logger has a level of its own (WARNING): vLLM's
API server runs with the root logger at ERROR, under which the warnings would never reach its log.

Runs inside vLLM's environment: the standard library only (scripts/check_imports.py, rule 5).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime as dt
import errno
import json
import logging
import math
import os
import re
import stat
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from draftsmith.fleet.drafter_route import STATE as DRAFTER
from draftsmith.fleet.drafter_route import DrafterState
from draftsmith.fleet.traffic_record import TrafficRecord

log = logging.getLogger("draftsmith.fleet.middleware")
if log.level == logging.NOTSET:
    # a level of its own, so the warnings reach vLLM's log: vLLM's API server sets the root logger to ERROR
    # (its model_hosting_container_standards dependency does), which a library logger would inherit and stay
    # silent under; an operator who configured this logger keeps their level
    log.setLevel(logging.WARNING)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
NAME = re.compile(r"^traffic-\d{8}T\d{12}Z-(?P<pid>\d+)(?:-\d+)?\.jsonl$")
ENV = "DRAFTSMITH_TRAFFIC_"
# what a kept chunk costs besides its bytes: the bytes object's header and its slot in the list, so a stream
# of many small events is charged what it holds
CHUNK_COST = 48
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _env_int(env, name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(ENV + name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and lo <= int(raw) <= hi):
        raise ValueError(f"TrafficLog: {ENV}{name}={raw[:40]!r}, expected an integer in {lo}..{hi}")
    return int(raw)


def _env_seconds(env, name: str, default: float, hi: float) -> float:
    raw = env.get(ENV + name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= hi):
        raise ValueError(f"TrafficLog: {ENV}{name}={raw[:40]!r}, expected seconds in 0..{hi:g}")
    return value


@dataclass(frozen=True)
class Settings:
    """What the middleware is configured with (module docstring: the environment variables)."""

    folder: str
    max_file_bytes: int = 64 << 20
    max_files: int = 100
    queue_size: int = 1024
    queue_bytes: int = 32 << 20
    # a body is kept whole or not at all: 4 MiB holds a 1M-token prompt's text; 8 such bodies fit the budget
    max_body_bytes: int = 4 << 20
    domain_header: str = "X-Draftsmith-Domain"
    shutdown_s: float = 5.0
    test_stall_s: float = 0.0  # tests only (module docstring)

    def __post_init__(self):
        if self.max_body_bytes > self.queue_bytes:
            raise ValueError(f"TrafficLog: {ENV}MAX_BODY_BYTES={self.max_body_bytes} is over "
                             f"{ENV}QUEUE_BYTES={self.queue_bytes}: no body could ever be kept")

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        folder = env.get(ENV + "DIR", "").strip()
        if not folder:
            raise ValueError(f"TrafficLog: {ENV}DIR is not set (the folder the traffic is logged into)")
        header = env.get(ENV + "DOMAIN_HEADER", "").strip() or cls.domain_header
        if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header):
            raise ValueError(f"TrafficLog: {ENV}DOMAIN_HEADER={header[:40]!r} is not a header name")
        return cls(folder, _env_int(env, "MAX_FILE_BYTES", cls.max_file_bytes, 1, 1 << 40),
                   _env_int(env, "MAX_FILES", cls.max_files, 1, 1 << 20),
                   _env_int(env, "QUEUE", cls.queue_size, 1, 1 << 20),
                   _env_int(env, "QUEUE_BYTES", cls.queue_bytes, 1 << 10, 1 << 40),
                   _env_int(env, "MAX_BODY_BYTES", cls.max_body_bytes, 1, 1 << 40), header,
                   _env_seconds(env, "SHUTDOWN_S", cls.shutdown_s, 600.0),
                   _env_seconds(env, "TEST_STALL_S", cls.test_stall_s, 3600.0))


@dataclass
class Exchange:
    """One request and its response as they passed through: bytes kept up to the cap and within the budget,
    nothing parsed."""

    endpoint: str
    arrived: float
    request_id: str | None
    header_domain: bytes | None
    request: list[bytes] = field(default_factory=list)
    response: list[bytes] = field(default_factory=list)
    status: int | None = None
    event_stream: bool = False
    finished: bool = False
    over: bool = False  # a body passed the cap: passed on, not logged
    unkept: bool = False  # the byte budget was spent: passed on, not logged
    sizes: list[int] = field(default_factory=lambda: [0, 0])  # request, response bytes seen
    held: int = 0  # bytes reserved for it in the budget (Counts)
    outcome: str | None = None  # set once, by Counts.settle
    # the drafter's (generation, version) when it arrived and when it ended (fleet/drafter_route.py)
    drafter: tuple = (0, None)
    drafter_end: tuple = (0, None)

    @property
    def keeping(self) -> bool:
        return not (self.over or self.unkept or self.outcome)

    def keep(self, side: int, chunk: bytes, cap: int, counts: Counts) -> None:
        if not chunk or not self.keeping:
            return
        self.sizes[side] += len(chunk)
        if self.sizes[side] > cap:
            self.over = True
            counts.free(self)
        elif not counts.reserve(self, len(chunk) + CHUNK_COST):
            self.unkept = True
            counts.free(self)
        else:
            (self.request if side == 0 else self.response).append(chunk)


class Counts:
    """Every exchange's one outcome (module docstring), and the byte budget its kept bodies are reserved in;
    used from the event loop and the writer thread."""

    OUTCOMES = ("written", "dropped_queue_full", "dropped_bytes", "over_cap", "incomplete", "errors", "lost",
                "lost_at_shutdown")

    def __init__(self, budget: int):
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.OUTCOMES, 0)
        self.values["reopened"] = 0  # not an outcome: the traffic file was gone and a new one was opened
        self.budget, self.held = budget, 0

    def reserve(self, x: Exchange, n: int) -> bool:
        with self._lock:
            if self.held + n > self.budget:
                return False
            self.held += n
            x.held += n
        return True

    def free(self, x: Exchange) -> None:
        """Release what `x` holds and forget its bodies."""
        with self._lock:
            self.held -= x.held
            x.held = 0
        x.request, x.response = [], []

    def settle(self, x: Exchange, kind: str, what: str = "") -> bool:
        """Count `x` as `kind` and release its bytes; False when it was counted already (its one outcome
        stands)."""
        with self._lock:
            if x.outcome is not None:
                return False
            x.outcome = kind
        self.free(x)
        self.add(kind, what)
        return True

    def add(self, kind: str, what: str = "") -> None:
        with self._lock:
            self.values[kind] += 1
            n = self.values[kind]
        if kind != "written" and n & (n - 1) == 0:  # 1, 2, 4, 8 ...: seen in the log, never a flood
            latest = f" (latest: {what[:200]})" if what else ""
            log.warning("draftsmith traffic log: %s %d times%s", kind, n, latest)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.values, "bytes_held": self.held}


def _choice_text(choice: dict, chat: bool, stream: bool):
    if not chat:
        return choice.get("text")
    part = choice.get("delta" if stream else "message")
    return part.get("content") if isinstance(part, dict) else None


def _answers(chunks: list[dict], chat: bool, stream: bool) -> dict:
    """The answer fields of a response, from its JSON body (one chunk) or its stream's chunks, in order."""
    out: dict = {}
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        if "id" not in out and isinstance(chunk.get("id"), str):
            out["id"] = chunk["id"]
        if chunk.get("usage") is not None:
            out["usage"] = chunk["usage"]
        metrics = chunk.get("metrics")
        if isinstance(metrics, dict) and metrics.get("speculative_decoding") is not None:
            out["speculative_decoding"] = metrics["speculative_decoding"]
        if chunk.get("error") is not None:  # vLLM's error body, or an error event in a stream
            err = chunk["error"]
            message = err.get("message") if isinstance(err, dict) else chunk.get("message", err)
            out["error"] = str(message)[:2000]
        for choice in chunk.get("choices") or []:
            i = choice.get("index", 0)
            text = _choice_text(choice, chat, stream)
            if isinstance(text, str):
                texts.setdefault(i, []).append(text)
            if isinstance(choice.get("token_ids"), list):
                ids.setdefault(i, []).extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                finish[i] = choice["finish_reason"]
    order = sorted(set(texts) | set(finish))
    if order:
        joined = ["".join(texts.get(i, [])) for i in order]
        out["response"] = joined[0] if len(joined) == 1 else joined
        reasons = [finish.get(i) for i in order]
        out["finish_reason"] = reasons[0] if len(reasons) == 1 else reasons
    if ids:
        listed = [ids.get(i, []) for i in sorted(ids)]
        out["output_token_ids"] = listed[0] if len(listed) == 1 else listed
    return out


def _events(body: bytes) -> list[dict]:
    """The JSON objects of a server-sent event stream (`data: {...}` lines; `data: [DONE]` ends it)."""
    out = []
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        obj = json.loads(payload)
        if isinstance(obj, dict):
            out.append(obj)
    return out


def record(x: Exchange) -> dict:
    """The JSON line of one finished exchange, built as the TrafficRecord its readers parse it back into
    (fleet/traffic_record.py; module docstring); run on the writer thread."""
    body = json.loads(b"".join(x.request)) if x.request else {}
    body = body if isinstance(body, dict) else {}
    chat = x.endpoint == "chat.completions"
    domain = body.get("domain")
    if not (isinstance(domain, str) and domain.strip()) and x.header_domain:
        domain = x.header_domain.decode("utf-8", "replace")
    response = b"".join(x.response)
    if x.event_stream:
        chunks = _events(response)
    else:
        parsed = json.loads(response) if response.strip() else {}
        chunks = [parsed] if isinstance(parsed, dict) else []
    stamp = dt.datetime.fromtimestamp(x.arrived, dt.timezone.utc).isoformat(timespec="milliseconds")
    return TrafficRecord(timestamp=stamp.replace("+00:00", "Z"), request_id=x.request_id, endpoint=x.endpoint,
                         model=body.get("model"), prompt=body.get("messages" if chat else "prompt"),
                         domain=domain.strip() or None if isinstance(domain, str) else None,
                         stream=bool(body.get("stream")), status=x.status,
                         **DrafterState.label(x.drafter, x.drafter_end),
                         **_answers(chunks, chat, x.event_stream)).to_json()


def _line(rec: dict) -> bytes:
    """One JSON line, UTF-8; a string holding a lone surrogate (JSON allows "\\ud800", UTF-8 does not) is
    written escaped instead of costing the line."""
    try:
        return (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def _open_folder(folder: str) -> int:
    """The traffic folder opened as a directory, without following a link (created when missing); a folder
    that is a file, a link or not writable is one ValueError line naming the variable."""
    where = f"TrafficLog: {ENV}DIR={folder}"
    try:
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
            st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode):
            raise ValueError(f"{where} is a symbolic link: name the folder itself (no link is followed)")
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{where} is not a folder")
        fd = os.open(folder, FOLDER_FLAGS)
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or type(e).__name__}") from None
    probe = f".draftsmith-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # root writes past a folder's mode bits
    try:
        os.close(os.open(probe, FILE_FLAGS, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
    except OSError as e:
        os.close(fd)
        why = e.strerror or type(e).__name__
        raise ValueError(f"{where} is not writable by this process ({why})") from None
    return fd


class Writer:
    """A background thread that turns queued exchanges into lines: unbuffered writes of whole lines (a torn
    one is taken back), a new file past `max_file_bytes` or when the current one was deleted or moved away, at
    most `max_files` of this process's own files kept. `os_write` and `os_ftruncate` are the seam the
    fault-injection tests replace (a partial write, a full disk, a stalled disk)."""

    def __init__(self, settings: Settings, counts: Counts):
        self.settings, self.counts = settings, counts
        self.os_write = os.write
        self.os_ftruncate = os.ftruncate
        self.dir_fd: int | None = _open_folder(settings.folder)
        self.fd: int | None = None
        self.name = ""  # the current file, in the folder
        self.size = 0  # bytes of whole lines in it
        self.mine: deque[str] = deque()  # the files this process created, oldest first
        self._cond = threading.Condition()
        self._queue: deque[Exchange] = deque()
        self._current: Exchange | None = None
        self._closed = False
        self._closing = threading.Lock()
        # a daemon thread: a stalled disk never holds the process's exit; close() (lifespan shutdown, atexit)
        # writes what is queued within shutdown_s
        self.thread = threading.Thread(target=self._run, name="draftsmith-traffic-log", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def submit(self, x: Exchange) -> None:
        with self._cond:
            if self._closed:
                kind, what = "lost_at_shutdown", "a request finished after shutdown"
            elif len(self._queue) >= self.settings.queue_size:
                kind, what = "dropped_queue_full", f"queue of {self.settings.queue_size} full"
            else:
                self._queue.append(x)
                self._cond.notify()
                return
        self.counts.settle(x, kind, what)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                x = self._current = self._queue.popleft()
            try:
                self._one(x)
            except Exception as e:  # noqa: BLE001 - costs this record only, never the thread
                self.counts.settle(x, "errors", f"{type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _one(self, x: Exchange) -> None:
        if self.settings.test_stall_s:
            time.sleep(self.settings.test_stall_s)
        try:
            line = _line(record(x))
        except Exception as e:  # noqa: BLE001 - a body that is not JSON, too deep, ...: its own line only
            self.counts.settle(x, "errors", f"{type(e).__name__}: {e}")
            return
        if x.outcome is not None:  # shutdown gave up on it meanwhile
            return
        try:
            start = self._write(line)
        except Exception as e:  # noqa: BLE001 - a full disk, an I/O error: counted; the next record tries
            self.counts.settle(x, "lost", f"{type(e).__name__}: {e}")
            return
        if not self.counts.settle(x, "written"):
            self._take_back(start)  # shutdown counted it lost while the write hung

    def _write(self, line: bytes) -> int:
        """Append `line` whole, or raise with nothing of it left glued to the file; its offset."""
        self._ready(len(line))
        start, done = self.size, 0
        view = memoryview(line)
        try:
            while done < len(line):
                n = self.os_write(self.fd, view[done:])
                if not n or n < 0:
                    raise OSError(errno.EIO, f"a write of {len(line) - done} bytes wrote {n}")
                done += n
        except Exception:
            if done and self._tear(start, done, len(line)):
                return start
            raise
        self.size = start + len(line)
        return start

    def _tear(self, start: int, done: int, total: int) -> bool:
        """A line cut short at `done` of `total` bytes: taken back (truncated), else ended by a newline of its
        own (a line that is no record), else the file closed so the next record opens a new one. True when the
        newline made the line whole after all (only its newline was missing): then it is a written record."""
        try:
            self.os_ftruncate(self.fd, start)
            self.size = start
            return False
        except OSError:
            pass
        try:
            if self.os_write(self.fd, b"\n") == 1:
                self.size = start + done + 1
                return done == total - 1
        except OSError:
            pass
        self._close_file()
        return False

    def _take_back(self, start: int) -> None:
        try:
            self.os_ftruncate(self.fd, start)
            self.size = start
        except OSError as e:
            log.warning("draftsmith traffic log: a line written after shutdown gave it up stays (%s)", e)

    def _ready(self, n: int) -> None:
        """An open file that the folder still names, with room for `n` more bytes."""
        if self.fd is not None and not self._still_named():
            self.counts.add("reopened", f"{self.name} was deleted or moved away")
            self._close_file()
        if self.fd is None or (self.size and self.size + n > self.settings.max_file_bytes):
            self._rotate()

    def _still_named(self) -> bool:
        """Whether the folder path and the file name in it still name what we hold open (inode, and a link
        count above 0): the operator may delete or rotate either."""
        try:
            own, there = os.fstat(self.fd), os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            folder, named = os.fstat(self.dir_fd), os.stat(self.settings.folder, follow_symlinks=False)
        except OSError:
            return False
        return (own.st_nlink > 0 and (own.st_dev, own.st_ino) == (there.st_dev, there.st_ino)
                and (folder.st_dev, folder.st_ino) == (named.st_dev, named.st_ino))

    def _close_file(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    def _rotate(self) -> None:
        self._close_file()
        try:
            folder, named = os.fstat(self.dir_fd), os.stat(self.settings.folder, follow_symlinks=False)
            same = (folder.st_dev, folder.st_ino) == (named.st_dev, named.st_ino)
        except (OSError, TypeError):  # TypeError: no folder open (opening it again failed last time)
            same = False
        if not same:  # the folder was deleted or replaced: open it again (made again when missing)
            if self.dir_fd is not None:
                os.close(self.dir_fd)
                self.dir_fd = None
            self.dir_fd = _open_folder(self.settings.folder)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        for n in range(1000):
            name = f"traffic-{stamp}Z-{os.getpid()}" + (f"-{n}" if n else "") + ".jsonl"
            try:
                self.fd = os.open(name, FILE_FLAGS, 0o644, dir_fd=self.dir_fd)
                break
            except FileExistsError:
                continue
        if self.fd is None:
            raise OSError(errno.EEXIST, f"no free file name for {stamp} in {self.settings.folder}")
        self.name, self.size = name, 0
        self.mine.append(name)
        while len(self.mine) > self.settings.max_files:
            old = self.mine.popleft()
            m = NAME.match(old)
            if m and int(m["pid"]) == os.getpid():  # only a file of ours, by its own name pattern
                try:
                    os.unlink(old, dir_fd=self.dir_fd)
                except FileNotFoundError:
                    pass

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued exchange is settled (tests, shutdown); False if the time ran out."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Take no more records, write what is queued within `timeout` (settings.shutdown_s), count the rest
        `lost_at_shutdown`. Idempotent; lifespan shutdown and atexit both call it."""
        with self._closing:
            if not self._closed:
                self._close(self.settings.shutdown_s if timeout is None else timeout)

    def _close(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.drain(timeout)
        with self._cond:
            left = [*self._queue, *([self._current] if self._current is not None else [])]
            self._queue.clear()
            self._cond.notify_all()
        for x in left:
            self.counts.settle(x, "lost_at_shutdown", f"not written within {timeout:g} s of shutdown")
        self.thread.join(max(0.0, end - time.monotonic()))
        if not self.thread.is_alive():
            self._close_file()
            if self.dir_fd is not None:
                os.close(self.dir_fd)
                self.dir_fd = None
        atexit.unregister(self.close)
        log.warning("draftsmith traffic log: closed; %s", self.counts.snapshot())  # the operator's summary


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return value
    return None


class TrafficLog:
    """The ASGI middleware (module docstring):
    `vllm serve --middleware draftsmith.fleet.middleware.TrafficLog`."""

    def __init__(self, app, settings: Settings | None = None):
        self.app = app
        self.settings = settings or Settings.from_env()
        self.counts = Counts(self.settings.queue_bytes)
        self.writer = Writer(self.settings, self.counts)
        self._domain_header = self.settings.domain_header.lower().encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "lifespan":
            return await self.app(scope, self._until_shutdown(receive), send)
        endpoint = (ENDPOINTS.get(scope.get("path"))
                    if scope.get("type") == "http" and scope.get("method") == "POST" else None)
        if endpoint is None:
            return await self.app(scope, receive, send)
        x = Exchange(endpoint, time.time(), None, None, drafter=DRAFTER.snapshot())
        try:
            pending: deque = deque()
            await self._read_request(receive, x, pending)
            try:
                scope = self._with_request_id(scope, x)
            except Exception as e:  # noqa: BLE001 - the request goes on as it came
                self._failed(x, e)

            async def replay():
                return pending.popleft() if pending else await receive()

            async def tap(message):
                try:
                    self._observe(x, message)
                except Exception as e:  # noqa: BLE001 - the response goes on as it came
                    self._failed(x, e)
                await send(message)

            await self.app(scope, replay, tap)
        finally:
            self._submit(x)

    def _until_shutdown(self, receive):
        """The lifespan's receive: at lifespan.shutdown (every request has ended) the writer writes what is
        queued, within shutdown_s and off the event loop, before the app's own shutdown goes on."""

        async def wrapped():
            message = await receive()
            if message.get("type") == "lifespan.shutdown":
                try:
                    await asyncio.to_thread(self.writer.close)
                except Exception as e:  # noqa: BLE001 - the server's shutdown goes on
                    log.warning("draftsmith traffic log: closing failed: %s: %s", type(e).__name__, e)
            return message

        return wrapped

    async def _read_request(self, receive, x: Exchange, pending: deque) -> None:
        """The request's messages up to its end (or until it is no longer kept), kept to be replayed to the
        app unchanged: the app reads the whole body before it answers anyway, and the id header must be
        decided before it starts."""
        while True:
            message = await receive()
            pending.append(message)
            if message.get("type") != "http.request":
                return
            x.keep(0, message.get("body") or b"", self.settings.max_body_bytes, self.counts)
            if not x.keeping or not message.get("more_body"):
                return

    def _with_request_id(self, scope: dict, x: Exchange) -> dict:
        x.header_domain = _header(scope, self._domain_header)
        given = _header(scope, b"x-request-id")
        if given is not None:
            x.request_id = given.decode("latin-1")
            return scope
        if not x.keeping or b'"request_id"' in b"".join(x.request):
            return scope  # the body may name its own id, which vLLM takes when no header overrides it
        x.request_id = uuid.uuid4().hex
        return {**scope, "headers": [*scope.get("headers", []), (b"x-request-id", x.request_id.encode())]}

    def _observe(self, x: Exchange, message: dict) -> None:
        if x.outcome is not None:
            return
        if message.get("type") == "http.response.start":
            x.status = int(message.get("status", 0))
            content_type = _header(message, b"content-type") or b""
            x.event_stream = content_type.split(b";")[0].strip().lower() == b"text/event-stream"
        elif message.get("type") == "http.response.body":
            x.keep(1, message.get("body") or b"", self.settings.max_body_bytes, self.counts)
            if not message.get("more_body"):
                x.finished = True

    def _failed(self, x: Exchange, e: Exception) -> None:
        self.counts.settle(x, "errors", f"{type(e).__name__}: {e}")

    def _submit(self, x: Exchange) -> None:
        try:
            x.drafter_end = DRAFTER.snapshot()
            if x.outcome is not None:
                return
            if x.over:
                self.counts.settle(x, "over_cap", f"a body over {self.settings.max_body_bytes} bytes")
            elif x.unkept:
                spent = f"the {self.settings.queue_bytes}-byte budget was spent"
                self.counts.settle(x, "dropped_bytes", spent)
            elif not x.finished:
                self.counts.settle(x, "incomplete", "the response ended before its last body message")
            else:
                self.writer.submit(x)
        except Exception as e:  # noqa: BLE001
            self.counts.settle(x, "errors", f"{type(e).__name__}: {e}")
