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
    found = headline.blocks(text)
    assert found, f"{doc} has no headline block"
    for start, end, path in found:
        report_path = ROOT / path
        assert report_path.is_file(), f"{doc}: the headline's report {path} is not committed"
        report = json.loads(report_path.read_text(encoding="utf-8"))
        assert text[start:end] == headline.render(report, path), (
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
