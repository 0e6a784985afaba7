"""The one HTTP client: every request draftsmith makes to a server (OpenAI-compatible completion servers,
vLLM's /metrics, health probes) goes through `request`.

A server is outside input like a file, and is bounded the same way, once, here:
  * a byte cap (`max_bytes`): the body is read in pieces and refused past the cap (a Content-Length above
    it is refused before reading), so an endless body costs at most the cap in memory;
  * a total deadline (`deadline` seconds) for the whole request: connect, send, headers and every byte of
    the body. A socket timeout bounds one read, so a server sending a byte just inside it each time would
    keep the reader forever; a timer that shuts the socket at the deadline bounds the sum;
  * `loads`: UTF-8 or a one-line refusal, and JSON nested at most `max_depth` deep (counted before parsing,
    without recursion, so a 100,000-deep answer is a bad answer and not a RecursionError);
  * secrets never leave in a message: `redact` removes the key the caller sent (any Authorization header
    value), Bearer tokens, `api_key=` / `"api_key": ...` / `x-api-key:` values, `sk-...` keys and URL
    credentials; `safe_url` is a URL without them. Every NetError is redacted, so whatever a server echoes
    (a proxy that prints the request it could not serve) is written nowhere.
Redirects are never followed (http.client does not follow them): a followed one would carry the key to
whatever origin the server names. The caller sees the 3xx status and refuses it.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from draftsmith.errors import DataError
from draftsmith.storage import json_depth

METRICS_MAX_BYTES = 64 << 20  # a /metrics page of vLLM is tens of KiB; a thousand LoRA adapters stay far below
ANSWER_MAX_BYTES = 16 << 20  # one completion, with token ids and logprobs, is at most a few MiB
MAX_DEPTH = 64  # an OpenAI answer nests about 5 deep
ERROR_BODY_BYTES = 4096  # what is read of an error answer: its first line explains it

REDACTED = "[redacted]"
_VALUE = r"[^\s\"',;&}\]]+"
_PATTERNS = [
    # Authorization: Bearer X / "Authorization": "Basic X" / authorization=X
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?:(?:bearer|basic|token)\s+)?" + _VALUE),
    re.compile(r"(?i)\b(bearer\s+)" + _VALUE),
    re.compile(r"(?i)\b((?:x-)?(?:api[_-]?key|access[_-]?token|auth[_-]?token|token|secret|password)[\"']?"
               r"\s*[:=]\s*[\"']?)" + _VALUE),
    re.compile(r"()\bsk-[A-Za-z0-9_\-]{6,}"),
    re.compile(r"(://)[^/\s@]+@"),  # credentials in a URL
]


def redact(text: str, secrets=()) -> str:
    """`text` with every secret removed: each of `secrets` (the key the caller holds) wherever it appears,
    and anything spelled like a credential (module docstring)."""
    text = str(text)
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, REDACTED)
    for p in _PATTERNS:
        text = p.sub(lambda m: m[1] + (REDACTED + "@" if m[1] == "://" else REDACTED), text)
    return text


def safe_url(url: str) -> str:
    """`url` as it may be printed: no user:password, no credential in its query."""
    return redact(url).replace(f"://{REDACTED}@", "://")


class NetError(DataError):
    """A request that gave no usable answer, as one line: `url` (safe to print), `reason`; `status` where the
    server answered an HTTP status (else None), `headers` of that answer, `detail` its body's first line."""

    def __init__(self, url: str, reason: str, status: int | None = None, headers: dict | None = None,
                 detail: str = ""):
        self.url, self.reason, self.status = url, reason, status
        self.headers, self.detail = headers or {}, detail
        super().__init__(f"{url}: {reason}")


@dataclass
class Response:
    url: str  # safe to print
    status: int
    body: bytes
    headers: dict = field(default_factory=dict)
    secrets: tuple = ()

    def text(self) -> str:
        return decode(self.body, self.url)

    def json(self, max_depth: int = MAX_DEPTH):
        return loads(self.body, self.url, max_depth, self.secrets)


def decode(data: bytes, where: str, what: str = "the answer") -> str:
    """UTF-8 text, or one line naming `where` and the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NetError(where, f"{what} is not UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def loads(data: bytes, url: str, max_depth: int = MAX_DEPTH, secrets=()):
    """A JSON answer: UTF-8, nested at most `max_depth` deep, or a NetError naming `url`."""
    text = decode(data, url)
    depth = json_depth(text)
    if depth > max_depth:
        raise NetError(url, f"the answer nests JSON {depth} deep (at most {max_depth} is read); refused")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise NetError(url, f"the answer is not JSON ({redact(text[:80], secrets)!r})") from None


def _prepared(url: str, headers: dict | None, has_body: bool):
    """(printable URL, its parts, port, the headers to send, the secrets they hold) of a request, or a NetError
    for a URL that is not one draftsmith can ask; credentials in the URL become a Basic Authorization header."""
    safe = safe_url(url)
    headers = dict(headers or {})
    secrets = tuple(v.split()[-1] for k, v in headers.items() if k.lower() == "authorization" and v.split())
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise NetError(safe, "the port is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NetError(safe, "not an http(s) URL")
    if parts.username is not None:
        cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers.setdefault("Authorization", "Basic " + base64.b64encode(cred.encode()).decode())
        secrets += (headers["Authorization"].split()[-1], parts.password or "")
    if has_body:
        headers.setdefault("Content-Type", "application/json")
    return safe, parts, port, headers, secrets


def request(url: str, body: bytes | None = None, *, deadline: float, max_bytes: int,
            headers: dict | None = None, method: str | None = None) -> Response:
    """One HTTP(S) request, answered within `deadline` seconds in all and at most `max_bytes` long. Returns
    the Response of a 2xx status; any other status, a refused connection, a deadline passed, a body too long
    or cut short is a NetError (module docstring). The values of `headers` never appear in its message."""
    safe, parts, port, headers, secrets = _prepared(url, headers, body is not None)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, port, timeout=deadline)
    expired = threading.Event()
    opened: list[socket.socket] = []  # the connection's socket: http.client drops conn.sock once the headers say
    # the body ends at close, while the body is still being read from it

    def cut() -> None:  # the deadline: whatever the request is waiting on returns now
        expired.set()
        for sock in opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline, cut)
    timer.daemon = True
    started = time.monotonic()
    timer.start()
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.connect()  # bounded by the socket timeout (= the deadline)
        opened.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting
            cut()
        conn.request(method or ("GET" if body is None else "POST"), target, body=body, headers=headers)
        resp = conn.getresponse()
        answer = {k: v for k, v in resp.getheaders()}
        if not 200 <= resp.status < 300:
            data = _read(resp, ERROR_BODY_BYTES, safe, partial=True)
            detail = redact(" ".join(data.decode("utf-8", "replace").split())[:300], secrets)
            raise NetError(safe, f"HTTP {resp.status} {resp.reason}: {detail}".rstrip(": "), resp.status, answer,
                           detail)
        data = _read(resp, max_bytes, safe)
        if expired.is_set():  # the socket was shut at the deadline: what was read is a part, not the answer
            raise _late(safe, deadline)
    except NetError as e:
        if expired.is_set() and e.status is None:
            raise _late(safe, deadline) from None
        raise
    except (http.client.HTTPException, OSError) as e:
        if expired.is_set() or isinstance(e, TimeoutError):
            raise _late(safe, deadline if expired.is_set() else time.monotonic() - started) from None
        if isinstance(e, http.client.HTTPException):  # an answer cut short (IncompleteRead), a garbled status
            raise NetError(safe, f"{type(e).__name__}: the answer was cut short or garbled "
                                 f"({redact(str(e)[:120], secrets)})") from None
        reason = getattr(e, "reason", None) or e
        raise NetError(safe, f"{type(e).__name__}: {redact(str(reason)[:200], secrets)}") from None
    finally:
        timer.cancel()
        conn.close()
    return Response(safe, resp.status, data, answer, secrets)


def _late(url: str, seconds: float) -> NetError:
    return NetError(url, f"no complete answer within the {seconds:g} s deadline (timed out)")


def _read(resp: http.client.HTTPResponse, max_bytes: int, url: str, partial: bool = False) -> bytes:
    """The body, read in pieces up to `max_bytes` (`partial`: the first `max_bytes` of it, the rest left)."""
    length = resp.getheader("Content-Length")
    if not partial and length and length.strip().isdigit() and int(length) > max_bytes:
        raise NetError(url, f"the answer is larger than {max_bytes} bytes (Content-Length {int(length)}); refused")
    pieces, n = [], 0
    while True:
        piece = resp.read1(min(65536, max_bytes + 1 - n))
        if not piece:
            break
        n += len(piece)
        if n > max_bytes:
            if partial:
                pieces.append(piece[:max_bytes - n])
                break
            raise NetError(url, f"the answer is larger than {max_bytes} bytes; refused (a server's answer is "
                                "read up to a cap)")
        pieces.append(piece)
    if not partial and resp.length:  # the connection closed before the Content-Length it announced
        raise NetError(url, f"IncompleteRead: the answer was cut short ({n} bytes, {n + resp.length} announced)")
    return b"".join(pieces)
