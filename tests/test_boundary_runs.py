"""The run folder's boundary (issue #58): what a training or capture reads back from disk, where it may resume
from, and how its writers lock and name their folders. Each test is a finding of the hostile-input audit: it
failed before the fix it names."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_job import NextTokenJob
from forged_runs import one_line as _one_line
from forged_runs import sharded_checkpoint
from forged_runs import train_cfg as _cfg

from draftsmith.errors import DataError, OutputError, TrainingError
from draftsmith.training import train


# --- 1. a resumed checkpoint never runs a pickle draftsmith did not write ------------------------------------
def test_a_malicious_sharded_checkpoint_given_as_resume_is_refused_unread(tiny_target, tmp_path):
    marker = tmp_path / "PWNED"
    evil = sharded_checkpoint(tmp_path / "downloaded" / "step-00000002", marker, 2)
    with pytest.raises(BaseException) as e:
        train(NextTokenJob(tiny_target), _cfg(tmp_path / "run", max_steps=4, resume=str(evil)))
    assert not marker.exists(), "the checkpoint's pickle was loaded"
    message = _one_line(e.value)
    assert "train.resume" in message and str(evil) in message and "output" in message, message


def test_a_malicious_checkpoint_copied_into_the_output_dir_is_never_unpickled(tiny_target, tmp_path):
    marker = tmp_path / "PWNED"
    out = tmp_path / "run"
    evil = sharded_checkpoint(out / "checkpoints" / "step-00000002", marker, 2)
    for resume in ("auto", str(evil)):  # found by resume: auto, or named: neither loads a pickle this run did not write
        with pytest.raises(BaseException) as e:
            train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, resume=resume))
        assert not marker.exists(), f"resume={resume}: the checkpoint's pickle was loaded"
        message = _one_line(e.value)
        assert "step-00000002" in message and "never loaded" in message, message


def test_resume_takes_a_copy_the_run_recorded_and_refuses_another_runs_checkpoint(tiny_target, tmp_path):
    import shutil

    out, other = tmp_path / "run", tmp_path / "other"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2))
    train(NextTokenJob(tiny_target), _cfg(other, max_steps=2, save_every=2))
    backup = tmp_path / "backup" / "step-00000002"
    shutil.copytree(out / "checkpoints" / "step-00000002", backup)  # a copy this run's written.json records
    result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=3, save_every=0, resume=str(backup)))
    assert result.resumed_from == backup and result.steps == 3
    foreign = other / "checkpoints" / "step-00000002"  # safetensors only, but not this run's
    with pytest.raises(TrainingError) as e:
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=3, resume=str(foreign)))
    assert str(foreign) in _one_line(e.value) and "written.json" in str(e.value)
    link = out / "checkpoints" / "step-00000009"  # a symlink in the run's own folder to another run's checkpoint
    link.symlink_to(foreign)
    with pytest.raises(TrainingError, match="is not a checkpoint of this run's output folder"):
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=3, resume=str(link)))


# --- 9, 26. one lock per folder, whatever its spelling, inside the folder it guards ----------------------------
_HOLD = ("import sys, time\nfrom draftsmith.locks import output_lock\n"
         "with output_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(120)\n")


class _Holder:
    """Another live process holding `folder`'s writer lock (what a running training or evaluation holds)."""

    def __init__(self, folder: Path, what: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder), what], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held", self.proc.stderr.read()

    def __enter__(self) -> subprocess.Popen:
        return self.proc

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def test_a_second_training_into_a_symlink_of_a_running_ones_output_dir_is_refused(tiny_target, tmp_path):
    from draftsmith.locks import OutputBusy

    out = tmp_path / "run"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2))  # a live checkpoint to resume
    (tmp_path / "alias").symlink_to(out)
    (tmp_path / "sub").mkdir()
    with _Holder(out, "training output") as first:
        for spelling in (tmp_path / "alias", tmp_path / "sub" / ".." / "run"):
            with pytest.raises(OutputBusy, match=f"another process \\(pid {first.pid}\\) is writing this training"):
                train(NextTokenJob(tiny_target), _cfg(spelling, max_steps=4))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".written.json", "step-00000002"]


def test_two_evaluations_into_a_folder_and_a_symlink_to_it_are_one_writer(tmp_path):
    from draftsmith.locks import OutputBusy, output_lock

    (tmp_path / "e").mkdir()
    (tmp_path / "e-link").symlink_to(tmp_path / "e")
    with _Holder(tmp_path / "e", "evaluation output"), pytest.raises(OutputBusy, match="e-link: another process"):
        with output_lock(tmp_path / "e-link", "evaluation output"):
            pass
    with output_lock(tmp_path / "e-link", "evaluation output"):  # the first one gone: free again
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "e-link"] and not any((tmp_path / "e").iterdir())


def test_the_lock_of_an_output_folder_lives_inside_it(tmp_path):
    from draftsmith.locks import output_lock

    ro, out = tmp_path / "RO", tmp_path / "RO" / "out"
    out.mkdir(parents=True)
    ro.chmod(0o555)  # `out` is writable, the folder it is in is not
    try:
        with output_lock(out, "evaluation output"):
            assert (out / ".draftsmith.lock").is_file()
            if os.geteuid() != 0:  # root writes anywhere: only an unprivileged user sees RO refuse the lock beside
                assert not (ro / ".out.lock").exists()
    finally:
        ro.chmod(0o755)
    assert not any(out.iterdir())


# --- 27, 25. the run's trackers and log: a local default, or one line naming what to fix -----------------------
def test_mlflow_without_a_tracking_uri_tracks_into_the_runs_output_dir(tmp_path, monkeypatch):
    from draftsmith.training.loggers import RunLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)  # where mlflow's own default (./mlflow.db) would go
    out = tmp_path / "run"
    logger = RunLogger(out, ["jsonl", "mlflow"], {"lr": 1e-3}, active=True)
    logger.log({"type": "train", "step": 1, "loss": 0.5})
    logger.close()
    run_id = logger.state["mlflow_run_id"]
    assert any((out / "mlruns").rglob(run_id)), "the run is not in <output_dir>/mlruns"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the process is left as it was
    again = RunLogger(out, ["mlflow"], {}, active=True, state=logger.state, resume_step=1)  # a resume: the same run
    again.close()
    assert again.state["mlflow_run_id"] == run_id


@pytest.mark.parametrize("name,make", [("tensorboard", "file"), ("log.jsonl", "folder")])
def test_a_run_folder_entry_of_the_wrong_kind_is_named_in_one_line(tmp_path, name, make):
    from draftsmith.training.loggers import RunLogger

    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if make == "folder" else (out / name).write_text("mine")
    with pytest.raises(OutputError) as e:
        RunLogger(out, ["jsonl", "tensorboard"], {"lr": 1e-3}, active=True)
    assert str(out / name) in _one_line(e.value) and "train.output_dir" in str(e.value)


def test_a_train_output_dir_that_is_a_file_is_named_in_one_line(tiny_target, tmp_path):
    (tmp_path / "run").write_text("a user's file")
    with pytest.raises(OutputError) as e:
        train(NextTokenJob(tiny_target), _cfg(tmp_path / "run", max_steps=2))
    assert "train.output_dir" in _one_line(e.value) and f"{tmp_path / 'run'} is a file" in str(e.value)
    assert (tmp_path / "run").read_text() == "a user's file"


# --- 25. a capture shard cut short: named, set aside, its rows captured again ------------------------------------
def _cache(folder: Path, rows: dict[int, int], close: bool = True):
    """A capture cache of one shard per row (layer 0, hidden 8, top-3)."""
    from draftsmith.capture.cache import ShardWriter

    w = ShardWriter(folder, layers=[0], topk=3, hidden_dtype=torch.float32, shard_tokens=1)
    for rid, n in rows.items():
        g = torch.Generator().manual_seed(rid)
        w.add(rid, {0: torch.randn(n, 8, generator=g)}, torch.randn(n, 3, generator=g),
              torch.randint(0, 100, (n, 3), generator=g))
    if close:
        w.close()
    return w


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_capture_shard_cut_in_half_is_named_set_aside_and_captured_again(tmp_path, caplog):
    from draftsmith.capture.cache import ShardReader

    rows = {3: 5, 4: 6, 5: 7}
    _cache(tmp_path / "c", rows)
    torn = tmp_path / "c" / "shard-00001.safetensors"  # row 4
    _cut_in_half(torn)
    with caplog.at_level(logging.WARNING):
        reader = ShardReader(tmp_path / "c")  # training from the cache: the rows of whole shards are read
    assert reader.rows == [3, 5] and reader.skipped == [torn]
    assert "1 torn or unreadable shard" in caplog.text and str(torn) in caplog.text
    with pytest.raises(DataError, match="row 4 is not in the capture cache"):
        reader.get(4)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        writer = _cache(tmp_path / "c", rows)  # `data capture` / `--grow` rerun: row 4 is captured again
    assert writer.skipped == [torn] and str(torn) in caplog.text
    again = ShardReader(tmp_path / "c")
    assert again.rows == [3, 4, 5] and again.skipped == [] and again.get(4)["layer.0"].shape == (6, 8)


def test_an_unfinished_capture_with_a_torn_shard_reads_the_whole_ones(tmp_path):
    from draftsmith.capture.cache import ShardReader

    _cache(tmp_path / "c", {1: 4, 2: 4}, close=False)  # killed before index.json
    _cut_in_half(tmp_path / "c" / "shard-00000.safetensors")
    reader = ShardReader(tmp_path / "c")
    assert reader.rows == [2] and [p.name for p in reader.skipped] == ["shard-00000.safetensors"]
    _cut_in_half(tmp_path / "c" / "shard-00001.safetensors")
    with pytest.raises(DataError) as e:
        ShardReader(tmp_path / "c")
    assert "shard-00000.safetensors" in _one_line(e.value)
