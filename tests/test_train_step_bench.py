"""`draftsmith bench train-step`: every job loaded as `draftsmith train` loads it, the same batches, one full
optimizer step each, interleaved; the steps each job takes at the reference's time follow from the measured
ratio. On a tiny target and rows it writes itself (the measured seconds are not checked: only what they give)."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny_models import make_target, prompt_rows

from draftsmith.benchmark.train_step import run
from draftsmith.errors import ConfigError


@pytest.fixture(scope="module")
def presets(tiny_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-step")
    target = make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp / "target")
    prompt_rows(target, tmp, [f"question {i}: how many {i}s?" for i in range(24)])
    train = {"batch_size": 4, "lr": 1e-3, "mixed_precision": "no", "progress": False}
    common = {"target": str(tmp / "target"), "data": str(tmp / "data"), "eval_fraction": 0.1, "train": train}
    eagle = tmp / "eagle.yaml"
    eagle.write_text(yaml.safe_dump({"kind": "eagle", **common, "output": str(tmp / "e"), "ttt_steps": 2}))
    dflash = tmp / "dflash.yaml"
    dflash.write_text(yaml.safe_dump({"kind": "dflash", **common, "output": str(tmp / "d"), "block_size": 4,
                                      "anchors_per_row": 2, "target_layers": [0, 1, 2]}))
    return tmp, eagle, dflash


def test_jobs_interleave_and_convert_steps_at_equal_time(presets):
    tmp, eagle, dflash = presets
    # dv: the same DFlash job with its own lm_head over a reduced vocabulary (what dflash-v8k.yaml sets)
    out = run([str(eagle), str(dflash), f"d2={dflash}", f"dv={dflash}"],
              sets={"d2": ["block_size=8"], "dv": ["draft_vocab_size=64"]}, batches=2, repeats=2,
              reference_steps=1000, out=tmp / "report")
    assert list(out["steps"]) == ["eagle", "dflash", "d2", "dv"]
    assert out["configs"]["d2"] == {"config": str(dflash), "method": "dflash", "overrides": ["block_size=8"]}
    assert out["configs"]["dv"]["overrides"] == ["draft_vocab_size=64"]
    ratio = out["cost_vs_eagle"]
    assert ratio["eagle"] == 1.0 and all(r > 0 for r in ratio.values())
    assert out["steps_at_equal_time"]["eagle"] == 1000
    for name in ("dflash", "d2", "dv"):
        assert out["steps_at_equal_time"][name] == round(1000 / ratio[name])
        # each job trains: its own optimizer steps move its own loss
        assert out["steps"][name]["first_loss"] != out["steps"][name]["last_loss"]
    assert json.loads((tmp / "report" / "report.json").read_text()) == out


def test_names_must_be_distinct_and_sets_must_name_a_job(presets):
    _, eagle, _ = presets
    with pytest.raises(ConfigError, match="two jobs named 'eagle'"):
        run([str(eagle), str(eagle)], batches=1, repeats=1)
    with pytest.raises(ConfigError, match=r"--set names \['nope'\]"):
        run([str(eagle), f"e2={eagle}"], sets={"nope": ["lr=1"]}, batches=1, repeats=1)
