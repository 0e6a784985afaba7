"""The network boundary (net.py): every answer draftsmith reads from a server is bounded in bytes, in total
time and in JSON nesting, is decoded as UTF-8 or refused in one line naming the URL, and no secret it was
given or sent ever reaches provenance, logs or errors. Plus the Prometheus reader behind `draftsmith alpha`:
counters it cannot count are refused in one line naming the file, and a restart between two dumps is seen.

The servers are stdlib HTTP servers on 127.0.0.1 in a thread of the test, stopped when the test leaves them;
every test runs in a few seconds (the slow-drip server is given a deadline of 1 s, not minutes).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import threading
import time

import pytest
from local_http import local_server
from test_hostile import _json, data_cfg, fake_server, openai_answer

from draftsmith.data import generate_dataset
from draftsmith.errors import DataError

KEY = "sk-live-0123456789abcdefXYZ"


def _good(req: dict) -> dict:
    return {"text": " 1 2 3", "finish_reason": "length"}


@contextlib.contextmanager
def streaming_server(write_body):
    """An HTTP server on 127.0.0.1 answering every GET with 200 and no Content-Length, then calling
    `write_body(wfile, stop)` for the body (an endless one, a slow one); yields its base address."""
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def log_message(self, *args):
            pass

        def do_GET(self):
            with contextlib.suppress(OSError):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                write_body(self.wfile, stop)

    with local_server(Handler) as url:
        try:
            yield url
        finally:
            stop.set()  # before the server stops: a body still being written ends


# --- 2. an API key echoed by a failing server is never written ---------------------------------------------
def test_an_api_key_echoed_by_a_failing_server_is_never_written(tiny_target, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("DS_TEST_KEY", KEY)

    def echo(method, path, body, headers):  # a proxy that echoes the request it could not serve
        if path.endswith("/models"):
            return _json({"data": [{"id": "tiny"}]})
        return 503, {"Content-Type": "text/plain"}, (f"upstream down; request was Authorization: "
                                                     f"{headers.get('Authorization')}").encode()

    with fake_server(echo) as bad, fake_server(openai_answer("tiny", _good)) as good, caplog.at_level(logging.WARNING):
        out = generate_dataset(data_cfg(tmp_path, [f"{bad}/v1", f"{good}/v1"], api_key_env="DS_TEST_KEY"),
                               tiny_target, progress=False)
        assert bad.seen and all(h.get("Authorization") == f"Bearer {KEY}" for _, _, h in bad.seen)
    provenance = (out / "provenance.json").read_text()
    servers = json.loads(provenance)["timing"]["servers"]["servers"]
    assert servers[0]["left"] and "HTTP 503" in servers[0]["left"] and "[redacted]" in servers[0]["left"]
    printed = caplog.text + "".join(capsys.readouterr())
    assert "left the run" in printed
    written = provenance + printed + "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                                              and p.suffix in (".json", ".jsonl", ".txt", ".md", ".log"))
    assert KEY not in written and "0123456789abcdef" not in written


def test_redact_removes_every_spelling_of_a_secret():
    from draftsmith.net import redact, safe_url

    text = (f'Authorization: Bearer {KEY}\n{{"api_key": "abc123secret"}} token=Bearer xyz.987 '
            f"https://user:pa55@host/v1?api_key=q1w2e3 x-api-key: k-99 plain-{KEY[::-1]}")
    clean = redact(text, [KEY[::-1]])
    for secret in (KEY, "abc123secret", "xyz.987", "pa55", "q1w2e3", "k-99", KEY[::-1]):
        assert secret not in clean, (secret, clean)
    assert safe_url("http://u:p@127.0.0.1:8000/metrics?token=t0k") == "http://127.0.0.1:8000/metrics?token=[redacted]"


# --- 19. an endless or slow /metrics body is cut at a byte cap and a total deadline -------------------------
def test_an_endless_metrics_body_is_cut_at_the_byte_cap(capsys):
    from draftsmith.cli import main
    from draftsmith.planning.production import read_metrics

    def endless(wfile, stop):
        line = b'vllm:spec_decode_num_drafts_total{model_name="m"} 1\n' * 1000
        while not stop.is_set():
            wfile.write(line)

    with streaming_server(endless) as url:
        t0 = time.monotonic()
        with pytest.raises(DataError,
                           match=r"/metrics: no metrics read \(the answer is larger than 1048576 bytes") as e:
            read_metrics(f"{url}/metrics", max_bytes=1 << 20)
        assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)
        assert main(["alpha", f"{url}/metrics", "--max-mib", "1"]) != 0
        assert "larger than 1048576 bytes" in capsys.readouterr().err


def test_a_slow_drip_metrics_body_ends_at_the_total_deadline(capsys):
    from draftsmith.cli import main
    from draftsmith.planning.production import read_metrics

    def drip(wfile, stop):  # one byte every 0.3 s: each read is quick, the whole never ends
        while not stop.wait(0.3):
            wfile.write(b"v")
            wfile.flush()

    with streaming_server(drip) as url:
        t0 = time.monotonic()
        with pytest.raises(DataError, match=r"/metrics: no metrics read \(no complete answer within the 1 s deadline"):
            read_metrics(f"{url}/metrics", timeout=1.0)
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        assert main(["alpha", f"{url}/metrics", "--timeout", "1"]) != 0
        assert time.monotonic() - t0 < 5 and "deadline" in capsys.readouterr().err


# --- 20. a deeply nested JSON answer is a bad answer of one server, not a crash ------------------------------
def test_a_deeply_nested_json_answer_is_refused_and_the_healthy_server_finishes(tiny_target, tmp_path):
    def nested(method, path, body, headers):
        if path.endswith("/models"):
            return _json({"data": [{"id": "tiny"}]})
        return 200, {"Content-Type": "application/json"}, b"[" * 100_000 + b"]" * 100_000

    with fake_server(nested) as bad, fake_server(openai_answer("tiny", _good)) as good:
        with pytest.raises(DataError, match=r"every server failed.*nests JSON 100000 deep") as e:
            generate_dataset(data_cfg(tmp_path, [f"{bad}/v1"], "alone"), tiny_target, progress=False)
        assert "\n" not in str(e.value)
        out = generate_dataset(data_cfg(tmp_path, [f"{bad}/v1", f"{good}/v1"], "two"), tiny_target, progress=False)
    servers = json.loads((out / "provenance.json").read_text())["timing"]["servers"]["servers"]
    assert "nests JSON" in servers[0]["left"] and servers[1]["rows"] == 3


def test_a_chat_answer_over_the_byte_cap_or_not_utf8_is_a_bad_answer(tiny_target, tmp_path):
    from draftsmith import net

    def huge(method, path, body, headers):
        if path.endswith("/models"):
            return _json({"data": [{"id": "tiny"}]})
        return 200, {"Content-Type": "application/json"}, b" " * (net.ANSWER_MAX_BYTES + 1)

    with fake_server(huge) as bad:
        with pytest.raises(DataError, match=r"every server failed.*larger than \d+ bytes"):
            generate_dataset(data_cfg(tmp_path, [f"{bad}/v1"], "huge"), tiny_target, progress=False)

    def latin(method, path, body, headers):
        return 200, {"Content-Type": "application/json"}, b'{"data": [{"id": "caf\xe9"}]}'

    with fake_server(latin) as bad:
        with pytest.raises(DataError, match=r"/v1/models: the answer is not UTF-8") as e:
            generate_dataset(data_cfg(tmp_path, [f"{bad}/v1"], "latin"), tiny_target, progress=False)
        assert "\n" not in str(e.value)


# --- 24. alpha: odd labels, non-UTF-8 answers and files, a bad line named with its file --------------------
def _dump(pos: dict | None = None, **counts) -> str:
    c = {"num_drafts": 100, "num_draft_tokens": 400, "num_accepted_tokens": 200, **counts}
    lines = [f'vllm:spec_decode_{k}_total{{model_name="m"}} {v}' for k, v in c.items() if v is not None]
    for p, v in (pos or {"0": 60, "1": 50, "2": 40, "3": 50}).items():
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{p}"}} {v}')
    return "\n".join(lines) + "\n"


def test_alpha_refuses_a_position_label_that_is_not_a_position(tmp_path, capsys):
    from draftsmith.cli import main

    f = tmp_path / "m.prom"
    f.write_text(_dump({"first": 60}))
    assert main(["alpha", str(f)]) != 0
    err = capsys.readouterr().err
    assert "position='first' is not a draft position" in err and str(f) in err and "\n" not in err.strip()


def test_alpha_names_a_non_utf8_answer_or_since_file(tmp_path, capsys):
    from draftsmith.cli import main

    good, bad = tmp_path / "after.prom", tmp_path / "before.prom"
    good.write_text(_dump())
    bad.write_bytes(_dump().replace("model_name=\"m\"", "model_name=\"caf\xe9\"").encode("latin-1"))
    assert main(["alpha", str(good), "--since", str(bad)]) != 0
    err = capsys.readouterr().err
    assert f"{bad}: the file is not UTF-8" in err and "\n" not in err.strip()

    def latin(wfile, stop):
        wfile.write(b'vllm:spec_decode_num_drafts_total{model_name="caf\xe9"} 1\n')

    with streaming_server(latin) as url:
        assert main(["alpha", f"{url}/metrics"]) != 0
        err = capsys.readouterr().err
        assert f"{url}/metrics: " in err and "the answer is not UTF-8 (byte 49" in err and "\n" not in err.strip()


def test_alpha_names_the_since_file_of_a_bad_line(tmp_path, capsys):
    from draftsmith.cli import main

    after, before = tmp_path / "after.prom", tmp_path / "before.prom"
    after.write_text(_dump())
    before.write_text('vllm:spec_decode_num_drafts_total{model_name="m"} 1\nthis is no sample\n')
    assert main(["alpha", str(after), "--since", str(before)]) != 0
    err = capsys.readouterr().err
    assert f"{before} line 2: not a Prometheus sample" in err, err


# --- 8. accepted tokens without a drafted-token count are refused, never summed into α ----------------------
def test_a_model_with_accepted_tokens_but_no_draft_token_counter_is_refused(tmp_path, capsys):
    from draftsmith.planning.production import vllm_alpha

    text = _dump() + _dump().replace('"m"', '"n"').replace(
        'vllm:spec_decode_num_draft_tokens_total{model_name="n"} 400\n', "")
    with pytest.raises(DataError, match=r"'n': .*no vllm:spec_decode_num_draft_tokens_total") as e:
        vllm_alpha(text, source="dump.prom")
    assert "dump.prom" in str(e.value)
    assert vllm_alpha(_dump())["overall"]["alpha"] == pytest.approx(0.5)


# --- 10. a restart between two dumps: the window is the counters since the restart -------------------------
def test_a_restart_between_two_dumps_counts_only_since_the_restart(tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.planning.production import vllm_alpha

    before = _dump(num_drafts=1000, num_draft_tokens=4000, num_accepted_tokens=3900,
                   pos={"0": 990, "1": 980, "2": 970, "3": 960}) + "process_start_time_seconds 1700000000.0\n"
    # restarted, then served more than before: every counter is past its old value, yet all are new counts
    after = _dump(num_drafts=2000, num_draft_tokens=8000, num_accepted_tokens=6480,
                  pos={"0": 1800, "1": 1700, "2": 1550, "3": 1430}) + "process_start_time_seconds 1700090000.0\n"
    t = vllm_alpha(after, since=before)
    assert t["overall"]["alpha"] == pytest.approx(0.81) and "restarted" in t["restarted"]
    (tmp_path / "a.prom").write_text(after)
    (tmp_path / "b.prom").write_text(before)
    assert main(["alpha", str(tmp_path / "a.prom"), "--since", str(tmp_path / "b.prom")]) == 0
    out = capsys.readouterr().out
    assert "0.810" in out and "restarted" in out
    # retraining's check since its last one says which window it read
    from draftsmith.retrain.config import MeasureConfig
    from draftsmith.retrain.run import _production

    kept = tmp_path / "kept.prom"
    kept.write_text(before)
    prod = _production(MeasureConfig(production=str(tmp_path / "a.prom"), production_since="last"), kept)
    assert prod["since"].startswith("server start (restarted") and prod["overall"]["alpha"] == pytest.approx(0.81)
    # the same server (same start): the window is the difference, as before
    same = after.replace("1700090000.0", "1700000000.0")
    assert vllm_alpha(same, since=before)["overall"]["alpha"] == pytest.approx((6480 - 3900) / 4000)


# --- 11. per-position samples are shown at their own positions -----------------------------------------------
def test_per_position_samples_at_positions_that_are_not_0_to_k_are_refused(tmp_path):
    from draftsmith.planning.production import vllm_alpha

    with pytest.raises(DataError, match=r"position='-1' is not a draft position"):
        vllm_alpha(_dump({"-1": 10, "0": 60, "5": 40}), source="d.prom")
    with pytest.raises(DataError, match=r"d.prom: 'm': per-position counters at positions \[0, 5\]"):
        vllm_alpha(_dump({"0": 60, "5": 40}), source="d.prom")
    assert vllm_alpha(_dump({"1": 50, "0": 60}))["overall"]["per_position_acceptance"] == [0.6, 0.5]
