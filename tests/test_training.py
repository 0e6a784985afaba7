"""The one training loop on a tiny real job (MLP head on a tiny Llama's features, tests/_train_job.py):
resume after SIGKILL equals an uninterrupted run, atomic checkpoints, keep-last-N, NaN handling,
warm start, gradient-accumulation equivalence, config validation and the schedule."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _train_job import NextTokenJob  # noqa: E402
from safetensors.torch import load_file

from draftsmith.config import from_dict  # noqa: E402
from draftsmith.errors import ConfigError, TrainingError  # noqa: E402
from draftsmith.training import TrainConfig, train  # noqa: E402
from draftsmith.training import checkpoint as ckpt  # noqa: E402
from draftsmith.training.loop import lr_factor, param_groups  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "_train_job.py"


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(lr=3e-3, max_steps=12, save_every=4, batch_size=4, log_every=2, eval_every=4, keep_last=2,
                warmup_steps=2, output_dir=str(out), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)


# ---- config & schedule ----------------------------------------------------------------------------

def test_config_validation(monkeypatch):
    with pytest.raises(ConfigError, match="train.lr"):
        from_dict(TrainConfig, {"lr": 0}, "train")
    with pytest.raises(ConfigError, match="grad_accum"):
        from_dict(TrainConfig, {"grad_accum": 0}, "train")
    with pytest.raises(ConfigError, match="schedule"):
        from_dict(TrainConfig, {"schedule": "exp"}, "train")
    with pytest.raises(ConfigError, match="logger"):
        from_dict(TrainConfig, {"loggers": ["neptune"]}, "train")
    c = from_dict(TrainConfig, {"lr": "2e-4", "betas": [0.9, 0.95], "loggers": ["tensorboard"]}, "train")
    assert c.lr == 2e-4 and c.betas == (0.9, 0.95) and c.loggers[0] == "jsonl"
    assert c.resolved_mixed_precision() in ("no", "bf16")
    if not torch.cuda.is_available():
        from draftsmith.targets import precision

        monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
        assert c.resolved_mixed_precision() == "no"
        monkeypatch.setattr(precision, "cpu_native_bf16", lambda: True)
        assert c.resolved_mixed_precision() == "bf16"


def test_lr_schedule():
    f = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[2] == pytest.approx(1.0)  # decay starts after warmup
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, 2, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(7, 10, 0, "constant", 0.0) == 1.0
    assert lr_factor(5, 10, 0, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_param_groups_decay_and_lr_scales():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    m[1].requires_grad_(False)
    plain = param_groups(m, 0.1)  # decay matrices, not biases; frozen parameters in no group
    assert [(g["weight_decay"], g["lr_scale"], len(g["params"])) for g in plain] == [(0.1, 1.0, 1), (0.0, 1.0, 1)]
    m[1].requires_grad_(True)
    scaled = param_groups(m, 0.1, lambda name: 0.5 if name.startswith("1.") else 1.0)
    assert [(g["weight_decay"], g["lr_scale"]) for g in scaled] == [(0.1, 1.0), (0.0, 1.0), (0.1, 0.5), (0.0, 0.5)]
    assert scaled[2]["params"][0] is m[1].weight and scaled[3]["params"][0] is m[1].bias


def test_state_flatten_roundtrip():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))], lr=0.1)
    opt.zero_grad()
    sum(p.sum() for g in opt.param_groups for p in g["params"]).backward()
    opt.step()
    sd = opt.state_dict()
    skel, tensors = ckpt.flatten_state(sd)
    back = ckpt.unflatten_state(skel, tensors)
    assert back["param_groups"] == sd["param_groups"]
    for pid, st in sd["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(back["state"][pid][k], v)


# ---- end-to-end runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory):
    """An uninterrupted 12-step run (checkpoints at 4, 8, 12)."""
    out = tmp_path_factory.mktemp("ref")
    # the resumed run is a subprocess with OMP_NUM_THREADS=1: the same thread count gives the same
    # reduction order, so the comparison below can be exact to 1e-6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(NextTokenJob(tiny_target), cfg_for(out))
    finally:
        torch.set_num_threads(threads)
    return out, result


def test_uninterrupted_run(reference):
    out, result = reference
    assert result.steps == 12 and result.artifact == out / "artifact"
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step-00000008", "step-00000012"]  # keep_last=2
    kinds = [r["type"] for r in result.history]
    assert kinds.count("eval") == 3 and kinds[-1] == "summary"
    assert result.metrics["nonfinite_steps"] == 0 and math.isfinite(result.metrics["eval/loss"])
    first, last = result.history[0], [r for r in result.history if r["type"] == "train"][-1]
    assert last["loss"] < first["loss"]  # it learns something
    assert (out / "tensorboard").is_dir() is False  # only asked loggers run (jsonl here)
    assert_same_weights(weights(out / "artifact"), weights(out / "checkpoints" / "step-00000012"))


def test_resume_after_sigkill_matches_uninterrupted(reference, tmp_path):
    """THE test: kill -9 a run after its first checkpoint, resume=auto, same weights and metrics."""
    ref_out, ref = reference
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--sleep", "0.15"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "checkpoints" / "step-00000004" / "state.json").exists():
        if proc.poll() is not None:
            pytest.fail(f"training subprocess ended early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [p.name for p in ckpt.list_checkpoints(out)]
    assert done and "step-00000012" not in done and not (out / "artifact").exists()
    killed_at = ckpt.load_checkpoint(ckpt.list_checkpoints(out)[-1]).state["step"]
    # resume in a fresh process, like a user rerunning the command
    subprocess.run(cmd[:-2], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = ckpt.read_log(out / "log.jsonl")
    summary = log[-1]
    assert summary["type"] == "summary" and summary["resumed_from"].endswith(f"step-{killed_at:08d}")
    assert summary["steps_this_run"] == 12 - killed_at
    # its training time counts the killed run's steps (0.15 s of sleep each) too, not only this run's
    assert summary["train_seconds"] >= killed_at * 0.15 and summary["train_seconds"] > summary["wall_s"]
    assert_same_weights(weights(out / "artifact"), weights(ref_out / "artifact"))
    for k in ("eval/loss", "eval/top1", "train/loss", "train/top1"):
        assert summary[k] == pytest.approx(ref.metrics[k], rel=1e-5, abs=1e-6), k
    # the log of the resumed run is the uninterrupted log (timings aside)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s",)}  # noqa: E731
                        for r in rs if r["type"] != "summary"]
    got, want = strip(log), strip(ref.history)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            if isinstance(g[k], str):
                assert g[k] == w[k]
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (g, w)


def test_trackers_resume_into_one_run(tmp_path, monkeypatch):
    """kill -9 a run after a checkpoint and resume it: its MLflow run (the run id kept in the checkpoint) and its
    TensorBoard run each hold both halves as one run, every step once in TensorBoard (the writer purges what the
    killed job logged after the checkpoint it resumes from)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    uri = f"file://{tmp_path / 'mlruns'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--loggers", "jsonl,tensorboard,mlflow", "--log-every", "1"]
    proc = subprocess.Popen([*cmd, "--sleep", "0.3"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:  # a checkpoint, and a step logged after it
        if proc.poll() is not None:
            pytest.fail(f"training subprocess ended early: {proc.stderr.read().decode()[-2000:]}")
        if ((out / "checkpoints" / "step-00000004" / "state.json").exists() and '"step": 5' in
                (out / "log.jsonl").read_text()):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = ckpt.load_checkpoint(ckpt.list_checkpoints(out)[-1]).state
    assert first["step"] < 12 and first["trackers"]["mlflow_run_id"]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = ckpt.load_checkpoint(ckpt.list_checkpoints(out)[-1]).state
    assert last["step"] == 12 and last["trackers"] == first["trackers"]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store for the test; users point at a server
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [first["trackers"]["mlflow_run_id"]]
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    assert steps == set(range(1, 13))  # both halves in the one run
    assert runs[0].data.params["lr"] == "0.003"  # the configuration, stored once

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tb = [e.step for e in acc.Scalars("train/loss")]
    assert tb == list(range(1, 13)), tb  # each step once, in order


def test_checkpoint_atomicity_and_keep_last(reference, tmp_path):
    out, _ = reference
    # a save killed half-way leaves only a dot-temp dir: never listed, cleaned on the next start
    root = ckpt.checkpoints_root(out)
    torn = root / ".step-00000016.tmp-abc"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    half = root / "step-00000020"  # even a dir under a final name without state.json is not "complete"
    half.mkdir()
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step-00000008", "step-00000012"]
    assert ckpt.list_checkpoints(out)[-1].name == "step-00000012"
    assert torn in ckpt.clean_temp(out) and not torn.exists()
    half.rmdir()
    # every listed checkpoint loads completely
    for p in ckpt.list_checkpoints(out):
        loaded = ckpt.load_checkpoint(p)
        assert loaded.state["step"] == int(p.name[5:]) and loaded.model and loaded.optimizer["state"]
    # keep-last prunes the oldest
    ckpt.prune(out, 1)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step-00000012"]


def test_resume_after_finish_is_idempotent(tiny_target, tmp_path):
    out = tmp_path / "r"
    first = train(NextTokenJob(tiny_target), cfg_for(out, max_steps=4, eval_every=0))
    again = train(NextTokenJob(tiny_target), cfg_for(out, max_steps=4, eval_every=0))
    assert again.resumed_from.name == "step-00000004"
    assert_same_weights(weights(first.artifact), weights(again.artifact), atol=0)
    assert again.metrics["eval/loss"] == pytest.approx(first.metrics["eval/loss"])


def test_nan_steps_skipped_and_counted(tiny_target, tmp_path):
    job = NextTokenJob(tiny_target, nan_calls={2, 5})
    result = train(job, cfg_for(tmp_path / "nan", max_steps=8, save_every=0))
    assert result.metrics["nonfinite_steps"] == 2
    assert all(torch.isfinite(v).all() for v in result.module.state_dict().values())
    assert math.isfinite(result.metrics["eval/loss"])


def test_nan_skip_leaves_weights_untouched(tiny_target, tmp_path):
    """A skipped step applies no update at all (AdamW momentum included)."""
    clean = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "a", max_steps=2, save_every=0, eval_every=0))
    nan_last = train(NextTokenJob(tiny_target, nan_calls={2}),
                     cfg_for(tmp_path / "b", max_steps=3, save_every=0, eval_every=0))
    assert nan_last.metrics["nonfinite_steps"] == 1
    assert_same_weights(clean.module.state_dict(), nan_last.module.state_dict(), atol=0)


def test_too_many_nans_raise_and_keep_last_good_checkpoint(tiny_target, tmp_path):
    out = tmp_path / "boom"
    job = NextTokenJob(tiny_target, nan_calls=set(range(4, 100)))
    with pytest.raises(TrainingError, match="3 non-finite .* in a row at step 7.*step-00000006"):
        train(job, cfg_for(out, max_steps=12, save_every=2, keep_last=5, max_nonfinite_in_row=3))
    names = [p.name for p in ckpt.list_checkpoints(out)]
    assert names == ["step-00000002", "step-00000004", "step-00000006"]  # step 6 was all-skipped: same weights
    good = ckpt.load_checkpoint(out / "checkpoints" / "step-00000004")
    assert all(torch.isfinite(v).all() for v in good.model.values())
    assert_same_weights(good.model, ckpt.load_checkpoint(out / "checkpoints" / "step-00000006").model, atol=0)
    assert not (out / "artifact").exists()


def test_warm_start(tiny_target, reference, tmp_path):
    ref_out, ref = reference
    job = NextTokenJob(tiny_target)
    # zero steps of learning rate ~0: the module starts from (and stays at) the artifact's weights
    result = train(job, cfg_for(tmp_path / "ws", max_steps=1, save_every=0, lr=1e-12, warmup_steps=0,
                                warm_start=str(ref_out / "artifact"), schedule="constant"))
    assert_same_weights(weights(result.artifact), weights(ref_out / "artifact"), atol=1e-7)
    assert result.metrics["eval/loss"] == pytest.approx(ref.metrics["eval/loss"], rel=1e-5)
    fresh = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "fresh", max_steps=1, save_every=0, lr=1e-12,
                                                      warmup_steps=0, schedule="constant"))
    assert fresh.metrics["eval/loss"] != pytest.approx(ref.metrics["eval/loss"], rel=1e-5)
    with pytest.raises(Exception, match="artifact"):
        train(NextTokenJob(tiny_target), cfg_for(tmp_path / "bad", max_steps=1, warm_start=str(tmp_path)))


def test_grad_accum_equivalence(tiny_target, tmp_path):
    """accum 2 x batch 2 == batch 4 (same rows per step, equal-length rows, mean losses)."""
    common = dict(max_steps=6, save_every=0, eval_every=0, max_grad_norm=None)
    a = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "a", batch_size=4, grad_accum=1, **common))
    b = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "b", batch_size=2, grad_accum=2, **common))
    assert_same_weights(a.module.state_dict(), b.module.state_dict(), atol=1e-5)
    assert a.metrics["eval/loss"] == pytest.approx(b.metrics["eval/loss"], rel=1e-5)
    c = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "c", batch_size=2, grad_accum=1, **common))
    assert (c.module.state_dict()["out.weight"] - a.module.state_dict()["out.weight"]).abs().max() > 1e-5


def test_bf16_autocast_on_the_cpu(tiny_target, tmp_path):
    """mixed_precision bf16 on the CPU (what `auto` picks on a CPU with AVX512-BF16): the loop runs under
    autocast, the trained weights stay float32 (master weights), and the frozen target keeps its dtype."""
    common = dict(max_steps=6, save_every=0, eval_every=0)
    fp = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "fp", mixed_precision="no", **common))
    bf = train(NextTokenJob(tiny_target), cfg_for(tmp_path / "bf", mixed_precision="bf16", **common))
    assert bf.metrics["train/loss"] == bf.metrics["train/loss"]  # finite, not NaN
    assert all(p.dtype == torch.float32 for p in bf.module.parameters())
    assert tiny_target.dtype == torch.float32
    a, b = fp.module.state_dict()["out.weight"], bf.module.state_dict()["out.weight"]
    assert not torch.equal(a, b)  # bf16 products: not the float32 run ...
    assert (a - b).abs().max() < 0.05 * a.abs().max()  # ... but close to it
