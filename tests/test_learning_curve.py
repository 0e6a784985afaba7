"""scripts/learning_curve.py's readers and chart, on logs and curves written here (the training and evaluation
it drives are the jobs' and the evaluator's own, tested with them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "learning_curve.py"


@pytest.fixture(scope="module")
def lc():
    spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log(path: Path, *records) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_held_out_top1_reads_the_final_summary_of_every_method(lc, tmp_path):
    eagle = _log(tmp_path / "e", {"type": "eval", "step": 5, "step0/acc": 0.1},
                 {"type": "summary", "eval/step0/acc": 0.3, "eval/step1/acc": 0.2, "train/step0/acc": 0.9})
    medusa = _log(tmp_path / "m", {"type": "summary", "eval/head0/top1": 0.4, "eval/head1/top1": 0.25})
    assert lc.held_out_top1(lc.final_summary(eagle)) == [0.3, 0.2]
    assert lc.held_out_top1(lc.final_summary(medusa)) == [0.4, 0.25]
    dflash = _log(tmp_path / "d", {"type": "summary", "eval/acc": 0.5, "eval/slot1/acc": 0.6, "eval/slot2/acc": 0.3})
    assert lc.held_out_top1(lc.final_summary(dflash)) == [0.6, 0.3]  # slot 0 is the anchor, never predicted
    with pytest.raises(SystemExit, match="no summary record"):
        lc.final_summary(_log(tmp_path / "x", {"type": "train", "step": 1}))
    with pytest.raises(SystemExit, match="no held-out top-1"):
        lc.held_out_top1(lc.final_summary(_log(tmp_path / "y", {"type": "summary", "train/loss": 1.0})))


def test_curves_are_drawn_alone_and_together(lc, tmp_path):
    points = [{"rows": n, "learned_tokens": 100 * n, "steps": 2, "held_out_top1": [0.1 + n / 100, 0.05],
               "tau_cut": 1.1, "tau_gpu": 1.3 + n / 100} for n in (1, 2, 4)]
    points = [p | lc.trained_on(p, 8) for p in points]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "curve.json").write_text(json.dumps({"points": points}))
    lc.plot(points, tmp_path / "a" / "curve.png", "eagle")
    assert lc.main(["together", str(tmp_path / "out" / "together.png"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    for png in (tmp_path / "a" / "curve.png", tmp_path / "out" / "together.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_points_record_epochs_and_tokens_trained_on(lc, tmp_path):
    """Equal steps are not equal epochs: 150 steps of 8 rows see a 67-row point 17.9 times and a 2,048-row
    point 0.59 times; the curve's x-axis is the tokens each point trained on."""
    small = {"rows": 67, "learned_tokens": 7009, "steps": 150}
    large = {"rows": 2048, "learned_tokens": 229990, "steps": 150}
    assert lc.trained_on(small, 8) == {"rows_per_step": 8, "rows_seen": 1200, "epochs": 17.91, "tokens_trained": 125534}
    assert lc.trained_on(large, 8)["epochs"] == pytest.approx(0.586, abs=1e-3)
    # a kept curve without them gets them from its config and each point's command, and is redrawn
    cfg = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m" / "eagle3.yaml"
    points = [{**p, "held_out_top1": [0.2], "tau_cut": 1.2, "tau_gpu": 1.5, "lossless": True,
               "command": "draftsmith train eagle train.train_rows=5 train.batch_size=4 train.max_steps=150"}
              for p in (small, large)]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "curve.json").write_text(json.dumps({"method": "eagle", "config": str(cfg), "points": points}))
    assert lc.main(["replot", str(tmp_path / "c")]) == 0
    kept = json.loads((tmp_path / "c" / "curve.json").read_text())["points"]
    assert [p["rows_per_step"] for p in kept] == [4, 4] and kept[0]["rows_seen"] == 600
    assert "| 67 | 7,009 | 150 | 8.96 | 62,767 |" in (tmp_path / "c" / "curve.md").read_text()
