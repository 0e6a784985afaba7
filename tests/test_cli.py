"""The `draftsmith` command: subcommands exist, errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys

from draftsmith.artifact import make_manifest, save_artifact
from draftsmith.cli import main


def test_targets_lists_both(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out


def test_check_reports_mismatch(tmp_path, tiny_target, other_target, capsys):
    from test_export import make_medusa_artifact

    art = make_medusa_artifact(tiny_target, tmp_path / "art")
    assert main(["check", "--artifact", str(art), "--target", str(tiny_target.folder)]) == 0
    empty = save_artifact(tmp_path / "empty", make_manifest("medusa", tiny_target.fingerprint(), {}), state={})
    assert main(["check", "--artifact", str(empty), "--target", str(tiny_target.folder)]) == 4  # no tensors
    assert main(["check", "--artifact", str(art), "--target", str(other_target.folder)]) == 3
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "vocab_size" in out and "tokenizer_hash" in out


def test_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "check", "--artifact", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error:"), proc.stderr
    assert "no target fingerprint" in lines[0]


def test_manifest_is_json(tmp_path, tiny_target):
    art = save_artifact(tmp_path / "a", make_manifest("draft", tiny_target.fingerprint(), {"x": 1}), state={})
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kind"] == "draft" and manifest["target"]["vocab_size"] == tiny_target.vocab_size


def test_overrides_may_follow_options():
    """`draftsmith train medusa --config X a=1 b=2`: argparse alone refuses overrides after an option."""
    import pytest

    from draftsmith.cli import build_parser, parse_with_overrides

    p = build_parser()
    args = parse_with_overrides(p, ["train", "medusa", "--config", "c.yaml", "a=1", "b=2"])
    assert args.job == "medusa" and args.config == "c.yaml" and args.overrides == ["a=1", "b=2"]
    args = parse_with_overrides(p, ["train", "medusa", "a=1", "--config", "c.yaml", "b=2"])
    assert args.overrides == ["a=1", "b=2"]
    with pytest.raises(SystemExit):
        parse_with_overrides(p, ["train", "medusa", "--config", "c.yaml", "--bogus"])


def test_bench_takes_a_job_or_overrides_of_the_whole_bench():
    """`draftsmith bench JOB ...` runs one timing job; without a job word, the words are the whole bench's
    key=value overrides, before, between or after its options."""
    import pytest

    from draftsmith.cli import build_parser, parse_with_overrides

    p = build_parser()
    args = parse_with_overrides(p, ["bench", "a=1", "--quick", "b=2", "--out", "D"])
    assert args.func.__name__ == "run" and args.overrides == ["a=1", "b=2"] and args.quick and args.out == "D"
    assert parse_with_overrides(p, ["bench", "--config", "c.yaml"]).func.__name__ == "run"
    args = parse_with_overrides(p, ["bench", "engine", "32", "128", "cb:32,cb:1", "t", "--json", "o.json"])
    assert args.func.__name__ == "run_engine" and (args.n, args.engines, args.target) == (32, "cb:32,cb:1", "t")
    args = parse_with_overrides(p, ["bench", "eagle-step", "c.yaml", "a=1", "--compare", "precision", "b=2"])
    assert args.func.__name__ == "run_eagle_step" and args.overrides == ["c.yaml", "a=1", "b=2"]
    assert parse_with_overrides(p, ["bench", "remote", "8", "4", "--concurrency", "2"]).batch == 2
    args = parse_with_overrides(p, ["bench", "train-step", "a.yaml", "d=b.yaml", "--set", "d", "x=1", "y=2",
                                    "--set", "eagle", "z=3", "--reference-steps", "1200"])
    assert args.func.__name__ == "run_train_step" and args.configs == ["a.yaml", "d=b.yaml"]
    assert args.set == [["d", "x=1", "y=2"], ["eagle", "z=3"]] and args.reference_steps == 1200
    for bad in (["bench", "engin"], ["bench", "a=1", "--bogus"], ["bench", "engine", "1", "2", "cb:1", "t", "x=1"]):
        with pytest.raises(SystemExit):
            parse_with_overrides(p, bad)


def test_headline_job_prints_the_block_its_report_renders(capsys):
    from pathlib import Path

    from draftsmith.benchmark import headline

    path = "results/headline-smollm2-135m/report.json"
    report = json.loads((Path(headline.ROOT) / path).read_text())
    assert main(["bench", "headline", str(Path(headline.ROOT) / path)]) == 0
    assert headline.render(report, str(Path(headline.ROOT) / path)) in capsys.readouterr().out
    assert main(["bench", "headline"]) == 2  # neither a report nor --write: one line, not a traceback


def test_every_job_is_a_subcommand():
    """One kind of entry point: no module of the package has a command line of its own. cli.py is the command
    line; export/vllm_run.py is not draftsmith's (vLLM's environment runs it, importing vLLM only)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    own = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                 if f.relative_to(root).parts[0] not in {"tests", "scripts", "build", "results", "runs"}
                 and not f.relative_to(root).parts[0].startswith(".")
                 and '__name__ == "__main__"' in f.read_text(encoding="utf-8"))
    assert own == ["cli.py", "export/vllm_run.py"]
