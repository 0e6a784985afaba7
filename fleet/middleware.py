"""The fleet's traffic, logged by vLLM's own API server: an ASGI middleware that writes one JSON line per
completion request, with vLLM's per-request speculative-decoding counters, for draftsmith to read back as
acceptance per domain (planning/production.py) and as retraining's recent traffic (retrain/traffic.py).

    DRAFTSMITH_TRAFFIC_DIR=/data/traffic vllm serve MODEL --speculative-config '{...}' \
        --per-request-spec-decode-metrics detailed --middleware draftsmith.fleet.middleware.TrafficLog

vLLM adds a middleware class with `app.add_middleware(cls)` (entrypoints/serve/middleware/register.py): no
constructor arguments, so it is configured by environment variables, read once at start (a bad value stops the
server there, never a request):

    DRAFTSMITH_TRAFFIC_DIR              the folder (required; created)
    DRAFTSMITH_TRAFFIC_MAX_FILE_BYTES   a file is closed and a new one opened past this (default 64 MiB)
    DRAFTSMITH_TRAFFIC_MAX_FILES        files of this process kept; its oldest is deleted past it (default 100)
    DRAFTSMITH_TRAFFIC_QUEUE            records waiting for the writer thread (default 1024)
    DRAFTSMITH_TRAFFIC_MAX_BODY_BYTES   a request or a response longer than this is passed on, not logged
                                        (default 8 MiB)
    DRAFTSMITH_TRAFFIC_DOMAIN_HEADER    the header a client names its domain in (default X-Draftsmith-Domain)

Logged: POST /v1/completions and /v1/chat/completions. One line per request, in
`<dir>/traffic-<UTC time>-<pid>.jsonl` (each API server process writes its own files):
    {"timestamp": ISO UTC (arrival), "id": the response id, "request_id": X-Request-Id, "endpoint",
     "model", "prompt": the completion prompt (text or token ids) or the chat messages, "domain": the body's
     own `domain` field, else the domain header, else absent, "response": the answer text (a list for n > 1),
     "output_token_ids" (with `return_token_ids`), "usage", "finish_reason", "stream", "status",
     "speculative_decoding": vLLM's `metrics.speculative_decoding`, verbatim, "error" (vLLM's message)}
vLLM reports `metrics.speculative_decoding` only with `--per-request-spec-decode-metrics summary|detailed`, only
for one prompt with n == 1, and in a stream only on its final usage chunk, which vLLM sends only when the
client asks `stream_options: {"include_usage": true}` or the server runs with `--enable-force-include-usage`:
a stream without it is logged without counters (the reader counts such rows as `uncounted`).

The request never waits for the log and never fails because of it: the request's and the response's bytes
pass through unchanged (vLLM accepts the unknown `domain` field: its request models allow extra fields); the
one thing added is an `X-Request-Id` header (a uuid4 hex) where the client sent none and no body
`request_id`, so that the id vLLM builds the engine's request id from (`cmpl-<id>-0-<8 hex>`,
`chatcmpl-<id>-<8 hex>`) is set here — the response `id` logged is what fleet/vllm_capture.py's files,
named by engine request id, are joined on. Bodies are kept as bytes up to the cap (nothing is parsed on the
event loop); a finished exchange goes into a bounded queue (full: the record is dropped and counted, never
waited for), and one background thread parses it and appends the line with one unbuffered write, so a
reader sees whole lines. Every exception of the logging path is caught and counted (`counts`; a warning in
vLLM's log at the 1st, 2nd, 4th, 8th ... of each kind). A process deletes only files it created itself
(matching its own name pattern and pid); files of earlier processes stay for the operator's retention. The
writer is a daemon thread: records still queued when the process exits are lost, never waited for.

Runs inside vLLM's environment: the standard library only (scripts/check_imports.py, rule 5).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("draftsmith.fleet.middleware")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
NAME = re.compile(r"^traffic-\d{8}T\d{12}Z-(?P<pid>\d+)(?:-\d+)?\.jsonl$")
ENV = "DRAFTSMITH_TRAFFIC_"


def _env_int(env, name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(ENV + name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and lo <= int(raw) <= hi):
        raise ValueError(f"TrafficLog: {ENV}{name}={raw[:40]!r}, expected an integer in {lo}..{hi}")
    return int(raw)


@dataclass(frozen=True)
class Settings:
    """What the middleware is configured with (module docstring: the environment variables)."""

    folder: str
    max_file_bytes: int = 64 << 20
    max_files: int = 100
    queue_size: int = 1024
    max_body_bytes: int = 8 << 20
    domain_header: str = "X-Draftsmith-Domain"

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
                   _env_int(env, "MAX_BODY_BYTES", cls.max_body_bytes, 1, 1 << 34), header)


class Counts:
    """What the logging path did, by kind; read from both the event loop and the writer thread."""

    KINDS = ("written", "dropped_queue_full", "over_cap", "incomplete", "errors")

    def __init__(self):
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, what: str = "") -> None:
        with self._lock:
            self.values[kind] += 1
            n = self.values[kind]
        if kind != "written" and n & (n - 1) == 0:  # 1, 2, 4, 8 ...: seen in the log, never a flood
            log.warning("draftsmith traffic log: %s %d times%s", kind, n, f" (latest: {what[:200]})" if what else "")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


@dataclass
class Exchange:
    """One request and its response as they passed through: bytes kept up to the cap, nothing parsed."""

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
    off: bool = False  # the logging path failed for this exchange: passed on, not logged
    sizes: list[int] = field(default_factory=lambda: [0, 0])  # request, response bytes kept

    def keep(self, side: int, chunk: bytes, cap: int) -> None:
        if self.over or not chunk:
            return
        self.sizes[side] += len(chunk)
        if self.sizes[side] > cap:
            self.over = True
            self.request.clear()
            self.response.clear()
        else:
            (self.request if side == 0 else self.response).append(chunk)


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
            out["error"] = str(err.get("message") if isinstance(err, dict) else chunk.get("message", err))[:2000]
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
    """The JSON line of one finished exchange (module docstring); run on the writer thread."""
    body = json.loads(b"".join(x.request)) if x.request else {}
    body = body if isinstance(body, dict) else {}
    chat = x.endpoint == "chat.completions"
    rec: dict = {"timestamp": dt.datetime.fromtimestamp(x.arrived, dt.timezone.utc).isoformat(timespec="milliseconds")
                 .replace("+00:00", "Z"), "id": None, "request_id": x.request_id, "endpoint": x.endpoint,
                 "model": body.get("model"), "prompt": body.get("messages" if chat else "prompt")}
    domain = body.get("domain")
    if not (isinstance(domain, str) and domain.strip()) and x.header_domain:
        domain = x.header_domain.decode("utf-8", "replace").strip()
    if isinstance(domain, str) and domain.strip():
        rec["domain"] = domain.strip()
    response = b"".join(x.response)
    if x.event_stream:
        chunks = _events(response)
    else:
        parsed = json.loads(response) if response.strip() else {}
        chunks = [parsed] if isinstance(parsed, dict) else []
    rec.update(_answers(chunks, chat, x.event_stream))
    rec["stream"] = bool(body.get("stream"))
    rec["status"] = x.status
    return rec


def _line(rec: dict) -> bytes:
    """One JSON line, UTF-8; a string holding a lone surrogate (JSON allows "\\ud800", UTF-8 does not) is
    written escaped instead of costing the line."""
    try:
        return (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


class Writer:
    """A background thread that turns queued exchanges into lines: one unbuffered write per line, a new file
    past `max_file_bytes`, at most `max_files` of this process's own files kept."""

    def __init__(self, settings: Settings, counts: Counts):
        self.settings, self.counts = settings, counts
        os.makedirs(settings.folder, exist_ok=True)
        self.queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=settings.queue_size)
        self.fd: int | None = None
        self.size = 0
        self.mine: deque[str] = deque()  # the files this process created, oldest first
        self.thread = threading.Thread(target=self._run, name="draftsmith-traffic-log", daemon=True)
        self.thread.start()

    def submit(self, x: Exchange) -> None:
        try:
            self.queue.put_nowait(x)
        except queue.Full:
            self.counts.add("dropped_queue_full", f"queue of {self.settings.queue_size} full")

    def _run(self) -> None:
        while True:
            x = self.queue.get()
            try:
                if x is None:
                    return
                self._write(_line(record(x)))
                self.counts.add("written")
            except Exception as e:  # noqa: BLE001 - a bad exchange or a full disk costs its own line only
                self.counts.add("errors", f"{type(e).__name__}: {e}")
            finally:
                self.queue.task_done()

    def _write(self, line: bytes) -> None:
        if self.fd is None or (self.size and self.size + len(line) > self.settings.max_file_bytes):
            self._rotate()
        view = memoryview(line)
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(line)

    def _rotate(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        for n in range(1000):
            name = f"traffic-{stamp}Z-{os.getpid()}" + (f"-{n}" if n else "") + ".jsonl"
            path = os.path.join(self.settings.folder, name)
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                continue
        if self.fd is None:
            raise OSError(f"no free file name for {stamp} in {self.settings.folder}")
        self.size = 0
        self.mine.append(path)
        while len(self.mine) > self.settings.max_files:
            old = self.mine.popleft()
            m = NAME.match(os.path.basename(old))
            if m and int(m["pid"]) == os.getpid():  # only a file of ours, by its own name pattern
                try:
                    os.unlink(old)
                except FileNotFoundError:
                    pass

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued exchange is written (tests, shutdown); False if the time ran out."""
        end = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)
        return not self.queue.unfinished_tasks

    def close(self, timeout: float = 10.0) -> None:
        self.drain(timeout)
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self.thread.join(timeout)
        if self.fd is not None and not self.thread.is_alive():
            os.close(self.fd)
            self.fd = None


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return value
    return None


class TrafficLog:
    """The ASGI middleware (module docstring). `vllm serve --middleware draftsmith.fleet.middleware.TrafficLog`."""

    def __init__(self, app, settings: Settings | None = None):
        self.app = app
        self.settings = settings or Settings.from_env()
        self.counts = Counts()
        self.writer = Writer(self.settings, self.counts)
        self._domain_header = self.settings.domain_header.lower().encode()

    async def __call__(self, scope, receive, send):
        endpoint = (ENDPOINTS.get(scope.get("path"))
                    if scope.get("type") == "http" and scope.get("method") == "POST" else None)
        if endpoint is None:
            return await self.app(scope, receive, send)
        x = Exchange(endpoint, time.time(), None, None)
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

        try:
            await self.app(scope, replay, tap)
        finally:
            self._submit(x)

    async def _read_request(self, receive, x: Exchange, pending: deque) -> None:
        """The request's messages up to its end (or the cap), kept to be replayed to the app unchanged: the
        app reads the whole body before it answers anyway, and the id header must be decided before it starts."""
        while True:
            message = await receive()
            pending.append(message)
            if message.get("type") != "http.request":
                return
            x.keep(0, message.get("body") or b"", self.settings.max_body_bytes)
            if x.over or not message.get("more_body"):
                return

    def _with_request_id(self, scope: dict, x: Exchange) -> dict:
        x.header_domain = _header(scope, self._domain_header)
        given = _header(scope, b"x-request-id")
        if given is not None:
            x.request_id = given.decode("latin-1")
            return scope
        if x.over or b'"request_id"' in b"".join(x.request):
            return scope  # the body may name its own id, which vLLM takes when no header overrides it
        x.request_id = uuid.uuid4().hex
        return {**scope, "headers": [*scope.get("headers", []), (b"x-request-id", x.request_id.encode())]}

    def _observe(self, x: Exchange, message: dict) -> None:
        if message.get("type") == "http.response.start":
            x.status = int(message.get("status", 0))
            content_type = _header(message, b"content-type") or b""
            x.event_stream = content_type.split(b";")[0].strip().lower() == b"text/event-stream"
        elif message.get("type") == "http.response.body":
            x.keep(1, message.get("body") or b"", self.settings.max_body_bytes)
            if not message.get("more_body"):
                x.finished = True

    def _failed(self, x: Exchange, e: Exception) -> None:
        x.off = True
        self.counts.add("errors", f"{type(e).__name__}: {e}")

    def _submit(self, x: Exchange) -> None:
        try:
            if x.off:
                return
            if x.over:
                self.counts.add("over_cap", f"a body over {self.settings.max_body_bytes} bytes")
            elif not x.finished:
                self.counts.add("incomplete", "the response ended before its last body message")
            else:
                self.writer.submit(x)
        except Exception as e:  # noqa: BLE001
            self.counts.add("errors", f"{type(e).__name__}: {e}")
