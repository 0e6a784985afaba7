"""The one reader of traffic rows (planning/logs.py reads the lines, fleet/traffic_record.py checks each row),
as `draftsmith alpha`, retraining and the held-out prompts evaluation measures on all use it: chats with content
parts and tool calls are read, refused requests never train, a lone surrogate costs its row only, invented
domains are capped, a line or a .gz is bounded by bytes, and α counts each row in its own terms."""

from __future__ import annotations

import gzip
import json
import time
import tracemalloc
from pathlib import Path

import pytest

from draftsmith import reading
from draftsmith.cli import main
from draftsmith.planning import logs as logs_module
from draftsmith.planning.production import log_alpha
from draftsmith.retrain.traffic import TrafficRow, read_traffic, write_prompt_file

NOW = time.time() - 60


def _write(path: Path, rows: list) -> Path:
    """Rows as JSON lines (a str row is written as it is: a line that is no JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _good(i: int, domain: str = "chat", **extra) -> dict:
    return {"prompt": f"question {i}", "domain": domain, "timestamp": NOW - i, "draft_tokens": 4,
            "accepted_tokens": 2, "drafts": 1, **extra}


CHAT_WITH_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
    {"role": "user", "content": [{"type": "text", "text": "what is on"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                 {"type": "text", "text": "this picture?"}]},
]
CHAT_WITH_TOOL_CALL = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
    {"role": "user", "content": "and tomorrow?"},
]


def test_content_parts_and_tool_call_messages_are_read_by_retraining_as_by_alpha(tmp_path):
    rows = [_good(0), {**_good(1), "prompt": CHAT_WITH_PARTS}, {**_good(2), "prompt": CHAT_WITH_TOOL_CALL}]
    folder = _write(tmp_path / "t" / "a.jsonl", rows).parent
    sample = read_traffic(folder)
    assert sample.malformed == 0, sample.bad
    assert sorted(r.prompt for r in sample.rows) == ["and tomorrow?", "question 0", "what is on\nthis picture?"]
    tool = next(r for r in sample.rows if r.prompt == "and tomorrow?")
    assert tool.messages[1] == {"role": "assistant", "content": None,
                                "tool_calls": CHAT_WITH_TOOL_CALL[1]["tool_calls"]}
    table = log_alpha(folder)
    assert table["domains"]["chat"]["n_prompts"] == 3 and table["malformed"] == 0  # the two readers agree


def test_refused_requests_never_train_and_are_counted(tmp_path):
    rows = [_good(0), {**_good(1), "status": 400}, {**_good(2), "error": "max_tokens is too large"},
            {**_good(3), "status": 200}]
    folder = _write(tmp_path / "t" / "a.jsonl", rows).parent
    sample = read_traffic(folder)
    assert sorted(r.prompt for r in sample.rows) == ["question 0", "question 3"]
    assert sample.refused == 2 and sample.malformed == 0
    table = log_alpha(folder)
    assert table["refused"] == 2 and table["domains"]["chat"]["n_prompts"] == 2


def test_a_lone_surrogate_costs_its_row_not_the_held_out_file(tmp_path):
    from draftsmith.evaluation.domains import load_prompts

    folder = tmp_path / "t"
    folder.mkdir()
    lines = [json.dumps(_good(i)) for i in range(3)]
    lines.insert(1, json.dumps({**_good(9), "prompt": "caf\ud800e"}))  # written escaped: "caf\\ud800e"
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    sample = read_traffic(folder)
    assert len(sample.rows) == 3 and sample.unencodable == 1 and sample.malformed == 0
    assert log_alpha(folder)["unencodable"] == 1
    held = write_prompt_file(sample.rows, tmp_path / "held.jsonl")
    assert len(load_prompts([held])) == 3  # evaluation reads the held-out file whole
    # a row built elsewhere with such text is left out of the file, never written into it
    rows = [*sample.rows, TrafficRow("bad \udc80 text", "chat", NOW)]
    assert len(load_prompts([write_prompt_file(rows, tmp_path / "held2.jsonl")])) == 3


def test_thousands_of_invented_domains_still_leave_training_rows(tmp_path):
    from draftsmith.retrain.config import TrafficConfig
    from draftsmith.retrain.run import split_traffic

    rows = [_good(i, domain=f"client-{i}") for i in range(3000)] + [_good(i, domain="code") for i in range(40)]
    folder = _write(tmp_path / "t" / "a.jsonl", rows).parent
    cfg = TrafficConfig()
    sample = read_traffic(folder, max_per_domain=cfg.max_per_domain)  # the default cap: 32 named domains
    held, train = split_traffic(sample.rows, cfg.eval_share, cfg.max_eval_per_domain, cfg.seed)
    assert len(train) >= 80, len(train)
    assert len(sample.per_domain) == 33 and sample.per_domain["other"] == cfg.max_per_domain
    assert sample.per_domain["code"] == 40 and sample.merged_domains == 3000 - 31
    assert cfg.max_domains == 32 and len(read_traffic(folder, max_domains=4).per_domain) == 5
    table = log_alpha(folder)  # alpha's table: the same cap by default
    assert len(table["domains"]) == 33 and table["domains"]["other"]["n_prompts"] == 3000 - 31
    assert table["merged_domains"] == 3000 - 31
    assert len(log_alpha(folder, max_domains=4)["domains"]) == 5
    assert main(["alpha", str(folder), "--max-domains", "4", "--out", str(tmp_path / "a.json")]) == 0
    assert len(json.loads((tmp_path / "a.json").read_text())["domains"]) == 5


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_an_over_long_line_is_one_bad_row_read_in_bounded_memory(tmp_path, monkeypatch, name):
    cap = 256 << 10
    monkeypatch.setattr(logs_module, "MAX_LINE_BYTES", cap, raising=False)
    long = {**_good(5), "prompt": "a" * (10 * cap)}  # ten times the cap
    f = _write(tmp_path / "t" / name, [_good(0), long, _good(1)])
    tracemalloc.start()
    try:
        sample = read_traffic(f.parent)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(r.prompt for r in sample.rows) == ["question 0", "question 1"]
    assert sample.malformed == 1 and sample.bad == [f"{f}:2: a line longer than {cap} bytes, skipped"]
    assert peak < 6 * cap, peak  # the long line (10x the cap) was never held
    table = log_alpha(f.parent)
    assert table["malformed"] == 1 and table["domains"]["chat"]["n_prompts"] == 2


def _bomb(path: Path, line_bytes: int, good_rows: int = 1) -> Path:
    """A .jsonl.gz: good rows, then one line of `line_bytes` 'a's, written streaming (never held whole)."""
    chunk = b"a" * (64 << 20)
    with gzip.open(path, "wb", compresslevel=6) as f:
        for i in range(good_rows):
            f.write(json.dumps(_good(i)).encode() + b"\n")
        f.write(b'{"prompt": "')
        left = line_bytes
        while left:
            f.write(chunk[:min(left, len(chunk))])
            left -= min(left, len(chunk))
        f.write(b'"}\n')
    return path


def test_a_gzip_bomb_is_skipped_after_its_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(logs_module, "MAX_LINE_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(reading, "MIN_GZIP_BYTES", 4 << 20)
    folder = tmp_path / "t"
    folder.mkdir()
    bomb = _bomb(folder / "b.jsonl.gz", 200 << 20)  # ~200 KB on disk, 200 MiB inside
    _write(folder / "a.jsonl", [_good(1)])
    start = time.monotonic()
    sample = read_traffic(folder)
    assert time.monotonic() - start < 5  # stopped at the budget, not after 200 MiB
    assert sorted(r.prompt for r in sample.rows) == ["question 0", "question 1"]  # the bomb's row before it too
    assert sample.malformed == 1 and sample.bad[0].startswith(f"{bomb}: gives more than "), sample.bad


@pytest.mark.slow
def test_a_4_gib_line_in_a_4_mb_gzip_costs_bounded_memory_and_time(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    bomb = _bomb(folder / "b.jsonl.gz", 4 << 30)
    assert bomb.stat().st_size < 8 << 20
    start = time.monotonic()
    sample = read_traffic(folder)  # the default caps: no MemoryError, a few seconds
    assert time.monotonic() - start < 30
    assert [r.prompt for r in sample.rows] == ["question 0"] and sample.malformed == 1, sample.bad
    assert log_alpha(folder)["malformed"] == 1


def test_alpha_counts_each_row_in_its_own_terms(tmp_path):
    vllm = {"num_spec_tokens": 3, "num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 9,
            "acceptance_histogram": [3, 5, 2, 0]}  # 5·1 + 2·2 = 9 accepted in 10 steps of 3 drafted
    rows = [{"domain": "chat", "speculative_decoding": vllm},
            {"domain": "chat", "spec_verify_ct": 10, "completion_tokens": 22},  # SGLang: τ only (12 accepted)
            {"domain": "chat", "draft_tokens": 20, "accepted_tokens": 6}]  # a gateway: α only (no steps)
    table = log_alpha(_write(tmp_path / "l.jsonl", rows))
    chat = table["domains"]["chat"]
    # α over the rows that count drafted tokens: (9 + 6) / (30 + 20); τ over those that count steps:
    # 1 + (9 + 12) / (10 + 10)
    assert chat["alpha"] == pytest.approx(0.30) and chat["tau"] == pytest.approx(2.05)
    assert table["overall"]["alpha"] == pytest.approx(0.30) and table["overall"]["tau"] == pytest.approx(2.05)
    assert chat["n_prompts"] == 3 and chat["per_position_acceptance"] == []  # not every step counted by position
    assert (chat["alpha_requests"], chat["tau_requests"]) == (2, 2)
    assert "alpha from the 2 requests" in table["note"] and "tau from the 2" in table["note"], table["note"]


def test_the_readers_count_a_hostile_file_alike(tmp_path):
    rows = [_good(0), {**_good(1), "status": 503}, {**_good(2), "prompt": "x\udfff"}, {**_good(3), "prompt": 7},
            "{not json", {**_good(4), "prompt": CHAT_WITH_TOOL_CALL}]
    f = _write(tmp_path / "t" / "a.jsonl", rows)
    sample, table = read_traffic(f.parent), log_alpha(f.parent)
    assert (sample.refused, sample.unencodable, sample.malformed) == (1, 1, 2)
    assert (table["refused"], table["unencodable"], table["malformed"]) == (1, 1, 2)
    assert len(sample.rows) == table["overall"]["n_prompts"] == 2


MEMORY_PROBE = """
import json, resource, sys
from draftsmith.planning.production import log_alpha
from draftsmith.retrain.traffic import read_traffic

size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + (160 << 20), resource.RLIM_INFINITY))
sample, table = read_traffic(sys.argv[1]), log_alpha(sys.argv[1])
print(json.dumps([sorted(r.prompt for r in sample.rows), sample.bad, table["malformed"]]))
"""


def test_a_line_under_the_cap_too_large_for_memory_is_one_bad_row(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "t"
    folder.mkdir()
    huge = b'{"prompt": "x", "draft_tokens": 1, "accepted_tokens": 1, "ids": [' + b"0," * (15 << 20) + b"0]}\n"
    # under the line cap: parsed, 15M list items under 160 MiB
    assert len(huge) < getattr(logs_module, "MAX_LINE_BYTES", 32 << 20)
    good = [json.dumps(_good(i)).encode() + b"\n" for i in range(2)]
    (folder / "a.jsonl").write_bytes(good[0] + huge + good[1])
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(folder)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # no MemoryError escaped
    prompts, bad, malformed = json.loads(run.stdout)
    assert prompts == ["question 0", "question 1"] and malformed == 1
    assert bad == [f"{folder / 'a.jsonl'}:2: {len(huge)} bytes of JSON too large to hold in memory"], bad


def test_a_log_under_two_names_is_read_once(tmp_path):
    """A gateway's `current.jsonl` linked to the live file: the folder holds one file under two names, and its
    rows are counted once (read twice, its domain's requests doubled)."""
    folder = _write(tmp_path / "t" / "traffic-1.jsonl", [_good(0), _good(1)]).parent
    (folder / "current.jsonl").symlink_to("traffic-1.jsonl")
    assert log_alpha(folder)["domains"]["chat"]["n_prompts"] == 2
    assert len(read_traffic(folder).rows) == 2


def test_a_prompt_file_line_or_gzip_past_its_cap_costs_bounded_memory(tmp_path, monkeypatch):
    """The prompt files' reader (data/sources.iter_jsonl: training sources, eval sets, held-out traffic) is
    bounded by bytes like the logs': an over-long line is one error read without being held, a gzip bomb stops
    at its budget."""
    from draftsmith.data import sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 64 << 10)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b" * (1 << 20)}) + "\n"
                 + json.dumps({"prompt": "c"}) + "\n")
    tracemalloc.start()
    try:
        got = list(sources.iter_jsonl(f))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(n, o, e) for n, o, e in got if e is None] == [(1, {"prompt": "a"}, None), (3, {"prompt": "c"}, None)]
    assert [(n, e) for n, _, e in got if e] == [(2, f"the line is longer than {64 << 10} bytes")]
    assert peak < 8 * (64 << 10), peak
    monkeypatch.setattr(reading, "MIN_GZIP_BYTES", 2 << 20)
    bomb = _bomb(tmp_path / "b.jsonl.gz", 50 << 20)
    got = list(sources.iter_jsonl(bomb))
    assert got[0][2] is None and "gzip bomb" in got[-1][2], got[-1]


def test_retraining_reads_production_logs_with_the_traffic_domain_cap(tmp_path):
    """The staleness check's production α (request logs) is capped as the traffic retraining trains on is
    (`traffic.max_domains`), not by the reader's default: otherwise a domain found stale could be one the
    training rows fold into `other`."""
    from types import SimpleNamespace

    from draftsmith.retrain.run import _production

    sizes = {"d0": 4, "d1": 3, "d2": 2, "d3": 2, "d4": 2}
    rows = [_good(i, domain=d) for d, n in sizes.items() for i in range(n)]
    folder = _write(tmp_path / "logs" / "a.jsonl", rows).parent
    measure = SimpleNamespace(production=str(folder), production_since=None, production_model_domains=None,
                              production_policy=None)
    table = _production(measure, tmp_path / "kept.prom", 2)
    assert sorted(table["domains"]) == ["d0", "d1", "other"] and table["merged_domains"] == 3
    assert table["domains"]["other"]["n_prompts"] == 6
