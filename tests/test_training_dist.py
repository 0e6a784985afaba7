"""Several processes on the CPU (gloo), through the user's own entry points (`train_medusa`, `train_eagle`),
as `accelerate launch` runs them on GPUs (tests/_dist_job.py):

- placement: each rank loads its target once, on its own device, never trainable;
- FSDP2 (`fully_shard`, 2 ranks): a Medusa and an EAGLE-3 head reach the losses of 1 process over the same
  global batch (1 rank x 4 rows x grad_accum 2 == 2 ranks x 4 rows), within LOSS_RTOL; no rank's
  optimizer holds the module's full state, and the frozen target is sharded too;
- sharded checkpoints: one rank SIGKILLed mid-run, the run resumes from the last shards with 2 ranks
  and, from the same checkpoint, with 1 process; both end on the uninterrupted losses and write one
  consolidated safetensors artifact.

Marked `dist` (each launch starts Python, torch and transformers: ~10-20 s on 2 cores): `make test-dist`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_dist_job.py"
# float32 sums of the same rows in another order (2 ranks' all-reduce vs 2 accumulated micro-batches)
LOSS_RTOL = 1e-4
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
ROOT = HERE.parent


def preset_env(name: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file configs/accelerate/<name>.yaml` gives its processes.
    On the CPU accelerate launch starts several processes only through mpirun, so the tests start them with
    torchrun and this environment: the preset is what they run."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(ROOT / "configs" / "accelerate" / f"{name}.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


FSDP2 = preset_env("cpu_fsdp2")


def launch(nproc: int, root: Path, out: Path, *args: str, env: dict | None = None, ok: bool = True):
    """Run tests/_dist_job.py train under torchrun (nproc > 1) or plain python; the ranks' DIST records."""
    if nproc > 1 and TORCHRUN is None:
        pytest.skip("torchrun not found")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([*cmd, str(SCRIPT), "train", "--root", str(root), "--out", str(out), *args],
                          env=full_env, capture_output=True, text=True, timeout=180, cwd=HERE)
    if ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    recs = {}
    for line in proc.stdout.splitlines():
        if line.startswith("DIST "):
            rec = json.loads(line[5:])
            recs[rec["rank"]] = rec
    return recs, proc


def train_losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in recs if r.get("type") == "train"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from _dist_job import prepare

    root = tmp_path_factory.mktemp("dist")
    prepare(root)
    return root


def test_each_rank_loads_its_target_once_on_its_own_device(root, tmp_path):
    recs, _ = launch(2, root, tmp_path / "ddp", "--job", "medusa", "--steps", "2")
    assert sorted(recs) == [0, 1]
    for rec in recs.values():
        assert rec["world"] == 2 and rec["preset"] == "MULTI_CPU"
        assert rec["loads"] == 1, rec  # built once on this rank
        assert rec["on_own_device"] and len(rec["target_devices"]) == 1, rec  # cuda:LOCAL_RANK on GPUs
        assert not rec["target_grad"] and not rec["target_sharded"]  # frozen, replicated, never wrapped
    assert len({rec["pid"] for rec in recs.values()}) == 2


@pytest.fixture(scope="module")
def one_process(root, tmp_path_factory):
    """The reference: 1 process, 4 rows x grad_accum 2 per step, 6 steps, both heads."""
    out = {}
    for job in ("medusa", "eagle3"):
        o = tmp_path_factory.mktemp(f"one-{job}")
        launch(1, root, o, "--job", job, "--steps", "6", "--grad-accum", "2")
        out[job] = train_losses(o)
    return out


@pytest.mark.parametrize("job", ["eagle3"])
def test_fsdp2_trains_an_eagle3_head_to_the_one_process_losses(root, one_process, tmp_path, job):
    recs, _ = launch(2, root, tmp_path / job, "--job", job, "--steps", "6", env=FSDP2)
    check_fsdp(recs)
    losses = train_losses(tmp_path / job)
    assert losses == pytest.approx(one_process[job], rel=LOSS_RTOL)
    assert (tmp_path / job / "artifact" / "model.safetensors").is_file()


def check_fsdp(recs: dict) -> None:
    assert sorted(recs) == [0, 1]
    for rec in recs.values():
        assert rec["preset"] == "FSDP" and rec["loads"] == 1 and not rec["target_grad"]
        # the trainable module's Adam state (2 tensors per parameter) is split: this rank holds its half
        assert 0 < rec["opt_local_numel"] <= rec["trainable_numel"] + 64, rec
        assert rec["opt_local_numel"] < 2 * rec["trainable_numel"], rec
        # the frozen target's decoder layers are sharded too
        assert rec["target_sharded"] and rec["target_local_numel"] < rec["target_numel"], rec
    assert sum(r["opt_local_numel"] for r in recs.values()) >= 2 * recs[0]["trainable_numel"]


def test_fsdp2_medusa_survives_a_killed_rank_and_resumes_on_two_ranks_and_on_one(root, one_process, tmp_path):
    killed = tmp_path / "killed"
    _, proc = launch(2, root, killed, "--job", "medusa", "--steps", "6", "--save-every", "2", "--die-at-step", "5",
                     env=FSDP2, ok=False)
    assert proc.returncode != 0
    ckpts = sorted(p.name for p in (killed / "run" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step-00000002", "step-00000004"], ckpts
    step4 = killed / "run" / "checkpoints" / "step-00000004"
    # each rank wrote its own shard; rank 0 the index and the loop state; no full model or optimizer file
    assert sorted(p.name for p in (step4 / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (step4 / "model.safetensors").exists() and not (step4 / "optimizer.safetensors").exists()
    assert json.loads((step4 / "state.json").read_text())["format"] == "sharded"

    one = tmp_path / "one"  # the same checkpoint, resumed by 1 process (4 rows x grad_accum 2)
    shutil.copytree(killed, one)
    recs, _ = launch(2, root, killed, "--job", "medusa", "--steps", "6", "--save-every", "2", env=FSDP2)
    check_fsdp(recs)
    assert train_losses(killed) == pytest.approx(one_process["medusa"], rel=LOSS_RTOL)
    launch(1, root, one, "--job", "medusa", "--steps", "6", "--save-every", "2", "--grad-accum", "2")
    assert train_losses(one) == pytest.approx(one_process["medusa"], rel=LOSS_RTOL)
    for out in (killed, one):  # one consolidated safetensors folder, whatever the world size was
        weights = load_file(str(out / "artifact" / "model.safetensors"))
        assert weights and not list((out / "artifact").glob("*.distcp"))
    a = load_file(str(killed / "artifact" / "model.safetensors"))
    b = load_file(str(one / "artifact" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() < 1e-4, k


def test_a_tampered_shard_index_is_refused_before_it_is_unpickled(root, tmp_path):
    from draftsmith.errors import TrainingError
    from draftsmith.training.sharded import load_sharded

    ck = tmp_path / "ck"
    (ck / "shards").mkdir(parents=True)
    (ck / "shards" / ".metadata").write_bytes(b"not what was written")
    (ck / "state.json").write_text(json.dumps({"metadata_sha256": "0" * 64}))
    with pytest.raises(TrainingError, match="sha256 mismatch"):
        load_sharded(ck, None, None)
