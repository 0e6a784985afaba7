"""Trust is earned, not self-declared (issue #64): a run folder received whole (a colleague's, a download)
brings its own `checkpoints/.written.json`, and that record vouched for its own pickled checkpoints, so
`train.resume: auto` ran the payload. The record is now signed with a key only this user holds
(training/trust.py); a folder from elsewhere resumes from its safetensors and JSON only, or in full after
`draftsmith trust RUN`. Each test failed before that fix."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
from _train_job import NextTokenJob
from forged_runs import Payload as _Payload
from forged_runs import one_line as _one_line
from forged_runs import sharded_checkpoint
from forged_runs import train_cfg as _cfg

from draftsmith.checksums import sha256_file
from draftsmith.errors import ConfigError, TrainingError
from draftsmith.training import checkpoint as ckpt
from draftsmith.training import train
from draftsmith.training.run_files import record_written

CONFIG_ENV = "DRAFTSMITH_CONFIG_HOME"


def _as(monkeypatch, home: Path) -> None:
    """Act as the user whose draftsmith config folder (and so signing key) is `home`."""
    monkeypatch.setenv(CONFIG_ENV, str(home))


def _received_run(tiny_target, tmp_path, monkeypatch, marker: Path, genuine: bool = True) -> Path:
    """A colleague's run (their own key): one genuine full checkpoint (step 2) unless not `genuine`, and a
    sharded step 4 whose pickle makes `marker`, recorded by their own draftsmith. Copied whole to `received`;
    the test then acts as this user."""
    _as(monkeypatch, tmp_path / "colleague-config")
    theirs = tmp_path / "theirs"
    train(NextTokenJob(tiny_target), _cfg(theirs, max_steps=2, save_every=2))
    if not genuine:
        shutil.rmtree(theirs / "checkpoints" / "step-00000002")
    evil = sharded_checkpoint(theirs / "checkpoints" / ".step-00000004.tmp-x", marker, 4)
    record_written(theirs / "checkpoints", evil / "state.json", "step-00000004")
    evil.rename(theirs / "checkpoints" / "step-00000004")
    received = tmp_path / "received"
    shutil.copytree(theirs, received)
    _as(monkeypatch, tmp_path / "my-config")
    return received


# --- a received run's record vouches for nothing ------------------------------------------------------------
def test_a_received_run_whose_record_lists_a_pickled_checkpoint_resumes_weights_only(tiny_target, tmp_path,
                                                                                        monkeypatch, caplog):
    marker = tmp_path / "PWNED"
    received = _received_run(tiny_target, tmp_path, monkeypatch, marker)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        result = train(NextTokenJob(tiny_target), _cfg(received, max_steps=3, resume="auto"))
    assert not marker.exists(), "the received run's pickle was loaded"
    assert result.resumed_from == received / "checkpoints" / "step-00000002" and result.steps == 3
    said = [r.getMessage() for r in caplog.records if "weights-only" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "draftsmith trust" in said[0], said
    assert "step-00000002" in said[0] and "another key" in said[0], said[0]


def test_a_received_run_with_only_a_pickled_checkpoint_is_refused_in_one_line(tiny_target, tmp_path,
                                                                               monkeypatch):
    marker = tmp_path / "PWNED"
    received = _received_run(tiny_target, tmp_path, monkeypatch, marker, genuine=False)
    for resume in ("auto", str(received / "checkpoints" / "step-00000004")):
        with pytest.raises(BaseException) as e:
            train(NextTokenJob(tiny_target), _cfg(received, max_steps=6, resume=resume))
        assert not marker.exists(), f"resume={resume}: the received run's pickle was loaded"
        message = _one_line(e.value)
        assert "step-00000004" in message and "pickles" in message and "draftsmith trust" in message, message


def test_an_edited_record_vouches_for_nothing(tiny_target, tmp_path, caplog):
    marker = tmp_path / "PWNED"
    out = tmp_path / "run"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2))  # this user's own, signed
    evil = sharded_checkpoint(out / "checkpoints" / "step-00000004", marker, 4)
    record = out / "checkpoints" / ".written.json"
    for forged_mac in (None, "0" * 64):  # a line added, signature kept / a signature made up
        data = json.loads(record.read_text())
        data["states"][sha256_file(evil / "state.json")] = "step-00000004"
        if forged_mac is not None:
            data["mac"] = forged_mac
        record.write_text(json.dumps(data))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draftsmith"):
            result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=3, resume="auto"))
        assert not marker.exists(), "a pickle an edited record lists was loaded"
        assert result.resumed_from == out / "checkpoints" / "step-00000002"
        assert any("weights-only" in r.getMessage() for r in caplog.records)


def test_a_pickle_folder_planted_in_a_signed_full_checkpoint_is_never_loaded(tiny_target, tmp_path):
    marker = tmp_path / "PWNED"
    out = tmp_path / "run"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2))
    step2 = out / "checkpoints" / "step-00000002"
    (step2 / "deepspeed").mkdir()  # its (signed) state.json names no such folder: a name decides nothing
    torch_pickle = step2 / "deepspeed" / "mp_rank_00_model_states.pt"
    torch_pickle.write_bytes(pickle.dumps(_Payload(marker)))
    result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=3, resume="auto"))
    assert not marker.exists() and result.resumed_from == step2 and result.steps == 3


def test_a_file_planted_beside_a_signed_checkpoints_pickles_is_refused_before_loading(tmp_path):
    out = tmp_path / "run"
    good = sharded_checkpoint(out / "checkpoints" / ".step-00000004.tmp-x", tmp_path / "unused", 4)
    record_written(out / "checkpoints", good / "state.json", "step-00000004")  # this user's own, signed
    good = good.rename(out / "checkpoints" / "step-00000004")
    assert ckpt.vouched_state(good, out)["step"] == 4
    (good / "shards" / "__0_0.distcp").write_bytes(b"planted")  # DCP reads every file its .metadata names
    with pytest.raises(TrainingError) as e:
        ckpt.vouched_state(good, out)
    assert "__0_0.distcp" in _one_line(e.value)
    other = tmp_path / "elsewhere"  # a run whose record does not list it
    with pytest.raises(TrainingError) as e:
        ckpt.vouched_state(good, other)
    assert "step-00000004" in _one_line(e.value)


# --- the key ------------------------------------------------------------------------------------------------
def test_the_key_is_made_once_private_under_the_users_config_folder(tiny_target, tmp_path, monkeypatch):
    from draftsmith.training import trust

    monkeypatch.delenv(CONFIG_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trust.key_path() == tmp_path / "xdg" / "draftsmith" / "trust.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert trust.key_path() == tmp_path / "home" / ".config" / "draftsmith" / "trust.key"
    _as(monkeypatch, tmp_path / "cfg")
    out = tmp_path / "run"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=1))
    key = tmp_path / "cfg" / "trust.key"
    st = key.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert sorted(p.name for p in key.parent.iterdir()) == ["trust.key"]  # no temporary file left
    first = key.read_bytes()
    train(NextTokenJob(tiny_target), _cfg(tmp_path / "run2", max_steps=1, save_every=1))
    assert key.read_bytes() == first  # made once
    record = json.loads((out / "checkpoints" / ".written.json").read_text())
    assert set(record) == {"states", "mac", "key_id"} and len(record["states"]) == 2


def _bad_key(kind: str, home: Path) -> Path:
    from draftsmith.training import trust

    home.mkdir(parents=True)
    key = home / "trust.key"
    text = "ab" * 32 + "\n"
    if kind == "symlink":  # a key someone else chose, linked into place
        (home / "planted").write_text(text)
        os.chmod(home / "planted", 0o600)
        key.symlink_to(home / "planted")
    elif kind == "fifo":  # would block a reader that waits for a writer
        os.mkfifo(key, 0o600)
    else:
        key.write_text(text)
        os.chmod(key, 0o644 if kind == "mode-0644" else 0o600)
        if kind == "another-uid":
            if os.geteuid() != 0:
                pytest.skip("giving a file to another uid needs root")
            os.chown(key, 4242, 4242)
    assert trust.key_path() == key
    return key


@pytest.mark.parametrize("kind", ["symlink", "mode-0644", "fifo", "another-uid"])
def test_a_key_file_that_is_not_a_private_regular_file_of_this_user_is_refused(kind, tiny_target, tmp_path,
                                                                                monkeypatch):
    from draftsmith.training import trust

    _as(monkeypatch, tmp_path / "cfg")
    key = _bad_key(kind, tmp_path / "cfg")
    with pytest.raises(ConfigError) as e:  # signing: a training that saves checkpoints, stopped before work
        train(NextTokenJob(tiny_target), _cfg(tmp_path / "run", max_steps=1, save_every=1))
    assert str(key) in _one_line(e.value) and not (tmp_path / "run" / "log.jsonl").exists()
    with pytest.raises(ConfigError) as e:  # verifying: the reader refuses it the same way
        trust.load_key()
    assert str(key) in _one_line(e.value)


# --- `draftsmith trust RUN` ---------------------------------------------------------------------------------
def test_draftsmith_trust_accepts_what_it_prints_and_the_run_then_resumes_in_full(
        tiny_target, tmp_path, monkeypatch, capsys, caplog):
    from draftsmith.cli import main

    marker = tmp_path / "PWNED"
    received = _received_run(tiny_target, tmp_path, monkeypatch, marker)
    step2, step4 = (received / "checkpoints" / f"step-0000000{n}" for n in (2, 4))
    evil = tmp_path / "step-00000004"
    shutil.move(step4, evil)  # looked at, set aside: only step 2 is to be trusted
    assert main(["trust", str(received)]) == 0
    printed = capsys.readouterr().out
    assert "step-00000002" in printed and sha256_file(step2 / "state.json") in printed, printed
    assert "step-00000004" not in printed, printed
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        result = train(NextTokenJob(tiny_target), _cfg(received, max_steps=3, resume="auto"))
    assert result.resumed_from == step2
    assert not [r for r in caplog.records if "weights-only" in r.getMessage()]
    # what `trust` accepts is what a resume loads, pickles included: trusting the sharded step 4 runs it
    shutil.move(evil, step4)
    assert main(["trust", str(received)]) == 0
    printed = capsys.readouterr().out
    assert "step-00000004" in printed and sha256_file(step4 / "state.json") in printed, printed
    assert "holds pickles" in printed, printed
    with pytest.raises(TrainingError, match="shards: cannot be loaded"):  # its .metadata is no DCP index
        train(NextTokenJob(tiny_target), _cfg(received, max_steps=6, resume="auto"))
    assert marker.exists(), "trusting a checkpoint did not make its pickles loadable"


def test_draftsmith_trust_of_a_folder_without_checkpoints_is_one_line(tmp_path, capsys):
    from draftsmith.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["trust", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "empty") in err and err.count("\n") == 1, err
    assert not (tmp_path / "empty" / "checkpoints").exists()
