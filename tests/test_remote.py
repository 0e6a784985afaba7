"""Regeneration through real OpenAI-compatible servers (`generation.backend: openai`, data/engines/remote.py).

The servers are `transformers serve` processes (`pip install 'transformers[serving]'`) on 127.0.0.1 serving
the tiny targets, plus a stdlib HTTP server that answers with errors or not at all. Every server is stopped
by its fixture; every request is bounded by `request_timeout` and `max_retries`.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from local_http import local_server
from tiny_models import assert_same_rows

from draftsmith.data import generate_dataset, load_distilled
from draftsmith.data.config import ChatConfig, DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.masks import masked_spans
from draftsmith.errors import DataError, FingerprintMismatch

SERVE = Path(sys.executable).parent / "transformers"
pytestmark = pytest.mark.skipif(
    not SERVE.exists() or not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn")),
    reason="transformers serve needs pip install 'transformers[serving]'")

# The tiny random model mostly repeats a prompt's last token: plain prompts ending in different digits make
# every row's answer its own, so a row given another row's answer shows
PROMPTS = [f"Question number {i}: what is {i} plus {i * 3}" for i in range(12)]
PLAIN = ChatConfig(mode="plain", plain_separator="")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`transformers serve FOLDER` on 127.0.0.1; `url`, `model` (its name), `stop()`."""

    def __init__(self, folder: Path):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = str(folder)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.proc = subprocess.Popen([str(SERVE), "serve", str(folder), "--host", "127.0.0.1", "--port",
                                      str(self.port), "--device", "cpu", "--log-level", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def wait(self, seconds: float = 90) -> Served:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/models", timeout=2):
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"transformers serve did not come up in {seconds} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(tiny_target, other_target):
    """Two servers of the tiny target and one of another model (another tokenizer), started together."""
    started = {"a": Served(tiny_target.folder), "b": Served(tiny_target.folder), "other": Served(other_target.folder)}
    try:
        yield {k: s.wait() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


class _Broken(http.server.BaseHTTPRequestHandler):
    """Lists the model it is told to, then answers every completion with HTTP 500 (or never, `hang`)."""

    model = ""
    hang = False

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.hang:
            time.sleep(3)  # longer than the tests' request_timeout
        self._send(500, {"error": "out of memory"})

    def _send(self, code, body):
        data = json.dumps(body).encode()
        with contextlib.suppress(OSError):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)


@contextlib.contextmanager
def broken_server(model: str, hang: bool = False):
    handler = type("Handler", (_Broken,), {"model": model, "hang": hang})
    with local_server(handler) as url:
        yield f"{url}/v1"


def _cfg(tmp_path, urls, name, prompts=PROMPTS, chat=PLAIN, **gen) -> DataConfig:
    p = tmp_path / f"prompts{len(prompts)}.jsonl"
    if not p.exists():
        p.write_text("".join(json.dumps({"q": q}) + "\n" for q in prompts))
    g = {"max_new_tokens": 10, "batch_size": 4, "flush_every": 2, "max_retries": 2, "retry_backoff": 0.05,
         "request_timeout": 20.0, "concurrency": 2, **gen}
    if urls:
        g.update(backend="openai", base_urls=list(urls))
    return DataConfig(sources=[SourceConfig(name="p", path=str(p), prompt="q", domain="general")],
                      output_dir=str(tmp_path / name), generation=GenerationConfig(**g), chat=chat)


@pytest.fixture(scope="module")
def engine_rows(tiny_target, tmp_path_factory):
    """The embedded engine's greedy rows for PROMPTS: what every server run is compared with."""
    tmp = tmp_path_factory.mktemp("engine")
    return load_distilled(generate_dataset(_cfg(tmp, [], "engine"), tiny_target, progress=False))


def test_a_server_writes_the_rows_the_engine_writes(tmp_path, servers, tiny_target, engine_rows):
    assert len(set(engine_rows["response"])) >= 10  # the rows differ: a mix-up would show
    out = generate_dataset(_cfg(tmp_path, [servers["a"].url], "one"), tiny_target, progress=False)
    assert_same_rows(load_distilled(out, tiny_target), engine_rows)
    # with the chat template: the same prompt ids and masks as the engine's (ChatML, the answer masked)
    chat = [load_distilled(generate_dataset(_cfg(tmp_path, urls, f"chat{len(urls)}", chat=ChatConfig(),
                                                 prompts=PROMPTS[:4]), tiny_target, progress=False))
            for urls in ([], [servers["a"].url])]
    assert_same_rows(chat[1], chat[0])
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["precision"] == {"backend": "openai", "served_model": servers["a"].model}
    assert prov["timing"]["servers"]["servers"][0]["rows"] == len(PROMPTS)


def test_killed_run_resumes_without_writing_a_row_twice(tmp_path, servers, tiny_target, engine_rows):
    cfg = _cfg(tmp_path, [servers["a"].url], "killed", flush_every=1, concurrency=1, max_new_tokens=10)
    preset = tmp_path / "preset.yaml"
    preset.write_text(json.dumps({
        "kind": "data", "target": str(tiny_target.folder), "output_dir": cfg.output_dir,
        "sources": [{"name": "p", "path": cfg.sources[0].path, "prompt": "q", "domain": "general"}],
        "chat": {"mode": PLAIN.mode, "plain_separator": PLAIN.plain_separator},
        "generation": {k: getattr(cfg.generation, k) for k in (
            "max_new_tokens", "flush_every", "backend", "base_urls", "concurrency", "max_retries",
            "retry_backoff", "request_timeout")}}))
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "data", "generate", "--config", str(preset),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    chunks = Path(cfg.output_dir) / "chunks"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None and len(list(chunks.glob("chunk-*.jsonl"))) < 3:
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    written = [json.loads(line)["row_id"] for p in chunks.glob("chunk-*.jsonl") for line in p.read_text().splitlines()]
    assert 3 <= len(written) < len(PROMPTS), proc.stderr.read().decode()[-2000:]
    again = []
    out = generate_dataset(cfg, tiny_target, progress=False, on_row=lambda r: again.append(r["row_id"]))
    assert not set(again) & set(written) and len(again) + len(set(written)) == len(PROMPTS)
    ds = load_distilled(out)
    assert_same_rows(ds, engine_rows)
    assert json.loads((out / "provenance.json").read_text())["timing"]["resumed_rows"] == len(set(written))


def test_one_server_killed_the_other_finishes(tmp_path, servers, tiny_target, engine_rows):
    a, b = servers["a"], servers["b"]
    seen = []

    def kill_b(rec):
        seen.append(rec)
        if len(seen) == 1:
            b.stop()

    # b leaves at its first failed try (no retries): with retries, a could answer every other row within b's
    # backoff and end the run before b is marked gone. Killed at the first row written (flush_every 1), b still
    # has rows to take: each server holds one request at a time, so most of the 12 are still queued
    cfg = _cfg(tmp_path, [a.url, b.url], "two", concurrency=1, flush_every=1, max_retries=0)
    out = generate_dataset(cfg, tiny_target, progress=False, on_row=kill_b)
    assert_same_rows(load_distilled(out), engine_rows)
    per = {s["url"]: s for s in json.loads((out / "provenance.json").read_text())["timing"]["servers"]["servers"]}
    assert per[b.url]["left"] and "tries failed" in per[b.url]["left"]
    assert per[a.url]["left"] is None and per[a.url]["rows"] + per[b.url]["rows"] == len(PROMPTS)


def test_a_server_that_returns_errors(tmp_path, servers, tiny_target, engine_rows):
    a = servers["a"]
    with broken_server(a.model) as bad:
        with pytest.raises(DataError, match="every server failed.*HTTP 500 from .*out of memory"):
            generate_dataset(_cfg(tmp_path, [bad], "bad"), tiny_target, progress=False)
        out = generate_dataset(_cfg(tmp_path, [bad, a.url], "bad_and_good"), tiny_target, progress=False)
    assert_same_rows(load_distilled(out), engine_rows)
    with broken_server(a.model, hang=True) as hung:  # answers nothing: the request timeout ends each try
        t0 = time.monotonic()
        out = generate_dataset(_cfg(tmp_path, [hung, a.url], "hung", request_timeout=0.5, max_retries=1,
                                    prompts=PROMPTS[:4]), tiny_target, progress=False)
        assert time.monotonic() - t0 < 30
    per = json.loads((out / "provenance.json").read_text())["timing"]["servers"]["servers"]
    assert "timed out" in per[0]["left"] and per[1]["rows"] == len(load_distilled(out))


def test_a_server_with_another_model_is_refused(tmp_path, servers, tiny_target):
    other = servers["other"]
    with pytest.raises(FingerprintMismatch, match="counted \\d+ tokens in row .* another tokenizer"):
        generate_dataset(_cfg(tmp_path, [other.url], "other"), tiny_target, progress=False)
    assert not list((tmp_path / "other").glob("chunks/chunk-*"))  # nothing it wrote was kept
    with pytest.raises(FingerprintMismatch, match="serve different models"):
        generate_dataset(_cfg(tmp_path, [servers["a"].url, other.url], "mixed"), tiny_target, progress=False)
    with pytest.raises(FingerprintMismatch, match="not generation.served_model"):
        generate_dataset(_cfg(tmp_path, [other.url], "named", served_model=servers["a"].model), tiny_target,
                         progress=False)


def test_sampled_rows_follow_the_row_seeds(tmp_path, servers, tiny_target, engine_rows):
    """do_sample sends temperature / top_p and a seed per row: the same seeds give the same rows again."""
    # transformers serve samples only when its generation config says so (vLLM / SGLang: temperature > 0)
    sample = {"generation_config": json.dumps({"do_sample": True, "eos_token_id": 2, "pad_token_id": 0})}
    runs = [load_distilled(generate_dataset(_cfg(tmp_path, [servers["a"].url], f"s{i}", do_sample=True,
                                                 temperature=1.5, concurrency=1, extra_body=sample),
                                            tiny_target, progress=False))
            for i in range(2)]
    assert runs[0]["response"] == runs[1]["response"]
    assert runs[0]["response"] != [r["response"] for r in engine_rows]  # not the greedy rows
    assert all(len(masked_spans(i, m)) == 1 for i, m in zip(runs[0]["input_ids"], runs[0]["loss_mask"]))
