"""Where a rank loads its target, as pure functions of the launcher's environment (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import ConfigError
from draftsmith.targets.device import local_cuda_device, select_device
from draftsmith.training.launch import target_device, target_dtype


def test_each_rank_of_a_launcher_gets_its_own_gpu():
    assert [local_cuda_device(str(r), 8) for r in range(8)] == [torch.device("cuda", r) for r in range(8)]
    assert local_cuda_device(None, 8) == torch.device("cuda")  # no launcher: the current device
    assert local_cuda_device("-1", 2) == torch.device("cuda")
    with pytest.raises(ConfigError, match="LOCAL_RANK=8 but this node has 8 CUDA device"):
        local_cuda_device("8", 8)


def test_a_bare_cuda_means_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert select_device("cuda") == torch.device("cuda", 5)
    assert select_device("cuda:1") == torch.device("cuda", 1)  # an explicit index stands
    assert select_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert select_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("kind", ["NO", "MULTI_GPU", "MULTI_CPU", "ZERO1", "ZERO2"])
def test_replicating_presets_load_the_target_on_the_ranks_device(kind):
    assert target_device(kind, torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert target_dtype(kind, "cuda:3", "bf16") is None  # the loader's own choice (bf16 on such a GPU)


@pytest.mark.parametrize("kind", ["FSDP", "ZERO3"])
def test_sharding_presets_load_the_target_on_the_cpu_in_the_gpus_dtype(kind):
    assert target_device(kind, torch.device("cuda", 3)) == torch.device("cpu")
    assert target_dtype(kind, "cuda:3", "bf16") == torch.bfloat16
    assert target_dtype(kind, "cuda:3", "no") is None
    assert target_dtype(kind, "cpu", "bf16") is None  # on a CPU-only run the CPU computes too


def test_the_launcher_script_is_draftsmith_train(monkeypatch, capsys, tmp_path):
    """scripts/train.py, the file `accelerate launch` and `torchrun` start, runs `draftsmith train METHOD` as
    it is: the method, its preset and the overrides reach the one runner unchanged."""
    import runpy
    import sys
    from pathlib import Path

    from draftsmith.runner import train as runner

    seen = {}

    def fake_run(method, cfg, **kw):
        seen.update(method=method.name, cfg=cfg, **kw)
        return runner.RunResult(tmp_path / "artifact")

    monkeypatch.setattr(runner, "run", fake_run)
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "train.py")
    monkeypatch.setattr(sys, "argv", [script, "medusa", "train.max_steps=7", "--init-only"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(script, run_name="__main__")
    assert done.value.code == 0
    assert seen["method"] == "medusa" and seen["init_only"] is True
    assert seen["cfg"].train.max_steps == 7  # the method's default preset, overridden
    assert f"artifact: {tmp_path / 'artifact'}" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [script, "no-such-method"])
    with pytest.raises(SystemExit) as refused:
        runpy.run_path(script, run_name="__main__")
    assert refused.value.code == 2  # argparse: not a registered method
