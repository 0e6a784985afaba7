"""Batches of self-distilled rows (data/batching.py): the window a long row is trained on keeps its
answer, the offline capture cache hands out the window's positions, and length-grouped epochs are a
deterministic reordering that pads less and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from _train_job import make_rows  # noqa: E402

from draftsmith.capture.cache import capture_dataset  # noqa: E402
from draftsmith.capture.online import CaptureSource  # noqa: E402
from draftsmith.data.batching import (  # noqa: E402  # noqa: E402
    batching_report,
    epoch_permutation,
    length_grouped,
    pad_rows,
    rank_batches,
    row_lengths,
    split_rows,
    window,
)


def test_window_keeps_the_answer():
    prompt, answer = [0] * 500, [1] * 100
    assert window(prompt + answer, 1000) == (0, 600)  # fits: whole row
    # the old rule (first 384 tokens) kept no learned token; the window ends at the row's end
    s, e = window(prompt + answer, 384)
    assert (s, e) == (216, 600) and sum((prompt + answer)[s:e]) == 100
    # an answer longer than the window: start `context` tokens before it, cut the answer's end
    long = [0] * 50 + [1] * 400
    assert window(long, 128, context=32) == (18, 146)
    assert window([0] * 10 + [1] * 400, 128, context=32) == (0, 128)  # not before the row's start
    assert window([0] * 300, 100) == (200, 300)  # nothing learned: the tail (no loss either way)
    # prompt_context: at most that many tokens before the first learned one, even where more would fit
    assert window(prompt + answer, 1000, prompt_context=64) == (436, 600)
    assert window([0] * 10 + [1] * 5, 1000, prompt_context=64) == (0, 15)
    assert window(long, 128, context=32, prompt_context=8) == (42, 170)


def test_pad_rows_windows_offsets_and_row_ids():
    rows = [{"input_ids": list(range(10, 20)), "loss_mask": [0] * 7 + [1] * 3, "row_id": 4},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "row_id": 9}]
    b = pad_rows(rows, pad_id=0, max_length=5, context=2)
    assert b["offset"].tolist() == [5, 0]
    assert b["input_ids"].tolist() == [[15, 16, 17, 18, 19], [5, 6, 7, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert b["row_id"].tolist() == [4, 9]


def test_offline_features_follow_the_window(tiny_target, tmp_path):
    rows = make_rows(3, tiny_target.vocab_size, length=14)
    for r in rows:
        r["loss_mask"] = [0] * 9 + [1] * 5
    cache = tmp_path / "cap"
    capture_dataset(tiny_target, rows, cache, layers=[0], topk=2, last_hidden=True, progress=False)
    src = CaptureSource(tiny_target, layers=[0], topk=2, last_hidden=True, cache_dir=cache)
    batch = pad_rows(rows, pad_id=0, max_length=8, context=3)
    assert batch["offset"].tolist() == [6, 6, 6]
    got = src(batch)
    full = src.reader.get(1)
    torch.testing.assert_close(got["layer.0"][1], full["layer.0"][6:14].to(got["layer.0"].dtype))
    assert torch.equal(got["topk_indices"][1], full["topk_indices"][6:14, :2])
    # a window past the stored row means the cache was made from other data
    batch["offset"][0] = 7
    with pytest.raises(Exception, match="needs 15"):
        src(batch)


def test_length_grouped_is_a_deterministic_permutation_that_pads_less():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 700, (1003,), generator=g).tolist()
    B, world = 8, 2
    perm = epoch_permutation(len(lengths), seed=3, epoch=1)
    grouped = length_grouped(perm, lengths, B * world, seed=3, epoch=1)
    assert grouped == length_grouped(perm, lengths, B * world, seed=3, epoch=1)
    assert grouped != length_grouped(perm, lengths, B * world, seed=3, epoch=2)
    assert sorted(grouped) == sorted(perm) and grouped[-(1003 % 16):] == perm[-(1003 % 16):]  # tail kept last

    def padded(order):  # tokens computed when each micro-batch is padded to its longest row
        total = 0
        for r in range(world):
            for batch in rank_batches(order, B, world, r, 0):
                total += len(batch) * max(lengths[i] for i in batch)
        return total

    useful = sum(lengths[i] for r in range(world) for b in rank_batches(grouped, B, world, r, 0) for i in b)
    assert padded(grouped) < 1.1 * useful < 0.8 * padded(perm)
    # the longest micro-batch comes first (a batch that does not fit fails at step 1)
    assert max(lengths[i] for i in grouped[:B * world]) == max(lengths[i] for i in grouped[: 1003 // 16 * 16])


def test_row_lengths_from_a_dataset_column():
    from datasets import Dataset

    ds = Dataset.from_list([{"input_ids": [1] * n, "loss_mask": [1] * n} for n in (3, 10, 7)])
    assert row_lengths(ds) == [3, 10, 7] and row_lengths(ds, 5) == [3, 5, 5]
    assert row_lengths([{"input_ids": [1, 2]}]) == [2]
    rows = [{"input_ids": [1] * 9, "loss_mask": [0] * 6 + [1] * 3}]
    assert row_lengths(rows, 8) == [8] and row_lengths(rows, 8, prompt_context=2) == [5]


def test_grouped_training_resumes_exactly(tiny_target, tmp_path):
    """A run with group_by_length killed after a checkpoint and resumed ends with the uninterrupted weights."""
    from _train_job import NextTokenJob

    from draftsmith.training import TrainConfig, train
    from draftsmith.training import checkpoint as ckpt

    class Ragged(NextTokenJob):  # rows of different lengths, padded per batch
        def __init__(self, target):
            super().__init__(target)
            for i, r in enumerate(self._train):
                r["input_ids"] = r["input_ids"][: 4 + i % 9]

        def collate(self, rows):
            T = max(len(r["input_ids"]) for r in rows)
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, r in enumerate(rows):
                ids[b, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
                mask[b, : len(r["input_ids"])] = 1
            return {"input_ids": ids, "attention_mask": mask, "row_id": torch.tensor([r["row_id"] for r in rows])}

    import shutil

    base = dict(lr=3e-3, max_steps=10, batch_size=4, save_every=5, group_by_length=True, progress=False)
    full = train(Ragged(tiny_target), TrainConfig(output_dir=str(tmp_path / "full"), **base))
    # the state of a run killed after its step-5 checkpoint: the later checkpoint and the artifact never written
    shutil.copytree(tmp_path / "full", tmp_path / "part")
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-00000010")
    shutil.rmtree(tmp_path / "part" / "artifact")
    assert ckpt.list_checkpoints(tmp_path / "part")[-1].name == "step-00000005"
    resumed = train(Ragged(tiny_target), TrainConfig(output_dir=str(tmp_path / "part"), **base))
    assert resumed.resumed_from is not None and resumed.steps == 10
    for k, v in full.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[k], v, atol=1e-6, rtol=0)
    # and the grouping changed the order: an ungrouped run ends elsewhere
    plain = train(Ragged(tiny_target), TrainConfig(output_dir=str(tmp_path / "plain"),
                                                   **{**base, "group_by_length": False}))
    assert any(not torch.allclose(plain.module.state_dict()[k], v) for k, v in full.module.state_dict().items())


def test_batching_report_counts_what_each_rule_keeps():
    masks = [[0] * 500 + [1] * 20, [0] * 10 + [1] * 30] * 8
    r = batching_report(masks, max_length=384, batch_size=4)
    assert r["rows"] == 16 and r["learned_kept_window"] == 1.0
    assert r["learned_kept_head"] == pytest.approx(240 / 400)  # the long rows' answers lie past token 384
    assert r["positions"] == 8 * 384 + 8 * 40
    assert r["padded_grouped"] == r["positions"] <= r["padded_random"]
    assert batching_report(masks, 384, 4, prompt_context=16)["positions"] == 8 * 36 + 8 * 40


def test_split_rows_is_a_seeded_partition():
    import datasets

    rows = [{"input_ids": [i], "loss_mask": [1]} for i in range(40)]
    train, held = split_rows(rows, 0.1, seed=3)
    assert len(held) == 4 and len(train) == 36
    assert sorted(r["input_ids"][0] for r in train + held) == list(range(40))
    assert split_rows(rows, 0.1, seed=3) == (train, held)
    assert split_rows(rows, 0.1, seed=4)[1] != held
    ds_train, ds_held = split_rows(datasets.Dataset.from_list(rows), 0.1, seed=3)  # the same rows via select
    assert ds_held["input_ids"] == [r["input_ids"] for r in held] and len(ds_train) == 36
    assert split_rows(rows[:2], 0.01, seed=0)[1] != []  # at least one row held out
    assert split_rows(rows[:1], 0.5, seed=0) == (rows[:1], [])  # ... except from a one-row set


def test_split_by_row_id_survives_a_growing_dataset():
    import datasets

    rows = [{"row_id": 1000 + 7 * i, "input_ids": [i]} for i in range(400)]
    train, held = split_rows(rows, 0.05, seed=0)
    assert len(held) == 20 and len(train) == 380
    grown = rows + [{"row_id": 90000 + i, "input_ids": [i]} for i in range(200)]  # a new source is added
    g_train, g_held = split_rows(grown, 0.05, seed=0)
    assert len(g_held) == 30
    old_held = {r["row_id"] for r in held}
    moved = old_held - {r["row_id"] for r in g_held}
    assert len(moved) <= 4  # only rows near the cut change sides (a permutation would move ~19 of 20)
    assert split_rows(list(reversed(rows)), 0.05, seed=0)[1] == sorted(held, key=lambda r: -r["row_id"])
    ds_train, ds_held = split_rows(datasets.Dataset.from_list(rows), 0.05, seed=0)  # datasets use the column
    assert ds_held["row_id"] == [r["row_id"] for r in held]
    assert split_rows(rows, 0.05, seed=1)[1] != held


@pytest.mark.parametrize("with_ids", [True, False])
def test_train_rows_gives_nested_points_of_one_learning_curve(with_ids):
    rows = [{"row_id": 1000 + 7 * i, "input_ids": [i]} if with_ids else {"input_ids": [i]} for i in range(100)]
    full_train, held = split_rows(rows, 0.05, seed=0)
    points = {n: split_rows(rows, 0.05, seed=0, train_rows=n) for n in (10, 20, 40, 95)}
    for n, (train, h) in points.items():
        assert h == held and len(train) == n  # the same held-out rows whatever N
    kept = {n: {r["input_ids"][0] for r in train} for n, (train, _) in points.items()}
    assert kept[10] < kept[20] < kept[40] < kept[95] == {r["input_ids"][0] for r in full_train}
    assert points[95][0] == full_train
    with pytest.raises(ValueError, match="train.train_rows=96 but the data has 95 training rows"):
        split_rows(rows, 0.05, seed=0, train_rows=96)


def test_train_rows_is_checked_in_the_config():
    from draftsmith.training.config import TrainConfig

    with pytest.raises(ValueError, match=r"TrainConfig\.train_rows: 0 is out of range \(expected 1 <= x"):
        TrainConfig(train_rows=0)
