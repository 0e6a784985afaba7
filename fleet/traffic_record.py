"""The traffic line: the one typed definition of what fleet/middleware.py writes for each request (one JSON object
per line of `traffic-*.jsonl`), and the one check every reader turns a parsed line into a typed record with.

Writer and readers share it: the middleware builds its line as a `TrafficRecord` (`to_json`), and
planning/logs.py hands every reader (`draftsmith alpha`, retraining's traffic, the held-out prompts evaluation
reads) `parse_record`'s result, so the readers cannot disagree about what a row says. A gateway's own logs in the
same shape (fewer fields, other engines' counters beside them) are read too: a field outside the schema is kept in
`extra` (planning/production.py reads SGLang's and gateways' counters there).

What a row is, decided once here:
- refused: vLLM answered with a status other than 200, or the line carries an `error` — it never trains, and it
  is counted `refused` (checked first: a refused request's other fields are whatever the client sent);
- unencodable: a string holding a lone surrogate (JSON allows "\\ud800", UTF-8 cannot encode it; the middleware
  writes such a line escaped) — the row is dropped and counted `unencodable`, so no file written from the rows
  (the held-out prompts, the data pipeline's prompts) can carry it;
- malformed: a field of the wrong type — one line naming the field;
- else a `TrafficRecord`, whose reader's view is computed once: `text` (the completion prompt, or the chat's
  last user message with its OpenAI content parts' text joined by newlines), `messages` (each message's text or
  None: an assistant's tool-call message with `content: null`, a tool result, an image-only message are kept
  as messages without text, and the chat stays usable) and `seconds` (the timestamp as epoch seconds).

Runs inside vLLM's environment: the standard library only (scripts/check_imports.py, rule 5).
"""

from __future__ import annotations

import datetime as dt
import math
import reprlib
from dataclasses import dataclass, field, fields

MALFORMED, REFUSED, UNENCODABLE = "malformed", "refused", "unencodable"
MAX_ID = 200  # the response id joins a row to its captured states (fleet/vllm_capture.py names files by it)
MAX_DOMAIN = 200  # a domain is a label; a longer one is a client's payload, not a traffic class
MAX_VERSION = 200  # a drafter version label (fleet/drafter_route.py takes it from a swap's body, the log carries it)
MAX_SHOWN = 120  # characters of a value an error line shows
# written on every line, null when unknown; the other fields are left out of the line when absent
ALWAYS = ("timestamp", "id", "request_id", "endpoint", "model", "prompt", "stream", "status")
KEPT_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")  # what a normalised chat message keeps besides its text


class Unusable(ValueError):  # noqa: N818 - read as "the row is unusable"; a ValueError so readers catch it as one
    """A parsed line that gives no usable record: `kind` is MALFORMED, REFUSED or UNENCODABLE, the message one line
    naming the field."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


@dataclass
class TrafficRecord:
    """One traffic line (fleet/middleware.py's docstring: what each field holds)."""

    timestamp: str | float | None = None  # arrival: ISO-8601 UTC text (the middleware) or epoch seconds
    id: str | None = None  # the API response id (`cmpl-...`, `chatcmpl-...`)
    request_id: str | None = None  # X-Request-Id
    endpoint: str | None = None  # "completions" | "chat.completions"
    model: str | None = None
    prompt: str | list | None = None  # text, token ids or a batch of either; a chat's messages
    domain: str | None = None  # the body's `domain`, else the domain header
    response: str | list[str] | None = None  # the answer text (a list for n > 1)
    output_token_ids: list[int] | list[list[int]] | None = None  # with `return_token_ids`
    usage: dict | None = None
    finish_reason: str | list[str | None] | None = None
    stream: bool | None = None
    status: int | None = None  # the HTTP status vLLM answered with
    speculative_decoding: dict | None = None  # vLLM's `metrics.speculative_decoding`, verbatim
    error: str | None = None  # vLLM's error message
    # the drafter version that served the request (fleet/drafter_route.py's label), or `drafter_swapped: true`
    # when a swap happened while it ran (its counters mix two drafters: read per version, it counts for neither)
    drafter_version: str | None = None
    drafter_swapped: bool | None = None
    extra: dict = field(default_factory=dict, repr=False)  # a gateway's fields outside the schema, as read
    # the reader's view, computed by parse_record (module docstring); a writer leaves them unset
    text: str | None = field(default=None, repr=False)
    messages: list[dict] | None = field(default=None, repr=False)
    seconds: float | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        """The line's JSON object: the ALWAYS fields (null when unknown), the others only when present."""
        out: dict = {}
        for f in fields(self):
            if f.name in SCHEMA and (f.name in ALWAYS or getattr(self, f.name) is not None):
                out[f.name] = getattr(self, f.name)
        return out

    @property
    def refused(self) -> bool:
        return refusal(self.status, self.error) is not None


SCHEMA = ("timestamp", "id", "request_id", "endpoint", "model", "prompt", "domain", "response", "output_token_ids",
          "usage", "finish_reason", "stream", "status", "speculative_decoding", "error", "drafter_version",
          "drafter_swapped")


def _show(value) -> str:
    """A value in an error line (config.show's rule, kept here: fleet/ imports no draftsmith module): its repr
    cut short, never walked whole."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxtuple, r.maxstring, r.maxother = 3, 8, 8, 8, MAX_SHOWN, 60
    text = r.repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def refusal(status, error) -> str | None:
    """Why a request was refused (a status other than 200, or an error), or None when it was served."""
    if error is not None:
        return "refused by the server (an error was logged)"
    if status is not None and status != 200:
        return f"refused by the server (status {status})"
    return None


def _unencodable(obj: dict) -> str | None:
    """The first top-level field holding a string UTF-8 cannot encode (a lone surrogate), or None. A walk over
    iterators: it holds one per level of nesting, never a copy of a long list, and never recurses."""
    end = object()
    for key, value in obj.items():
        stack = [iter((key, value))]
        while stack:
            item = next(stack[-1], end)
            if item is end:
                stack.pop()
            elif isinstance(item, str):
                if not item.isascii():
                    try:
                        item.encode("utf-8")
                    except UnicodeEncodeError as e:
                        return f"{key} holds text UTF-8 cannot encode (U+{ord(item[e.start]):04X}, a lone surrogate)"
            elif isinstance(item, dict):
                stack.append(iter(item.keys()))
                stack.append(iter(item.values()))
            elif isinstance(item, list):
                stack.append(iter(item))
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _seconds(value) -> float | None:
    """Epoch seconds of a timestamp (ISO-8601 text or a number), finite; None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"timestamp is {_show(value)}, expected ISO-8601 text or epoch seconds")
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"unreadable timestamp {_show(value)}") from None
        try:
            value = parsed.timestamp()
        except (OverflowError, OSError, ValueError):  # year 1 in local time lies before the epoch's range
            raise ValueError(f"timestamp {_show(value)} is not a finite time") from None
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"timestamp {_show(value)} is not a finite time")
    return seconds


def _part_text(parts: list, where: str) -> str | None:
    """The text of OpenAI content parts (`text` parts joined by newlines, as vLLM joins them for the chat
    template); None when no part is text (an image, audio)."""
    texts = []
    for part in parts:
        if not isinstance(part, dict):
            raise ValueError(f"{where}: a content part is {_show(part)}, expected a JSON object")
        if part.get("type", "text") == "text" and "text" in part:
            if not isinstance(part["text"], str):
                raise ValueError(f"{where}: a text part's text is {_show(part['text'])}, expected a string")
            texts.append(part["text"])
    return "\n".join(texts) if texts else None


def _messages(prompt: list) -> list[dict]:
    """A chat's messages, each {"role", "content": its text or None} plus the KEPT_MESSAGE_KEYS it has."""
    out = []
    for i, m in enumerate(prompt):
        where = f"prompt[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is {_show(m)}, expected a message {{role, content}}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}.role is {_show(m.get('role'))}, expected a string")
        content = m.get("content")
        if isinstance(content, list):
            content = _part_text(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}.content is {_show(content)}, expected text, content parts or null")
        if content is None and m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ValueError(f"{where}.tool_calls is {_show(m['tool_calls'])}, expected a list")
        out.append({"role": m["role"], "content": content, **{k: m[k] for k in KEPT_MESSAGE_KEYS if k in m}})
    return out


def _prompt(prompt) -> tuple[str | None, list[dict] | None]:
    """(the prompt's text, a chat's messages) of the logged prompt; token ids and batches have no one text."""
    if prompt is None or isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list):
        raise ValueError(f"prompt is {_show(prompt)}, expected text, token ids or a chat's messages")
    if prompt and all(isinstance(m, dict) for m in prompt):
        messages = _messages(prompt)
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users[-1] if users else None), messages
    if all(_is_int(t) for t in prompt) or all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        return None, None  # token ids, or a batch of prompts: one line, no one text
    raise ValueError("prompt is a list mixing messages, text and token ids")


def _typed(obj: dict, key: str, kinds: tuple, expected: str):
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise ValueError(f"{key} is {_show(value)}, expected {expected} or null")
    return value


def _list_of(obj: dict, key: str, ok, expected: str):
    """A field that is one item or a list of them (n > 1 choices)."""
    value = obj.get(key)
    if value is None or ok(value) or isinstance(value, list) and all(ok(v) for v in value):
        return value
    raise ValueError(f"{key} is {_show(value)}, expected {expected}, a list of them (n > 1) or null")


def is_version_label(value) -> bool:
    """What a drafter version label is, for the route that sets it and the reader of the line that carries it."""
    return isinstance(value, str) and 0 < len(value) <= MAX_VERSION and value.isprintable()


def _version(obj: dict) -> str | None:
    value = _typed(obj, "drafter_version", (str,), "a string")
    if value is not None and not is_version_label(value):
        raise ValueError(f"drafter_version is {_show(value)}, expected a version label (at most {MAX_VERSION} "
                         "printable characters)")
    return value


def _check(obj: dict) -> TrafficRecord:
    rid = obj.get("id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_ID and rid.isprintable()):
        raise ValueError(f"id is {_show(rid)}, expected the response id (text of at most {MAX_ID} characters)")
    domain = _typed(obj, "domain", (str,), "a string")
    domain = domain.strip() or None if domain is not None else None
    if domain is not None and len(domain) > MAX_DOMAIN:
        raise ValueError(f"domain is {len(domain)} characters long, expected a label of at most {MAX_DOMAIN}")
    text, messages = _prompt(obj.get("prompt"))
    ids = obj.get("output_token_ids")
    if ids is not None and not (isinstance(ids, list) and (all(_is_int(t) for t in ids) or all(
            isinstance(c, list) and all(_is_int(t) for t in c) for c in ids))):
        raise ValueError(f"output_token_ids is {_show(ids)}, expected token ids (a list per choice for n > 1)")
    return TrafficRecord(
        timestamp=obj.get("timestamp"), id=rid, request_id=_typed(obj, "request_id", (str,), "a string"),
        endpoint=_typed(obj, "endpoint", (str,), "a string"), model=_typed(obj, "model", (str,), "a string"),
        prompt=obj.get("prompt"), domain=domain,
        response=_list_of(obj, "response", lambda v: isinstance(v, str), "text"),
        output_token_ids=ids, usage=_typed(obj, "usage", (dict,), "a JSON object"),
        finish_reason=_list_of(obj, "finish_reason", lambda v: isinstance(v, str), "text"),
        stream=_typed(obj, "stream", (bool,), "true or false"),
        status=obj.get("status"),
        speculative_decoding=_typed(obj, "speculative_decoding", (dict,), "vLLM's per-request metrics (a JSON object)"),
        drafter_version=_version(obj), drafter_swapped=_typed(obj, "drafter_swapped", (bool,), "true or false"),
        extra={k: v for k, v in obj.items() if k not in SCHEMA},
        text=text, messages=messages, seconds=_seconds(obj.get("timestamp")))


def parse_record(obj) -> TrafficRecord:
    """A parsed traffic line as a typed record, or Unusable naming in one line why it gives none (module
    docstring: refused, unencodable, malformed — in that order)."""
    if not isinstance(obj, dict):
        raise Unusable(MALFORMED, f"not a JSON object ({type(obj).__name__})")
    status, error = obj.get("status"), obj.get("error")
    if status is not None and not (_is_int(status) and 100 <= status <= 599):
        raise Unusable(MALFORMED, f"status is {_show(status)}, expected an HTTP status (an int in 100..599)")
    why = refusal(status, error)
    if why is not None:
        raise Unusable(REFUSED, why)
    why = _unencodable(obj)
    if why is not None:
        raise Unusable(UNENCODABLE, why)
    try:
        return _check(obj)
    except ValueError as e:
        raise Unusable(MALFORMED, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
