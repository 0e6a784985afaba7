"""The main job end to end on the real default target (SmolLM2-135M), at a tiny budget:
self-distilled data → Medusa heads through the one loop → per-domain evaluation (lossless) → vLLM export.
This is the CI's real-model path; the full-budget numbers live in BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from draftsmith.config import load_config
from draftsmith.data import generate_dataset, load_distilled
from draftsmith.data.generate import load_data_config
from draftsmith.evaluation import evaluate
from draftsmith.export import export_artifact
from draftsmith.medusa.job import MedusaJobConfig
from draftsmith.paths import shared_data_dir
from draftsmith.runner.train import run

pytestmark = pytest.mark.real


def test_data_train_evaluate_export(real_target, tmp_path):
    data_cfg = load_data_config("configs/smollm2-135m/data.yaml", [
        f"output_dir={tmp_path / 'data'}", "max_rows=12", "generation.max_new_tokens=24",
        "generation.batch_size=12"])
    generate_dataset(data_cfg, real_target, progress=False)
    rows = load_distilled(tmp_path / "data", real_target)
    assert len(rows) == 12 and all(sum(r["loss_mask"]) > 0 for r in rows)

    cfg = load_config("configs/smollm2-135m/medusa.yaml", [
        f"data={tmp_path / 'data'}", f"output={tmp_path / 'medusa'}", f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=4", "train.batch_size=4", "train.eval_every=0", "train.save_every=2",
        "train.progress=false", "num_heads=2", "max_length=160", "calibration_rows=4", "tree_budget=6",
        "evaluate.enabled=false", "train.loggers=[jsonl]"], cls=MedusaJobConfig)
    art = run("medusa", cfg).artifact
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kind"] == "medusa" and manifest["target"]["vocab_size"] == 49152

    gsm8k = shared_data_dir() / "eval" / "dev" / "gsm8k.jsonl"
    report = evaluate(real_target, f"medusa:{art}", prompts=[str(gsm8k)], limit_per_domain=1,
                      max_new_tokens=16, tree_from_proposer=True, cost_model=False)
    assert report["domains"]["math"]["lossless"] is True
    assert report["overall"]["tau"] >= 1.0
    # the whole calibrated tree, uncut, decoded beside the cut one for its τ
    assert report["overall"]["gpu_tree"]["lossless"] is True and report["overall"]["gpu_tree"]["tau"] >= 1.0
    assert report["settings"]["gpu_tree"]["tree_max_nodes"] == 6  # tree_budget

    result = export_artifact(art, "vllm", tmp_path / "export", target=real_target)
    config = json.loads((result.out / "config.json").read_text())
    assert config["model_type"] == "medusa" and (result.out / "serve.md").is_file()
