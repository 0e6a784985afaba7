"""Medusa end to end on the tiny target: train through the one loop, save, reload as a proposer,
and decode losslessly (chain and tree, greedy and sampled)."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.proposer import build_proposer
from draftsmith.errors import FingerprintMismatch
from draftsmith.heads.medusa_job import MedusaJob, MedusaJobConfig, load_medusa
from draftsmith.training import TrainConfig, train


def self_distilled_rows(target, n=32, prompt_len=6, new=24, seed=0):
    """Rows the target wrote itself (greedy), assistant tokens in the loss mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, target.vocab_size, (n, prompt_len), generator=g)
    out = target.model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    rows = []
    for i, seq in enumerate(out.tolist()):
        rows.append({"input_ids": seq, "loss_mask": [0] * prompt_len + [1] * new, "row_id": i})
    return rows


@pytest.fixture(scope="module")
def medusa_artifact(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("medusa")
    rows = self_distilled_rows(tiny_target)
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp / "artifact"), num_heads=3,
                          num_layers=1, eval_fraction=0.125, calibration_rows=8, tree_budget=10,
                          tree_max_rank=4,
                          train=TrainConfig(lr=3e-3, max_steps=40, batch_size=4, warmup_steps=5,
                                            output_dir=str(tmp / "run"), log_every=10, progress=False))
    cfg.evaluate.enabled = False
    job = MedusaJob(cfg, tiny_target, rows)
    result = train(job, cfg.train)
    return result, tmp / "artifact"


def test_training_learns_and_writes_a_complete_artifact(medusa_artifact, tiny_target):
    result, path = medusa_artifact
    assert result.artifact == path
    assert {p.name for p in path.iterdir()} >= {"model.safetensors", "config.json", "manifest.json", "tree.json"}
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "medusa" and manifest["target"] == tiny_target.fingerprint()
    train_log = [r for r in result.history if r["type"] == "train"]
    assert train_log[-1]["loss"] < 0.8 * train_log[0]["loss"]
    assert "head0/top1" in train_log[-1] and "eval/head2/top5" in result.metrics
    tree = json.loads((path / "tree.json").read_text())["paths"]
    assert 1 <= len(tree) <= 10 and all(p[:-1] in tree for p in tree if len(p) > 1)


def test_reload_refuses_another_target(medusa_artifact, other_target):
    with pytest.raises(FingerprintMismatch, match="vocab_size"):
        load_medusa(medusa_artifact[1], other_target)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_medusa_decoding_is_lossless(medusa_artifact, tiny_target, mode):
    proposer = build_proposer(f"medusa:{medusa_artifact[1]}", tiny_target)
    prompts = torch.randint(3, tiny_target.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)[:, 5:]
    kwargs = {"k": 3} if mode == "chain" else {"k": None, "tree": proposer.default_tree_spec()}
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=20, eos_ids=[], **kwargs)
    assert out.tokens == ref.tolist()
    assert out.stats.tau >= 1.0 and out.stats.proposed > 0
    # sampling goes through the same proposer without error and respects the budget
    sampled = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=12, temperature=1.0,
                                   eos_ids=[], seed=3, **kwargs)
    assert all(len(t) == 12 for t in sampled.tokens)


def test_evaluation_report_is_written_into_the_artifact(medusa_artifact, tiny_target, tmp_path):
    import shutil

    from draftsmith.evaluation.after_training import EvalAfterTraining, evaluate_into_artifact

    art = tmp_path / "art"
    shutil.copytree(medusa_artifact[1], art)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": d, "turns": [f"add {i} and {i}"]})
                                 for d in ("math", "code") for i in range(2)) + "\n")
    report = evaluate_into_artifact(art, tiny_target, "medusa", EvalAfterTraining(
        prompts=[str(prompts)], limit_per_domain=2, max_new_tokens=8))
    assert set(report["domains"]) == {"math", "code"}
    assert report["settings"]["tree"] == list(build_proposer(f"medusa:{art}", tiny_target).default_tree_spec().branching)
    assert all(row["lossless"] for row in report["domains"].values())
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["eval"]["report"] == "eval/report.json" and (art / "eval" / "report.md").is_file()
