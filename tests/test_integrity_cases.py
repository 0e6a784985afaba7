"""The fault cases of "never destroy, never lie" that tests/test_integrity.py does not reach: every head kind
skips and counts a batch it cannot learn from, a skipped step is logged as skipped, the checkpoint an error
names as the last good one is intact, a changed byte is caught by every reader of every kind, `check` fails
on damage to every kind, every writer leaves a user's folder alone, and unreadable input lines are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_job import NextTokenJob
from test_export import deep_target, make_draft_artifact, make_eagle_artifact, make_medusa_artifact  # noqa: F401
from test_integrity import _cfg, flip_last_byte

from draftsmith.errors import TrainingError
from draftsmith.training import TrainConfig, train
from draftsmith.training import checkpoint as ckpt
from draftsmith.training.loop import epoch_permutation, rank_batches


# --- training: a batch nothing can be learned from, for every head kind --------------------------------
def _rows(target, n: int, seed: int = 0) -> list[dict]:
    """Self-distilled rows (prompt 6 tokens, answer 10), kept short so four kinds train in seconds."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, target.vocab_size, (n, 6), generator=g)
    out = target.model.generate(prompts, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    return [{"input_ids": seq, "loss_mask": [0] * 6 + [1] * 10, "row_id": i, "domain": "d"}
            for i, seq in enumerate(out.tolist())]


def _unlearnable(row: dict, i: int) -> dict:
    """No learned token at all (even rows), or only the token at position 1 (odd rows): a next-token model
    learns that one, but no Medusa head and no EAGLE step has a label there (they predict x_{t+2} and on)."""
    mask = [0] * len(row["loss_mask"])
    if i % 2:
        mask[1] = 1
    return {**row, "loss_mask": mask}


def _job(kind: str, target, rows: list[dict], tmp_path: Path, max_steps: int):
    train_cfg = TrainConfig(max_steps=max_steps, batch_size=4, output_dir=str(tmp_path / "run"), progress=False,
                            eval_every=0, log_every=1, loggers=["jsonl"], lr=1e-3, warmup_steps=0)
    if kind == "medusa":
        from draftsmith.heads.medusa_job import MedusaJob, MedusaJobConfig

        cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "art"), num_heads=2,
                              num_layers=1, eval_fraction=0.2, calibration_rows=2, train=train_cfg)
        cfg.evaluate.enabled = False
        return MedusaJob(cfg, target, rows), tmp_path / "art"
    if kind in ("eagle1", "eagle3"):
        from draftsmith.heads.eagle_job import EagleJob, EagleJobConfig

        extra = dict(target_layers=[0, 1, 1], draft_vocab_size=64) if kind == "eagle3" else {}
        cfg = EagleJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "art"), version=kind,
                             ttt_steps=2, eval_fraction=0.2, train=train_cfg, **extra)
        cfg.evaluate.enabled = False
        return EagleJob(cfg, target, rows), tmp_path / "art"
    from test_distill import tiny_cfg

    from draftsmith.distill.job import DistillJob

    cfg = tiny_cfg(tmp_path, f"train.max_steps={max_steps}", "train.log_every=1", "train.eval_every=0",
                   "train.loggers=[jsonl]", "data.eval_fraction=0.2")
    return DistillJob(cfg, target, rows), tmp_path / "run" / "artifact"


KINDS = ["medusa", "eagle1", "eagle3", "distill"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_skips_and_counts_a_batch_it_cannot_learn_from(tiny_target, tmp_path, kind):
    rows = _rows(tiny_target, 20)
    # three rows in four cannot be learned from: some micro-batches hold only such rows
    rows = [r if i % 4 == 0 else _unlearnable(r, 0 if kind == "distill" else i) for i, r in enumerate(rows)]
    steps = 10
    job, art = _job(kind, tiny_target, rows, tmp_path, steps)
    train_rows = list(job.train_rows())

    def learnable(r):
        mask = r["loss_mask"]
        return sum(mask[1:]) > 0 if kind == "distill" else sum(mask[2:]) > 0

    per_epoch = len(train_rows) // 4
    empty_steps = []
    for step in range(steps):  # the loop's own data order (epoch permutation, rank 0 of 1)
        epoch, b = divmod(step, per_epoch)
        batch = rank_batches(epoch_permutation(len(train_rows), 0, epoch), 4, 1, 0, b)[0]
        if not any(learnable(train_rows[i]) for i in batch):
            empty_steps.append(step + 1)
    assert 0 < len(empty_steps) < steps, empty_steps  # the case is really exercised, and training still happens
    result = train(job, job.cfg.train)
    assert result.metrics["empty_batches"] == len(empty_steps)
    records = {r["step"]: r for r in result.history if r["type"] == "train"}
    for step, r in records.items():
        if step in empty_steps:  # skipped, not a loss of 0.0
            assert r["loss"] is None and r["skipped_steps"] == 1 and r["empty_batches"] == 1, r
        else:
            assert r["loss"] is not None and r["loss"] > 0 and "skipped_steps" not in r, r
    assert (art / "manifest.json").is_file()


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_a_head_with_only_position_one_learned_tokens_writes_no_artifact(tiny_target, tmp_path, kind):
    rows = [_unlearnable(r, 1) for r in _rows(tiny_target, 10)]  # every row: one learned token, at position 1
    job, art = _job(kind, tiny_target, rows, tmp_path, 2)
    with pytest.raises(TrainingError, match=r"no optimizer step was taken in 2 steps \(2 batches had no learned"):
        train(job, job.cfg.train)
    assert not art.exists()


def test_a_non_finite_step_is_logged_as_skipped(tiny_target, tmp_path):
    result = train(NextTokenJob(tiny_target, nan_calls={1, 3}), _cfg(tmp_path / "n", max_steps=5))
    records = [r for r in result.history if r["type"] == "train"]
    assert [r["loss"] is None for r in records] == [False, True, False, True, False]
    assert [r.get("skipped_steps", 0) for r in records] == [0, 1, 0, 1, 0]
    assert [r["nonfinite_steps"] for r in records] == [0, 1, 1, 2, 2]
    assert result.metrics["nonfinite_steps"] == 2 and result.metrics["train/loss"] > 0


def test_the_last_good_checkpoint_named_after_non_finite_steps_is_intact(tiny_target, tmp_path, monkeypatch, caplog):
    from draftsmith.training import loop

    out = tmp_path / "boom"
    real = loop.Trainer.save

    def save_then_damage(self):  # the newest checkpoint is torn on disk (a full disk, a bad copy) after step 4
        real(self)
        if self.step == 4:
            flip_last_byte(out / "checkpoints" / "step-00000004" / "model.safetensors")

    monkeypatch.setattr(loop.Trainer, "save", save_then_damage)
    with caplog.at_level("WARNING"), pytest.raises(TrainingError, match=r"in a row at step 6 .*last good "
                                                                          r"checkpoint: (\S+step-00000002)$") as e:
        train(NextTokenJob(tiny_target, nan_calls=set(range(4, 100))),
              _cfg(out, max_steps=12, save_every=2, keep_last=5, max_nonfinite_in_row=2))
    named = Path(str(e.value).rsplit(": ", 1)[1])
    assert named == out / "checkpoints" / "step-00000002"
    assert ckpt.checkpoint_problems(named) == []
    good = ckpt.load_checkpoint(named)
    assert all(torch.isfinite(v).all() for v in good.model.values())
    assert "step-00000004 is damaged" in caplog.text
