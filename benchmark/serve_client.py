"""serve-bench's client: streamed chat completions sent to a vLLM server at a fixed concurrency, each one timed.

One request is one POST /v1/chat/completions with `stream: true` and `stream_options: {include_usage: true}`
(vLLM sends the final usage chunk, and with `--per-request-spec-decode-metrics` the request's own
speculative-decoding counters on it, only then), greedy (temperature 0). The answer's server-sent events are
timed as they arrive (net.request's `on_piece`):

    TTFT    send -> the first event carrying a choice (vLLM sends its first, the role, with the first token)
    decode  that event -> the last event carrying a choice
    TPOT    decode / (output tokens - 1): the time per output token after the first
    output tokens   the usage chunk's completion_tokens (the engine's count, not the events': a speculative
                    step streams several tokens in one event)

A run keeps `concurrency` requests in flight (one thread each, every request through net.request: a byte cap and
a total deadline per answer) until its list of requests is done or its own deadline has passed (the requests
not yet sent then are counted `not_sent`, never silently dropped). Nothing here starts or chooses a server.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from draftsmith import net
from draftsmith.errors import show
from draftsmith.planning.production import spec_decoding
from draftsmith.reading import is_int

ANSWER_MAX_BYTES = 4 << 20  # a streamed answer of a few hundred tokens is tens of KiB of events


@dataclass
class Sample:
    """One request's measurement; `error` is set (one line) where it gave no usable answer."""

    domain: str
    error: str | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    # vLLM's per-request counters, read by planning/production.spec_decoding: (verify steps, drafted tokens,
    # accepted tokens, accepted per position) and the chain length it drafted (num_spec_tokens)
    spec: tuple[float, float, float, list[float]] | None = None
    k: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.decode_s is None or self.output_tokens < 2:
            return None
        return self.decode_s / (self.output_tokens - 1)


@dataclass
class _Events:
    """The server-sent events of one streamed answer, parsed as their bytes arrive (`feed`)."""

    url: str
    buf: bytes = b""
    first: float | None = None
    last: float | None = None
    usage: dict | None = None
    spec: dict | None = None
    done: bool = False

    def feed(self, piece: bytes) -> None:
        now = time.perf_counter()
        self.buf += piece
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self._line(line.strip(), now)

    def _line(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return  # blank separators, `:` comments
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        event = net.loads(data, self.url)
        if not isinstance(event, dict):
            raise net.NetError(self.url, f"a streamed event is {show(event)}, expected a JSON object")
        if event.get("choices"):
            self.first = self.first if self.first is not None else now
            self.last = now
        if event.get("usage") is not None:
            self.usage = event["usage"]
        metrics = event.get("metrics")
        if isinstance(metrics, dict) and metrics.get("speculative_decoding") is not None:
            self.spec = metrics["speculative_decoding"]


def _finish(sample: Sample, ev: _Events, url: str) -> None:
    """The sample's counts from the answer's last events, or its error naming the field at fault."""
    tokens = (ev.usage or {}).get("completion_tokens")
    if not ev.done or ev.first is None:
        sample.error = f"{url}: the stream ended without [DONE] or without a choice"
    elif not is_int(tokens, 0):
        sample.error = (f"{url}: usage.completion_tokens is {show(tokens)}, expected an int >= 0 (the final usage "
                        "chunk: stream_options.include_usage)")
    else:
        sample.output_tokens, sample.decode_s = tokens, ev.last - ev.first
    if ev.spec is not None and sample.error is None:
        try:
            sample.spec = spec_decoding(ev.spec, "metrics.speculative_decoding")
            sample.k = ev.spec["num_spec_tokens"]
        except ValueError as e:
            sample.error = f"{url}: {e}"


def stream_chat(url: str, model: str, domain: str, messages: list[dict], max_tokens: int, deadline: float,
                headers: dict | None = None) -> Sample:
    """One streamed greedy chat completion from `url` (the server's /v1 root), timed (module docstring)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    endpoint = f"{url}/chat/completions"
    ev, sample = _Events(endpoint), Sample(domain)
    sent = time.perf_counter()
    try:
        net.request(endpoint, json.dumps(body).encode(), deadline=deadline, max_bytes=ANSWER_MAX_BYTES,
                    headers={**(headers or {}), "Content-Type": "application/json"}, on_piece=ev.feed)
    except net.NetError as e:
        sample.error = str(e)
    sample.latency_s = time.perf_counter() - sent
    if sample.error is None:
        _finish(sample, ev, endpoint)
        if sample.error is None:
            sample.ttft_s = ev.first - sent
    return sample


@dataclass
class Run:
    """What one run measured: its samples in the order sent, the wall time from the first send to the last
    answer, and the requests its deadline left unsent."""

    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    not_sent: int = 0


def drive(url: str, model: str, items: list[tuple[str, list[dict]]], concurrency: int, max_tokens: int,
          request_deadline: float, run_deadline: float) -> Run:
    """Send every (domain, messages) of `items` with `concurrency` requests in flight: a worker takes the next item
    as soon as its answer is in, until none is left or `run_deadline` seconds have passed since the first send."""
    run = Run(concurrency)
    lock = threading.Lock()
    nxt = iter(range(len(items)))
    results: dict[int, Sample] = {}
    start = time.perf_counter()

    def worker() -> None:
        while time.perf_counter() - start < run_deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            domain, messages = items[i]
            results[i] = stream_chat(url, model, domain, messages, max_tokens, request_deadline)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    run.wall_s = time.perf_counter() - start
    run.samples = [results[i] for i in sorted(results)]
    run.not_sent = len(items) - len(results)
    return run


def served_model(url: str, deadline: float = 30.0) -> str:
    """The first model a server lists at /v1/models (a server started elsewhere, given by --url)."""
    answer = net.request(f"{url}/models", deadline=deadline, max_bytes=net.ANSWER_MAX_BYTES).json()
    data = answer.get("data") if isinstance(answer, dict) else None
    if not (isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str)):
        raise net.NetError(f"{url}/models", f"data is {show(data)}, expected a list of models with an `id`")
    return data[0]["id"]
