"""No file is written through a link: a symlink, a hard link, a FIFO, a socket or a folder where draftsmith
puts a lock, a record, a report or a pointer is refused in one line naming the path and what it is, and the
file it leads to keeps its bytes (never followed, truncated, read or copied into a record).

The real entry points are driven: locks.output_lock (what `draftsmith evaluate`, train and data hold),
RunLock (what `draftsmith retrain` holds), outputs.py's writers, the registry's pointer and records, and
`draftsmith evaluate` itself through cli.main (it takes its lock before it loads anything).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path

import pytest

from draftsmith.errors import DraftsmithError, OutputError

SECRET = b"precious: the user's own bytes, SECRET-TOKEN=abc123\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    return victim


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and text, text
    return text


@contextlib.contextmanager
def _no_hang(seconds: int = 10):
    """Fail (instead of hanging the suite) when the block blocks: an open or read of a FIFO waits forever."""
    def alarm(*_):
        raise TimeoutError(f"blocked for {seconds}s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _place(path: Path, how: str, victim: Path) -> None:
    """Put `how` at `path`: a symlink or a hard link to `victim`, a FIFO, a listening socket, a folder."""
    if how == "symlink":
        path.symlink_to(victim)
    elif how == "hardlink":
        os.link(victim, path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))  # the file stays after close
        s.close()
    elif how == "folder":
        path.mkdir()
    else:
        raise AssertionError(how)


_WHAT = {"symlink": "a symlink", "hardlink": "hard link", "fifo": "a FIFO", "socket": "a socket",
         "folder": "a folder"}
KINDS = sorted(_WHAT)


# --- output_lock: `<out>/.draftsmith.lock` and `.<out>.lock` ------------------------------------------------
@pytest.mark.parametrize("how", KINDS)
def test_a_lock_inside_an_output_folder_that_is_not_a_plain_file_is_refused_keeping_its_victim(tmp_path, how):
    from draftsmith.locks import INSIDE, output_lock

    victim, out = _victim(tmp_path), tmp_path / "out"
    out.mkdir()
    _place(out / INSIDE, how, victim)
    with _no_hang(), pytest.raises(OutputError) as e:
        with output_lock(out, "evaluation output"):
            pytest.fail("the lock was taken through a link")
    text = _one_line(e.value)
    assert str(out / INSIDE) in text and _WHAT[how] in text, text
    assert victim.read_bytes() == SECRET
    assert os.path.lexists(out / INSIDE)  # left as it was: not replaced, not removed


@pytest.mark.parametrize("how", KINDS)
def test_a_lock_beside_an_output_folder_that_is_not_a_plain_file_is_refused_keeping_its_victim(tmp_path, how):
    from draftsmith.locks import lock_path, output_lock

    victim, out = _victim(tmp_path), tmp_path / "out"  # `out` does not exist yet: only the lock beside it
    _place(lock_path(out), how, victim)
    with _no_hang(), pytest.raises(OutputError) as e:
        with output_lock(out, "evaluation output"):
            pytest.fail("the lock was taken through a link")
    text = _one_line(e.value)
    assert str(lock_path(out)) in text and _WHAT[how] in text, text
    assert victim.read_bytes() == SECRET and not out.exists()


def test_a_symlinked_lock_beside_an_existing_output_folder_is_refused(tmp_path):
    from draftsmith.locks import lock_path, output_lock

    victim, out = _victim(tmp_path), tmp_path / "out"
    out.mkdir()
    lock_path(out).symlink_to(victim)
    with pytest.raises(OutputError, match="a symlink"):
        with output_lock(out, "evaluation output"):
            pass
    assert victim.read_bytes() == SECRET and not any(out.iterdir())


def test_a_lock_of_another_owner_is_never_written_into(tmp_path):
    from draftsmith.locks import INSIDE, output_lock

    out = tmp_path / "out"
    out.mkdir()
    (out / INSIDE).write_bytes(SECRET)
    other = os.geteuid() + 1
    try:
        os.chown(out / INSIDE, other, -1)
    except PermissionError:
        pytest.skip("only root can give a file to another user")
    with pytest.raises(OutputError, match=f"owned by uid {other}"):
        with output_lock(out, "evaluation output"):
            pass
    assert (out / INSIDE).read_bytes() == SECRET


def test_draftsmith_evaluate_refuses_a_symlinked_lock_and_keeps_the_victim(tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.locks import INSIDE

    victim, out = _victim(tmp_path), tmp_path / "eval"
    out.mkdir()
    (out / INSIDE).symlink_to(victim)
    code = main(["evaluate", "--out", str(out), f"target={tmp_path / 'no-target'}"])  # the lock comes first
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and f"{out / INSIDE}: a symlink" in err, err
    assert victim.read_bytes() == SECRET


def test_a_lock_file_a_killed_writer_left_is_still_taken_over(tmp_path):
    from draftsmith.locks import INSIDE, output_lock

    out = tmp_path / "out"
    out.mkdir()
    (out / INSIDE).write_text("999999999")  # a regular file of ours with a dead pid: a lock, not a victim
    with output_lock(out, "evaluation output"):
        assert (out / INSIDE).read_text() == str(os.getpid())
    assert not (out / INSIDE).exists()


# --- RunLock: the registry's `.lock` ------------------------------------------------------------------------
@pytest.mark.parametrize("how", KINDS)
def test_a_registry_lock_that_is_not_a_plain_file_is_refused_keeping_its_victim(tmp_path, how):
    from draftsmith.locks import RunLock

    victim, lock = _victim(tmp_path), tmp_path / "registry" / ".lock"
    lock.parent.mkdir()
    _place(lock, how, victim)
    run = RunLock(lock)
    with _no_hang(), pytest.raises(OutputError) as e:
        run.acquire()
    text = _one_line(e.value)
    assert str(lock) in text and _WHAT[how] in text and "SECRET" not in text, text
    assert victim.read_bytes() == SECRET and run.broke_stale is None and run.fd is None


def test_a_registry_lock_holding_what_no_run_wrote_is_not_copied_into_the_record(tmp_path):
    from draftsmith.locks import RunLock

    lock = tmp_path / ".lock"
    lock.write_bytes(SECRET)  # a regular file of ours, but not the JSON note a run writes
    with RunLock(lock) as run:
        assert "SECRET" not in json.dumps(run.broke_stale), run.broke_stale
    for note in (b'{"raw": "SECRET"}', b'["SECRET"]', b'{"host": "h", "pid": "SECRET", "started": 1}'):
        lock.write_bytes(note)
        with RunLock(lock) as run:
            assert "SECRET" not in json.dumps(run.broke_stale), (note, run.broke_stale)


def test_a_registry_lock_a_dead_run_left_is_reported_from_its_note(tmp_path):
    from draftsmith.locks import RunLock

    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"host": "node-1", "pid": 4242, "started": 1700000000.5}))
    with RunLock(lock) as run:
        assert run.broke_stale == {"host": "node-1", "pid": 4242, "started": 1700000000.5}
    with RunLock(lock) as again:
        assert again.broke_stale is None


def test_retrain_refuses_a_symlinked_registry_lock_and_writes_no_record_of_the_victim(tiny_target, tmp_path):
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.registry import Registry
    from draftsmith.retrain.run import retrain_once

    victim = _victim(tmp_path)
    cfg = RetrainConfig(registry=str(tmp_path / "reg"), target=str(tiny_target.folder))
    reg = Registry(Path(cfg.registry), _target_name(cfg.target), cfg.artifact_kind)
    (reg.base / ".lock").symlink_to(victim)
    with pytest.raises(OutputError, match=r"\.lock: a symlink"):
        retrain_once(cfg)
    assert victim.read_bytes() == SECRET
    records = [p.read_bytes() for p in (reg.base / "runs").iterdir()]
    assert not any(b"SECRET" in r for r in records)


def _target_name(target: str) -> str:
    from draftsmith.targets import load_target

    return load_target(target).name


# --- outputs.py's writers and the registry's files ----------------------------------------------------------
@pytest.mark.parametrize("name", ["report.json", "manifest.json", "current.json", "report.md"])
def test_an_atomic_write_onto_a_symlink_is_refused_and_its_victim_kept(tmp_path, name):
    from draftsmith.outputs import atomic_write_json

    victim, out = _victim(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(OutputError) as e:
        atomic_write_json(out / name, {"kind": "report"})
    assert f"{out / name}: a symlink" in _one_line(e.value)
    assert victim.read_bytes() == SECRET and (out / name).is_symlink()
    assert [p.name for p in out.iterdir()] == [name]  # no temporary file left


@pytest.mark.parametrize("how", ["fifo", "socket", "folder"])
def test_an_atomic_write_onto_what_is_no_file_is_one_line(tmp_path, how):
    from draftsmith.outputs import atomic_write_bytes

    path = tmp_path / "report.json"
    _place(path, how, _victim(tmp_path))
    with _no_hang(), pytest.raises(OutputError, match=_WHAT[how]):
        atomic_write_bytes(path, b"{}")


def test_the_registry_never_writes_or_reads_current_json_through_a_link(tmp_path):
    from draftsmith.errors import ArtifactError
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path / "reg", "t", "medusa")
    (reg.path("v0001")).mkdir()
    (reg.path("v0001") / "manifest.json").write_text("{}")
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"version": "v0001", "SECRET": "abc"}))
    (reg.base / "current.json").symlink_to(victim)
    with pytest.raises(DraftsmithError, match="current.json: a symlink") as e:
        reg.set_current("v0001", "test")
    _one_line(e.value)
    with pytest.raises(ArtifactError, match="current.json: a symlink"):
        reg.current()
    assert json.loads(victim.read_text()) == {"version": "v0001", "SECRET": "abc"}


def test_a_version_that_is_a_symlink_is_not_a_published_version(tmp_path):
    from draftsmith.errors import ArtifactError
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path / "reg", "t", "medusa")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("{}")
    reg.path("v0001").symlink_to(elsewhere, target_is_directory=True)
    assert reg.versions() == [] and reg.next_version() == "v0002"
    with pytest.raises(ArtifactError, match="v0001.*a symlink"):
        reg.set_current("v0001", "test")
    assert not os.path.lexists(reg.base / "current.json")


def test_run_records_and_the_policy_are_not_written_through_links(tmp_path):
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path / "reg", "t", "medusa")
    victim = _victim(tmp_path)
    (reg.base / "policy.json").symlink_to(victim)
    with pytest.raises(OutputError, match="policy.json: a symlink"):
        reg.write_policy({"domains": {}})
    assert victim.read_bytes() == SECRET
    path = reg.write_run_record({"started": "2024-01-01T00:00:00+00:00"})
    assert path.is_file() and not path.is_symlink()


def test_a_report_plot_that_is_a_symlink_is_not_drawn_into_its_victim(tiny_target, tmp_path):
    # the package's names (lazy.py): importing the submodule first would bind `evaluate` to the module
    from draftsmith.evaluation import evaluate, write_report

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "chat", "turns": ["Say hi."]}) + "\n")
    report = evaluate(tiny_target, "ngram", prompts=[str(prompts)], max_new_tokens=4, k=2, cost_model=False)
    out = write_report(report, tmp_path / "eval")  # a draftsmith report folder: rewritten by the next report
    victim = _victim(tmp_path)
    (out / "domains.png").unlink()
    (out / "domains.png").symlink_to(victim)
    with pytest.raises(OutputError, match="domains.png: a symlink"):
        write_report(report, out)
    assert victim.read_bytes() == SECRET


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("how", ["symlink", "hardlink", "fifo"])
def test_a_streamed_output_is_not_opened_through_a_link(tmp_path, how, append):
    from draftsmith.outputs import open_output

    victim, log = _victim(tmp_path), tmp_path / "serve.log"
    _place(log, how, victim)
    with _no_hang(), pytest.raises(OutputError, match=_WHAT[how]):
        with open_output(log, append=append) as f:
            f.write("written through")
    assert victim.read_bytes() == SECRET


def test_a_streamed_output_replaces_or_extends_a_plain_file_of_ours(tmp_path):
    from draftsmith.outputs import open_output

    log = tmp_path / "serve.log"
    log.write_text("old\n")
    with open_output(log) as f:
        f.write("new\n")
    with open_output(log, append=True) as f:
        f.write("more\n")
    assert log.read_text() == "new\nmore\n"


def test_a_training_log_is_not_appended_through_a_link_put_there_after_the_run_began(tmp_path):
    from draftsmith.training.loggers import RunLogger

    victim, out = _victim(tmp_path), tmp_path / "run"
    logger = RunLogger(out, [], {}, active=True)
    logger.log({"type": "train", "step": 1, "loss": 1.0})
    (out / "log.jsonl").unlink()
    (out / "log.jsonl").symlink_to(victim)
    with pytest.raises(OutputError, match="log.jsonl: a symlink"):
        logger.log({"type": "train", "step": 2, "loss": 0.5})
    assert victim.read_bytes() == SECRET


def test_a_traffic_prompt_file_is_not_written_through_a_link(tmp_path):
    from draftsmith.retrain.traffic import TrafficRow, write_prompt_file

    victim, path = _victim(tmp_path), tmp_path / "prompts.jsonl"
    path.symlink_to(victim)
    with pytest.raises(OutputError, match="prompts.jsonl: a symlink"):
        write_prompt_file([TrafficRow("hello", "chat", 0.0)], path)
    assert victim.read_bytes() == SECRET


# --- atomic_dir: the folder swap ----------------------------------------------------------------------------
def test_atomic_dir_with_overwrite_refuses_a_symlinked_output_and_keeps_its_target(tmp_path):
    from draftsmith.outputs import atomic_dir

    target, link = tmp_path / "mine", tmp_path / "out"
    target.mkdir()
    (target / "data.bin").write_bytes(SECRET)
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(OutputError, match="a symlink") as e:
        with atomic_dir(link, overwrite=True) as tmp:
            (tmp / "x").write_text("new")
    _one_line(e.value)
    assert link.is_symlink() and (target / "data.bin").read_bytes() == SECRET
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]


def test_atomic_dir_gives_no_mode_to_a_file_a_link_in_the_new_folder_leads_to(tmp_path):
    from draftsmith.outputs import atomic_dir

    victim = _victim(tmp_path)
    victim.chmod(0o600)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "link").symlink_to(victim)
    assert victim.stat().st_mode & 0o777 == 0o600


def test_clean_stale_does_not_put_a_planted_link_in_place_of_the_output(tmp_path):
    from draftsmith.outputs import clean_stale

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = tmp_path / ".out.old-999999999"  # a dead pid's "previous copy": a link, not a folder we moved
    planted.symlink_to(elsewhere, target_is_directory=True)
    clean_stale(tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out") and planted.is_symlink()
