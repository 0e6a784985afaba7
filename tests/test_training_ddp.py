"""A real 2-process run over gloo (`torchrun --nproc_per_node 2`, accelerate MULTI_CPU): both ranks end
with identical weights, and only rank 0 writes files (checked with a Python audit hook on every rank)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "_train_job.py"


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None and
                    shutil.which("torchrun") is None, reason="torchrun not found")
def test_two_process_gloo_run(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    audit = tmp_path / "audit"  # each rank's record in a file of its own: their stdout lines interleave
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out),
                           "--audit", str(audit), "--max-steps", "8"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    audits = {}
    for path in sorted(audit.glob("rank-*.json")):
        rec = json.loads(path.read_text())
        audits[rec["rank"]] = rec
    assert sorted(audits) == [0, 1] and {a["world"] for a in audits.values()} == {2}
    assert audits[0]["weights"] == audits[1]["weights"]  # DDP kept the replicas in lock-step
    assert audits[0]["metrics"] == audits[1]["metrics"]  # all-reduced metrics agree
    assert audits[1]["events"] == []  # rank 1 created, opened for writing, renamed or deleted nothing
    assert any("checkpoints/.step-00000008" in e for e in audits[0]["events"])
    assert (out / "artifact" / "model.safetensors").is_file()
    state = json.loads((out / "checkpoints" / "step-00000008" / "state.json").read_text())
    assert state["world_size"] == 2 and len(state["rng"]) == 2  # per-rank RNG gathered to rank 0
