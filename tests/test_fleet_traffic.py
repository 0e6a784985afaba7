"""The fleet's traffic log (fleet/middleware.py) and its reader (planning/production.py, source 2a), without vLLM.

The middleware is driven with asyncio around a small real ASGI app that answers the way vLLM's OpenAI server
does (a JSON body, or `data: {...}` events ending in `data: [DONE]`, the per-request metrics on the final
usage chunk): what the client gets is what the app sent, byte for byte; the lines written are what the app
answered; a full queue or a failing logging path never holds or breaks a request; files rotate and only the
process's own are deleted. The reader's tests feed it logged rows: the per-domain table, the refusal of
metrics that break a rule (one bad row naming file:line and field), and the table's sums.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from draftsmith.errors import ConfigError, DataError
from draftsmith.fleet import middleware as mw
from draftsmith.fleet.middleware import NAME, Settings, TrafficLog

K = 3


def spec(per_step: list[tuple[int, int]]) -> dict:
    """vLLM's RequestSpecDecodeMetrics.to_dict() (detailed) for steps of (drafted, accepted)."""
    hist = [0] * (K + 1)
    for _, a in per_step:
        hist[a] += 1
    steps, acc, dra = len(per_step), sum(a for _, a in per_step), sum(d for d, _ in per_step)
    out = {"mean_acceptance_length": 1.0 + acc / steps if steps else 1.0,
           "draft_acceptance_rate": acc / dra if dra else 0.0, "acceptance_histogram": hist,
           "num_spec_steps": steps, "num_accepted_draft_tokens": acc, "num_draft_tokens": dra, "num_spec_tokens": K}
    if steps:
        out["per_step_accepted"] = [a for _, a in per_step]
        out["per_step_drafted"] = [d for d, _ in per_step]
    return out


STEPS = [(3, 3), (3, 1), (3, 0), (2, 2)]


async def vllm_like(scope, receive, send):
    """A real ASGI app answering like vLLM's completions / chat completions (and 404 elsewhere); it records
    the request body and headers it saw in scope["state"]."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    scope["state"]["seen"] = (body, list(scope["headers"]))
    if scope["path"] not in ("/v1/completions", "/v1/chat/completions"):
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"detail":"Not Found"}'})
        return
    req = json.loads(body)
    chat = scope["path"].endswith("chat/completions")
    rid = dict(scope["headers"]).get(b"x-request-id", req.get("request_id", "rnd").encode()).decode()
    rid = ("chatcmpl-" if chat else "cmpl-") + rid
    words = ["Paris", " is", " the", " capital", "."]
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    metrics = {"speculative_decoding": spec(STEPS)}
    if not req.get("stream"):
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(words)}} if chat
                  else {"index": 0, "text": "".join(words), "token_ids": [11, 12, 13, 14, 15]})
        answer = {"id": rid, "object": "x", "choices": [{**choice, "finish_reason": "stop"}], "usage": usage,
                  "metrics": metrics}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    for i, w in enumerate(words):
        choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
        choice["finish_reason"] = "stop" if i == len(words) - 1 else None
        event = f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n".encode()
        await send({"type": "http.response.body", "body": event[:9], "more_body": True})  # events split mid-line
        await send({"type": "http.response.body", "body": event[9:], "more_body": True})
    if (req.get("stream_options") or {}).get("include_usage"):
        final = {"id": rid, "choices": [], "usage": usage, "metrics": metrics}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(final)}\n\n".encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def call(app, path: str, body: dict | bytes, headers=(), chunk: int = 7):
    """One POST through `app`: (the messages the client got, the body and headers the inner app saw)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = [raw[i:i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    state: dict = {}
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json"),
                                                                         *headers], "state": state}
    out: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        out.append(message)

    await app(scope, receive, send)
    return out, state.get("seen")


def run(coro):
    return asyncio.run(coro)


def rows(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("traffic-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return out


@pytest.fixture
def traffic(tmp_path):
    """A TrafficLog around vllm_like writing into tmp_path/traffic; its writer is closed at the end."""
    made = []

    def make(**kw):
        t = TrafficLog(vllm_like, Settings(str(tmp_path / "traffic"), **kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.writer.close()


REQUESTS = [
    ("/v1/completions", {"model": "m", "prompt": "The capital of France", "max_tokens": 5, "domain": "geo"}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Capital?"}], "stream": True,
                              "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("path,body", REQUESTS)
def test_bytes_pass_through_unchanged_and_the_answer_is_logged(traffic, path, body):
    t = traffic()
    direct, seen_direct = run(call(vllm_like, path, body, [(b"x-request-id", b"abc")]))
    through, seen = run(call(t, path, body, [(b"x-request-id", b"abc")]))
    assert through == direct and seen == seen_direct  # the response's messages, the request's bytes and headers
    assert t.writer.drain() and t.counts.snapshot()["written"] == 1
    (row,) = rows(Path(t.settings.folder))
    assert row["response"] == "Paris is the capital." and row["finish_reason"] == "stop" and row["status"] == 200
    assert row["id"].endswith("-abc") and row["request_id"] == "abc"
    assert row["endpoint"] == ("chat.completions" if "chat" in path else "completions")
    assert row["prompt"] == (body.get("messages") or body.get("prompt")) and row["model"] == "m"
    assert row["stream"] == bool(body.get("stream")) and row["usage"]["completion_tokens"] == 5
    assert row["speculative_decoding"] == spec(STEPS)  # vLLM's dict, verbatim
    assert row.get("domain") == body.get("domain")
    assert row.get("output_token_ids") == ([11, 12, 13, 14, 15] if path == "/v1/completions" and not body.get("stream")
                                           else None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row["timestamp"])


def test_the_written_line_is_the_traffic_record_its_readers_parse(traffic):
    """Writer and readers share fleet/traffic_record.py: every line the middleware writes has the schema's
    fields only (the ALWAYS ones on every line) and parses back into the record it was built from."""
    from draftsmith.fleet.traffic_record import ALWAYS, SCHEMA, parse_record

    t = traffic()
    for path, body in REQUESTS:
        run(call(t, path, {**body, "domain": "  geo "}, [(b"x-draftsmith-domain", b"ignored")]))
    run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}, [(b"x-draftsmith-domain", b" code ")]))
    t.writer.drain()
    logged = rows(Path(t.settings.folder))
    assert len(logged) == len(REQUESTS) + 1
    for row in logged:
        assert set(ALWAYS) <= set(row) <= set(SCHEMA), row
        assert parse_record(row).to_json() == row
    assert [r["domain"] for r in logged] == ["geo"] * len(REQUESTS) + ["code"]


def test_a_stream_without_include_usage_is_logged_without_counters(traffic):
    t = traffic()
    run(call(t, "/v1/chat/completions", {"model": "m", "messages": [], "stream": True}))
    t.writer.drain()
    (row,) = rows(Path(t.settings.folder))
    assert row["response"] == "Paris is the capital." and "speculative_decoding" not in row and row["stream"]


def test_request_id_is_added_only_where_the_client_named_none(traffic):
    t = traffic()
    _, (body, headers) = run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}))
    added = dict(headers)[b"x-request-id"].decode()
    assert re.fullmatch(r"[0-9a-f]{32}", added)
    _, (_, headers) = run(call(t, "/v1/completions", {"model": "m", "prompt": "x", "request_id": "mine"}))
    assert b"x-request-id" not in dict(headers)  # vLLM takes the body's own id when no header overrides it
    t.writer.drain()
    first, second = rows(Path(t.settings.folder))
    assert first["id"] == f"cmpl-{added}" and first["request_id"] == added
    assert second["id"] == "cmpl-mine" and second["request_id"] is None


def test_domain_comes_from_the_body_else_the_header(traffic):
    t = traffic(domain_header="X-Team-Domain")
    hdr = [(b"x-team-domain", b"code")]
    run(call(t, "/v1/completions", {"model": "m", "prompt": "x", "domain": "math"}, hdr))
    run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}, hdr))
    run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}))
    t.writer.drain()
    assert [r.get("domain") for r in rows(Path(t.settings.folder))] == ["math", "code", None]


def test_other_paths_are_not_logged(traffic):
    t = traffic()
    out, _ = run(call(t, "/v1/embeddings", {"input": "x"}))
    assert out[0]["status"] == 404 and t.writer.drain() and rows(Path(t.settings.folder)) == []


def test_a_full_queue_drops_the_record_and_never_blocks(traffic, monkeypatch):
    release = threading.Event()
    real = mw.record
    monkeypatch.setattr(mw, "record", lambda x: (release.wait(10), real(x))[1])  # a writer stuck on a slow disk
    t = traffic(queue_size=1)
    start = time.monotonic()
    for _ in range(6):
        out, _ = run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}))
        assert out[-1]["type"] == "http.response.body"
    assert time.monotonic() - start < 5.0
    counts = t.counts.snapshot()
    assert counts["dropped_queue_full"] >= 4 and counts["written"] == 0
    release.set()
    assert t.writer.drain()
    assert t.counts.snapshot()["written"] == 6 - counts["dropped_queue_full"] == len(rows(Path(t.settings.folder)))


def test_an_exception_in_the_logging_path_never_reaches_the_client(traffic, monkeypatch):
    t = traffic()
    monkeypatch.setattr(mw, "record", lambda x: 1 / 0)
    direct, _ = run(call(vllm_like, "/v1/completions", {"model": "m", "prompt": "x"}, [(b"x-request-id", b"i")]))
    out, _ = run(call(t, "/v1/completions", {"model": "m", "prompt": "x"}, [(b"x-request-id", b"i")]))
    assert out == direct and t.writer.drain() and t.counts.snapshot()["errors"] == 1
    monkeypatch.undo()

    async def odd(scope, receive, send):  # a status our observer cannot read: its message still goes out
        await receive()
        await send({"type": "http.response.start", "status": "two hundred", "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    t2 = TrafficLog(odd, t.settings)
    out, _ = run(call(t2, "/v1/completions", {"prompt": "x"}))
    assert [m.get("status") for m in out] == ["two hundred", None] and out[1]["body"] == b"{}"
    assert t2.counts.snapshot()["errors"] == 1 and t2.writer.drain() and t2.counts.snapshot()["written"] == 0
    t2.writer.close()


def test_bodies_over_the_cap_pass_through_and_are_counted(traffic):
    t = traffic(max_body_bytes=64)
    body = {"model": "m", "prompt": "y" * 200}
    direct, seen_direct = run(call(vllm_like, "/v1/completions", body, [(b"x-request-id", b"c")]))
    out, seen = run(call(t, "/v1/completions", body, [(b"x-request-id", b"c")]))
    assert out == direct and seen == seen_direct
    assert t.writer.drain() and t.counts.snapshot()["over_cap"] == 1 and rows(Path(t.settings.folder)) == []


def test_files_rotate_and_only_this_process_own_are_deleted(traffic, tmp_path):
    folder = tmp_path / "traffic"
    folder.mkdir()
    foreign = folder / "traffic-20250101T000000000000Z-1.jsonl"  # another process's file
    foreign.write_text("{}\n")
    (folder / "notes.jsonl").write_text("{}\n")
    t = traffic(max_file_bytes=300, max_files=2)
    for i in range(6):
        run(call(t, "/v1/completions", {"model": "m", "prompt": f"p{i}"}))
        t.writer.drain()
    mine = sorted(p for p in folder.iterdir() if (m := NAME.match(p.name)) and int(m["pid"]) == os.getpid())
    assert len(mine) == 2 and foreign.is_file() and (folder / "notes.jsonl").is_file()
    kept = [json.loads(line) for p in mine for line in p.read_text().splitlines()]  # whole lines only
    assert [r["prompt"] for r in kept] == ["p4", "p5"] and t.counts.snapshot()["written"] == 6


def test_settings_come_from_the_environment(tmp_path):
    s = Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path), "DRAFTSMITH_TRAFFIC_MAX_FILES": "3",
                           "DRAFTSMITH_TRAFFIC_DOMAIN_HEADER": "X-Team"})
    assert (s.folder, s.max_files, s.domain_header, s.queue_size) == (str(tmp_path), 3, "X-Team", 1024)
    with pytest.raises(ValueError, match="DRAFTSMITH_TRAFFIC_DIR is not set"):
        Settings.from_env({})
    with pytest.raises(ValueError, match=r"DRAFTSMITH_TRAFFIC_QUEUE='-1', expected an integer in 1\.\."):
        Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path), "DRAFTSMITH_TRAFFIC_QUEUE": "-1"})


# --- the reader: logged rows -> the per-domain table ---------------------------------------------------------------
def _write(path: Path, rows_: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows_))
    return path


def test_the_per_domain_table_from_the_middleware_rows(traffic):
    from draftsmith.planning.production import log_alpha

    t = traffic()
    for path, body in REQUESTS:  # one "geo" row (its body's domain), three without
        run(call(t, path, body))
    t.writer.drain()
    table = log_alpha(t.settings.folder)
    geo, unknown = table["domains"]["geo"], table["domains"]["unknown"]
    # STEPS: 4 steps, 11 drafted, 6 accepted; positions 0, 1, 2 accepted in 3, 2, 1 of the 4 steps
    assert (geo["drafts"], geo["proposed"], geo["accepted"], geo["n_prompts"]) == (4, 11, 6, 1)
    assert geo["per_position_acceptance"] == [0.75, 0.5, 0.25] and geo["alpha"] == 6 / 11 and geo["tau"] == 2.5
    assert (unknown["drafts"], unknown["proposed"], unknown["accepted"], unknown["n_prompts"]) == (12, 33, 18, 3)
    assert table["overall"]["drafts"] == 16 and table["malformed"] == 0 and table["uncounted"] == 0


def test_a_policy_classifies_rows_without_a_domain(tmp_path):
    from draftsmith.cli import main as cli

    m = spec(STEPS)
    policy = {"kind": "routing_policy", "router": {"kind": "declared", "keywords": {"code": ["def "],
                                                                                 "math": ["how many"]}},
              "default": "off", "domains": {"code": "off", "math": "off"}}
    (tmp_path / "policy.json").write_text(json.dumps(policy))
    _write(tmp_path / "logs" / "a.jsonl", [
        {"prompt": "def f(x):", "speculative_decoding": m},
        {"prompt": [{"role": "user", "content": "def g"}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": "How many apples?"}]}],
         "speculative_decoding": m},
        {"prompt": "def h():", "domain": "chat", "speculative_decoding": m},  # declared: kept
        {"prompt": [5, 6, 7], "metrics": {"speculative_decoding": m}},  # a raw response's metrics; no text
        {"prompt": "def s():", "stream": True},  # a stream logged without include_usage
    ])
    out = tmp_path / "table.json"
    assert cli(["alpha", str(tmp_path / "logs"), "--policy", str(tmp_path / "policy.json"), "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert {d: r["n_prompts"] for d, r in table["domains"].items()} == {"code": 1, "math": 1, "chat": 1,
                                                                        "unknown": 1}
    assert table["uncounted"] == 1
    # retraining's production check reads the same folder with the same policy
    from draftsmith.retrain.config import MeasureConfig
    from draftsmith.retrain.run import _production

    m = MeasureConfig(production=str(tmp_path / "logs"), production_policy=str(tmp_path / "policy.json"))
    assert _production(m, tmp_path / "kept.prom")["domains"] == table["domains"]
    with pytest.raises(ConfigError, match="is /metrics"):
        from draftsmith.planning.production import production_alpha

        (tmp_path / "m.prom").write_text("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 1\n")
        production_alpha(tmp_path / "m.prom", policy=tmp_path / "policy.json")


def _broken(**change) -> dict:
    m = spec(STEPS)
    for k, v in change.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    return m


@pytest.mark.parametrize("change,field", [
    ({"acceptance_histogram": [1, 1, 1]}, r"speculative_decoding\.acceptance_histogram is \[1, 1, 1\], expected 4"),
    ({"acceptance_histogram": [1, 1, 1, -1]}, r"speculative_decoding\.acceptance_histogram is"),
    ({"acceptance_histogram": [2, 1, 1, 1]}, r"acceptance_histogram sums to 5, not num_spec_steps 4"),
    ({"acceptance_histogram": [0, 2, 1, 1]}, r"acceptance_histogram counts 7 accepted tokens, not num_accepted"),
    ({"num_draft_tokens": 5}, r"speculative_decoding\.num_draft_tokens is 5: expected num_accepted_draft_tokens 6"),
    ({"num_draft_tokens": 13}, r"<= num_spec_tokens x num_spec_steps 12"),
    ({"num_spec_tokens": True}, r"speculative_decoding\.num_spec_tokens is True, expected an int in 1\.\.1024"),
    ({"num_spec_steps": None}, r"speculative_decoding\.num_spec_steps is None, expected an int >= 0"),
    ({"draft_acceptance_rate": 0.9}, r"speculative_decoding\.draft_acceptance_rate is 0\.9, but the counts give"),
    ({"per_step_accepted": [3, 1, 0]}, r"speculative_decoding\.per_step_accepted is \[3, 1, 0\], expected 4 ints"),
    ({"per_step_drafted": [3, 3, 3, 3]}, r"per_step_accepted / per_step_drafted sum to 6 / 12, "
                                         r"not num_accepted_draft_tokens 6 / num_draft_tokens 11"),
    ({"per_step_accepted": [1, 0, 2, 3]}, r"per_step_accepted\[3\] is 3 > per_step_drafted\[3\] 2"),
    ({"per_step_accepted": [3, 3, 0, 0]}, r"acceptance_histogram \[1, 1, 1, 1\] is not the histogram of per_step"),
    ({"per_step_drafted": None}, r"per_step_drafted is None, expected 4 ints"),
])
def test_metrics_that_break_a_rule_are_one_named_bad_row(tmp_path, change, field):
    from draftsmith.planning.production import log_alpha

    good = {"domain": "a", "speculative_decoding": spec(STEPS)}
    f = _write(tmp_path / "logs" / "t.jsonl", [good, {"domain": "a", "speculative_decoding": _broken(**change)}, good])
    table = log_alpha(f.parent)
    assert table["malformed"] == 1 and table["domains"]["a"]["n_prompts"] == 2  # skipped, the rest read
    (bad,) = table["bad"]
    assert bad.startswith(f"{f}:2: ") and "\n" not in bad and re.search(field, bad), bad


def test_a_raw_response_metrics_field_is_read_and_named(tmp_path):
    from draftsmith.planning.production import log_alpha

    f = _write(tmp_path / "r.jsonl", [{"metrics": {"speculative_decoding": spec(STEPS)}},
                                      {"metrics": {"speculative_decoding": _broken(num_spec_steps=9)}},
                                      {"metrics": [1]}, {"metrics": None}])
    table = log_alpha(f)
    assert table["domains"]["unknown"]["drafts"] == 4 and table["uncounted"] == 1
    assert "r.jsonl:2: metrics.speculative_decoding.acceptance_histogram sums to 4, not" in table["bad"][0]
    assert "r.jsonl:3: metrics is [1], expected a JSON object" in table["bad"][1] and len(table["bad"]) == 2


def test_the_table_sums_every_row_and_mixed_counters_give_no_position_rate(tmp_path):
    import random

    from draftsmith.planning.production import log_alpha

    rng = random.Random(0)
    logged, totals = [], {"drafts": 0, "proposed": 0, "accepted": 0, "pos": [0] * K}
    for i in range(40):
        steps = [(d := rng.randint(1, K), rng.randint(0, d)) for _ in range(rng.randint(0, 6))]
        logged.append({"domain": "ab"[i % 2], "speculative_decoding": spec(steps)})
        totals["drafts"] += len(steps)
        totals["proposed"] += sum(d for d, _ in steps)
        totals["accepted"] += sum(a for _, a in steps)
        for _, a in steps:
            for p in range(a):
                totals["pos"][p] += 1
    table = log_alpha(_write(tmp_path / "l.jsonl", logged))
    o = table["overall"]
    assert (o["drafts"], o["proposed"], o["accepted"], o["n_prompts"]) == (totals["drafts"], totals["proposed"],
                                                                           totals["accepted"], 40)
    assert o["per_position_acceptance"] == pytest.approx([p / totals["drafts"] for p in totals["pos"]])
    assert sum(r["drafts"] for r in table["domains"].values()) == o["drafts"]
    # a gateway's counters beside vLLM's in one domain: α and τ still, per-position rates no more
    table = log_alpha(_write(tmp_path / "l.jsonl", [*logged, {"domain": "a", "draft_tokens": 9, "accepted_tokens": 3,
                                                              "drafts": 3}]))
    assert table["domains"]["a"]["per_position_acceptance"] == [] and table["domains"]["b"]["per_position_acceptance"]
    assert table["overall"]["per_position_acceptance"] == [] and table["overall"]["accepted"] == totals["accepted"] + 3


def test_logs_with_no_counters_are_refused_in_one_line(tmp_path):
    from draftsmith.planning.production import log_alpha

    f = _write(tmp_path / "l.jsonl", [{"prompt": "x", "stream": True}, "{", {"speculative_decoding": 7}])
    with pytest.raises(DataError) as e:
        log_alpha(f)
    assert "\n" not in str(e.value) and "1 rows without, 2 malformed" in str(e.value) and str(f) in str(e.value)
