"""Every accelerate preset and DeepSpeed JSON under configs/ loads through accelerate's own config classes
and plugins (the launch path `accelerate launch --config_file` takes), even though they need GPUs to run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
EXPECTED = {
    "single_cpu": "NO", "single_gpu": "NO", "multi_gpu_ddp": "MULTI_GPU", "fsdp": "FSDP",
    "deepspeed_zero2": "DEEPSPEED", "deepspeed_zero3": "DEEPSPEED", "two_node_ddp": "MULTI_GPU",
    "cpu_ddp": "MULTI_CPU", "cpu_fsdp2": "FSDP", "cpu_zero2": "DEEPSPEED", "cpu_zero3": "DEEPSPEED",
}


def test_all_presets_present():
    assert {p.stem for p in PRESETS} >= set(EXPECTED)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_with_accelerate(preset, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.chdir(ROOT)  # DeepSpeed JSON paths are relative to the launch directory
    cfg = ClusterConfig.from_yaml_file(str(preset))  # unknown keys / bad enum values raise here
    assert cfg.distributed_type.value == EXPECTED.get(preset.stem, cfg.distributed_type.value)
    args = launch_command_parser().parse_args(["--config_file", str(preset), "train.py"])
    args, defaults, mp_flag = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(
            list(defaults.deepspeed_config) + (["mixed_precision"] if mp_flag else []))
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    elif cfg.distributed_type.value == "MULTI_CPU":  # the CPU form of DDP (tests/test_training_dist.py)
        assert args.use_cpu and args.num_processes == 2
        return
    else:
        assert args.num_processes == 1
        return
    env = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    with mock.patch.dict(os.environ, env):
        if args.use_fsdp:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2
            assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # checkpoints gather a full state dict
        if args.use_deepspeed:
            plugin = DeepSpeedPlugin()
            stage = 3 if "zero3" in preset.stem else 2
            assert plugin.zero_stage == stage
            assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_json(name):
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    path = ROOT / "configs" / "deepspeed" / f"{name}.json"
    data = json.loads(path.read_text())
    hf = HfDeepSpeedConfig(str(path))
    assert hf.get_value("zero_optimization.stage") == int(name[-1])
    assert hf.is_zero3() == (name == "zero3")
    assert "optimizer" not in data  # the loop's own AdamW is the client optimizer
