"""The GPU presets of configs/llama3.1-8b-instruct and configs/qwen3-8b, checked without a GPU or the hub:
every file loads into its job config, the shipped target configs build on the meta device with the
published parameter counts, the EAGLE head they describe is the Llama layer the stacks load, and
`draftsmith plan --config` puts each job within the GPUs it names."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.config import load_config
from draftsmith.memory.serving import count_params, load_target_config
from draftsmith.memory.training import plan_config, read_accelerate

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"llama3.1-8b-instruct": ("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248, "llama", 500000.0),
           "qwen3-8b": ("Qwen/Qwen3-8B", 8_190_735_360, "qwen3", 1000000.0)}
ACCELERATE = {"eagle3": "deepspeed_zero2.yaml", "medusa": "multi_gpu_ddp.yaml", "distill": "fsdp.yaml"}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_files_load_for_their_target(name):
    from draftsmith.data.generate import load_data_config

    hub = PRESETS[name][0]
    folder = ROOT / "configs" / name
    data = load_data_config(folder / "data.yaml")
    assert data.target == hub and data.generation.dtype == "bfloat16"
    for kind in ACCELERATE:
        job = load_config(folder / f"{kind}.yaml")
        assert job.target == hub and job.train.mixed_precision == "bf16"
        length = job.data.max_length if kind == "distill" else job.max_length
        assert length >= 2048
        text = (folder / f"{kind}.yaml").read_text()
        assert f"configs/accelerate/{ACCELERATE[kind]}" in text  # the launch line names its sharding preset
    eagle = load_config(folder / "eagle3.yaml")
    assert eagle.draft_vocab_size == 32000 and eagle.draft_layer == "llama"
    assert load_config(folder / "medusa.yaml").draft_vocab_size == 32000


@pytest.mark.parametrize("name", PRESETS)
def test_target_config_builds_on_meta_with_the_published_size(name):
    from draftsmith.capture.layers import default_eagle3_layers
    from draftsmith.eagle.model import EagleConfig, EagleHead, layer_config_dict
    from draftsmith.targets.families import family, full_attention_rope

    _, params, model_type, theta = PRESETS[name]
    cfg = load_target_config(ROOT / "configs" / name / "target-config.json")
    assert family(cfg).model_type == model_type
    assert count_params(cfg) == params  # the model card's number: the shipped config is the real shape
    assert full_attention_rope(cfg)["rope_theta"] == theta
    eagle = load_config(ROOT / "configs" / name / "eagle3.yaml")
    assert eagle.target_layers == default_eagle3_layers(cfg.num_hidden_layers)
    layer = layer_config_dict(cfg, eagle.draft_layer)
    assert layer["model_type"] == "llama" and layer["rope_theta"] == theta and layer["hidden_size"] == 4096
    import torch

    with torch.device("meta"):
        head = EagleHead(EagleConfig(3, 4096, cfg.vocab_size, eagle.target_layers, 32000, 7, layer_config=layer))
    assert head.layer.self_attn.q_proj.in_features == 2 * 4096 and head.lm_head.out_features == 32000


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("kind", list(ACCELERATE))
def test_plan_fits_the_named_gpus(name, kind):
    folder = ROOT / "configs" / name
    acc = ROOT / "configs" / "accelerate" / ACCELERATE[kind]
    p = plan_config(folder / f"{kind}.yaml", folder / "target-config.json", acc, "H100-80GB")
    assert p["ranks"] == 8 and p["sharding"] == {"eagle3": "zero2", "medusa": "replicate", "distill": "fsdp"}[kind]
    assert p["fits"], p
    assert p["target_params"] == PRESETS[name][1]
    b = p["bytes"]
    assert p["total_bytes"] == sum(b.values())
    if kind == "distill":  # FSDP shards the frozen target: an eighth of its bf16 weights plus one layer
        assert b["target_weights"] < PRESETS[name][1] * 2 / 8 + 0.5 * 2**30
    else:
        assert b["target_weights"] == PRESETS[name][1] * 2
    # activations grow with the micro-batch, nothing else does
    double = plan_config(folder / f"{kind}.yaml", folder / "target-config.json", acc, "H100-80GB",
                         overrides=[f"train.batch_size={2 * p['batch_size']}"])
    assert double["bytes"]["activations"] > 1.9 * b["activations"] - 2 * 2**30
    assert ({k: v for k, v in double["bytes"].items() if k != "activations"} ==
        {k: v for k, v in b.items() if k != "activations"})


@pytest.mark.parametrize("name", PRESETS)
def test_a100_40gb_needs_the_smaller_batch_the_presets_name(name):
    folder = ROOT / "configs" / name
    acc = ROOT / "configs" / "accelerate" / ACCELERATE["eagle3"]
    assert "A100-40GB: train.batch_size=1" in (folder / "eagle3.yaml").read_text()
    small = plan_config(folder / "eagle3.yaml", folder / "target-config.json", acc, "A100-40GB",
                        overrides=["train.batch_size=1"])
    assert small["fits"], small


def test_accelerate_presets_read_as_their_sharding():
    acc = ROOT / "configs" / "accelerate"
    assert read_accelerate(acc / "deepspeed_zero3.yaml").kind == "zero3"
    assert read_accelerate(acc / "deepspeed_zero2.yaml").kind == "zero2"
    assert read_accelerate(acc / "fsdp.yaml").kind == "fsdp"
    assert read_accelerate(acc / "multi_gpu_ddp.yaml", ranks=4).ranks == 4
    assert read_accelerate(None).kind == "replicate"


def test_plan_command_prints_the_training_plan(capsys):
    from draftsmith.cli import main

    folder = ROOT / "configs" / "qwen3-8b"
    rc = main(["plan", "--config", str(folder / "eagle3.yaml"), "--target", str(folder / "target-config.json"),
               "--accelerate", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml")])
    out = capsys.readouterr().out
    assert rc == 0 and "training memory per GPU: eagle job, 8 x H100-80GB (zero2, bf16)" in out and ": fits" in out
