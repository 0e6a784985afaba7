"""`draftsmith bench` end to end on a tiny target: every stage a real subprocess, then resume and the
generated BENCHMARKS.md block."""

from __future__ import annotations

import json

import yaml

from draftsmith.benchmark.run import BEGIN, END, GENERATED_HEADING, run_bench, update_benchmarks_md


def test_update_benchmarks_md_replaces_only_its_block(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nhand-written text\n")
    update_benchmarks_md(md, "t:quick", "first")
    update_benchmarks_md(md, "t:full", "other")
    update_benchmarks_md(md, "t:quick", "second")
    text = md.read_text()
    assert "hand-written text" in text and "first" not in text and "second" in text and "other" in text
    assert text.count(BEGIN.format(key="t:quick")) == 1 and text.count(END.format(key="t:full")) == 1
    # a third block joins the other two under the one heading, ahead of text written after them
    md.write_text(md.read_text() + "\n## Hand-written later\n")
    update_benchmarks_md(md, "u:quick", "third")
    text = md.read_text()
    assert text.count(GENERATED_HEADING) == 1
    assert text.index("other") < text.index("third") < text.index("## Hand-written later")


def test_recorded_commands_are_shown_as_typed():
    import sys

    from draftsmith.benchmark.run import _as_typed, shown_command

    assert (shown_command([sys.executable, "-m", "draftsmith.cli", "evaluate", "--k", "4"])
            == "draftsmith evaluate --k 4")
    assert (shown_command([sys.executable, "-m", "draftsmith.cli", "bench", "engine", "4"])
            == "draftsmith bench engine 4")
    assert _as_typed("/w/.venv/bin/python -m draftsmith.cli train medusa") == "draftsmith train medusa"
    assert _as_typed("/usr/bin/python3.11 -m draftsmith.other 32") == "python -m draftsmith.other 32"
    # an older results folder ran the timing stages as modules: shown as the `bench` job that runs them now
    assert _as_typed("/usr/bin/python3.11 -m draftsmith.benchmark.engine 32") == "draftsmith bench engine 32"
    assert (_as_typed("python -m draftsmith.evaluation.baseline t --json b.json")
            == "draftsmith bench baseline t --json b.json")
    assert _as_typed("draftsmith evaluate --out 'a b'") == "draftsmith evaluate --out 'a b'"


def test_bench_runs_every_stage_and_resumes(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = str(tiny_target.folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"Question {i}: what is {i} plus {i}?"}) + "\n" for i in range(6)))
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({
        "kind": "data", "target": folder, "output_dir": "unused",
        "sources": [{"name": "p", "type": "jsonl", "path": str(prompts), "prompt": "q", "domain": "math"}],
        "generation": {"max_new_tokens": 8, "batch_size": 4}, "eval_sets": []}))
    (tmp_path / "medusa.yaml").write_text(yaml.safe_dump({
        "kind": "medusa", "target": folder, "num_heads": 2, "eval_fraction": 0.2, "calibration_rows": 2,
        "tree_budget": 4, "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 0, "loggers": ["jsonl"]}}))
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump({
        "kind": "bench", "target": folder, "out": str(tmp_path / "results"), "benchmarks_md": "BENCH.md",
        "data": {"config": "data.yaml"},
        "artifacts": [{"name": "medusa", "job": "medusa", "config": "medusa.yaml", "eval": {"tree": "auto"}}],
        "baselines": [{"name": "ngram", "proposer": "ngram", "eval": {"k": 2}}],
        "budgets": {"quick": {"data_rows": 5, "data_new_tokens": 8, "train_steps": {"medusa": 2},
                              "limit_per_domain": 1, "max_new_tokens": 6,
                              "engine_prompts": 2, "engine_new_tokens": 4, "cost_repeats": 1}}}))
    out = tmp_path / "results" / "run"
    summary = run_bench("bench.yaml", [], quick=True, out=str(out), progress=False)

    assert summary["data"]["rows"] == 5
    assert set(summary["engine"]["engines"]) == {"continuous_b2", "continuous_b2_capture", "hf_generate_b2",
                                                 "continuous_b1"}
    assert summary["training"]["medusa"]["steps"] == 2
    assert summary["engine"]["command"].startswith("draftsmith bench engine ")
    assert summary["training"]["medusa"]["command"].startswith("draftsmith train medusa --config ")
    assert set(summary["reports"]) == {"ngram", "medusa"}
    for name, r in summary["reports"].items():
        assert r["overall"]["lossless"] is True, name
        assert r["command"].split()[:3] == ["draftsmith", "evaluate", "--target"]  # the command, as typed
        assert (out / "eval" / name / "report.md").is_file()
    assert all(s["returncode"] == 0 and s["seconds"] > 0 for s in summary["stages"].values() if "skipped" not in s)
    assert ("not a GGUF" in summary["stages"]["llamacpp"]["skipped"]
            or "not installed" in summary["stages"]["llamacpp"]["skipped"])
    # the plain-step check ran on this target and recorded its kernel plan
    assert summary["baseline"]["plan_1_token_s"] > 0 and summary["baseline"]["kernels"]["plan"] == "measured"
    for name in ("summary.md", "summary.json", "acceptance.png", "verify_cost.png", "logs/train_medusa.log"):
        assert (out / name).is_file(), name
    md = (tmp_path / "BENCH.md").read_text()
    # the tables in BENCHMARKS.md are the results folder's: every overall speedup appears there
    for r in summary["reports"].values():  # ("–" where no prompt could be timed validly on a busy machine)
        speedup = r["overall"]["speedup"]
        assert ("–" if speedup is None else f"{speedup:.2f}") in md

    # resume: every stage is done, nothing runs again, the block is replaced (not appended)
    again = run_bench("bench.yaml", [], quick=True, out=str(out), progress=False)
    assert all(s.get("skipped_on_resume") or "skipped" in s for s in again["stages"].values())
    assert (tmp_path / "BENCH.md").read_text().count(BEGIN.format(key=f"{folder}:quick")) == 1

    # --redo runs a finished measurement again and keeps the rest; a training stage cannot be redone
    report = out / "eval" / "ngram" / "report.json"
    before = report.stat().st_mtime_ns
    redone = run_bench("bench.yaml", [], quick=True, out=str(out), progress=False, redo=["eval/ngram"])
    assert report.stat().st_mtime_ns > before and not redone["stages"]["eval/ngram"].get("skipped_on_resume")
    assert redone["stages"]["eval/medusa"].get("skipped_on_resume")

    # a folder holds one bench: another configuration (here another budget) may not resume into it
    import pytest

    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="cannot redo train/medusa"):
        run_bench("bench.yaml", [], quick=True, out=str(out), progress=False, redo=["train/medusa"])
    with pytest.raises(DraftsmithError, match="another bench"):
        run_bench("bench.yaml", ["budgets.quick.limit_per_domain=2"], quick=True, out=str(out), progress=False)
