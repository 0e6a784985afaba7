"""Every headline number in README.md and BENCHMARKS.md is its committed report's: each block names its
report.json, and rendering that report must give the block back, character for character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.benchmark import headline

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md"])
def test_published_headline_equals_its_committed_report(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = headline.all_blocks(text)  # README's without its per-domain table, which BENCHMARKS.md's block holds
    assert found, f"{doc} has no headline block"
    assert doc == "README.md" or all(per_domain for *_, per_domain in found)
    for start, end, path, per_domain in found:
        report_path = ROOT / path
        assert report_path.is_file(), f"{doc}: the headline's report {path} is not committed"
        report = json.loads(report_path.read_text(encoding="utf-8"))
        assert text[start:end] == headline.render(report, path, per_domain), (
            f"{doc}: the headline block differs from {path}; rerun draftsmith bench headline --write")
        for key in ("command", "date", "machine"):
            assert report.get(key), f"{path}: no {key}"
        assert report["settings"]["split"] == "test"  # headline numbers come from the split nothing chose on
        assert report["overall"]["lossless"] is True  # judged against HF generate on every prompt
        assert report["references"]["hf_generate"]["tokens_per_s"]  # the other plain decoding was timed beside


def test_render_states_source_validity_and_both_baselines(tiny_target, tmp_path):
    from draftsmith.evaluation.evaluate import evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t], "category": "math"}) + "\n"
                               for t in ("What is 2 + 3?", "Count to five.")))
    report = evaluate(tiny_target, "ngram", prompts=[str(prompts)], max_new_tokens=6, k=2, cost_model=False,
                      compare=["ngram@chain=1"], command="draftsmith evaluate --proposer ngram")
    block = headline.render(report, "results/x/report.json")
    assert block.startswith("From [results/x/report.json](results/x/report.json)")
    assert "`draftsmith evaluate --proposer ngram`" in block and "HF `generate` (stock kernels)" in block
    assert f"speeds from the {report['overall']['n_timed']} of 2 prompts timed validly" in block
    assert "| n-gram lookup, chain of 2 |" in block and "| n-gram lookup, chain of 1 |" in block
    doc = tmp_path / "DOC.md"
    doc.write_text("intro\n<!-- headline: r.json -->\nstale numbers\n<!-- /headline -->\nend\n")
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert headline.rewrite(doc, tmp_path) == 1
    text = doc.read_text()
    assert "stale numbers" not in text and text.startswith("intro\n") and text.endswith("<!-- /headline -->\nend\n")
    assert "Per domain, speedup" in block and "Per domain" not in headline.render(report, "r.json", domain_table=False)
    doc.write_text("<!-- headline-overall: r.json -->\nstale\n<!-- /headline-overall -->\n")
    overall = headline.render(report, "r.json", False)
    assert headline.rewrite(doc, tmp_path) == 1
    assert doc.read_text() == f"<!-- headline-overall: r.json -->\n{overall}<!-- /headline-overall -->\n"


def test_committed_results_live_in_results_and_every_name_of_one_exists():
    """The committed results are one flat folder, results/ (benchmark/ is the code that writes them): every
    `results/NAME` a doc, preset, script, module or kept report names is there, and nothing names the folder they
    were kept in before (results/ inside a bench/ folder, whose name read like the code's)."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    assert (ROOT / "results").is_dir() and not (ROOT / "bench").exists()
    old, missing = [], set()
    for name in files:
        path = ROOT / name
        if path.suffix in (".gz", ".png", ".safetensors") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "bench/" + "results" in text:
            old.append(name)
        if name.startswith("tests/"):  # tests name folders of their own making
            continue
        for ref in re.finditer(r"(?<![\w/.<-])results/([\w.-]*\w)", text):
            destination = text.endswith(("--out ", "--json "), 0, ref.start())  # where a command would write one
            if not destination and not (ROOT / "results" / ref[1]).exists():
                missing.add(f"{name}: {ref[0]}")
    assert old == [], f"files naming the former results folder: {old}"
    assert sorted(missing) == []


def _by_engine_blocks(doc: str) -> tuple[str, list[tuple[int, int, str]]]:
    from draftsmith.benchmark import by_engine

    text = (ROOT / doc).read_text(encoding="utf-8")
    return text, headline.blocks(text, by_engine.BEGIN, by_engine.END)


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md"])
def test_published_headline_by_engine_equals_its_committed_reports(doc):
    """README leads its results with what each engine serves of each shipped drafter; every number is its report's."""
    from draftsmith.benchmark import by_engine

    text, found = _by_engine_blocks(doc)
    assert found, f"{doc} has no by-engine block"
    for start, end, path in found:
        sources = by_engine.read_sources(ROOT / path)
        assert text[start:end] == by_engine.render(sources, ROOT, path), (
            f"{doc}: the by-engine block differs from the reports {path} names; rerun draftsmith bench headline "
            "--write")
    if doc == "README.md":  # the by-engine table comes first: what a vLLM user gets, before draftsmith's own decoder
        assert found[0][0] < headline.all_blocks(text)[0][0]


def test_by_engine_runs_are_on_the_test_split_and_every_left_out_shape_is_refused():
    """Each column's report measured the test split in its engine's shape, and a drafter a column has no run of is
    one the engine profile refuses: the table cannot leave out what draftsmith could measure."""
    from draftsmith.benchmark import by_engine
    from draftsmith.decoding.served_shape import served_shape
    from draftsmith.errors import ConfigError
    from draftsmith.reading import read_json

    _, found = _by_engine_blocks("README.md")
    sources = by_engine.read_sources(ROOT / found[0][2])
    for engine in by_engine.ENGINES:
        report = read_json(ROOT / sources[engine])
        assert report["settings"]["split"] == "test" and report["shape"]["engine"] == engine
    for d in sources["drafters"]:
        served = read_json(ROOT / d["vllm"])
        assert served["loaded"] and served["lossless"], d["vllm"]
        assert all("/eval/test/" in f for f in served["prompt_files"]), d["vllm"]
        if "draftsmith" in served:  # serve-check's own evaluator decoded the shape the block names
            assert served["draftsmith"]["shape"]["label"] == served_shape("vllm", d["spec"], served["k"]).label()
        for engine in d.get("not_run") or {}:
            with pytest.raises(ConfigError, match=f"--as-served {engine}"):
                served_shape(engine, d["spec"])


def test_by_engine_cells_follow_their_reports(tmp_path):
    """A changed number in a report changes the block; a committed serve-bench report fills the served speedups
    and drops the pending note."""
    import shutil

    from draftsmith.benchmark import by_engine

    _, found = _by_engine_blocks("README.md")
    path = found[0][2]
    sources = by_engine.read_sources(ROOT / path)
    reports = [sources[name] for name in ("sglang", "trtllm", "draftsmith")] + [d["vllm"] for d in sources["drafters"]]
    for rel in [path, *reports]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    first = sources["drafters"][0]
    served = json.loads((tmp_path / first["vllm"]).read_text())
    served["vllm"]["tau"] = 9.87
    (tmp_path / first["vllm"]).write_text(json.dumps(served))
    bench = tmp_path / by_engine.serve_bench_path(sources)
    bench.parent.mkdir(parents=True)
    bench.write_text(json.dumps({"date": "2026-12-01", "comparisons": {first["serve_bench"]: {"by_concurrency": {
        "1": {"speedup": 1.234}, "4": {"speedup": 1.0}, "16": {"speedup": 0.567}}}}}))
    block = by_engine.render(by_engine.read_sources(tmp_path / path), tmp_path, path)
    row = next(line for line in block.splitlines() if line.startswith(f"| {first['name']} |"))
    assert "| 9.87, vLLM eagle3 chain k=4 | 1.23 | 0.57 |" in row
    assert "until the serve-bench run" not in block and "; serve-bench [2026-12-01](" in block
    other = next(line for line in block.splitlines() if line.startswith(f"| {sources['drafters'][1]['name']} |"))
    assert "| – | – |" in other  # a drafter the serve-bench report has no run of
    doc = tmp_path / "DOC.md"  # `bench headline --write` replaces the block's body, nothing around it
    doc.write_text(f"intro\n<!-- by-engine: {path} -->\nstale\n<!-- /by-engine -->\nend\n")
    assert by_engine.rewrite(doc, tmp_path) == 1
    assert doc.read_text() == f"intro\n<!-- by-engine: {path} -->\n{block}<!-- /by-engine -->\nend\n"


def test_readme_and_benchmarks_stay_within_their_line_budgets():
    """README is read whole (150 lines), BENCHMARKS.md the reference (1,200): history is in git, not in them."""
    for doc, limit in (("README.md", 150), ("BENCHMARKS.md", 1200)):
        lines = len((ROOT / doc).read_text(encoding="utf-8").splitlines())
        assert lines <= limit, f"{doc}: {lines} lines, over its {limit}"
