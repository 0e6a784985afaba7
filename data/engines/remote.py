"""Regeneration through OpenAI-compatible completion servers (`generation.backend: openai`).

At scale the target answers the prompts on the fleet users already run — vLLM or SGLang with tensor
parallelism, one server per node (docs/data.md has the commands) — and draftsmith keeps everything else:
prompts formatted with the target's own chat template, loss masks, chunks, resume, provenance.

Each request is one turn of one row: the exact prompt of `data/generate.py` (as text, or as token ids with
`prompt_as: token_ids`) sent to `/completions` with `max_tokens`, greedy (`temperature: 0`) or sampled
(`temperature`, `top_p`, and a per-row `seed`). Several `base_urls` share the rows: each server keeps
`concurrency` requests in flight. A request that fails (connection refused or reset, no answer within
`request_timeout`, HTTP 429 or 5xx) is retried on the same server after `retry_backoff`, 2x, 4x ... seconds;
after `max_retries` retries the server is taken out of the run and its rows go to the others. When no
server is left the run stops with every server's last error; the rows already written are kept, and a
rerun resumes from them.

Every request goes through the one client (net.py): `request_timeout` is a deadline for the whole request
(not for one read: a server dripping bytes cannot hold a row forever), an answer is at most
net.ANSWER_MAX_BYTES long and nests JSON at most net.MAX_DEPTH deep, and anything else is a bad answer of that
server (retried, then the server leaves the run). The API key, and anything a server echoes that is spelled
like a credential, is redacted from every error, log line and provenance entry.

A server serving another model is refused, never written from:
  * `/models` must list `served_model` (or exactly one model, when none is named), and every answer must
    name that model;
  * the server's count of prompt tokens (`usage.prompt_tokens`) must equal the length of the prompt ids
    our tokenizer made (a server that returns `prompt_token_ids`, like vLLM with `return_token_ids`, must
    return exactly them): another tokenizer splits the same text differently.
A response's tokens are the ones the server returns (`token_ids`) where it does; otherwise its text is
tokenized with the target's tokenizer and the end-of-turn token appended when it stopped (`finish_reason:
stop`), exactly as the chat template ends an assistant turn.

Every request carries an `X-Request-Id` header naming its row and turn, with a part of its own (a retried row
sends a new id): `ds-<row>-t<turn>-<12 hex>`. vLLM takes it as the request's id, so a capture replica's file for
it is `cmpl-ds-<row>-t<turn>-<12 hex>-0-<8 hex>.safetensors` (`capture.backend: vllm`, data/served.py joins them).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from draftsmith import net
from draftsmith.data.chat import encode_text
from draftsmith.data.engines.base import Completion, Request, TextEngine, run_stats
from draftsmith.errors import DataError, FingerprintMismatch, show

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class _Retry(Exception):
    """A failure worth retrying (the server may recover or another server may take the row)."""


class _Refused(Exception):
    """A failure no retry fixes: the server rejects our requests (HTTP 4xx)."""


class _Mismatch(_Refused):
    """The server is not serving the target: its tokenizer or its model name differ."""


@dataclass
class _Server:
    url: str
    model: str | None = None
    dead: str | None = None  # why the server left the run
    last_error: str | None = None
    requests: int = 0
    failures: int = 0
    rows: int = 0
    stats: dict[str, int] = field(default_factory=dict)


def request_key(key, turn: int) -> str:
    """What every request id of row `key`'s turn `turn` starts with (`ds-<row>-t<turn>`): characters a vLLM request
    id and a file name keep, without '-' inside the row's part so that the id splits back."""
    return f"ds-{re.sub(r'[^A-Za-z0-9._:]', '_', str(key))[:80]}-t{int(turn)}"


def request_id(key, turn: int) -> str:
    """A new id for one request (one try) of row `key`'s turn `turn`: request_key and 12 hex of its own."""
    return f"{request_key(key, turn)}-{uuid.uuid4().hex[:12]}"


def _http(url: str, body: dict | None, timeout: float, api_key: str | None, rid: str | None = None) -> dict:
    """One request through the one client (net.py): answered within `timeout` seconds in all, at most
    net.ANSWER_MAX_BYTES long, JSON nested at most net.MAX_DEPTH deep; _Retry / _Refused on failure. A redirect
    is refused, never followed: a followed one would carry the API key (`Authorization`) to whatever origin
    the server names, and turn the POST into a GET. Every message is redacted (net.redact). `rid`: the
    request's X-Request-Id."""
    headers = {"Content-Type": "application/json"}
    if rid:
        headers["X-Request-Id"] = rid
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        return net.request(url, data, deadline=timeout, max_bytes=net.ANSWER_MAX_BYTES, headers=headers).json()
    except net.NetError as e:
        if e.status is not None and 300 <= e.status < 400:
            where = net.safe_url(str(e.headers.get("Location", "")))[:200]
            raise _Refused(f"HTTP {e.status} from {e.url}: a redirect to {where} is not followed (the API key goes "
                           "only to the addresses in generation.base_urls; give the final address there)") from None
        if e.status is not None:
            raise (_Retry if e.status in RETRY_STATUS else _Refused)(
                f"HTTP {e.status} from {e.url}: {e.detail}") from None
        raise _Retry(str(e)) from None


def _listed_models(url: str, answer) -> list[str]:
    """The model names of a /models answer ({"data": [{"id": name}, ...]}); anything else is a bad answer."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise _Retry(f"{url}: not an OpenAI /models answer ({{\"data\": [{{\"id\": ...}}]}} expected, got "
                     f"{show(answer)})")
    return [m["id"] for m in data]


def _token_ids(ids, vocab_size: int, what: str) -> list[int]:
    """A server's token ids: a list of ints in [0, vocab_size); a float (5.7), a string or a negative id is a
    bad answer, never truncated or stored."""
    if not isinstance(ids, list):
        raise _Retry(f"{what} is not a list ({type(ids).__name__})")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise _Retry(f"{what}[{i}] = {show(t)} is not a token id of the target (ints in [0, {vocab_size}))")
    return ids


def _usage(answer: dict, what: str) -> dict[str, int]:
    """The answer's token counts (`usage.prompt_tokens`, `usage.completion_tokens`): whole numbers >= 0 where given
    (a float 60.0, a string or a negative count is a bad answer, never compared as if it were one)."""
    usage = answer.get("usage")
    if usage is None:
        return {}
    if not isinstance(usage, dict):
        raise _Retry(f"{what}: usage is not an object ({show(usage)})")
    out = {}
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Retry(f"{what}: usage.{name} is {show(value)}, not a whole number of tokens")
        out[name] = value
    return out


def end_of_turn_id(tokenizer, eos_ids: list[int], chat_mode: str) -> int:
    """The end-of-turn token the chat template writes after an assistant turn (plain mode: the first EOS),
    which a text-only answer that stopped is given back."""
    from draftsmith.data.masks import end_tokens

    ends = end_tokens(tokenizer, eos_ids)
    if not ends:
        raise DataError("the target has no EOS token: a server's stopped answers cannot be ended")
    if chat_mode == "chat":
        from draftsmith.data.chat import build_messages, render_chat

        probe = render_chat(tokenizer, build_messages(["x"], ["y"]), add_generation_prompt=False)
        after = probe[probe.rindex("y") + 1:]
        for i, text in ends:
            if text and after.startswith(text):
                return i
    return ends[0][0]


class RemoteEngine(TextEngine):
    """Drives `base_urls` like the embedded engine: `run(requests, on_done, on_tokens)`."""

    report_as = "servers"  # provenance.json: each server's rows, retries and why it left

    def __init__(self, tokenizer, eos_ids: list[int], gen, chat_mode: str, vocab_size: int | None = None):
        self.tok = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos_ids = list(eos_ids)
        self.gen = gen
        self.end_id = end_of_turn_id(tokenizer, self.eos_ids, chat_mode)
        self.api_key = os.environ.get(gen.api_key_env) if gen.api_key_env else None
        if gen.api_key_env and not self.api_key:
            raise DataError(f"generation.api_key_env: the environment variable {gen.api_key_env} is not set")
        net.hold_secret(self.api_key)  # every later line of this process is redacted of it, in every spelling
        self.servers = [_Server(u.rstrip("/") if u.rstrip("/").endswith("/v1") else u.rstrip("/") + "/v1")
                        for u in gen.base_urls]
        self.model: str | None = gen.served_model
        self.checked = False
        # answers handed over per key: a row's turns are asked one after another, so it is the turn being asked
        self.answered: dict = {}
        if not self.servers:
            raise DataError("generation.base_urls: no server to send the rows to")

    # ------------------------------------------------------------------------------------ identity

    def check_servers(self) -> None:
        """Every server answers /models and serves the same model (`served_model`, or its only one)."""
        for s in self.servers:
            for attempt in range(self.gen.max_retries + 1):
                try:
                    listed = _listed_models(f"{s.url}/models", _http(f"{s.url}/models", None,
                                                                     self.gen.request_timeout, self.api_key))
                    break
                except _Retry as e:
                    s.last_error = self._clean(e)
                    if attempt < self.gen.max_retries:
                        time.sleep(self.gen.retry_backoff * 2 ** attempt)
                except _Refused as e:
                    raise DataError(self._clean(f"server {s.url}: {e}")) from None
            else:
                s.dead = f"no answer to /models ({s.last_error})"
                log.warning("%s", self._clean(f"server {s.url} left the run: {s.dead}"))
                continue
            if self.gen.served_model is not None:
                if self.gen.served_model not in listed:
                    raise FingerprintMismatch(f"server {s.url} serves {listed}, not generation.served_model "
                                              f"{self.gen.served_model!r}: refused")
                s.model = self.gen.served_model
            elif len(listed) != 1:
                raise DataError(f"server {s.url} serves {len(listed)} models {listed[:5]}: name the target's "
                                "with generation.served_model")
            else:
                s.model = listed[0]
        alive = [s for s in self.servers if not s.dead]
        if not alive:
            raise DataError(self._clean("no server answered: " + "; ".join(f"{s.url}: {s.dead}" for s in self.servers)))
        names = {s.model for s in alive}
        if len(names) > 1:
            raise FingerprintMismatch(f"the servers serve different models ({sorted(names)}): give one target's "
                                      "servers, or name it with generation.served_model")
        self.model = names.pop()
        self.checked = True

    def _body(self, req: Request, model: str) -> dict:
        gen = self.gen
        body: dict[str, Any] = {**gen.extra_body, "model": model, "max_tokens": req.max_new_tokens}
        if gen.prompt_as == "token_ids":
            body["prompt"] = list(req.prompt_ids)
        else:
            body["prompt"] = self.tok.decode(req.prompt_ids, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
        if gen.do_sample:
            body.update(temperature=gen.temperature, top_p=gen.top_p, seed=req.seed % (2**31))
        else:
            body["temperature"] = 0.0
        return body

    def check_prompt(self, req: Request) -> None:
        """With prompt_as text the server tokenizes the text itself: it must come back to our exact ids."""
        if self.gen.prompt_as != "text":
            return
        text = self.tok.decode(req.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = list(self.tok(text)["input_ids"])
        if again != list(req.prompt_ids):
            raise DataError(
                f"row {req.key}: the prompt text does not tokenize back to its ids (the tokenizer adds "
                f"{len(again) - len(req.prompt_ids):+d} tokens, e.g. a BOS); use generation.prompt_as: token_ids")

    def _complete(self, s: _Server, req: Request) -> Completion:
        answer = _http(f"{s.url}/completions", self._body(req, s.model), self.gen.request_timeout, self.api_key,
                       request_id(req.key, self.answered.get(req.key, 0)))
        try:
            choice = answer["choices"][0]
            text, finish = choice["text"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise _Retry(f"{s.url}: an answer with no choices[0].text ({show(answer)})") from None
        if not isinstance(text, str):
            raise _Retry(f"{s.url}: row {req.key}: choices[0].text is {show(text)}, not a string")
        if answer.get("model") not in (None, s.model):
            raise _Mismatch(f"answered as model {answer.get('model')!r}, not {s.model!r}")
        usage = _usage(answer, f"{s.url}: row {req.key}")
        got_prompt = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
        if got_prompt is not None:
            got_prompt = _token_ids(got_prompt, self.vocab_size, f"{s.url}: row {req.key}: prompt_token_ids")
        if got_prompt is not None and list(got_prompt) != list(req.prompt_ids):
            raise _Mismatch(f"tokenized row {req.key}'s prompt differently (prompt_token_ids differ): it serves a "
                           "model with another tokenizer")
        if usage.get("prompt_tokens") is not None and usage["prompt_tokens"] != len(req.prompt_ids):
            raise _Mismatch(f"counted {usage['prompt_tokens']} tokens in row {req.key}'s prompt, the target's "
                           f"tokenizer {len(req.prompt_ids)}: it serves a model with another tokenizer")
        n = usage.get("completion_tokens")
        if n is not None and n > req.max_new_tokens:  # a server that ignored max_tokens
            raise _Refused(f"row {req.key}: wrote {n} tokens (usage.completion_tokens) for max_tokens "
                           f"{req.max_new_tokens}")
        ids = choice.get("token_ids")
        if ids is not None:
            tokens = list(_token_ids(ids, self.vocab_size, f"{s.url}: row {req.key}: token_ids"))
            if len(tokens) > req.max_new_tokens or (n is not None and n not in (len(tokens), len(tokens) + 1)):
                raise _Refused(f"row {req.key}: returned {len(tokens)} token ids for max_tokens {req.max_new_tokens} "
                               f"and usage.completion_tokens {n}: the counts disagree")
        else:
            tokens = self._text_tokens(s, req, text, n)
        return self._ended(req, tokens, finish == "stop")

    def _text_tokens(self, s: _Server, req: Request, text: str, n: int | None) -> list[int]:
        """A text answer as the target's tokenizer splits it: what the row stores and its mask covers (special-token
        strings the model wrote stay text). Where the model wrote a split the tokenizer would not make, the count
        differs from the server's (a sampled answer of a small model splits very differently: 10 tokens came back as
        18): counted, kept, and cut to max_tokens where the server's own count shows it kept to them, so that no
        row holds more than it asked for. More text than max_tokens allows with no count is refused."""
        tokens = encode_text(self.tok, text)
        if n is not None and n != len(tokens):
            s.stats["retokenized_differently"] = s.stats.get("retokenized_differently", 0) + 1
        if len(tokens) > req.max_new_tokens:
            if n is None:
                raise _Refused(f"row {req.key}: answered {len(tokens)} tokens of text for max_tokens "
                               f"{req.max_new_tokens}, with no usage.completion_tokens: the server does not keep "
                               "to max_tokens")
            s.stats["cut_to_max_tokens"] = s.stats.get("cut_to_max_tokens", 0) + 1
            tokens = tokens[: req.max_new_tokens]
        return tokens

    def _ended(self, req: Request, tokens: list[int], stopped: bool) -> Completion:
        """The completion, its end-of-turn token given back where the server left it out (and the budget has room
        for it: a row never holds more than max_tokens answer tokens, so never more than the context)."""
        if stopped and (not tokens or tokens[-1] not in self.eos_ids):
            if len(tokens) < req.max_new_tokens:
                tokens = tokens + [self.end_id]
            else:
                stopped = False  # cut at the budget: kept as an answer that did not end
        return Completion(req.key, list(req.prompt_ids), tokens, stopped)

    # ------------------------------------------------------------------------------------ running

    def run(self, requests: list[Request], on_done, on_tokens=None) -> dict[str, float]:
        if not requests:
            return run_stats(0, 0.0)
        if not self.checked:
            self.check_servers()
        for r in requests:
            self.check_prompt(r)
        todo: queue.Queue = queue.Queue()
        for r in requests:
            todo.put(r)
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        threads = [threading.Thread(target=self._worker, args=(s, todo, results, stop), daemon=True,
                                    name=f"openai-{s.url}")
                   for s in self.servers if not s.dead for _ in range(self.gen.concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        try:
            generated = self._collect(results, len(requests), on_done, on_tokens)
        finally:
            stop.set()
            for t in threads:  # a worker inside a request returns within request_timeout; none waits longer
                t.join(timeout=0.2)
        seconds = time.perf_counter() - t0
        return run_stats(generated, seconds)

    def _worker(self, s: _Server, todo: queue.Queue, results: queue.Queue, stop: threading.Event) -> None:
        """One of server `s`'s `concurrency` threads: takes requests until the run stops or `s` leaves it.
        Puts (server, request, Completion or the error that ends the run) on `results`; a request whose
        retries all failed goes back to `todo` for the other servers, and `s` leaves the run."""
        gen = self.gen
        while not stop.is_set() and not s.dead:
            try:
                req = todo.get(timeout=0.05)
            except queue.Empty:
                continue
            for attempt in range(gen.max_retries + 1):
                if stop.is_set() or s.dead:
                    todo.put(req)
                    return
                s.requests += 1
                try:
                    results.put((s, req, self._complete(s, req)))
                    s.last_error = None
                    break
                except _Retry as e:
                    s.failures += 1
                    s.last_error = self._clean(e)
                    if attempt < gen.max_retries:
                        stop.wait(gen.retry_backoff * 2 ** attempt)
                except _Refused as e:
                    results.put((s, req, e))
                    return
                except Exception as e:  # a bug here must reach the caller, not kill a thread silently
                    results.put((s, req, e))
                    return
            else:
                s.dead = f"{gen.max_retries + 1} tries failed, last: {s.last_error}"
                log.warning("%s", self._clean(f"server {s.url} left the run: {s.dead}; its rows go to the others"))
                todo.put(req)
                results.put((s, None, None))  # wakes the main loop to see who is left

    def _collect(self, results: queue.Queue, pending: int, on_done, on_tokens) -> int:
        """Hand each completion to `on_done` as the workers deliver it, until `pending` are done; a refusal,
        a bug in a worker or the last server leaving ends the run. Returns the tokens generated."""
        generated = 0
        while pending:
            try:
                s, req, got = results.get(timeout=0.5)
            except queue.Empty:
                got = None
            if isinstance(got, _Mismatch):
                raise FingerprintMismatch(self._clean(f"server {s.url} (model {s.model!r}) refused: it {got}"))
            if isinstance(got, _Refused):
                raise DataError(self._clean(f"server {s.url} rejected a request: {got}"))
            if isinstance(got, Exception):
                raise got
            if isinstance(got, Completion):
                pending -= 1
                s.rows += 1
                self.answered[got.key] = self.answered.get(got.key, 0) + 1
                generated += len(got.tokens)
                if on_tokens is not None:
                    on_tokens(len(got.tokens))
                on_done(got)
            elif all(x.dead for x in self.servers):
                raise DataError(self._clean(f"every server failed ({pending} requests left): "
                                            + "; ".join(f"{x.url}: {x.dead}" for x in self.servers)))
        return generated

    def _clean(self, text) -> str:
        """`text` as it may be logged, raised or written to provenance: without the API key or anything
        spelled like a credential (a server may echo the request it failed, `Authorization` header and all), and
        on one line."""
        text = net.redact(str(text), [self.api_key] if self.api_key else [])
        return text.replace("\r", "\\r").replace("\n", "\\n")  # a server's text never breaks the one line

    def describe(self) -> dict:
        return {"model": self.model, "servers": [
            {"url": net.safe_url(s.url), "rows": s.rows, "requests": s.requests, "failures": s.failures,
             "left": None if s.dead is None else self._clean(s.dead), **s.stats} for s in self.servers]}
