"""serve-bench's statistics, cost model along the batch dimension and streaming client, on values computed by hand
(the real `vllm serve` runs are tests/test_vllm_serve_bench.py). The client is driven against a real HTTP server on
127.0.0.1 that streams server-sent events as vLLM does, with pauses between them."""

from __future__ import annotations

import http.server
import json
import time

import pytest
from local_http import local_server

from draftsmith.benchmark.serve_bench import compare, homogeneous, mixed, summarize
from draftsmith.benchmark.serve_client import Run, Sample, drive, stream_chat
from draftsmith.decoding import batch_cost


def test_percentile_interpolates_between_the_closest_ranks():
    # sorted [1, 2, 3, 4]: p50 at position 1.5 -> 2.5; p99 at 2.97 -> 3 + 0.97 * (4 - 3)
    assert batch_cost.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert batch_cost.percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert batch_cost.percentile([4, 1, 3, 2], 0) == 1 and batch_cost.percentile([4, 1, 3, 2], 100) == 4
    assert batch_cost.percentile([5.0], 99) == 5.0 and batch_cost.percentile([], 50) is None
    with pytest.raises(ValueError, match="expected 0..100"):
        batch_cost.percentile([1], 101)


def test_step_ratio_speedup_and_the_interpolated_chain():
    assert batch_cost.step_ratio(0.1, 0.12) == pytest.approx(1.2)
    assert batch_cost.ratio(3.0, 0) is None and batch_cost.ratio(None, 2.0) is None
    # r(c, k') = 1 + (r - 1) k'/k: at k = 4 with r = 1.8, k' = 1 costs 1.2, k' = 0 costs one plain step
    assert batch_cost.step_ratio_at(1.8, 4, 1) == pytest.approx(1.2) and batch_cost.step_ratio_at(1.8, 4, 0) == 1.0
    with pytest.raises(ValueError, match="outside 0..4"):
        batch_cost.step_ratio_at(1.8, 4, 5)
    # E[tokens | 2] = 1 + (6 + 3) / 10 = 1.9 over r = 1.5
    assert batch_cost.predicted_speedup([6, 3], 10, 2, 1.5) == pytest.approx(1.9 / 1.5)
    assert batch_cost.predicted_speedup([6, 3], 10, 2, None) is None


@pytest.mark.parametrize(("r", "k", "speedups"), [
    # accepted at positions [6, 3] of 10 steps: E(1) = 1.6, E(2) = 1.9; r(c, 1) = (1 + r) / 2
    (1.5, 1, {0: 1.0, 1: 1.6 / 1.25, 2: 1.9 / 1.5}),  # the short chain wins: 1.28 > 1.267
    (1.2, 2, {0: 1.0, 1: 1.6 / 1.1, 2: 1.9 / 1.2}),  # cheap steps: the whole chain, 1.583 > 1.455
    (2.5, 0, {0: 1.0, 1: 1.6 / 1.75, 2: 1.9 / 2.5}),  # the drafter costs more than it saves: off
])
def test_recommend_k_takes_the_chain_with_the_largest_predicted_speedup(r, k, speedups):
    rec = batch_cost.recommend_k([6, 3], 10, 2, r)
    assert rec["k"] == k
    assert rec["predicted_decode_speedup_by_k"] == pytest.approx({str(x): v for x, v in speedups.items()})
    assert batch_cost.recommend_k([6, 3], 10, 2, None)["k"] is None


def test_served_speedup_adds_each_sides_first_token_and_a_costly_prefill_turns_the_drafter_off():
    served = batch_cost.Served(t1=0.1, ttft_plain=0.2, ttft_drafter=0.25, n=10)
    assert served.speedup(2.0) == pytest.approx((0.2 + 1.0) / (0.25 + 0.5)) and served.speedup(None) is None
    # decode alone would win (S_decode(2) = 1.9 / 1.2 = 1.583), but a 2 s first token makes the request slower
    slow = batch_cost.Served(t1=0.1, ttft_plain=0.2, ttft_drafter=2.0, n=10)
    rec = batch_cost.recommend_k([6, 3], 10, 2, 1.2, slow)
    assert rec["k"] == 0 and rec["off_by_prefill"]
    assert rec["predicted_speedup"] == pytest.approx(1.2 / (2.0 + 1.0 / (1.9 / 1.2)))
    assert batch_cost.recommend_k([6, 3], 10, 2, 1.2, served)["k"] == 2


def test_schedule_is_vllms_per_batch_size_ranges():
    assert batch_cost.schedule({1: 2, 4: 1, 16: 0}, 16) == [[1, 3, 2], [4, 15, 1], [16, 16, 0]]
    assert batch_cost.schedule({1: 2, 4: 2, 16: 0}, 32) == [[1, 15, 2], [16, 32, 0]]  # equal neighbours merge
    assert batch_cost.schedule({4: 3}, 8) == [[1, 8, 3]]  # vLLM's first range starts at 1
    assert batch_cost.schedule({}, 8) == []
    with pytest.raises(ValueError, match="below the largest measured concurrency 16"):
        batch_cost.schedule({16: 1}, 8)


def test_mixed_runs_interleave_domains_and_homogeneous_runs_cycle_one():
    by_domain = {"math": ["m1", "m2"], "code": ["c1"]}
    assert mixed(by_domain, 5) == [("code", "c1"), ("math", "m1"), ("math", "m2"), ("code", "c1"), ("math", "m1")]
    assert homogeneous("math", ["m1", "m2"], 3) == [("math", "m1"), ("math", "m2"), ("math", "m1")]


def _run(c: int, wall: float, samples: list[Sample]) -> Run:
    return Run(c, samples, wall)


def _by_hand() -> tuple[dict, dict, dict]:
    # plain: 2 answers of 11 tokens, 1.0 s from first to last token each -> 0.1 s a step; 22 tokens in 2.4 s
    plain = summarize(_run(1, 2.4, [Sample("math", ttft_s=0.2, decode_s=1.0, output_tokens=11) for _ in range(2)]),
                      "mixed")
    assert plain["step_s"] == pytest.approx(0.1) and plain["output_tokens_per_s"] == pytest.approx(22 / 2.4)
    assert plain["tpot_s"]["p50"] == pytest.approx(0.1) and plain["acceptance"] is None
    # drafter (k = 2): 5 verify steps a request, 5 of 10 drafted accepted (4 at position 0, 1 at 1), 0.6 s each
    spec_samples = [Sample("math", ttft_s=0.25, decode_s=0.6, output_tokens=11, spec=(5.0, 10.0, 5.0, [4.0, 1.0]),
                           k=2) for _ in range(2)]
    spec = summarize(_run(1, 1.6, spec_samples + [Sample("math", error="x: refused")]), "mixed")
    assert spec["errors"] == 1 and spec["first_error"] == "x: refused" and spec["ok"] == 2
    assert spec["step_s"] == pytest.approx(1.2 / 10)  # per verify step, not per token
    acc = spec["acceptance"]
    assert acc["alpha"] == pytest.approx(0.5) and acc["tau"] == pytest.approx(2.0)
    assert acc["per_position_acceptance"] == pytest.approx([0.8, 0.2])
    comp = compare([plain], [spec], max_batch=1)
    row = comp["by_concurrency"]["1"]
    assert row["step_ratio"] == pytest.approx(1.2)  # 0.12 s against 0.1 s
    assert row["speedup"] == pytest.approx((22 / 1.6) / (22 / 2.4))  # 1.5
    assert row["predicted_decode_speedup"] == pytest.approx(2.0 / 1.2)  # E[tokens | 2] = 1 + (8 + 2) / 10
    # latencies: plain 0.2 s + 10 steps of 0.1 s; drafter 0.25 s + 1.0 s / (2.0 / 1.2) = 0.85 s
    assert row["predicted_speedup"] == pytest.approx(1.2 / 0.85)
    assert row["prediction_error"] == pytest.approx((1.2 / 0.85) / 1.5 - 1)
    assert row["tpot_speedup"] == pytest.approx(0.1 / 0.06) and row["ttft_ratio"] == pytest.approx(1.25)
    # S_decode(1) = 1.8 / 1.1 = 1.636 < S_decode(2) = 1.667: the whole chain
    assert row["recommended_k"] == 2 and not row["recommended"]["off_by_prefill"]
    assert row["recommended"]["predicted_speedup"] == pytest.approx(1.2 / 0.85)
    assert row["recommended_k"] == 2 and comp["num_speculative_tokens_per_batch_size"] == [[1, 1, 2]]
    assert comp["verdict"] == "on at k = 2 at every measured concurrency"
    return plain, spec, comp


def test_summary_and_comparison_by_hand():
    _by_hand()


def test_report_renders_the_comparison_and_writes_its_three_files(tmp_path):
    from draftsmith.benchmark.serve_report import write_report

    plain, spec, comp = _by_hand()
    report = {"target": "t", "date": "2026-01-01", "seconds": 3.0, "concurrency": [1], "requests": 2,
              "domain_requests": 0, "max_tokens": 11, "prompts": {"domains": {"math": 1}, "left_out_too_long": 0},
              "machine": {"platform": "p", "cpus": 2, "load_before": [0.1], "load_after": [0.2]},
              "servers": {"plain": {"runs": [plain]}, "d": {"runs": [spec], "patches_not_applied": ["fix-x"]}},
              "comparisons": {"d": comp}}
    write_report(report, tmp_path)
    text = (tmp_path / "report.md").read_text()
    # c, tok/s plain / drafter, speedup, predicted, error, r(c), decode speedup / predicted, TTFT ratio, τ, α, k, rec
    assert "| 1 | 9.2 | 13.8 | 1.50 | 1.41 | -6% | 1.20 | 1.67 | 1.67 | 1.25 | 2.000 | 0.500 | 2 | 2 |" in text
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 2]]' in text and "fix-x" in text
    assert (tmp_path / "tokens_per_s.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "report.json").read_text())["comparisons"]["d"]["verdict"] == comp["verdict"]


def _spec_metrics(**changes) -> dict:
    # one verify step drafting 2 tokens, the first accepted: histogram over 0, 1, 2 accepted
    return {"num_spec_tokens": 2, "num_spec_steps": 1, "num_draft_tokens": 2, "num_accepted_draft_tokens": 1,
            "acceptance_histogram": [0, 1, 0], **changes}


def _sse_server(spec: dict, pause: float):
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "a b"}}]},
              {"choices": [{"delta": {"content": "c"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3},
               "metrics": {"speculative_decoding": spec}}]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] and body["stream_options"] == {"include_usage": True}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, ev in enumerate(events):
                if i < 3:
                    time.sleep(pause)  # prefill, then a decode step before each token event
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    return local_server(Handler)


def test_streamed_answer_is_timed_as_its_events_arrive_and_its_counters_read():
    with _sse_server(_spec_metrics(), 0.05) as base:
        s = stream_chat(f"{base}/v1", "m", "math", [{"role": "user", "content": "hi"}], 3, deadline=10.0)
    assert s.error is None and s.output_tokens == 3 and s.k == 2
    assert s.ttft_s >= 0.05 and s.decode_s >= 0.1  # the role event after one pause, the last after two more
    assert s.tpot_s == pytest.approx(s.decode_s / 2)
    assert s.spec == (1.0, 2.0, 1.0, [1.0, 0.0])


def test_counters_that_break_a_rule_fail_the_request_in_one_line_and_a_run_counts_every_answer():
    with _sse_server(_spec_metrics(acceptance_histogram=[0, 0, 1]), 0.0) as base:
        s = stream_chat(f"{base}/v1", "m", "math", [{"role": "user", "content": "hi"}], 3, deadline=10.0)
        assert s.error and "acceptance_histogram counts 2 accepted tokens, not num_accepted_draft_tokens 1" in s.error
        run = drive(f"{base}/v1", "m", [("a", [])] * 3, 2, 3, request_deadline=10.0, run_deadline=60.0)
    assert len(run.samples) == 3 and run.not_sent == 0 and all(x.error for x in run.samples)
