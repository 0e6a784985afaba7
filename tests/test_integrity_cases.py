"""The fault cases of "never destroy, never lie" that tests/test_integrity.py does not reach: every head kind
skips and counts a batch it cannot learn from, a skipped step is logged as skipped, the checkpoint an error
names as the last good one is intact, a changed byte is caught by every reader of every kind, `check` fails
on damage to every kind, every writer leaves a user's folder alone, and unreadable input lines are named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _train_job import NextTokenJob
from test_export import make_draft_artifact, make_medusa_artifact
from test_integrity import _cfg, flip_last_byte, siblings, snapshot, users_folder

from draftsmith.errors import IntegrityError, OutputError, TrainingError
from draftsmith.export.api import export_artifact
from draftsmith.training import TrainConfig, train
from draftsmith.training import checkpoint as ckpt
from draftsmith.training.loop import epoch_permutation, rank_batches


def _find(name: str, *modules: str):
    """`name` from the first of `modules` that defines it: the head modules live in draftsmith.medusa /
    draftsmith.eagle, earlier in draftsmith.heads."""
    import importlib

    for module in modules:
        try:
            found = importlib.import_module(f"draftsmith.{module}")
        except ImportError:
            continue
        if hasattr(found, name):
            return getattr(found, name)
    raise ImportError(f"{name} is in none of {modules}")


MEDUSA_JOB, EAGLE_JOB = ("medusa.job", "heads.medusa_job"), ("eagle.job", "heads.eagle_job")
EAGLE_MODEL = ("eagle.model", "heads.eagle", "heads.eagle_job")
MEDUSA_MODEL = ("medusa.model", "heads.medusa_job")


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
        MedusaJob, MedusaJobConfig = _find("MedusaJob", *MEDUSA_JOB), _find("MedusaJobConfig", *MEDUSA_JOB)
        cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "art"), num_heads=2,
                              num_layers=1, eval_fraction=0.2, calibration_rows=2, train=train_cfg)
        cfg.evaluate.enabled = False
        return MedusaJob(cfg, target, rows), tmp_path / "art"
    if kind in ("eagle1", "eagle3"):
        EagleJob, EagleJobConfig = _find("EagleJob", *EAGLE_JOB), _find("EagleJobConfig", *EAGLE_JOB)
        # a 2-layer target: layer 1's output is captured by no serving stack, so the head is for our decoder only
        extra = dict(target_layers=[0, 1, 1], draft_vocab_size=64, exportable=False) if kind == "eagle3" else {}
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


@pytest.fixture(scope="module")
def deep_target(tiny_tokenizer, tmp_path_factory):
    """A 4-layer tiny target: EAGLE-3 reads three distinct feature layers."""
    from tiny_models import make_target

    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("deep_target"))


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


# --- a changed byte in a weight file: every reader of every kind ----------------------------------------
def _eagle_artifact(target, path: Path) -> Path:
    """An EAGLE-3 artifact as heads/eagle_job.py saves it (config from the head, manifest of kind eagle)."""
    from dataclasses import asdict

    from draftsmith import artifact
    from draftsmith.heads.vocab import build_draft_vocab

    EagleHead = _find("EagleHead", *EAGLE_MODEL)

    counts = torch.bincount(torch.randint(0, target.vocab_size, (2000,), generator=torch.Generator().manual_seed(0)),
                            minlength=target.vocab_size)
    head = EagleHead.from_target(target.model, version=3, target_layers=[0, 1, 3],
                                 draft_vocab=build_draft_vocab(counts, 64))
    cfg = {**asdict(head.config)}
    return artifact.save_artifact(path, artifact.make_manifest("eagle", target.fingerprint(), cfg),
                                  dict(head.state_dict()), cfg)


class _KindJob(NextTokenJob):
    """The tiny loop job, taking a warm start of another artifact kind: the loop's warm start reads it."""

    def __init__(self, target, kind):
        super().__init__(target)
        self.kind = kind


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
def test_a_flipped_bit_is_caught_by_every_reader_of_every_kind(tiny_target, deep_target, tmp_path, capsys, kind):
    from draftsmith.cli import main
    from draftsmith.distill.model import existing_draft

    target = deep_target if kind == "eagle" else tiny_target
    make = {"medusa": make_medusa_artifact, "eagle": _eagle_artifact, "draft": make_draft_artifact}[kind]
    art = make(target, tmp_path / "a")
    export = export_artifact(art, "hf" if kind == "draft" else "vllm", tmp_path / "served", target).out
    before = snapshot(export)
    flip_last_byte(art / "model.safetensors")
    named = r"a/model\.safetensors: sha256 differs from the one \S+a/manifest\.json recorded"
    readers = {
        "load": {"medusa": lambda: _find("load_medusa", *MEDUSA_MODEL)(art, target),
                 "eagle": lambda: _find("load_eagle", *EAGLE_MODEL)(art, target),
                 "draft": lambda: _find("DraftProposer", "distill.proposer").from_path(art, target)}[kind],
        "export": lambda: export_artifact(art, "hf" if kind == "draft" else "vllm", export, target),
        "warm start": lambda: train(_KindJob(target, kind), _cfg(tmp_path / "w", max_steps=1, warm_start=str(art))),
    }
    if kind == "draft":
        readers["draft.init=existing"] = lambda: existing_draft(art, target)
    for name, read in readers.items():
        with pytest.raises(IntegrityError, match=named):
            read()
        assert snapshot(export) == before, name  # the failed export left the served one as it was
    assert siblings(export) == []
    capsys.readouterr()
    assert main(["evaluate", "--proposer", f"{kind}:{art}", "--target", str(target.folder), "--no-hf-reference",
                 "--no-cost-model"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert len(err) == 1 and "model.safetensors: sha256 differs" in err[0], err
    assert main(["check", "--artifact", str(art), "--target", str(target.folder)]) == 4
    assert "model.safetensors: sha256 differs" in capsys.readouterr().out


def test_a_flipped_bit_in_a_checkpoint_is_caught_by_resume(tiny_target, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = dict(save_every=2, keep_last=3)
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, **cfg))
    newest = out / "checkpoints" / "step-00000004"
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "optimizer.json", "log.jsonl"):
        flip_last_byte(newest / name)
        assert ckpt.checkpoint_problems(newest) == [f"{newest / name}: sha256 differs from the one state.json "
                                                     "recorded when it was written (the file was changed, truncated "
                                                     "or corrupted since)"]
        with pytest.raises(TrainingError, match=rf"step-00000004 is damaged: .*{name}: sha256 differs"):
            train(NextTokenJob(tiny_target), _cfg(out, max_steps=6, resume=str(newest), **cfg))
        flip_last_byte(newest / name)  # back as it was
    flip_last_byte(newest / "model.safetensors")
    with caplog.at_level("WARNING"):
        result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=6, **cfg))
    assert result.resumed_from.name == "step-00000002" and "step-00000004 is damaged" in caplog.text


# --- writers: a user's folder survives every one ------------------------------------------------------
def test_every_other_writer_leaves_a_users_folder_alone(tiny_target, deep_target, tmp_path):
    import datasets
    from test_chat_data import SHAREGPT, _jsonl
    from test_data import _gen_cfg

    from draftsmith.capture.config import CaptureConfig
    from draftsmith.data import generate_dataset
    from draftsmith.data.config import DataConfig, SourceConfig
    from draftsmith.errors import DataError

    mine = users_folder(tmp_path / "mine")
    theirs = tmp_path / "theirs"  # a user's own datasets.save_to_disk folder, named `dataset`
    datasets.Dataset.from_dict({"text": ["mine"]}).save_to_disk(str(theirs / "dataset"))
    capture_dataset_dir = _find("capture_dataset_dir", "data.generate", "capture.offline")
    folders = {"mine": mine, "theirs": theirs}
    before = {name: snapshot(f) for name, f in folders.items()}
    eagle = _eagle_artifact(deep_target, tmp_path / "eagle")
    sg = SourceConfig(name="sg", path=str(_jsonl(tmp_path / "sg.jsonl", SHAREGPT)), conversations="conversations",
                      domain="chat")
    for name, folder in folders.items():
        writers = {
            "data generate": lambda f=folder: generate_dataset(_gen_cfg(tmp_path, ["Hi"], name=f.name), tiny_target,
                                                               progress=False),
            "data generate, responses keep": lambda f=folder: generate_dataset(
                DataConfig(sources=[sg], output_dir=str(f), responses="keep"), tiny_target, progress=False),
            "export eagle": lambda f=folder: export_artifact(eagle, "vllm", f, deep_target),
        }
        for what, write in writers.items():
            with pytest.raises(OutputError, match=rf"{name} already exists and is not a draftsmith"):
                write()
            assert snapshot(folder) == before[name] and siblings(folder) == [], (name, what)
        # capture writes only into a finished draftsmith dataset
        cfg = DataConfig(sources=[sg], output_dir=str(folder), capture=CaptureConfig(enabled=True, layers=[1]))
        with pytest.raises(DataError, match=str(folder)):
            capture_dataset_dir(cfg, tiny_target, progress=False)
        assert snapshot(folder) == before[name]


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "distill"])
def test_every_job_refuses_a_users_output_folder_before_training(tiny_target, tmp_path, kind):
    job, art = _job(kind, tiny_target, _rows(tiny_target, 10), tmp_path, 1)
    users_folder(art)
    with pytest.raises(OutputError, match=rf"{art} already exists and is not a draftsmith artifact .*notes\.txt"):
        train(job, job.cfg.train)
    assert sorted(p.name for p in art.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_retrain_writes_only_its_own_names_in_a_registry_folder(tiny_target, tmp_path):
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.run import EXIT_OK, retrain_once

    root = users_folder(tmp_path / "reg")
    before = snapshot(root)
    code, record = retrain_once(RetrainConfig(registry=str(root), target=str(tiny_target.folder)),
                                init=str(make_medusa_artifact(tiny_target, tmp_path / "m")))
    assert code == EXIT_OK
    assert {k: v for k, v in snapshot(root).items() if k in before} == before
    assert all(Path(k).parts[0] in ("notes.txt", Path(record["registry"]).relative_to(root).parts[0])
               for k in snapshot(root))


def test_a_train_output_dir_keeps_a_users_log(tiny_target, tmp_path):
    out = users_folder(tmp_path / "run")
    (out / "log.jsonl").write_text("my own log\n")
    with pytest.raises(OutputError, match=r"run/log\.jsonl exists and is not a draftsmith training log"):
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=1))
    assert (out / "log.jsonl").read_text() == "my own log\n"
    (out / "log.jsonl").unlink()
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=1))
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=1, resume="never"))  # its own log is rewritten
    assert (out / "notes.txt").read_text() == "my own notes"


# --- draftsmith check: damage to every kind, artifact and export --------------------------------------
def _rename_first(sd):
    name = sorted(k for k in sd if k.endswith("weight"))[0]
    sd[name + "x"] = sd.pop(name)


def _reshape_first_vector(sd):
    name = sorted(k for k, v in sd.items() if v.ndim == 1 and v.is_floating_point())[0]
    sd[name] = torch.zeros(3, dtype=sd[name].dtype)


@pytest.mark.parametrize("kind", ["eagle", "draft"])
@pytest.mark.parametrize("damage", ["rename", "shape", "truncate"])
def test_check_fails_on_damage_to_every_kind(tiny_target, deep_target, tmp_path, capsys, kind, damage):
    from test_integrity import _rewrite

    from draftsmith.cli import main

    target = deep_target if kind == "eagle" else tiny_target
    art = (_eagle_artifact if kind == "eagle" else make_draft_artifact)(target, tmp_path / "a")
    out = export_artifact(art, "vllm" if kind == "eagle" else "hf", tmp_path / "x", target).out
    check = ["check", "--target", str(target.folder), "--artifact"]
    assert main([*check, str(art)]) == 0 and main([*check, str(out)]) == 0
    capsys.readouterr()
    for folder, manifest in ((art, "manifest.json"), (out, "draftsmith.json")):
        f = folder / "model.safetensors"
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[:-100])
        else:
            _rewrite(f, _rename_first if damage == "rename" else _reshape_first_vector, manifest)
        assert main([*check, str(folder)]) == 4, folder
        text = capsys.readouterr().out
        expect = {"rename": ["missing tensor '", "unexpected tensor '"], "shape": ["has shape [3], expected"],
                  "truncate": ["model.safetensors: sha256 differs"]}[damage]
        assert all(e in text for e in expect) and "DAMAGED" in text, text


# --- resume honesty: settings that move the data position refuse --------------------------------------
def test_resume_refuses_a_changed_data_order(tiny_target, tmp_path):
    out = tmp_path / "r"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2))
    # the seed pins the permutation of every epoch: another one would repeat some rows and skip others
    with pytest.raises(TrainingError, match=r"step-00000002 was written with seed=0.*this run has seed=7"):
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2, seed=7))
    with pytest.raises(TrainingError, match=r"step-00000002 was written with world_size=1, batch_size=4"):
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2, batch_size=8))
    result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2))
    assert result.resumed_from.name == "step-00000002" and result.steps == 4


def test_resume_records_a_changed_precision(tiny_target, tmp_path):
    out = tmp_path / "p"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, save_every=2, mixed_precision="auto"))
    result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2, mixed_precision="no"))
    assert result.metrics["resume_changes"]["mixed_precision"] == {"checkpoint": "auto", "now": "no"}


# --- errors name the file -----------------------------------------------------------------------------
def test_more_errors_name_the_file(tiny_target, deep_target, tmp_path):
    from test_integrity import _rename_export, _rewrite

    from draftsmith.config import read_yaml
    from draftsmith.errors import ArtifactError, ConfigError
    load_eagle, load_medusa = _find("load_eagle", *EAGLE_MODEL), _find("load_medusa", *MEDUSA_MODEL)

    (tmp_path / "c.yaml").write_bytes(b"kind: medusa\nnum_heads: \xff\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8 text \(byte 24\)"):
        read_yaml(tmp_path / "c.yaml")
    med = make_medusa_artifact(tiny_target, tmp_path / "m")
    cfg = json.loads((med / "config.json").read_text())
    (med / "config.json").write_text(json.dumps({**cfg, "num_heads": "three"}))
    with pytest.raises(ConfigError,
                       match=r"m/config\.json: field 'num_heads' is 'three', expected an int in \[1, 16\]"):
        load_medusa(med, tiny_target)
    (med / "config.json").write_text(json.dumps(cfg))
    # a renamed tensor whose checksum was recorded again: the load names the weights and the config
    _rewrite(med / "model.safetensors", _rename_export, "manifest.json")
    with pytest.raises(ArtifactError, match=r"m/model\.safetensors: does not fit the module \S+m/config\.json "
                                            r"describes \(Missing key"):
        load_medusa(med, tiny_target)
    eagle = _eagle_artifact(deep_target, tmp_path / "e")
    _rewrite(eagle / "model.safetensors", _rename_export, "manifest.json")
    with pytest.raises(ArtifactError, match=r"e/model\.safetensors: does not fit the module"):
        load_eagle(eagle, deep_target)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OutputError, match=r"file/sub: cannot be written, \S+file is a file, not a folder"):
        export_artifact(make_medusa_artifact(tiny_target, tmp_path / "m2"), "vllm", tmp_path / "file" / "sub",
                        tiny_target)
    assert (tmp_path / "file").read_text() == "mine"


def test_a_garbled_current_pointer_is_a_recorded_error(tiny_target, tmp_path):
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.run import EXIT_ERROR, EXIT_OK, retrain_once

    cfg = RetrainConfig(registry=str(tmp_path / "reg"), target=str(tiny_target.folder))
    code, record = retrain_once(cfg, init=str(make_medusa_artifact(tiny_target, tmp_path / "m")))
    assert code == EXIT_OK
    pointer = Path(record["registry"]) / "current.json"
    pointer.write_text('{"version": ')  # torn by hand: the registry writes it atomically
    code, record = retrain_once(cfg)
    assert code == EXIT_ERROR and record["error"].startswith(f"{pointer}: not valid JSON") and record["current"] is None
    assert json.loads(Path(record["record_path"]).read_text())["error"] == record["error"]


def test_a_bench_refuses_a_users_folder(tmp_path):
    from draftsmith.benchmark.run import Bench, BenchConfig

    mine = users_folder(tmp_path / "mine")
    (mine / "summary.md").write_text("my own summary")
    before = snapshot(mine)
    with pytest.raises(OutputError, match=r"mine already exists and is not a draftsmith bench folder"):
        Bench(BenchConfig(target="tiny"), "quick", mine, progress=False)
    assert snapshot(mine) == before
    Bench(BenchConfig(target="tiny"), "quick", tmp_path / "new", progress=False)  # a new folder is fine


def test_a_really_held_lock_exits_12_and_touches_nothing(tiny_target, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.locks import RunLock
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.run import EXIT_LOCKED, retrain_once

    cfg = RetrainConfig(registry=str(tmp_path / "reg"), target=str(tiny_target.folder))
    _, record = retrain_once(cfg, init=str(make_medusa_artifact(tiny_target, tmp_path / "m")))
    base = Path(record["registry"])
    before = snapshot(base)
    with RunLock(base / ".lock"):  # a live run holds it (a flock: another open file is refused)
        capsys.readouterr()
        rc = main(["retrain", "--init", str(tmp_path / "m"), f"registry={tmp_path / 'reg'}",
                   f"target={tiny_target.folder}"])
        err = capsys.readouterr().err
    assert rc == EXIT_LOCKED == 12 and "another retraining run holds" in err and f"pid {os.getpid()}" in err
    after = snapshot(base)
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
    with pytest.raises(SystemExit):
        main(["retrain", "--help"])
    assert "12 another run holds the registry's lock" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["eagle", "draft"])
def test_a_failed_export_of_every_kind_leaves_the_previous_one_byte_identical(tiny_target, deep_target, tmp_path,
                                                                               kind):
    from test_integrity import _rewrite

    from draftsmith.errors import DraftsmithError

    target = deep_target if kind == "eagle" else tiny_target
    make = _eagle_artifact if kind == "eagle" else make_draft_artifact
    stack = "vllm" if kind == "eagle" else "hf"
    served = export_artifact(make(target, tmp_path / "good"), stack, tmp_path / "served", target).out
    before = snapshot(served)
    bad = make(target, tmp_path / "bad")
    _rewrite(bad / "model.safetensors", _rename_first, "manifest.json")  # checksums agree: only structure is wrong
    with pytest.raises(DraftsmithError, match=r"weight|tensor|fit"):
        export_artifact(bad, stack, served, target)
    assert snapshot(served) == before and siblings(served) == []


def test_a_symlink_out_is_refused_and_its_target_kept(tiny_target, tmp_path):
    from test_data import _gen_cfg

    from draftsmith.data import generate_dataset

    mine = users_folder(tmp_path / "mine")
    link = tmp_path / "link"
    link.symlink_to(mine, target_is_directory=True)
    before = snapshot(mine)
    med = make_medusa_artifact(tiny_target, tmp_path / "m")
    for write in (lambda: export_artifact(med, "vllm", link, tiny_target),
                  lambda: generate_dataset(_gen_cfg(tmp_path, ["Hi"], name="link"), tiny_target, progress=False)):
        with pytest.raises(OutputError, match=r"link already exists and is a symlink"):
            write()
    assert link.is_symlink() and snapshot(mine) == before


def test_bad_data_rows_and_damaged_datasets_are_named(tiny_target, tmp_path):
    from test_integrity import make_dataset

    from draftsmith.data import load_distilled
    from draftsmith.errors import DataError
    from draftsmith.retrain.traffic import read_traffic

    logs = tmp_path / "traffic"
    logs.mkdir()
    (logs / "a.jsonl").write_text('{"domain": "chat"}\n{"prompt": " ", "domain": "chat"}\n[1, 2]\n{"prompt": \n'
                                  '{"prompt": "a fine prompt", "domain": "chat", "timestamp": 1763632800}\n')
    sample = read_traffic(logs)
    assert len(sample.rows) == 1 and sample.malformed == 4
    f = logs / "a.jsonl"
    assert sample.bad == [f"{f}:1: missing field 'prompt'", f"{f}:2: empty prompt", f"{f}:3: not a JSON object (list)",
                          f"{f}:4: not valid JSON (Expecting value)"]
    data = make_dataset(tiny_target, tmp_path / "d")
    assert len(load_distilled(data, tiny_target)) == 2
    arrow = next((data / "dataset").glob("*.arrow"))
    whole = arrow.read_bytes()
    arrow.write_bytes(whole[:200])  # torn by a full disk or a killed copy
    with pytest.raises(DataError, match=r"d/dataset: cannot be read, damaged or incomplete"):
        load_distilled(data, tiny_target)
    arrow.write_bytes(whole)
    prov = json.loads((data / "provenance.json").read_text())
    (data / "provenance.json").write_text(json.dumps({**prov, "target": {}}))
    with pytest.raises(DataError, match=r"d/provenance\.json: missing field 'target\.fingerprint'"):
        load_distilled(data, tiny_target)


def test_resume_records_a_changed_job_setting(tiny_target, tmp_path):
    from draftsmith import artifact

    rows = _rows(tiny_target, 10)
    job, art = _job("medusa", tiny_target, rows, tmp_path, 2)
    job.cfg.train.save_every = 2
    train(job, job.cfg.train)
    job, art = _job("medusa", tiny_target, rows, tmp_path, 4)  # the same run, another head weighting
    job.cfg.train.save_every = 2
    job.cfg.decay = 0.5
    result = train(job, job.cfg.train)
    assert result.resumed_from.name == "step-00000002"
    assert result.metrics["resume_changes"] == {"max_steps": {"checkpoint": 2, "now": 4},
                                                "job.decay": {"checkpoint": 0.8, "now": 0.5}}
    manifest = artifact.load_manifest(art)
    assert manifest["config"]["decay"] == 0.5  # the value used from the resume on ...
    assert manifest["metrics"]["resume_changes"]["job.decay"]["checkpoint"] == 0.8  # ... and the one before
