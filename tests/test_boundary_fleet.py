"""The fleet side's boundary (issue 58): every file `route build`, `route compare`, `alpha`, `plan` and
`retrain` read from outside passes one validating reader per format — evaluation reports, routing policies
and verify profiles (evaluation/report_file.py, decoding/routing.py, planning/policy.py), traffic and
request logs (planning/logs.py, retrain/traffic.py), Prometheus dumps (planning/production.py), accelerate
YAML and DeepSpeed JSON (memory/training.py), the registry's current.json (retrain/registry.py) — and is
refused in one line naming the file and the field, or, where the job can go on without it, named and skipped.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.errors import ConfigError, DataError, DraftsmithError

BOMB = "\n".join(['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'] +
                 [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]) + "\n"


def one_line(err: str) -> str:
    err = err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def report(proposer: str, speedups: dict, fp: str = "A", **extra) -> dict:
    """A report of the shape `evaluate` writes, with the fields routing reads."""
    return {"proposer": proposer, "target": {"name": "t", "fingerprint": {"tokenizer_hash": fp}},
            "settings": {"k": 4, "tree": None, "tree_max_nodes": None},
            "domains": {d: {"speedup": s, "alpha": 0.5, "tau": 2.0, "lossless": True, "n_prompts": 4,
                            "verified_nodes_per_step": 2.0} for d, s in speedups.items()}, **extra}


def write(path: Path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, allow_nan=True))
    return path


# --- 13. a NaN speedup: the route depended on the order of --reports ----------------------------------------
def test_route_build_refuses_a_nan_speedup_whatever_the_order_of_reports(tmp_path, capsys):
    good = write(tmp_path / "a" / "report.json", report("ngram", {"code": 1.3}))
    nan = write(tmp_path / "b" / "report.json", report("medusa:m", {"code": float("nan")}))
    for order in ([good, nan], [nan, good]):
        assert main(["route", "build", "--reports", *map(str, order), "--out", str(tmp_path / "p.json")]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"{nan}: domains.code.speedup is nan" in err and "finite" in err, err
    assert not (tmp_path / "p.json").exists()


def test_build_policy_is_the_same_whatever_the_order_of_reports():
    from draftsmith.planning.policy import build_policy

    # equal values, equal nodes: the tie is broken by the proposer's name, never by the input's order
    a, b, c = report("ngram", {"code": 1.3}), report("medusa:m", {"code": 1.3}), report("eagle:e", {"code": 0.9})
    first = build_policy([a, b, c])
    for order in ([b, a, c], [c, b, a], [a, c, b]):
        assert build_policy(order) == first
    assert first["domains"]["code"]["candidates"] == {"eagle:e": 0.9, "medusa:m": 1.3, "ngram": 1.3}


@pytest.mark.parametrize("field, value, says", [
    ("alpha", 1.5, "domains.code.alpha is 1.5"), ("speedup", -1.0, "domains.code.speedup is -1.0"),
    ("speedup", "fast", "domains.code.speedup is 'fast'"), ("lossless", "yes", "domains.code.lossless is 'yes'"),
    ("tau", float("inf"), "domains.code.tau is inf"), ("speedup", True, "domains.code.speedup is True"),
])
def test_a_report_number_out_of_range_is_refused_naming_file_and_field(tmp_path, field, value, says):
    from draftsmith.evaluation.report_file import read_report

    doc = report("ngram", {"code": 1.3})
    doc["domains"]["code"][field] = value
    path = write(tmp_path / "report.json", doc)
    with pytest.raises(DataError) as e:
        read_report(path)
    assert str(e.value).startswith(f"{path}: {says}"), str(e.value)


# --- 25. route build with {} or a report that is not JSON ---------------------------------------------------
def test_route_build_names_the_report_that_has_no_proposer_or_is_not_json(tmp_path, capsys):
    empty = write(tmp_path / "empty.json", {})
    torn = tmp_path / "torn.json"
    torn.write_text('{"proposer": "ngram", "domains": {')
    for bad, says in ((empty, "proposer is missing"), (torn, "not valid JSON")):
        assert main(["route", "build", "--reports", str(bad), "--out", str(tmp_path / "p.json")]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"{bad}: {says}" in err, err


def test_route_compare_reads_its_reports_through_the_same_reader(tmp_path, capsys):
    torn = tmp_path / "routed.json"
    torn.write_bytes(b'{"proposer": "route:p", "domains": {"code": {"speedup": 1.0, "route": "caf\xe9"}}}')
    assert main(["route", "compare", "--routed", str(torn)]) == 2
    assert f"{torn}: not UTF-8" in one_line(capsys.readouterr().err)


def test_a_report_whose_routes_a_policy_would_refuse_is_refused_when_read(tmp_path):
    from draftsmith.evaluation.report_file import read_report

    doc = report("ngram", {"code": 1.3})
    doc["settings"]["k"] = 1000
    with pytest.raises(DataError, match=r"report.json: settings.k is 1000"):
        read_report(write(tmp_path / "report.json", doc))


# --- routing policies and verify profiles ------------------------------------------------------------------
def test_a_policy_that_is_not_utf8_or_nested_too_deep_is_one_line_naming_it(tmp_path):
    from draftsmith.decoding.routing import load_policy

    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"kind": "routing_policy", "domains": {"caf\xe9": "off"}}')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path, says in ((latin, "not UTF-8"), (deep, "JSON nested 100000 deep")):
        with pytest.raises(DraftsmithError) as e:
            load_policy(path)
        assert str(e.value).startswith(f"{path}: {says}"), str(e.value)


def test_a_policy_whose_target_is_not_a_mapping_is_refused_at_load(tmp_path):
    from draftsmith.decoding.routing import load_policy

    path = write(tmp_path / "p.json", {"kind": "routing_policy", "domains": {}, "target": ["x"]})
    with pytest.raises(ConfigError, match=r"p.json: target is \['x'\]"):
        load_policy(path)


@pytest.mark.parametrize("profile, says", [
    ({"v": {"1": 1.0, "01": 2.0}}, "v has node count 1 twice"),
    ({"v": {"many": 1.0}}, "v key 'many' is not a node count"),
    ({"v": {"0": [1]}}, "v.0 is [1]"),
    ({"v": {"0": 1.0}, "c": {"eagle": float("nan")}}, "c.eagle is nan"),
])
def test_a_verify_profile_with_a_bad_point_is_one_line_naming_it(tmp_path, profile, says):
    from draftsmith.planning.policy import VerifyProfile

    path = write(tmp_path / "h100.json", profile)
    with pytest.raises(ConfigError) as e:
        VerifyProfile.load(str(path))
    assert str(e.value).startswith(f"{path}: {says}"), str(e.value)


# --- 18. traffic.window_days = nan: 0 rows, no error ---------------------------------------------------------
def _traffic(folder: Path, n: int = 3, ts: float | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    now = ts or time.time() - 60
    rows = [{"prompt": f"question {i}", "domain": "code", "timestamp": now - i} for i in range(n)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("window", [float("nan"), float("inf"), 0.0, -1.0])
def test_read_traffic_refuses_a_window_that_is_not_a_finite_positive_number(tmp_path, window):
    from draftsmith.retrain.traffic import read_traffic

    with pytest.raises(ConfigError, match=r"traffic.window_days is .*expected a finite number of days > 0"):
        read_traffic(_traffic(tmp_path), window_days=window)


def test_read_traffic_says_how_many_rows_the_window_left_out(tmp_path):
    from draftsmith.retrain.traffic import read_traffic

    folder = _traffic(tmp_path)
    (folder / "old.jsonl").write_text(json.dumps({"prompt": "ancient", "timestamp": 1_000_000}) + "\n")
    sample = read_traffic(folder, window_days=1)
    assert len(sample.rows) == 3 and sample.outside_window == 1


# --- 25. a dangling current.jsonl symlink or a folder named x.jsonl.gz: raw FileNotFoundError ---------------
def test_read_traffic_names_and_skips_a_dangling_symlink_and_a_folder(tmp_path):
    from draftsmith.retrain.traffic import read_traffic

    folder = _traffic(tmp_path)
    (folder / "current.jsonl").symlink_to(folder / "rotated-away.jsonl")
    (folder / "x.jsonl.gz").mkdir()
    sample = read_traffic(folder)
    assert len(sample.rows) == 3
    assert any(f"{folder / 'current.jsonl'}: a dangling symlink" in b for b in sample.bad), sample.bad
    assert any(f"{folder / 'x.jsonl.gz'}: a folder" in b for b in sample.bad), sample.bad


def test_read_traffic_keeps_the_rows_before_a_gzip_cut_in_half(tmp_path):
    from draftsmith.retrain.traffic import read_traffic

    folder = _traffic(tmp_path)
    rows = "".join(json.dumps({"prompt": f"gz {i}", "timestamp": time.time() - 30}) + "\n" for i in range(400))
    data = gzip.compress(rows.encode())
    (folder / "b.jsonl.gz").write_bytes(data[:len(data) // 2])
    sample = read_traffic(folder)
    assert len(sample.rows) > 3 and any("b.jsonl.gz: damaged or partly written" in b for b in sample.bad)


@pytest.mark.parametrize("row, says", [
    ({"prompt": [{"role": "user", "content": 5}]}, "prompt[0].content is 5, expected text, content parts or null"),
    ({"prompt": [{"role": "user"}]}, "prompt: the last user message has no text"),
    ({"prompt": [{"role": "user", "content": "hi"}, "hi"]}, "prompt is a list mixing messages, text and token ids"),
    ({"prompt": ["hi"]}, "prompt is a batch of 1 prompts: no one text to train on"),
    ({"prompt": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "prompt[0].content: a text part's"),
    ({"prompt": "hi", "domain": {"a": 1}}, "domain is {'a': 1}"),
    ({"prompt": "hi", "response": 7}, "response is 7"),
])
def test_a_traffic_row_of_the_wrong_types_is_named_not_taken(tmp_path, row, says):
    from draftsmith.retrain.traffic import read_traffic

    folder = _traffic(tmp_path)
    (folder / "b.jsonl").write_text(json.dumps(row) + "\n")
    sample = read_traffic(folder)
    assert len(sample.rows) == 3 and len(sample.bad) == 1, sample.bad
    assert sample.bad[0].startswith(f"{folder / 'b.jsonl'}:1: {says}"), sample.bad


# --- 24 (rest). alpha over request logs: a line not UTF-8, a dangling symlink ------------------------------
def test_alpha_over_request_logs_names_and_skips_what_it_cannot_read(tmp_path, capsys):
    from draftsmith.planning.production import log_alpha

    folder = tmp_path / "logs"
    folder.mkdir()
    rows = [{"domain": "code", "draft_tokens": 40, "accepted_tokens": 20, "drafts": 10}] * 3
    (folder / "a.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"caf\xe9": 1}\n')
    (folder / "current.jsonl").symlink_to(folder / "gone.jsonl")
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(json.dumps(rows[0]).encode() + b"\n"))
    table = log_alpha(folder)
    assert table["domains"]["code"]["n_prompts"] == 4 and table["overall"]["alpha"] == pytest.approx(0.5)
    assert table["malformed"] == 2 and any(f"{folder / 'a.jsonl'}:4: not UTF-8" in b for b in table["bad"])
    assert main(["alpha", str(folder)]) == 0


@pytest.mark.parametrize("row, says", [
    ({"draft_tokens": True, "accepted_tokens": 1}, "draft_tokens is True"),
    ({"draft_tokens": "40", "accepted_tokens": 1}, "draft_tokens is '40'"),
    ({"draft_tokens": 4, "accepted_tokens": 9}, "accepted_tokens 9 > draft_tokens 4"),  # one request's own counts
    ({"spec_verify_ct": 10, "completion_tokens": 3}, "completion_tokens 3 < spec_verify_ct 10"),
    ({"spec_verify_ct": 2, "completion_tokens": 9, "draft_tokens": 3}, "completion_tokens 9 - spec_verify_ct 2"),
])
def test_a_request_log_row_with_counters_that_are_not_counts_is_named(tmp_path, row, says):
    from draftsmith.planning.production import log_alpha

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"draft_tokens": 4, "accepted_tokens": 2}) + "\n" + json.dumps(row) + "\n")
    table = log_alpha(f)
    assert table["malformed"] == 1 and table["bad"][0].startswith(f"{f}:2: {says}"), table["bad"]


def test_a_position_label_of_unicode_digits_is_refused_in_one_line():
    from draftsmith.planning.production import vllm_alpha

    text = ('vllm:spec_decode_num_drafts_total{model_name="m"} 4\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 4\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="\u00b2"} 1\n')
    with pytest.raises(DataError, match="d.prom: .*position='²' is not a draft position"):
        vllm_alpha(text, source="d.prom")


# --- 21. an alias bomb given to plan --accelerate (and to bench train-step) --------------------------------
def test_plan_refuses_an_accelerate_alias_bomb_in_one_line(tmp_path, capsys):
    root = Path(__file__).resolve().parents[1]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    folder = root / "configs" / "qwen3-8b"
    rc = main(["plan", "--config", str(folder / "eagle3.yaml"), "--target", str(folder / "target-config.json"),
               "--accelerate", str(bomb)])
    assert rc == 2 and f"{bomb}: not valid YAML (aliases expand" in one_line(capsys.readouterr().err)


def test_bench_train_step_reads_a_preset_through_the_bounded_loader(tmp_path):
    from draftsmith.benchmark.train_step import _named

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    with pytest.raises(ConfigError, match="bomb.yaml: not valid YAML"):
        _named(str(bomb))


@pytest.mark.parametrize("text, says", [
    ("num_processes: eight\n", "num_processes is 'eight': expected an int >= 1"),
    ("num_processes: 0\n", "num_processes is 0"),
    ("mixed_precision: fp7\n", "mixed_precision is 'fp7'"),
    ("distributed_type: DEEPSEED\n", "distributed_type is 'DEEPSEED'"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 9}\n", "deepspeed_config.zero_stage is 9"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config: [1]\n", "deepspeed_config is [1]"),
    ("- 1\n", "top level must be a mapping"),
])
def test_an_accelerate_file_with_a_bad_field_is_one_line_naming_it(tmp_path, text, says):
    from draftsmith.memory.training import read_accelerate

    path = tmp_path / "acc.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_accelerate(path)
    assert str(e.value).startswith(f"{path}: {says}"), str(e.value)


def test_an_unquoted_mixed_precision_no_is_read_as_no(tmp_path):
    from draftsmith.memory.training import read_accelerate

    path = tmp_path / "acc.yaml"
    path.write_text("num_processes: 2\nmixed_precision: no\n")  # YAML 1.1 reads a bare `no` as false
    assert read_accelerate(path).mixed_precision == "no"


def test_a_missing_or_broken_deepspeed_file_is_named(tmp_path):
    from draftsmith.memory.training import read_accelerate

    path = tmp_path / "acc.yaml"
    for content, says in ((None, "no such file"), ("[1, 2]", "expected a JSON object"),
                          ('{"zero_optimization": {"stage": "three"}}', "zero_optimization.stage is 'three'")):
        ds = tmp_path / "ds.json"
        if content is not None:
            ds.write_text(content)
        path.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config: {{deepspeed_config_file: {ds}}}\n")
        with pytest.raises(ConfigError) as e:
            read_accelerate(path)
        assert f"{ds}: {says}" in str(e.value), str(e.value)


# --- retrain: the registry's current.json ---------------------------------------------------------------------
@pytest.mark.parametrize("pointer, says", [
    ({}, "version is missing"), ({"version": "../../etc"}, "version is '../../etc'"), ([1], "expected a JSON object"),
])
def test_a_current_pointer_that_names_no_version_is_one_line(tmp_path, pointer, says):
    from draftsmith.errors import ArtifactError
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path, "t", "medusa")
    write(reg.base / "current.json", pointer)
    with pytest.raises(ArtifactError) as e:
        reg.current()
    assert str(e.value).startswith(f"{reg.base / 'current.json'}: {says}"), str(e.value)


def test_a_shipped_report_reads_cleanly():
    from draftsmith.evaluation.report_file import read_report

    root = Path(__file__).resolve().parents[1]
    results = sorted((root / "results").glob("*/report.json"))
    shipped = [p for p in results if "proposer" in json.loads(p.read_text())]
    assert len(shipped) >= 5  # the evaluation reports among the results (the data stage writes its own kind)
    for path in shipped:
        assert read_report(path)["proposer"]


# --- retraining's decisions: the acceptance a version recorded, a domain without a measured alpha ------------
def test_a_recorded_alpha_that_is_not_a_number_is_one_line_naming_the_manifest():
    from draftsmith.retrain.decide import recorded_alpha

    good = {"traffic_eval": {"domains": {"a": {"alpha": 0.7, "n_prompts": 4}, "b": {"alpha": None}}}}
    assert recorded_alpha(good, "m/manifest.json") == {"a": 0.7}
    for bad, says in (({"domains": {"a": {"alpha": "high"}}}, "traffic_eval.domains.a.alpha is 'high'"),
                      ({"domains": {"a": {"alpha": float("nan")}}}, "traffic_eval.domains.a.alpha is nan"),
                      ({"domains": ["a"]}, "traffic_eval.domains is ['a']"), ([1], "traffic_eval is [1]")):
        with pytest.raises(DataError) as e:
            recorded_alpha({"traffic_eval": bad}, "m/manifest.json")
        assert str(e.value).startswith(f"m/manifest.json: {says}"), str(e.value)


def test_the_serving_policy_turns_off_a_domain_whose_alpha_was_not_measured():
    from draftsmith.retrain.decide import domain_policy

    policy = domain_policy({"domains": {"a": {"alpha": 0.6}, "b": {"alpha": None}}}, 0.3, "v0002")
    assert policy["domains"]["a"]["speculate"] and not policy["domains"]["b"]["speculate"]
    assert policy["domains"]["b"]["why"] == "alpha not measured (no drafted tokens)"


# --- bench headline: a report read by the same reader, plus the fields the block prints -----------------------
def test_bench_headline_names_the_report_and_the_field_it_lacks(tmp_path, capsys):
    root = Path(__file__).resolve().parents[1]
    doc = json.loads((root / "results" / "headline-smollm2-135m" / "report.json").read_text())
    assert main(["bench", "headline", str(write(tmp_path / "ok.json", doc))]) == 0
    capsys.readouterr()
    name = next(iter(doc["settings"]["compare_settings"]))
    cases = [("machine", None, "machine is None"), ("date", 20261126, "date is 20261126"),
             ("overall", {**doc["overall"], "speedup_vs_plain": "1.2"}, "overall.speedup_vs_plain is '1.2'"),
             ("overall", {**doc["overall"], "compare": {}}, f"overall.compare.{name} is missing")]
    for key, value, says in cases:
        path = write(tmp_path / "bad.json", {**doc, key: value})
        assert main(["bench", "headline", str(path)]) == 2
        assert f"{path}: {says}" in one_line(capsys.readouterr().err)
    torn = tmp_path / "torn.json"
    torn.write_text('{"proposer": ')
    assert main(["bench", "headline", str(torn)]) == 2
    assert f"{torn}: not valid JSON" in one_line(capsys.readouterr().err)
