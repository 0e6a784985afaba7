"""Fuzzing the fleet side's readers (tests/fuzzing.py): evaluation reports (and the policy built from them),
routing policies, verify profiles, traffic logs (JSON lines and gzip, cut short too), request logs with
per-request counters (a gateway's, SGLang's, and vLLM's own as the fleet's traffic middleware logs them),
Prometheus dumps, accelerate YAML and the registry's current.json. Each reads its input
or refuses it in one line naming it; what a reader accepts, the code behind it runs on without a raw error."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import (
    FUZZ,
    FUZZ_LONG,
    PLACES,
    _damage,
    mutated_json,
    mutated_jsonl,
    mutated_yaml,
    place,
    refuses_cleanly,
)

NOW = int(time.time()) - 600

REPORT = {
    "proposer": "eagle:runs/e", "target": {"name": "t", "fingerprint": {"tokenizer_hash": "A"}},
    "settings": {"k": 4, "tree": [4, 2], "tree_max_nodes": 8,
                 "compare_settings": {"ngram@chain=4": {"k": 4, "tree": None, "tree_max_nodes": None}}},
    "cost_model": {"t_step_decode_s": 0.01},
    "overall": {"alpha": 0.5, "tau": 2.0, "lossless": True},
    "domains": {"code": {"speedup": 1.3, "alpha": 0.5, "tau": 2.1, "lossless": True, "n_prompts": 4,
                         "verified_nodes_per_step": 6.0, "target_forwards": 100, "proposer_time_s": 0.2,
                         "gpu_tree": {"tau": 2.5, "verified_nodes_per_step": 12.0},
                         "compare": {"ngram@chain=4": {"speedup": 1.1, "alpha": 0.4, "tau": 1.6, "lossless": True}}},
                "math": {"speedup": 0.9, "alpha": 0.3, "tau": 1.4, "lossless": False, "n_prompts": 4}},
}
POLICY = {"kind": "routing_policy", "threshold": 1.0, "criterion": "speedup",
          "target": {"fingerprint": {"tokenizer_hash": "A"}},
          "router": {"kind": "keyword", "keywords": {"code": ["def "], "math": ["sum of"]}}, "default": "off",
          "domains": {"code": {"proposer": "ngram", "k": 4, "tree": None, "tree_max_nodes": None},
                      "math": {"proposer": "eagle:e", "k": None, "tree": [4, 2], "tree_max_nodes": 8}, "chat": "off"}}
PROFILE = {"name": "h100", "v": {"0": 1.0, "64": 1.0, "128": 2.0}, "c": {"eagle": 0.1, "ngram": 0.0}}
TRAFFIC = [{"prompt": "Write a python function.", "domain": "code", "timestamp": NOW},
           {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
            "domain": "math", "response": "4", "timestamp": "2026-01-01T00:00:00Z"},
           {"prompt": "Tell me a story.", "timestamp": NOW - 60}]
REQUESTS = [{"domain": "code", "draft_tokens": 40, "accepted_tokens": 20, "drafts": 10},
            {"domain": "math", "meta_info": {"spec_verify_ct": 10, "completion_tokens": 25}},
            {"domain": "chat", "prompt": "served without speculation"}]
# the fleet's traffic log (fleet/middleware.py): vLLM's per-request counters, detailed and summary, and a raw
# response's metrics.speculative_decoding
SPEC = {"mean_acceptance_length": 2.5, "draft_acceptance_rate": 6 / 11, "acceptance_histogram": [1, 1, 1, 1],
        "num_spec_steps": 4, "num_accepted_draft_tokens": 6, "num_draft_tokens": 11, "num_spec_tokens": 3,
        "per_step_accepted": [3, 1, 0, 2], "per_step_drafted": [3, 3, 3, 2]}
FLEET = [{"timestamp": "2026-01-01T00:00:00.000Z", "id": "cmpl-a", "request_id": "a", "endpoint": "completions",
          "model": "m", "prompt": "def f():", "domain": "code", "response": " pass", "output_token_ids": [5, 6],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "finish_reason": "stop", "stream": False,
          "status": 200, "speculative_decoding": SPEC},
         {"endpoint": "chat.completions", "prompt": [{"role": "user", "content": "How many apples?"}],
          "stream": True, "status": 200, "speculative_decoding": {**SPEC, "per_step_accepted": None,
                                                                  "per_step_drafted": None}},
         {"id": "chatcmpl-b", "choices": [], "metrics": {"speculative_decoding": SPEC}},
         {"prompt": "no counters", "stream": True, "status": 200}]
ACCELERATE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_processes": 8,
              "mixed_precision": "bf16", "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "none"}}
POINTER = {"version": "v0001", "since": "2026-01-01T00:00:00Z", "reason": "initial version"}
PROM = [
    "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
    "# TYPE vllm:spec_decode_num_drafts_total counter",
    'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0',
    'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 400.0',
    'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 200.0',
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 80.0',
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 60.0',
    'vllm:request_success_total{finished_reason="stop",model_name="m"} 12.0',
    "process_start_time_seconds 1.7e9",
]
PROM_TOKENS = ["NaN", "+Inf", "-Inf", "-1", "1e999", "abc", "", "0x10", "1_000", "²", "-0", "1e-320", "9" * 400]


@st.composite
def mutated_prometheus(draw, lines: list[str] = PROM) -> bytes:
    """A /metrics dump that started as `lines`: a value, a label or a whole line swapped, lines dropped or
    repeated, then maybe damaged bytes."""
    lines = list(lines)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "value", "label", "line", "drop", "repeat"]))
        head, _, _ = lines[i].rpartition(" ")
        if op == "value":
            lines[i] = f"{head} {draw(st.sampled_from(PROM_TOKENS) | st.text(max_size=6))}"
        elif op == "label" and "=" in lines[i]:
            name, _, rest = lines[i].partition('="')
            lines[i] = f'{name}="{draw(st.sampled_from(PROM_TOKENS) | st.text(max_size=6))}' + rest[rest.find('"'):]
        elif op == "line":
            lines[i] = draw(st.text(max_size=40) | st.sampled_from(['x{a="1"', "vllm:x{} 1 2 3", "{}", " 1"]))
        elif op == "drop":
            del lines[i]
        else:
            lines.insert(i, lines[i])
        if not lines:
            lines = ["# empty"]
    return _damage(draw, ("\n".join(lines) + "\n").encode())


HEADLINE = json.loads((Path(__file__).resolve().parents[1] / "results" / "headline-smollm2-135m" /
                       "report.json").read_text())


# --- each reader, and what runs behind it ---------------------------------------------------------------------
def _report(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.decoding.routing import policy_problem
    from draftsmith.evaluation.report_file import read_report
    from draftsmith.planning.policy import build_policy

    path = place(tmp_path / "report.json", data, how)
    if refuses_cleanly(lambda: read_report(path), path.name) is None:
        return
    for criterion in ("speedup", "tau", "predicted"):  # what the reader accepts, routing runs on
        policy = refuses_cleanly(lambda c=criterion: build_policy([path], threshold=0.0, criterion=c), path.name)
        assert policy is None or policy_problem(policy) is None


def _headline(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.benchmark.headline import read_headline_report, render

    path = place(tmp_path / "headline.json", data, how)
    report = refuses_cleanly(lambda: read_headline_report(path), path.name)
    if report is not None:
        assert render(report, "r.json")


def _policy(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.decoding.routing import KeywordRouter, load_policy

    path = place(tmp_path / "policy.json", data, how)
    policy = refuses_cleanly(lambda: load_policy(path), path.name)
    if policy is not None:
        KeywordRouter((policy.get("router") or {}).get("keywords")).classify("def sum of")


def _profile(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.planning.policy import VerifyProfile

    path = place(tmp_path / "profile.json", data, how)
    prof = refuses_cleanly(lambda: VerifyProfile.load(str(path)), path.name)
    if prof is not None:
        assert all(prof.v(n) > 0 for n in (0, 1, 60, 1000)) and prof.draft_cost("multi:ngram+eagle:x", 0.1)[0] >= 0


def _folder(tmp_path):
    folder = tmp_path / "logs"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


def _traffic(tmp_path, data: bytes, how: str, gz: bool, cut: float) -> None:
    from draftsmith.retrain.traffic import read_traffic

    folder = _folder(tmp_path)
    if gz:  # a gzip file, maybe cut short by a writer that stopped
        whole = gzip.compress(data)
        data = whole[:int(len(whole) * cut)] if cut < 1 else whole
    place(folder / ("a.jsonl.gz" if gz else "a.jsonl"), data, how)
    sample = refuses_cleanly(lambda: read_traffic(folder, window_days=365), folder.name)
    for r in sample.rows if sample else []:
        assert isinstance(r.prompt, str) and r.prompt.strip() and isinstance(r.domain, str)


def _requests(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.planning.production import log_alpha, render

    folder = _folder(tmp_path)
    place(folder / "r.jsonl", data, how)
    table = refuses_cleanly(lambda: log_alpha(folder), folder.name)
    if table is not None:
        assert all(r["alpha"] is None or 0 <= r["alpha"] <= 1 for r in table["domains"].values()) and render(table)


def _fleet_traffic(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.planning.production import log_alpha, render

    folder = _folder(tmp_path)
    place(folder / "traffic-20260101T000000000000Z-1.jsonl", data, how)
    policy = tmp_path / "fleet-policy.json"  # never placed by a mutation (the long run shares tmp_path)
    policy.write_text(json.dumps(POLICY))
    table = refuses_cleanly(lambda: log_alpha(folder, policy), folder.name)
    if table is not None:  # what the reader accepts is counts the table can be built on
        for r in [*table["domains"].values(), table["overall"]]:
            assert r["alpha"] is None or 0 <= r["alpha"] <= 1
            assert all(0 <= p <= 1 for p in r["per_position_acceptance"])
        assert all("\n" not in b and b.startswith(str(folder)) for b in table["bad"]) and render(table)


def _prometheus(tmp_path, data: bytes, since: bytes, how: str) -> None:
    from draftsmith.planning.production import production_alpha, render

    path = place(tmp_path / "after.prom", data, how)
    table = refuses_cleanly(lambda: production_alpha(path), path.name)
    if table is not None:
        render(table)
        earlier = place(tmp_path / "before.prom", since)
        refuses_cleanly(lambda: production_alpha(path, since=earlier))  # names after.prom or before.prom


def _accelerate(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.memory.training import read_accelerate

    path = place(tmp_path / "acc.yaml", data, how)
    sharding = refuses_cleanly(lambda: read_accelerate(path), path.name)
    if sharding is not None:
        assert sharding.ranks >= 1 and sharding.kind in ("replicate", "zero2", "zero3", "fsdp")


def _pointer(tmp_path, data: bytes, how: str) -> None:
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path / "registry", "t", "medusa")
    (reg.path("v0001")).mkdir(exist_ok=True)
    (reg.path("v0001") / "manifest.json").write_text("{}")
    place(reg.base / "current.json", data, how)
    version = refuses_cleanly(lambda: reg.current(), "current.json")
    assert version in (None, "v0001")


# --- make test: a fixed set of examples per reader --------------------------------------------------------------
@FUZZ
@given(mutated_json(REPORT), PLACES)
def test_fuzz_evaluation_report(tmp_path, data, how):
    _report(tmp_path, data, how)


@FUZZ
@given(mutated_json(HEADLINE), PLACES)
def test_fuzz_headline_report(tmp_path, data, how):
    _headline(tmp_path, data, how)


@FUZZ
@given(mutated_json(POLICY), PLACES)
def test_fuzz_routing_policy(tmp_path, data, how):
    _policy(tmp_path, data, how)


@FUZZ
@given(mutated_json(PROFILE), PLACES)
def test_fuzz_verify_profile(tmp_path, data, how):
    _profile(tmp_path, data, how)


@FUZZ
@given(mutated_jsonl(TRAFFIC), PLACES, st.booleans(), st.sampled_from([1.0, 0.5, 0.9, 0.1]))
def test_fuzz_traffic_logs(tmp_path, data, how, gz, cut):
    _traffic(tmp_path, data, how, gz, cut)


@FUZZ
@given(mutated_jsonl(REQUESTS), PLACES)
def test_fuzz_request_logs_with_counters(tmp_path, data, how):
    _requests(tmp_path, data, how)


@FUZZ
@given(mutated_jsonl(FLEET), PLACES)
def test_fuzz_fleet_traffic_with_vllm_counters(tmp_path, data, how):
    _fleet_traffic(tmp_path, data, how)


@FUZZ
@given(mutated_prometheus(), mutated_prometheus(), PLACES)
def test_fuzz_prometheus_dump(tmp_path, data, since, how):
    _prometheus(tmp_path, data, since, how)


@FUZZ
@given(mutated_yaml(ACCELERATE), PLACES)
def test_fuzz_accelerate_yaml(tmp_path, data, how):
    _accelerate(tmp_path, data, how)


@FUZZ
@given(mutated_json(POINTER), PLACES)
def test_fuzz_registry_current_pointer(tmp_path, data, how):
    _pointer(tmp_path, data, how)


# --- the longer random run ----------------------------------------------------------------------------------------
@pytest.mark.slow
@FUZZ_LONG
@given(mutated_json(REPORT), mutated_json(HEADLINE), mutated_json(POLICY), mutated_json(PROFILE),
       mutated_jsonl(TRAFFIC), mutated_jsonl(REQUESTS), mutated_jsonl(FLEET), mutated_prometheus(),
       mutated_yaml(ACCELERATE), mutated_json(POINTER), PLACES, st.booleans(), st.floats(0.05, 1.0))
def test_fuzz_fleet_readers_long(tmp_path, report, headline, policy, profile, traffic, requests, fleet, prom, acc,
                                 pointer, how, gz, cut):
    _report(tmp_path, report, how)
    _headline(tmp_path, headline, how)
    _policy(tmp_path, policy, how)
    _profile(tmp_path, profile, how)
    _traffic(tmp_path, traffic, how, gz, cut)
    _requests(tmp_path, requests, how)
    _fleet_traffic(tmp_path, fleet, how)
    _prometheus(tmp_path, prom, prom, how)
    _accelerate(tmp_path, acc, how)
    _pointer(tmp_path, pointer, how)
