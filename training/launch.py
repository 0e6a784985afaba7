"""Where each rank's frozen target lives, decided from the launcher before anything is loaded.

The one job runner (runner/train.py `run`) creates the Accelerator FIRST
(`make_accelerator`) and then loads the target once, on the device that Accelerator gives this rank
(`load_target_for`). Under `accelerate launch` / `torchrun` on a GPU node that is `cuda:LOCAL_RANK`, so eight
ranks put eight targets on eight GPUs, not eight targets on `cuda:0`.

    preset                               target loaded on       then (targets/frozen.place_frozen)
    single device, DDP, ZeRO-1/2         accelerator.device     replicated, never wrapped
    FSDP (1 or 2), DeepSpeed ZeRO-3      cpu                    sharded across ranks (per decoder layer)

Under a sharded preset the target is built on the CPU (in the GPU's compute dtype) and `place_frozen`
shards it: a target larger than one device never lands whole on one. The frozen target is never passed
to `accelerator.prepare` with an optimizer: it has no gradients and no optimizer state.
"""

from __future__ import annotations

import os

import torch

from draftsmith.training.config import TrainConfig

SHARDED = ("FSDP", "ZERO3")


def _cpu_only() -> bool:
    """No accelerator device: tell accelerate so, or under torchrun it stays single-process (DistributedType.NO)
    instead of MULTI_CPU over gloo (accelerate 1.15 only picks MULTI_CPU with cpu=True)."""
    acc = getattr(torch, "accelerator", None)
    has_device = acc.is_available() if acc is not None else torch.cuda.is_available()
    return not has_device


def _release_precision(wanted: str) -> None:
    """Let a single-process run pick its own mixed precision after an earlier run in the same process.

    accelerate keeps one AcceleratorState per process and refuses an Accelerator with another precision (a
    Python session that trains in float32, then in bf16). In a single process nothing else shares that state,
    so it is cleared; under a multi-process launcher the launcher's precision stands and accelerate's error
    says so.
    """
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and int(os.environ.get("WORLD_SIZE", "1")) == 1 and str(state.get("_mixed_precision")) != wanted:
        AcceleratorState._reset_state()


def make_accelerator(cfg: TrainConfig):
    """The Accelerator of a training run, from the launcher's environment (accelerate launch / torchrun)."""
    from accelerate import Accelerator

    precision = cfg.resolved_mixed_precision()
    _release_precision(precision)
    cpu = _cpu_only()
    handlers = []
    if cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # DeepSpeed on CPU processes (the CPU form of the ZeRO presets, DeepSpeed's CPU accelerator): accelerate
        # takes DeepSpeed up only on its not-cpu path, where deepspeed.comm starts the process group; named
        # gloo, it counts the ranks from that group as it does for GPUs
        from accelerate.utils import InitProcessGroupKwargs

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        cpu, handlers = False, [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.grad_accum,
                              step_scheduler_with_optimizer=False, cpu=cpu, kwargs_handlers=handlers)
    if cpu and accelerator.num_processes > 1 and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        _fsdp_on_cpu(accelerator)
    return accelerator


def _fsdp_on_cpu(accelerator) -> None:
    """FSDP over gloo on CPU processes (the CPU form of configs/accelerate/fsdp.yaml, what the tests run).

    FSDP2's `fully_shard` runs on CPU tensors with gloo, but accelerate 1.15 only switches to FSDP from a
    GPU-type distributed mode and leaves CPU processes in MULTI_CPU (DDP). The preset's FSDP_* environment
    is there all the same, so the plugin is built from it and the state switched to FSDP before anything is
    prepared; `accelerator.prepare` then shards the trainable module as it does on GPUs.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_STATE_DICT_TYPE, ... as accelerate does
    if plugin.fsdp_version != 2:
        from draftsmith.errors import ConfigError

        raise ConfigError("FSDP on CPU processes needs fsdp_version: 2 (fully_shard); FSDP1 wants GPUs")
    from accelerate.state import PartialState

    accelerator.state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's fields each time it is instantiated: switch both
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP


def preset_kind(accelerator) -> str:
    """'FSDP', 'ZERO3', 'ZERO2', 'ZERO1', 'ZERO0' or the DistributedType's name ('NO', 'MULTI_GPU', ...)."""
    from accelerate.utils import DistributedType

    dist = accelerator.distributed_type
    if dist == DistributedType.DEEPSPEED:
        stage = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)
        return f"ZERO{int(stage)}"
    return "FSDP" if dist == DistributedType.FSDP else str(dist.value if hasattr(dist, "value") else dist)


def target_device(kind: str, device: torch.device | str) -> torch.device:
    """Where a rank loads its frozen target: the rank's own device, or the CPU when the preset shards it."""
    return torch.device("cpu") if kind in SHARDED else torch.device(device)


def target_dtype(kind: str, device: torch.device | str, mixed_precision: str) -> torch.dtype | None:
    """A sharded preset loads on the CPU but computes on the rank's device: load in that device's
    compute dtype (bf16/fp16 on a GPU), not the CPU's float32 (twice the host memory per rank). None: the
    loader's own choice (`targets.device.select_dtype`)."""
    if kind in SHARDED and torch.device(device).type != "cpu":
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision))
    return None


def load_target_for(spec: str, accelerator, **kw):
    """Load the job's target once on this rank, where the preset wants it (see the module docstring)."""
    from draftsmith.targets import load_target

    kind = preset_kind(accelerator)
    dtype = kw.pop("dtype", None) or target_dtype(kind, accelerator.device, accelerator.mixed_precision)
    return load_target(spec, device=target_device(kind, accelerator.device), dtype=dtype, **kw)


def evaluation_target(target, spec: str, accelerator, **kw):
    """The target the rank-0 evaluation after training decodes with: the placed one, unless the preset
    sharded it across ranks (an FSDP / ZeRO-3 shard cannot run a forward alone); then a whole copy is loaded
    on this rank's device, which only a target that fits one device allows anyway."""
    if preset_kind(accelerator) not in SHARDED or accelerator.num_processes == 1:
        return target
    from draftsmith.targets import load_target

    return load_target(spec, device=accelerator.device, **kw)


def leave_process_group(accelerator) -> None:
    """Training is done on every rank: meet at a barrier, then leave the process group together. A rank that
    exits with its gloo / NCCL group still open, or tears it down while a peer still talks to it, can abort
    in the group's threads at exit ("terminate called without an active exception"), which the launcher
    reports as a failed job after a good run. What follows (rank 0's evaluation) needs no collectives, so
    the other ranks are free to exit while it runs."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        accelerator.wait_for_everyone()
        dist.destroy_process_group()
