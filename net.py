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
  * secrets never leave in a message, by one redaction that parses rather than guesses: `redact` removes
    each secret the caller holds (the Authorization values a request sent, the API key of
    `generation.api_key_env`, DRAFTSMITH_API_KEY / OPENAI_API_KEY ...: hold_secret, SECRET_ENV) in every
    spelling a server may echo it in: raw, percent-encoded (quote, quote_plus, either hex case), base64
    (standard or URL-safe, padded or not, inside Basic's user:key too) and JSON-escaped; it passes every URL
    in the text through `safe_url`, which splits it as urllib does and drops the userinfo and the value of
    every query or fragment parameter named like a credential (key, token, sig, api_key, client_secret,
    X-Amz-Signature ...); Bearer / api_key= / sk-... values of keys no one named are replaced too. Every
    NetError is redacted, so whatever a server echoes (a proxy that prints the request it could not serve)
    is written nowhere; draftsmith's loggers, the CLI's error line and the files that record outside text
    (provenance, run records, the alpha table) pass through the same `redact` (`redact_all` for JSON).
Redirects are never followed (http.client does not follow them): a followed one would carry the key to
whatever origin the server names. The caller sees the 3xx status and refuses it.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from draftsmith.errors import DataError
from draftsmith.reading import json_depth

METRICS_MAX_BYTES = 64 << 20  # a /metrics page of vLLM is tens of KiB; a thousand LoRA adapters stay far below
ANSWER_MAX_BYTES = 16 << 20  # one completion, with token ids and logprobs, is at most a few MiB
MAX_DEPTH = 64  # an OpenAI answer nests about 5 deep
ERROR_BODY_BYTES = 4096  # what is read of an error answer: its first line explains it

REDACTED = "[redacted]"
# The environment variables that hold an API key of draftsmith's servers (or of what it runs beside): their
# values are secrets of this process wherever they turn up, whoever writes the line.
SECRET_ENV = ("DRAFTSMITH_API_KEY", "OPENAI_API_KEY", "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
              "WANDB_API_KEY")
MIN_SECRET = 4  # a shorter "secret" would blank out ordinary words; no key is that short
_HELD: dict[str, None] = {}  # the secrets this process was handed (hold_secret), in the order it got them
_HELD_MAX = 256  # a process talks to a few servers with a few keys; past this, a key is redacted where passed

_VALUE = r"(?!\[redacted\])[^\s\"',;&}\]]+"  # a credential's value, never the mark of one already removed
_SEP = r"[\"']?\s*(?:[:=]|%3[AaDd])\s*[\"']?"  # `: `, `=`, `":"`, and their percent-encoded spellings
_SPACE = r"(?:\s+|%20|\+)"
# Spelled like a credential, in text that is not a URL (URLs are parsed: safe_url). The names are the ones
# that say so whatever precedes them (openai_api_key, client_secret, X-Amz-Signature).
_PATTERNS = [
    # Authorization: Bearer X / "Authorization": "Basic X" / authorization=X / Authorization%3A%20Bearer%20X
    re.compile(r"(?i)(authorization" + _SEP + r"(?:(?:bearer|basic|token)" + _SPACE + r")?+)" + _VALUE),
    re.compile(r"(?i)\b(bearer" + _SPACE + r")" + _VALUE),
    # openai_api_key=, x-api-key:, client_secret=, db_password=, access_token=, "token": ...; never a
    # pad_token or max_tokens, which name no secret
    re.compile(r"(?i)\b((?:(?:[\w-]*[_-])?(?:(?:api|access|secret|private)[_-]?key|secret|password|passwd|"
               r"(?:access|auth|refresh|id|bearer|session|security|oauth)[_-]?token)|(?:x-)?(?:api[_-]?key|token))"
               + _SEP + r")" + _VALUE),
    re.compile(r"()\bsk-[A-Za-z0-9_\-]{6,}"),
]
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]+")
# A query or fragment parameter whose name (any word of it, split at _ - . and case changes) says it holds
# a credential: a word ending in key, token, secret, sig(nature), passw(or)d, pwd, auth, credential(s), jwt,
# cookie, passphrase, or starting with session or authoriz. `author`, `monkeys`, `max_tokens` are not.
_SECRET_WORD = re.compile(r"(?:\w*(?:key|token|secret|sig|signature|passw(?:or)?d|pwd|auth|credentials?|jwt|"
                          r"cookie|passphrase)|session\w*|authoriz\w*)")


def hold_secret(*values: str | None) -> None:
    """Remember `values` as secrets of this process (the API key read from `generation.api_key_env`, a key or
    password a request sent): every later redact() removes them in every spelling, whoever calls it and with
    whatever it passes, so a line written far from where the key was read (a log handler, the CLI's error
    line, a run record) never carries it."""
    for v in values:
        if isinstance(v, str) and len(v) >= MIN_SECRET and v not in _HELD and len(_HELD) < _HELD_MAX:
            _HELD[v] = None


def _known(secrets) -> tuple[str, ...]:
    """`secrets` with the ones this process holds (hold_secret, SECRET_ENV), long enough to look for, the
    longest first (a secret that holds another is removed whole)."""
    found = {s for s in (*secrets, *list(_HELD), *(os.environ.get(n) for n in SECRET_ENV))
             if isinstance(s, str) and len(s) >= MIN_SECRET}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def _ci(text: str) -> str:
    """A regex for `text` whose letters match in either case (the hex of an escape: %2b, \\u00E9)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in text)


def _char(ch: str) -> str:
    """A regex for one character of a secret in each way text carries it: itself, percent-encoded (either
    hex case, once or twice, `+` for a space: quote and quote_plus), JSON-escaped (`\\"`, `\\/`,
    `\\u00e9`)."""
    forms = {re.escape(ch), "".join("%(?:25)?" + _ci(f"{b:02X}") for b in ch.encode())}
    if ch == " ":
        forms.add(r"\+")
    escaped = json.dumps(ch)[1:-1]
    if escaped != ch:
        forms.add(_ci(escaped) if escaped.startswith("\\u") else re.escape(escaped))
    if ch == "/":
        forms.add(r"\\/")
    return "(?:" + "|".join(sorted(forms, key=len, reverse=True)) + ")"


def _base64(secret: bytes) -> list[str]:
    """The base64 spellings of `secret`, standard and URL-safe: alone (padded, or not), and the characters
    that spell it inside a longer value at each of the three offsets modulo 3 (Basic's `user:key`, a token
    wrapped in JSON and encoded): the characters whose 6 bits all come from the secret."""
    out = [base64.b64encode(secret).decode()]
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + secret).decode()
        core = enc[(8 * k + 5) // 6:(8 * (k + len(secret))) // 6]
        if len(core) >= 6:
            out.append(core)
    out += [s.replace("+", "-").replace("/", "_") for s in out]
    return sorted(set(out), key=len, reverse=True)


@functools.lru_cache(maxsize=64)
def _secrets_pattern(secrets: tuple[str, ...]) -> re.Pattern | None:
    """One regex for every spelling of every secret (longest first)."""
    alts = []
    for s in secrets:
        alts += ["".join(_char(c) for c in s), *map(re.escape, _base64(s.encode()) if len(s) >= 8 else [])]
    return re.compile("|".join(alts)) if alts else None


def _secret_name(name: str) -> bool:
    """Whether a URL parameter named `name` (as written, percent-encoded or not) holds a credential."""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", urllib.parse.unquote_plus(name))
    return any(_SECRET_WORD.fullmatch(w) for w in re.split(r"[^a-z0-9]+", name.lower()) if w)


def _params(text: str) -> str:
    """A query or fragment (`a=1&key=x;sig=y`) with the value of every credential parameter replaced."""
    pieces = re.split(r"([&;])", text)
    for i in range(0, len(pieces), 2):
        name, eq, _ = pieces[i].partition("=")
        if eq and _secret_name(name):
            pieces[i] = f"{name}={REDACTED}"
    return "".join(pieces)


def _parsed_url(url: str) -> str:
    """`url` with its userinfo dropped and its credential parameters replaced, split as urllib.parse.urlsplit
    splits it: the netloc runs from `//` to the first `/`, `?` or `#`, its userinfo up to its last `@`. A
    password holding `/` ends urllib's netloc early and goes on in what it reads as the path: where the netloc
    has a `:` (user:pass) and that path an `@`, everything up to the path's last `@` is taken for userinfo and
    printed as `[redacted]@` (a port followed by an `@` in the path is cut too: never a password printed)."""
    m = re.match(r"(?s)((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)([^/?#]*)(.*)", url)
    head, tail = "", url
    if m:
        prefix, netloc, tail = m.groups()
        path = re.match(r"[^?#]*", tail)[0]
        if ":" in netloc and "@" in path:
            head, tail = f"{prefix}{REDACTED}@", tail[path.rindex("@") + 1:]
        else:
            userinfo, _, host = netloc.rpartition("@")
            head = prefix + (f"{REDACTED}@" if userinfo == REDACTED else "") + host  # printed before: kept
    path = re.match(r"[^?#]*", tail)[0]
    rest = tail[len(path):]
    if rest.startswith("?"):
        query, mark, fragment = rest[1:].partition("#")
        return f"{head}{path}?{_params(query)}{mark}{_params(fragment)}"
    return head + path + (f"#{_params(rest[1:])}" if rest else "")


def _without_secrets(text, secrets) -> str:
    """`text` with every spelling of each of `secrets` and of the secrets this process holds removed."""
    pattern = _secrets_pattern(_known(secrets))
    return str(text) if pattern is None else pattern.sub(REDACTED, str(text))


def _scrub(text: str) -> str:
    """`text` with the values of credentials no one named (Bearer X, api_key=X, sk-...) replaced."""
    for p in _PATTERNS:
        text = p.sub(lambda m: m[1] + REDACTED, text)
    return text


def redact(text, secrets=()) -> str:
    """`text` as it may be written anywhere (a log line, an error, provenance, a report): every spelling of
    each of `secrets` and of the secrets this process holds (hold_secret, SECRET_ENV) removed, each URL in
    it as safe_url prints it, and anything else spelled like a credential (Bearer X, api_key=X, sk-...)
    replaced."""
    return _scrub(_URL.sub(lambda m: _parsed_url(m[0]), _without_secrets(text, secrets)))


def safe_url(url, secrets=()) -> str:
    """`url` as it may be printed: no userinfo (split as urllib splits it), no credential parameter's value
    in its query or fragment, no secret in any spelling; every other character as it was."""
    return _scrub(_parsed_url(_without_secrets(url, secrets)))


def redact_all(obj, secrets=()):
    """A JSON-like `obj` (a provenance, a run record, a table) with every string in it, keys too, redacted."""
    if isinstance(obj, str):
        return redact(obj, secrets)
    if isinstance(obj, dict):
        return {redact_all(k, secrets): redact_all(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_all(v, secrets) for v in obj]
    return obj


class _LogRedaction(logging.Handler):
    """First among the handlers of draftsmith's logger (and, in the CLI's process, of the root logger):
    every record reaching a handler above it (the console, a log file, pytest's capture) has passed it,
    redacted. A Filter on a logger sees only the records of that very logger, never its children's; a
    handler sees them all, before the handlers of the loggers above. It writes nothing itself, except where
    no other handler would take the record: then logging.lastResort does, as it would without this one."""

    redacts = True  # what guard_logging recognises it by (a reloaded module makes another class)

    def handle(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "draftsmith_redacted", False):
            try:
                record.msg, record.args = redact(record.getMessage()), None
                if record.exc_info and not record.exc_text:
                    record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_text = redact(record.exc_text) if record.exc_text else record.exc_text
                record.stack_info = redact(record.stack_info) if record.stack_info else record.stack_info
            except Exception:  # arguments that do not format: the handlers report that as they would
                pass
            record.draftsmith_redacted = True
            last = logging.lastResort
            if last is not None and record.levelno >= last.level and not _other_handlers(record):
                last.handle(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


def _other_handlers(record: logging.LogRecord) -> bool:
    """Whether a handler other than _LogRedaction takes `record` on its way up from its logger."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(not getattr(h, "redacts", False) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def guard_logging(name: str = "draftsmith") -> None:
    """Put _LogRedaction first among the handlers of logger `name` (once): draftsmith's own as this module is
    imported, the root logger's where the CLI owns the process (every line of it, a library's too)."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "redacts", False) for h in logger.handlers):
        # the list replaced whole, not changed in place: a record going through the old one is unharmed
        logger.handlers = [_LogRedaction(), *logger.handlers]


guard_logging()


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
        secrets += (headers["Authorization"].split()[-1], parts.password or "",
                    urllib.parse.unquote(parts.password or ""))
    hold_secret(*secrets)  # the key and the password are this process's secrets from now on, in every line
    if has_body:
        headers.setdefault("Content-Type", "application/json")
    return safe, parts, port, headers, secrets


def request(url: str, body: bytes | None = None, *, deadline: float, max_bytes: int,
            headers: dict | None = None, method: str | None = None, on_piece=None) -> Response:
    """One HTTP(S) request, answered within `deadline` seconds in all and at most `max_bytes` long. Returns
    the Response of a 2xx status; any other status, a refused connection, a deadline passed, a body too long
    or cut short is a NetError (module docstring). The values of `headers` never appear in its message.
    `on_piece(bytes)`: called with each piece of a 2xx body as it arrives, within the same cap and deadline (a
    streamed answer's events are timed as they come: serve-bench's time to first token); the whole body is
    still returned."""
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
        data = _read(resp, max_bytes, safe, on_piece=on_piece)
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


def _read(resp: http.client.HTTPResponse, max_bytes: int, url: str, partial: bool = False, on_piece=None) -> bytes:
    """The body, read in pieces up to `max_bytes` (`partial`: the first `max_bytes` of it, the rest left);
    `on_piece` sees each piece within the cap as it is read."""
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
        if on_piece is not None:
            on_piece(piece)
    if not partial and resp.length:  # the connection closed before the Content-Length it announced
        raise NetError(url, f"IncompleteRead: the answer was cut short ({n} bytes, {n + resp.length} announced)")
    return b"".join(pieces)
