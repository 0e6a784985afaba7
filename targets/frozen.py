"""The frozen target inside a training step: no grads, eval mode, right device and dtype, never DDP-wrapped.

It lives with the target, not in training/, because it needs nothing but the target and accelerate, and the
online capture (capture/online.py), a layer below training/, places the target it runs with it.

How each accelerate preset treats it (`place_frozen`):
- single device, DDP (MULTI_GPU / MULTI_CPU), DeepSpeed ZeRO-1/2: the target is REPLICATED — every rank
  holds a full copy on `accelerator.device`. It is not passed to `accelerator.prepare`: it has no
  trainable parameters, so DDP would have nothing to all-reduce (and refuses such a module), and ZeRO-1/2
  only shard optimizer state and gradients, which the target does not have.
- FSDP: the target is SHARDED with its own FSDP wrapper (`accelerator.prepare_model` for FSDP1, which
  wraps modules whose parameters are all frozen; `fully_shard` per decoder layer for FSDP2, the
  embedding / final norm / lm_head left whole on each rank). Every forward all-gathers one layer at a
  time, so a target larger than one GPU fits. No optimizer touches it.
- DeepSpeed ZeRO-3: the target gets its own inference-only DeepSpeed engine (`deepspeed.initialize` with
  the training config's ZeRO-3 section and no optimizer), the same pattern TRL uses for reference models,
  so its parameters are partitioned across ranks and gathered per layer on forward.
The FSDP2 path runs with 2 CPU processes over gloo in tests/test_training_dist.py; FSDP1 and the ZeRO-3
engine were not run here.

Dtype: with mixed precision bf16/fp16 on a GPU the target's weights are cast to that dtype (halving its
memory; it is never updated, so there is no master copy to keep); with "no" it keeps its own dtype. On the
CPU it keeps its dtype too: autocast runs its matrix products in bf16 anyway, and the evaluation after
training then measures the target as it was loaded, as `draftsmith evaluate` does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from draftsmith.targets.families import decoder_layers

log = logging.getLogger(__name__)


def freeze_module(model: nn.Module) -> nn.Module:
    """No grads, eval mode (dropout off). Idempotent."""
    model.eval()
    model.requires_grad_(False)
    return model


def compute_dtype(accelerator) -> torch.dtype | None:
    """The dtype a frozen target is cast to: the mixed-precision dtype on a GPU, None (keep) on the CPU."""
    if accelerator.device.type == "cpu":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))


def _reshard_after_forward(module, args, output):
    module.reshard()


def place_frozen(model: nn.Module, accelerator, dtype: torch.dtype | None = None, shard: bool | None = None) -> Any:
    """Freeze `model` and put it where the preset says (see module docstring). Returns the module to call.

    `shard=None` follows the preset (FSDP / ZeRO-3 shard, everything else replicates); False forces a
    replicated copy even under FSDP / ZeRO-3 (right for small targets: no per-layer all-gathers).
    """
    from accelerate.utils import DistributedType

    freeze_module(model)
    dtype = dtype or compute_dtype(accelerator)
    dist = accelerator.distributed_type
    zero_stage = None
    if dist == DistributedType.DEEPSPEED:
        zero_stage = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
    if shard is None:
        shard = dist == DistributedType.FSDP or zero_stage == 3
    if not shard:
        model.to(device=accelerator.device, dtype=dtype) if dtype is not None else model.to(accelerator.device)
        return model
    if dist == DistributedType.FSDP:
        return _fsdp_sharded(model, accelerator, dtype)
    if dist == DistributedType.DEEPSPEED:
        return _zero3_engine(model, accelerator)
    raise ValueError(f"cannot shard a frozen target under {dist}")


def _fsdp_sharded(model: nn.Module, accelerator, dtype: torch.dtype | None) -> nn.Module:
    """The target sharded under FSDP: per decoder layer under FSDP2, by accelerate's wrapper under FSDP1."""
    if dtype is not None:
        model.to(dtype=dtype)
    if not getattr(accelerator, "is_fsdp2", False):
        return freeze_module(accelerator.prepare_model(model, evaluation_mode=False))
    from torch.distributed.fsdp import fully_shard

    # the decoder layers (nearly all of a target's weights) are sharded, each all-gathered for its
    # own forward; the root's embedding, final norm and lm_head stay whole on every rank, since the
    # heads call them outside the target's forward (EAGLE's embedding and lm_head rows)
    # each layer is its own FSDP root, and FSDP2 keeps a root's parameters gathered after its forward
    # (it expects the backward next): the hook frees them again, so a rank holds one whole layer at
    # a time (the target has no backward)
    for layer in decoder_layers(model):
        fully_shard(layer)
        layer.register_forward_hook(_reshard_after_forward)
    model.to(accelerator.device)
    return freeze_module(model)


def _zero3_config(model: nn.Module, accelerator) -> dict:
    """The training config's DeepSpeed section made an inference-only ZeRO-3 one: no optimizer or scheduler,
    batch settings that agree with each other, "auto" precision resolved."""
    import copy

    ds_config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    ds_config.pop("optimizer", None)
    ds_config.pop("scheduler", None)
    ds_config["zero_optimization"] = {
        "stage": 3, "stage3_param_persistence_threshold": 10 * model.config.hidden_size
        if hasattr(model, "config") else 1e4,
    }
    # an inference-only engine: its batch settings only have to agree with each other (DeepSpeed checks
    # train_batch = micro x accumulation x ranks); the training engine fills its own from the config
    ds_config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                     train_batch_size=accelerator.num_processes, gradient_clipping=0.0)
    for key in ("bf16", "fp16"):  # "auto" is resolved by accelerate for the engines it prepares, not here
        if isinstance(ds_config.get(key), dict) and ds_config[key].get("enabled") == "auto":
            ds_config[key]["enabled"] = str(accelerator.mixed_precision) == key
    return ds_config


def _zero3_engine(model: nn.Module, accelerator) -> Any:
    """The target in an inference-only DeepSpeed ZeRO-3 engine, its root modules kept whole on every rank."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=_zero3_config(model, accelerator))
    engine.eval()
    # as under FSDP: the decoder layers stay partitioned, each gathered for its own forward; the embedding,
    # final norm and lm_head are gathered once and kept whole on every rank (persistent), since the heads
    # read them outside the target's forward (Medusa's lm_head copy, EAGLE's embedding and lm_head rows)
    in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_layers and hasattr(p, "ds_id")]
    for p in root:
        p.ds_persist = True
    if root:
        root[0].all_gather(param_list=root)  # collective: every rank places its target here
    return engine
