"""Fuzzing the readers of the run folder's own files (tests/fuzzing.py): a checkpoint's state.json, the training
log, the record of the checkpoints a run wrote, and the capture cache (its shards cut short or with mutated
metadata, its index.json). Each reads the file correctly or refuses it in one line naming it; never a raw
exception."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_job import NextTokenJob
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from draftsmith.capture.cache import ShardReader, ShardWriter
from draftsmith.errors import DataError
from draftsmith.training import TrainConfig, train
from draftsmith.training import checkpoint as ckpt
from draftsmith.training.loggers import RunLogger
from draftsmith.training.run_files import WRITTEN, read_log, read_state, read_written
from tests.fuzzing import FUZZ, FUZZ_LONG, PLACES, RUNS, mutated_json, mutated_jsonl, place, refuses_cleanly


@pytest.fixture(scope="module")
def checkpoint(tiny_target, tmp_path_factory) -> Path:
    """A real checkpoint of a tiny training (2 steps), whose state.json the tests replace."""
    out = tmp_path_factory.mktemp("fuzz_run") / "run"
    train(NextTokenJob(tiny_target), TrainConfig(batch_size=4, output_dir=str(out), save_every=2, max_steps=2,
                                                 eval_every=0, log_every=1, progress=False, loggers=["jsonl"]))
    return out / "checkpoints" / "step-00000002"


def _resumable(folder: Path) -> None:
    """What a resume does with a checkpoint's files: load it (state.json validated, checksums checked, RNG and
    log read) and restore its RNG (the generators are put back as they were after)."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        loaded = ckpt.load_checkpoint(folder)
        ckpt.restore_rng(loaded.rng_json[0], loaded.rng_tensors[0])
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def _state_property(checkpoint: Path, data: bytes, how: str) -> None:
    path = checkpoint / "state.json"
    valid = path.with_name("valid-state.json")
    if not valid.exists():
        shutil.copyfile(path, valid)
    try:
        place(path, data, how)
        refuses_cleanly(lambda: read_state(path), "state.json")
        refuses_cleanly(lambda: _resumable(checkpoint), "state.json")
    finally:
        place(path, valid.read_bytes())


def _valid_state(checkpoint: Path) -> dict:
    name = "valid-state.json" if (checkpoint / "valid-state.json").exists() else "state.json"
    return json.loads((checkpoint / name).read_text())


@pytest.mark.parametrize("runs", RUNS)
def test_state_json_mutations_are_read_or_refused_in_one_line(checkpoint, runs):
    runs(given(data=mutated_json(_valid_state(checkpoint)), how=PLACES)(
        lambda data, how: _state_property(checkpoint, data, how)))()


# --- the training log ---------------------------------------------------------------------------------------
LOG = [{"type": "train", "step": 1, "loss": 5.5, "lr": 1e-3}, {"type": "eval", "step": 2, "eval/loss": 5.4},
       {"type": "summary", "step": 2, "steps": 2, "train_seconds": 0.5, "resumed_from": ""}]


def _log_property(folder: Path, data: bytes, how: str) -> None:
    path = place(folder / "log.jsonl", data, how)
    records = refuses_cleanly(lambda: read_log(path), "log.jsonl")
    assert records is None or all(isinstance(r["type"], str) and r["step"] >= 0 for r in records)
    logger = refuses_cleanly(lambda: RunLogger(folder, ["jsonl"], {}, active=True), "log.jsonl")
    if logger is not None:
        logger.close()


@FUZZ
@given(data=mutated_jsonl(LOG), how=PLACES)
def test_log_jsonl_mutations_are_read_or_refused_in_one_line(tmp_path, data, how):
    _log_property(tmp_path / "run", data, how)


@pytest.mark.slow
@FUZZ_LONG
@given(data=mutated_jsonl(LOG), how=PLACES)
def test_log_jsonl_mutations_long(tmp_path, data, how):
    _log_property(tmp_path / "run", data, how)


# --- the record of the checkpoints a run wrote ------------------------------------------------------------------
@FUZZ
@given(data=mutated_json({"states": {"ab" * 32: "step-00000002", "cd" * 32: "step-00000004"}}), how=PLACES)
def test_written_json_mutations_are_read_or_refused_in_one_line(tmp_path, data, how):
    place(tmp_path / "checkpoints" / WRITTEN, data, how)
    written = refuses_cleanly(lambda: read_written(tmp_path / "checkpoints"), WRITTEN)
    assert written is None or all(len(k) == 64 and isinstance(v, str) for k, v in written.listed.items())
    assert written is None or written.vouched == {}  # unsigned, whatever it holds: it vouches for nothing


# --- the capture cache: shards cut short or with mutated metadata, index.json mutated ------------------------
_META = {"layers": [0], "topk": 3, "hidden_dtype": "float32", "hidden_size": 8, "last_hidden": False,
         "logsumexp": False, "rows": [[3, 0, 4], [7, 4, 2]]}


def _shard_bytes(folder: Path, meta_text: str) -> bytes:
    g = torch.Generator().manual_seed(0)
    tensors = {"layer.0": torch.randn(6, 8, generator=g), "topk_values": torch.randn(6, 3, generator=g),
               "topk_indices": torch.randint(0, 100, (6, 3), generator=g, dtype=torch.int32)}
    tmp = folder / "one.safetensors"
    save_file(tensors, str(tmp), metadata={"draftsmith": meta_text})
    data = tmp.read_bytes()
    tmp.unlink()
    return data


def _read_cache(folder: Path) -> list:
    reader = ShardReader(folder)
    return [reader.get(r) for r in reader.rows]


def _cache_property(folder: Path, shard: bytes, how: str) -> None:
    path = place(folder / "shard-00000.safetensors", shard, how)
    refuses_cleanly(lambda: _read_cache(folder), path.name)
    writer = refuses_cleanly(lambda: ShardWriter(folder, [0], 3, torch.float32), path.name)
    if writer is not None:  # a shard it could not read was set aside: the rows are to capture again
        assert writer.skipped or writer.rows


@FUZZ
@given(meta=mutated_json(_META), cut=st.one_of(st.none(), st.floats(0, 1)), how=PLACES)
def test_capture_shard_mutations_and_cuts_are_read_or_refused_in_one_line(tmp_path, meta, cut, how):
    folder = tmp_path / "cache"
    folder.mkdir(exist_ok=True)
    for p in folder.iterdir():
        p.unlink() if not p.is_dir() or p.is_symlink() else shutil.rmtree(p)
    data = _shard_bytes(folder, meta.decode("utf-8", "replace"))
    if cut is not None:
        data = data[: int(len(data) * cut)]
    _cache_property(folder, data, how)


@pytest.mark.slow
@FUZZ_LONG
@given(meta=mutated_json(_META), cut=st.one_of(st.none(), st.floats(0, 1)), how=PLACES)
def test_capture_shard_mutations_long(tmp_path, meta, cut, how):
    test_capture_shard_mutations_and_cuts_are_read_or_refused_in_one_line.hypothesis.inner_test(tmp_path, meta, cut,
                                                                                                how)


_INDEX = {"layers": [0], "topk": 3, "hidden_size": 8, "hidden_dtype": "float32", "last_hidden": False,
          "logsumexp": False, "fingerprint": {"vocab_size": 100}, "n_rows": 2, "n_tokens": 6,
          "shards": ["shard-00000.safetensors"], "rows": {"3": [0, 0, 4], "7": [0, 4, 2]}}


@FUZZ
@given(data=mutated_json(_INDEX), how=PLACES, shard=st.booleans())
def test_capture_index_mutations_are_read_or_refused_in_one_line(tmp_path, data, how, shard):
    folder = tmp_path / "cache"
    folder.mkdir(exist_ok=True)
    (folder / "shard-00000.safetensors").unlink(missing_ok=True)
    if shard:
        (folder / "shard-00000.safetensors").write_bytes(_shard_bytes(folder, json.dumps(_META)))
    place(folder / "index.json", data, how)
    names = ("index.json",) if not shard else ()
    got = refuses_cleanly(lambda: _read_cache(folder), *names)
    assert got is None or len(got) == (2 if shard else 0)


def test_a_shard_without_its_hidden_size_is_named(tmp_path):
    """Found by the long fuzz run: a shard's metadata without `hidden_size` was a raw KeyError."""
    folder = tmp_path / "cache"
    folder.mkdir()
    meta = {k: v for k, v in _META.items() if k != "hidden_size"}
    (folder / "shard-00000.safetensors").write_bytes(_shard_bytes(folder, json.dumps(meta)))
    with pytest.raises(DataError, match="shard-00000.safetensors: missing field 'hidden_size'"):
        _read_cache(folder)


def test_a_shard_of_no_rows_is_not_taken_for_one_of_ours(tmp_path):
    """Found by the long fuzz run: a shard whose metadata lists no rows (the writer never writes one) was neither
    read nor set aside; now it is named, and a writer sets it aside to capture again."""
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "shard-00000.safetensors").write_bytes(_shard_bytes(folder, json.dumps({**_META, "rows": []})))
    with pytest.raises(DataError, match="shard-00000.safetensors: field 'rows' must be a non-empty list"):
        _read_cache(folder)
    assert [p.name for p in ShardWriter(folder, [0], 3, torch.float32).skipped] == ["shard-00000.safetensors"]
