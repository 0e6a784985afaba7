"""Never destroy what a user owns, never give a silently wrong result: output folders are replaced only when
they are draftsmith outputs of the same kind, a failed export leaves the previous one byte-identical, a
changed byte in any weight file is caught by every reader, `draftsmith check` fails on a damaged artifact
or export, resume skips a damaged checkpoint and is honest about changed settings, training skips and logs
what it cannot learn from, retraining keeps its replay data, errors name the file, and an evaluation on a
busy machine says its speedups are not valid. Every test here failed on the code before these guarantees."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _train_job import NextTokenJob
from safetensors.torch import load_file, save_file
from test_export import make_draft_artifact, make_medusa_artifact

from draftsmith import artifact
from draftsmith.checksums import sha256_file, weight_checksums
from draftsmith.errors import (
    ArtifactError,
    ConfigError,
    DataError,
    IntegrityError,
    OutputError,
    TrainingError,
)
from draftsmith.export.api import export_artifact, import_export, verify_export
from draftsmith.layouts.verify import VerificationError
from draftsmith.outputs import atomic_dir
from draftsmith.training import TrainConfig, train
from draftsmith.training import checkpoint as ckpt


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def users_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("my own notes")
    return path


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.fixture(scope="module")
def medusa(tiny_target, tmp_path_factory):
    return make_medusa_artifact(tiny_target, tmp_path_factory.mktemp("integrity") / "medusa")


def make_dataset(target, path: Path) -> Path:
    import datasets

    rows = {"row_id": [0, 1], "domain": ["chat", "code"], "input_ids": [[1, 2, 3], [4, 5, 6]],
            "loss_mask": [[0, 1, 1], [0, 1, 1]]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(path / "dataset"))
    (path / "provenance.json").write_text(json.dumps({
        "target": {"name": "tiny", "spec": "tiny", "fingerprint": target.fingerprint()},
        "counts": {"rows": 2, "per_domain": {"chat": 1, "code": 1}}}))
    return path


# --- output folders ---------------------------------------------------------------------------------
def test_every_writer_leaves_a_users_folder_alone(tiny_target, medusa, tmp_path, capsys):
    from test_data import PROMPTS, _gen_cfg

    from draftsmith.cli import main
    from draftsmith.data import generate_dataset
    from draftsmith.data.commands import subset_dataset

    mine = users_folder(tmp_path / "mine")
    before = snapshot(mine)
    draft = make_draft_artifact(tiny_target, tmp_path / "draft")
    export = export_artifact(medusa, "vllm", tmp_path / "export", tiny_target).out
    dataset = make_dataset(tiny_target, tmp_path / "data")
    _, state = artifact.load_artifact(medusa)
    writers = {
        "export heads": lambda: export_artifact(medusa, "vllm", mine, tiny_target),
        "export draft": lambda: export_artifact(draft, "hf", mine, tiny_target),
        "save artifact": lambda: artifact.save_artifact(mine, artifact.make_manifest("medusa", {}, {}), state),
        "import export": lambda: import_export(export, mine),
        "data subset": lambda: subset_dataset(dataset, mine, domains=["chat"]),
        "data generate": lambda: generate_dataset(_gen_cfg(tmp_path, PROMPTS[:2], name="mine"), tiny_target,
                                                  progress=False),
    }
    for name, write in writers.items():
        with pytest.raises(OutputError, match=r"mine already exists and is not a draftsmith .*notes\.txt"):
            write()
        assert snapshot(mine) == before, name
    capsys.readouterr()
    rc = main(["export", "--artifact", str(medusa), "--to", "vllm", "--out", str(mine),
               "--target", str(tiny_target.folder)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "--overwrite" in errors[0]
    # another kind of draftsmith output is not replaced either, and a file is not a folder
    with pytest.raises(OutputError, match="a draftsmith artifact, not an export"):
        export_artifact(medusa, "vllm", draft, tiny_target)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        export_artifact(medusa, "vllm", tmp_path / "file.txt", tiny_target)
    with pytest.raises(DataError, match="would replace the dataset it is taken from"):
        subset_dataset(dataset, dataset, domains=["chat"])
    assert snapshot(mine) == before and siblings(mine) == []
    # its own kind is replaced; --overwrite is the user saying they mean it
    export_artifact(medusa, "trtllm", export, tiny_target)
    assert json.loads((export / "draftsmith.json").read_text())["stack"] == "trtllm"
    export_artifact(medusa, "vllm", mine, tiny_target, overwrite=True)
    assert not (mine / "notes.txt").exists() and siblings(mine) == []


def test_a_job_refuses_a_users_output_folder_before_training(tiny_target, tmp_path):
    from test_medusa_job import self_distilled_rows

    from draftsmith.medusa.job import MedusaJob, MedusaJobConfig

    mine = users_folder(tmp_path / "mine")
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(mine), num_heads=2, num_layers=1,
                          train=TrainConfig(max_steps=1, batch_size=4, output_dir=str(tmp_path / "run"),
                                            progress=False))
    cfg.evaluate.enabled = False
    with pytest.raises(OutputError, match="mine already exists"):
        train(MedusaJob(cfg, tiny_target, self_distilled_rows(tiny_target, n=8)), cfg.train)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


def test_a_failed_export_leaves_the_previous_export_byte_identical(tiny_target, medusa, tmp_path):
    out = export_artifact(medusa, "vllm", tmp_path / "served", tiny_target).out
    before = snapshot(out)
    bad = make_medusa_artifact(tiny_target, tmp_path / "bad", heads=3)
    (bad / "tree.json").write_text(json.dumps({"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    # the tree is refused as the artifact is read (medusa/model.py tree_problem), before anything is written
    with pytest.raises(ConfigError, match=r"bad/tree\.json: a path of depth 4, but the artifact has 3 heads"):
        export_artifact(bad, "vllm", out, tiny_target)
    assert snapshot(out) == before and siblings(out) == []


def test_an_interrupted_write_is_tidied_on_the_next_one(tmp_path):
    out = tmp_path / "a"
    out.mkdir()
    (out / "draftsmith.json").write_text(json.dumps({"format": "x", "stack": "vllm", "target": {}}))
    dead = 2 ** 22 + 12345  # above the default pid_max: no live process has this pid
    (tmp_path / f".a.tmp-{dead}-xyz").mkdir()  # a killed write's temporary folder
    os.replace(out, tmp_path / f".a.old-{dead}")  # killed between the two renames of a swap
    with atomic_dir(out, kind="export") as tmp:
        (tmp / "draftsmith.json").write_text(json.dumps({"format": "y", "stack": "vllm", "target": {}}))
    assert json.loads((out / "draftsmith.json").read_text())["format"] == "y"
    assert siblings(out) == []


# --- checksums --------------------------------------------------------------------------------------
def test_a_flipped_bit_is_caught_by_every_reader(tiny_target, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.distill.proposer import DraftProposer
    from draftsmith.medusa.model import load_medusa

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    good_export = export_artifact(art, "vllm", tmp_path / "v", tiny_target).out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["checksums"] == {"model.safetensors": sha256_file(art / "model.safetensors")}
    assert json.loads((good_export / "draftsmith.json").read_text())["checksums"] == weight_checksums(good_export)
    flip_last_byte(art / "model.safetensors")
    named = r"m/model\.safetensors: sha256 differs"
    with pytest.raises(IntegrityError, match=named):
        load_medusa(art, tiny_target)
    with pytest.raises(IntegrityError, match=named):
        export_artifact(art, "vllm", tmp_path / "v2", tiny_target)
    assert not (tmp_path / "v2").exists()
    with pytest.raises(IntegrityError, match=named):  # warm start
        train(NextTokenJob(tiny_target), TrainConfig(max_steps=1, batch_size=4, output_dir=str(tmp_path / "w"),
                                                     warm_start=str(art), progress=False, loggers=["jsonl"]))
    assert main(["check", "--artifact", str(art), "--target", str(tiny_target.folder)]) == 4
    assert "model.safetensors: sha256 differs" in capsys.readouterr().out

    draft = make_draft_artifact(tiny_target, tmp_path / "d")
    flip_last_byte(draft / "model.safetensors")
    with pytest.raises(IntegrityError, match=r"d/model\.safetensors"):
        DraftProposer.from_path(draft, tiny_target)
    with pytest.raises(IntegrityError, match=r"d/model\.safetensors"):
        export_artifact(draft, "hf", tmp_path / "dx", tiny_target)

    flip_last_byte(good_export / "model.safetensors")
    with pytest.raises(VerificationError, match=r"v/model\.safetensors: sha256 differs"):
        verify_export(good_export)
    with pytest.raises(VerificationError, match=r"v/model\.safetensors"):
        import_export(good_export, tmp_path / "back")
    assert main(["check", "--artifact", str(good_export), "--target", str(tiny_target.folder)]) == 4


# --- draftsmith check -------------------------------------------------------------------------------
def _rewrite(path: Path, edit, manifest: str | None) -> None:
    """Change a weight file and re-record its checksum, so only the structure check can catch it."""
    sd = load_file(path)
    edit(sd)
    save_file(sd, path)
    if manifest is not None:
        m = path.parent / manifest
        data = json.loads(m.read_text())
        data["checksums"][path.name] = sha256_file(path)
        m.write_text(json.dumps(data))


def _rename(sd):
    sd["heads.0.lm_head.weightx"] = sd.pop("heads.0.lm_head.weight")


def _reshape(sd):
    sd["heads.1.blocks.0.linear.bias"] = torch.zeros(3)


def _rename_export(sd):
    name = next(k for k in sd if k.endswith("weight"))
    sd[name + "x"] = sd.pop(name)


def _reshape_export(sd):
    name = next(k for k in sd if k.endswith("bias"))
    sd[name] = torch.zeros(3)


def _poison(sd):
    name = next(k for k, v in sd.items() if v.is_floating_point())
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] = float("nan")


@pytest.mark.parametrize("damage", ["rename", "shape", "truncate", "tree", "nan"])
def test_check_fails_on_a_damaged_artifact_and_export(tiny_target, medusa, tmp_path, capsys, damage):
    import shutil

    from draftsmith.cli import main

    art = Path(shutil.copytree(medusa, tmp_path / "m"))
    out = export_artifact(art, "vllm", tmp_path / "v", tiny_target).out
    check = ["check", "--target", str(tiny_target.folder), "--artifact"]
    assert main([*check, str(art)]) == 0 and main([*check, str(out)]) == 0
    capsys.readouterr()
    if damage == "rename":
        _rewrite(art / "model.safetensors", _rename, "manifest.json")
        _rewrite(out / "model.safetensors", _rename_export, "draftsmith.json")
        expect = ["missing tensor '", "unexpected tensor '"]
    elif damage == "shape":
        _rewrite(art / "model.safetensors", _reshape, "manifest.json")
        _rewrite(out / "model.safetensors", _reshape_export, "draftsmith.json")
        expect = ["has shape [3], expected [64]"]
    elif damage == "truncate":
        for f in (art / "model.safetensors", out / "model.safetensors"):
            f.write_bytes(f.read_bytes()[:-100])
        expect = ["model.safetensors: sha256 differs"]
    elif damage == "nan":
        _rewrite(art / "model.safetensors", _poison, "manifest.json")
        _rewrite(out / "model.safetensors", _poison, "draftsmith.json")
        expect = ["holds non-finite values"]
    else:  # a tree deeper than the heads (3): a stack would index past them
        for f, key in ((art / "tree.json", "paths"), (out / "draftsmith.json", "medusa_choices")):
            data = json.loads(f.read_text())
            data[key] = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
            f.write_text(json.dumps(data))
        expect = ["depth 4"]
    if damage == "tree":
        from draftsmith.errors import ConfigError
        from draftsmith.medusa.model import load_medusa

        with pytest.raises(ConfigError, match=r"tree\.json: a path of depth 4, but the artifact has 3 heads"):
            load_medusa(art, tiny_target)
    for path in (art, out):
        assert main([*check, str(path)]) == 4, path
        text = capsys.readouterr().out
        assert all(e in text for e in expect), text
        assert "DAMAGED" in text


# --- checkpoints ------------------------------------------------------------------------------------
def test_resume_falls_back_past_a_damaged_checkpoint(tiny_target, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = dict(batch_size=4, output_dir=str(out), save_every=2, keep_last=3, eval_every=0, progress=False,
               loggers=["jsonl"], lr=1e-3)
    train(NextTokenJob(tiny_target), TrainConfig(max_steps=4, **cfg))
    names = [p.name for p in ckpt.list_checkpoints(out)]
    assert names == ["step-00000002", "step-00000004"]
    state = json.loads((out / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert set(state["checksums"]) == {"model.safetensors", "optimizer.safetensors", "rng.safetensors",
                                       "optimizer.json", "log.jsonl"}
    f = out / "checkpoints" / "step-00000004" / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # torn
    with pytest.raises(TrainingError, match=r"step-00000004 is damaged: .*optimizer\.safetensors"):
        ckpt.load_checkpoint(out / "checkpoints" / "step-00000004")
    with caplog.at_level("WARNING"):
        result = train(NextTokenJob(tiny_target), TrainConfig(max_steps=6, **cfg))
    assert result.resumed_from.name == "step-00000002"
    assert "step-00000004 is damaged" in caplog.text and "optimizer.safetensors" in caplog.text
    assert "resuming from" in caplog.text and "step-00000002" in caplog.text
    assert result.steps == 6 and not ckpt.checkpoint_problems(out / "checkpoints" / "step-00000004")


def test_a_load_error_names_the_file(tiny_target, medusa, tmp_path):
    import shutil

    from draftsmith.errors import ConfigError
    from draftsmith.medusa.model import load_medusa

    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"manifest\.json: not valid JSON"):
        artifact.load_manifest(tmp_path)
    art = Path(shutil.copytree(medusa, tmp_path / "m"))
    cfg = json.loads((art / "config.json").read_text())
    del cfg["num_heads"]
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"m/config\.json: missing field 'num_heads'"):
        load_medusa(art, tiny_target)


# --- retraining -------------------------------------------------------------------------------------
def test_replay_keeps_all_earlier_traffic_after_three_promotions(tiny_target, tmp_path, monkeypatch):
    import shutil

    import datasets

    from draftsmith.retrain import run as runmod
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.registry import Registry
    from draftsmith.retrain.traffic import TrafficRow

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the data preset path is relative to the repo
    cfg = RetrainConfig(registry=str(tmp_path / "reg"))
    cfg.budget.replay_fraction = 0.75  # 3 old rows per new one: every earlier row fits
    reg = Registry(tmp_path / "reg", "tiny", "medusa")
    old_data = None
    art = make_medusa_artifact(tiny_target, tmp_path / "art", heads=2)
    for round_ in range(1, 5):
        work = reg.staging / f"attempt{round_}"
        fresh = make_dataset(tiny_target, work / "data")
        ds = datasets.load_from_disk(str(fresh / "dataset"))
        ds.map(lambda r, i=round_: {"domain": f"round{i}"}).save_to_disk(str(fresh / "dataset2"))
        shutil.rmtree(fresh / "dataset")
        (fresh / "dataset2").rename(fresh / "dataset")
        rows = [TrafficRow(f"prompt {round_}", f"round{round_}", 0.0)]
        mixed = runmod._build_data(cfg, tiny_target, work, rows, old_data)
        seen = set(datasets.load_from_disk(str(mixed / "dataset"))["domain"])
        assert seen == {f"round{i}" for i in range(1, round_ + 1)}, (round_, seen)
        if round_ == 4:
            break
        candidate = Path(shutil.copytree(art, work / "candidate"))
        artifact.update_manifest(candidate, data={"path": str(mixed)})
        version = runmod.promote(reg, candidate, {"parent": None}, mixed, "better")
        shutil.rmtree(work)  # as a run does after promoting
        old_data = reg.manifest(version)["data"]["path"]
        assert Path(old_data).is_dir() and reg.manifest(version)["data"]["trained_from"] == str(mixed)


def test_a_held_lock_has_its_own_exit_code(tmp_path, monkeypatch, capsys):
    from draftsmith.locks import LockHeld
    from draftsmith.retrain import run as runmod

    def held(cfg, init=None):
        raise LockHeld(f"another retraining run holds {tmp_path / '.lock'} (pid 1)")

    monkeypatch.setattr(runmod, "retrain_once", held)
    assert runmod.run_retrain(None, [f"registry={tmp_path}"]) == runmod.EXIT_LOCKED == 12
    assert "holds" in capsys.readouterr().err


def test_files_for_a_serving_process_follow_the_umask(tiny_target, medusa, tmp_path):
    from draftsmith.outputs import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "current.json", {"version": "v0001"})
        out = export_artifact(medusa, "vllm", tmp_path / "served", tiny_target).out
    finally:
        os.umask(old)
    assert (tmp_path / "current.json").stat().st_mode & 0o777 == 0o644
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}


# --- training: non-finite, empty batches, exploding loss ----------------------------------------------
class EmptyOrExploding(NextTokenJob):
    """The tiny loop job, with chosen micro-batches reported empty (no learned token) or given a huge loss."""

    def __init__(self, target, empty=(), explode=(), **kw):
        super().__init__(target, **kw)
        self.empty, self.explode, self.seen, self.loss_calls = set(empty), set(explode), 0, 0

    def learned_tokens(self, batch):
        self.seen += 1
        return 0 if self.seen - 1 in self.empty else int(batch["input_ids"][:, 1:].numel())

    def loss(self, module, batch):
        loss, metrics = super().loss(module, batch)
        if module.training:
            self.loss_calls += 1
            if self.loss_calls - 1 in self.explode:
                loss = loss * 1e6
        return loss, metrics


def _cfg(out, **kw):
    base = dict(batch_size=4, output_dir=str(out), save_every=0, eval_every=0, log_every=1, progress=False,
                loggers=["jsonl"], lr=1e-3)
    return TrainConfig(**{**base, **kw})


def test_empty_batches_are_skipped_counted_and_logged_as_skipped(tiny_target, tmp_path, caplog):
    job = EmptyOrExploding(tiny_target, empty={1, 2}, explode={10})
    with caplog.at_level("WARNING"):
        result = train(job, _cfg(tmp_path / "e", max_steps=14))
    records = [r for r in result.history if r["type"] == "train"]
    assert [r["loss"] is None for r in records[:3]] == [False, True, True]  # skipped, not 0.0
    assert records[1]["skipped_steps"] == 1 and records[1]["empty_batches"] == 1
    assert result.metrics["empty_batches"] == 2 and job.loss_calls == 12  # never scored
    assert records[12].get("exploding_losses") == 1 and "running median" in caplog.text


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_rows_without_a_learned_token_do_not_make_an_artifact(tiny_target, tmp_path, kind):
    from test_medusa_job import self_distilled_rows

    rows = [{**r, "loss_mask": [0] * len(r["loss_mask"]), "domain": "d"} for r in self_distilled_rows(tiny_target, n=8)]
    train_cfg = TrainConfig(max_steps=2, batch_size=4, output_dir=str(tmp_path / "run"), progress=False,
                            eval_every=0, loggers=["jsonl"])
    if kind == "medusa":
        from draftsmith.medusa.job import MedusaJob, MedusaJobConfig

        cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "art"), num_heads=2,
                              num_layers=1, eval_fraction=0.25, calibration_rows=2, train=train_cfg)
        job = MedusaJob(cfg, tiny_target, rows)
    else:
        from draftsmith.eagle.job import EagleJob, EagleJobConfig

        cfg = EagleJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "art"), version="eagle3",
                             target_layers=[0, 1, 1], ttt_steps=2, draft_vocab_size=64, eval_fraction=0.25,
                             exportable=False, train=train_cfg)  # 2 layers: no stack captures layer 1
        job = EagleJob(cfg, tiny_target, rows)
    with pytest.raises(TrainingError, match=r"no optimizer step .* had no learned token"):
        train(job, cfg.train)
    assert not (tmp_path / "art").exists()


def test_checkpoints_only_from_finite_weights(tiny_target, tmp_path, monkeypatch, caplog):
    from draftsmith.training import loop

    out = tmp_path / "nf"
    real = loop.Trainer.save

    def poisoned_save(self):  # weights that went non-finite without a non-finite loss (e.g. a bad optimizer state)
        if self.step == 4:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")
        return real(self)

    monkeypatch.setattr(loop.Trainer, "save", poisoned_save)
    with caplog.at_level("WARNING"), pytest.raises(TrainingError,
                                                   match=r"non-finite values; last good checkpoint: .*step-00000002"):
        train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2, keep_last=5))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step-00000002"]
    assert "not saving a checkpoint" in caplog.text
    assert not (out / "artifact").exists()
    # a run killed while saving its artifact left a temporary folder: the next run removes it at the start
    dead = 2 ** 22 + 4321
    (out / f".artifact.tmp-{dead}-abc").mkdir()
    monkeypatch.setattr(loop.Trainer, "save", real)
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=0, resume="never"))
    assert siblings(out / "artifact") == [] and (out / "artifact" / "manifest.json").is_file()


# --- resume honesty ---------------------------------------------------------------------------------
def test_resume_applies_a_changed_setting_knowingly_or_refuses(tiny_target, tmp_path, caplog):
    from torch import nn

    out = tmp_path / "r"
    base = dict(save_every=2, keep_last=5, schedule="constant", warmup_steps=0)
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=2, **base))
    with caplog.at_level("WARNING"):
        result = train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, **{**base, "lr": 2e-3}))
    assert result.resumed_from.name == "step-00000002"
    assert result.metrics["resume_changes"]["lr"] == {"checkpoint": 1e-3, "now": 2e-3}
    assert "lr 0.001 -> 0.002" in caplog.text
    lrs = {r["step"]: r["lr"] for r in result.history if r["type"] == "train"}
    assert lrs[1] == lrs[2] == pytest.approx(1e-3) and lrs[3] == lrs[4] == pytest.approx(2e-3)  # the lr used

    class Wider(NextTokenJob):
        def build_module(self):
            m = super().build_module()
            m.extra = nn.Linear(2, 2)
            return m

    with pytest.raises(TrainingError, match=r"step-00000004 holds a module of another shape .*extra"):
        train(Wider(tiny_target), _cfg(out, max_steps=6, **base))
    with pytest.raises(TrainingError, match=r"was trained on data .*32 rows.*36 rows"):
        train(NextTokenJob(tiny_target, n_train=36), _cfg(out, max_steps=6, **base))


# --- errors name the file ---------------------------------------------------------------------------
def test_a_non_utf8_traffic_line_is_a_counted_named_bad_row(tmp_path):
    from draftsmith.retrain.traffic import read_traffic

    logs = tmp_path / "traffic"
    logs.mkdir()
    good = json.dumps({"prompt": "hello there", "domain": "chat", "timestamp": 1763632800}).encode()
    (logs / "a.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "domain": "chat"}\n' + good + b"\n")
    sample = read_traffic(logs)
    assert len(sample.rows) == 2 and sample.malformed == 1
    assert sample.bad == [f"{logs / 'a.jsonl'}:2: not UTF-8 (byte 15)"]
    from draftsmith.evaluation.domains import load_prompts

    (tmp_path / "p.jsonl").write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not UTF-8"):  # evaluation prompts: an error naming the line
        load_prompts([tmp_path / "p.jsonl"])


def test_a_checkpoint_missing_a_field_is_named_and_skipped(tiny_target, tmp_path, caplog):
    out = tmp_path / "c"
    train(NextTokenJob(tiny_target), _cfg(out, max_steps=4, save_every=2, keep_last=5))
    state = out / "checkpoints" / "step-00000004" / "state.json"
    data = json.loads(state.read_text())
    del data["micro"]
    state.write_text(json.dumps(data))
    with pytest.raises(TrainingError, match=r"step-00000004/state\.json: missing field 'micro'"):
        ckpt.load_checkpoint(state.parent)
    with caplog.at_level("WARNING"):
        assert ckpt.resolve_resume("auto", out).name == "step-00000002"
    assert "missing field 'micro'" in caplog.text
    (out / "checkpoints" / "step-00000002" / "state.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(TrainingError, match=r"step-00000002/state\.json: unreadable"):
        ckpt.load_checkpoint(out / "checkpoints" / "step-00000002")


def test_check_on_a_corrupt_guard_is_one_line_naming_it(tiny_target, medusa, tmp_path, capsys):
    from draftsmith.cli import main

    out = export_artifact(medusa, "vllm", tmp_path / "v", tiny_target).out
    (out / "draftsmith.json").write_text('{"target": ')
    capsys.readouterr()
    assert main(["check", "--artifact", str(out), "--target", str(tiny_target.folder)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "draftsmith.json: not valid JSON" in errors[0], errors


# --- evaluation under contention --------------------------------------------------------------------
def test_an_evaluation_on_a_busy_machine_says_its_speedups_are_not_valid(tiny_target, tmp_path, monkeypatch):
    from draftsmith.decoding import cost
    from draftsmith.evaluation.commands import summary_line
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import render_markdown

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "chat", "turns": ["Say hi."]}) + "\n")
    kw = dict(prompts=[str(prompts)], max_new_tokens=4, k=2, cost_model=False)
    quiet = evaluate(tiny_target, "ngram", **kw)
    clock = {"busy": 0.0, "total": 0.0}

    def busy_machine():  # every read: 10 more core-seconds, all of them busy (others, not us)
        clock["busy"] += 10.0
        clock["total"] += 10.0
        return clock["busy"], clock["total"]

    monkeypatch.setattr(cost, "_machine_cpu_s", busy_machine)
    busy = evaluate(tiny_target, "ngram", **kw)
    assert quiet["contention"]["speedups_valid"] in (True, False)  # measured for real: whatever the machine is
    c = busy["contention"]
    from draftsmith.evaluation.report import write_report

    users = users_folder(tmp_path / "mine")
    (users / "report.md").write_text("my own report")
    with pytest.raises(OutputError, match=r"report\.md exists and is not from a draftsmith evaluation"):
        write_report(busy, users)
    assert (users / "report.md").read_text() == "my own report"
    write_report(busy, tmp_path / "r")
    write_report(quiet, tmp_path / "r")  # its own report is rewritten
    assert c["speedups_valid"] is False and c["other_cpu_share"] > cost.BUSY_SHARE
    assert "Speedups are not valid" in render_markdown(busy)
    assert "SPEEDUPS NOT VALID" in summary_line(busy) and "not valid" in c["note"]


def test_retrain_init_verifies_what_it_publishes(tiny_target, tmp_path):
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.registry import Registry
    from draftsmith.retrain.run import EXIT_ERROR, EXIT_OK, retrain_once

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    flip_last_byte(art / "model.safetensors")
    cfg = RetrainConfig(registry=str(tmp_path / "reg"), target=str(tiny_target.folder))
    code, record = retrain_once(cfg, init=str(art))
    assert code == EXIT_ERROR and "model.safetensors: sha256 differs" in record["error"]
    base = Path(record["registry"])
    reg = Registry(base.parent.parent, base.parent.name, "medusa")
    assert reg.versions() == [] and reg.current() is None
    good = make_medusa_artifact(tiny_target, tmp_path / "good")
    old = os.umask(0o022)
    try:
        code, record = retrain_once(cfg, init=str(good))
    finally:
        os.umask(old)
    assert code == EXIT_OK and reg.current() == "v0001"
    assert (base / "current.json").stat().st_mode & 0o044  # readable by the serving process's group
