"""Training memory per GPU for a job preset: the frozen target, the trained module, its optimizer, and the
activations of one micro-batch at the preset's batch and context.

    draftsmith plan --config configs/qwen3-8b/eagle3.yaml --target configs/qwen3-8b/target-config.json \
        --accelerate configs/accelerate/deepspeed_zero2.yaml --gpu H100-80GB

Nothing is allocated: the target and the trained module are built on the `meta` device from their configs
(exact parameter counts). What is counted, in bytes per GPU (GiB = 2**30 in the printout):

  target       its weights in the mixed-precision dtype (targets/frozen.py casts a frozen target to it);
               divided over the ranks under FSDP / ZeRO-3 (the frozen target is sharded there) plus one
               decoder layer gathered for its forward, whole on every rank otherwise. A mixture of experts
               counts its TOTAL parameters, every expert: FSDP and ZeRO-3 shard them like any weight and
               gather a whole layer, all its experts, for the forward (no expert parallelism in the
               training loop); its ACTIVE parameters (reported beside them) size the forward's workspace
  module       the trained parameters in fp32 (accelerate keeps fp32 weights and autocasts the products)
  gradients    fp32, one per trained parameter; divided over the ranks under ZeRO-2/3 and FSDP
  optimizer    AdamW's two fp32 moments; divided over the ranks under ZeRO-2/3 and FSDP
  activations  one micro-batch of `batch_size` rows of `max_length` tokens: the target's forward (no grad:
               one layer's transient workspace plus the features the job keeps), and what autograd keeps
               for the trained module's backward (per EAGLE training-time-test step / Medusa head / draft
               layer: the layer's inputs and intermediates in the compute dtype, fp32 logits and their
               softmax over the vocabulary the module predicts)
  overhead     CUDA context, allocator fragmentation, NCCL buffers: 3 GiB

It is an estimate of the peak, not a measurement: a preset whose total is within 90% of the device is
flagged. Checked here on the meta device only (no GPU on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith import methods
from draftsmith.errors import ConfigError
from draftsmith.planning.memory import GIB, GPUS, activation_bytes, load_target_config, param_counts
from draftsmith.storage import read_json
from draftsmith.targets.families import attention_dims, family, text_config

OVERHEAD = 3 * GIB
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "no": 4}


@dataclass
class Sharding:
    kind: str  # "replicate" (one GPU, DDP, ZeRO-1), "zero2", "zero3", "fsdp"
    ranks: int
    mixed_precision: str = "bf16"

    @property
    def shards_target(self) -> bool:
        return self.kind in ("zero3", "fsdp")

    @property
    def shards_optimizer(self) -> bool:
        return self.kind in ("zero2", "zero3", "fsdp")


def read_accelerate(path: str | Path | None, ranks: int | None = None) -> Sharding:
    """The sharding an accelerate config file describes (None: one GPU, no sharding)."""
    if path is None:
        return Sharding("replicate", ranks or 1)
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--accelerate {path}: no such file")
    cfg = yaml.safe_load(path.read_text()) or {}
    n = ranks or int(cfg.get("num_processes") or 1)
    mp = str(cfg.get("mixed_precision") or "bf16")
    dist = str(cfg.get("distributed_type", "NO")).upper()
    if dist == "FSDP":
        return Sharding("fsdp", n, mp)
    if dist == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        stage = ds.get("zero_stage")
        if stage is None and ds.get("deepspeed_config_file"):
            ds_file = Path(ds["deepspeed_config_file"])  # relative to where accelerate launches: the checkout
            if not ds_file.is_file():
                ds_file = path.resolve().parents[2] / ds_file  # configs/accelerate/x.yaml -> the checkout
            ds_json = read_json(ds_file)
            stage = (ds_json.get("zero_optimization") or {}).get("stage")
            if (ds_json.get("bf16") or {}).get("enabled"):
                mp = "bf16"
        stage = int(stage or 0)
        return Sharding("zero3" if stage == 3 else "zero2" if stage == 2 else "replicate", n, mp)
    return Sharding("replicate", n, mp)


def meta_params(build) -> int:
    import torch

    with torch.device("meta"):
        module = build()
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_bytes_per_token(c, inter: int | None = None, attn_in: int | None = None) -> int:
    """Elements autograd keeps per token for one Llama-shaped decoder layer (in the compute dtype)."""
    h = c["hidden_size"]
    heads, kv, hd = attention_dims(c)
    inter = inter or c["intermediate_size"]
    return ((attn_in or h)  # the q/k/v input
            + (heads + 2 * kv) * hd  # q, k, v
            + 2 * heads * hd  # attention output, o_proj input
            + 4 * h  # residuals and norm outputs
            + 4 * inter)  # gate, up, act(gate), act(gate) * up


def training_plan(job, target_config, sharding: Sharding, gpu: str | int = "H100-80GB") -> dict:
    """Bytes per GPU of a training job (an EagleJobConfig, MedusaJobConfig or DistillConfig). Module docstring."""
    family(target_config)  # a family outside the table: one line
    tc = text_config(target_config)
    act = DTYPE_BYTES.get(sharding.mixed_precision, 2)
    H, V, L = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers
    target_params, target_active = param_counts(target_config)
    kind = getattr(job, "config_kind", "?")
    method = next((m for m in methods.all_methods() if m.train_memory is not None
                   and getattr(m.get("config"), "config_kind", None) == kind), None)
    if method is None:
        raise ConfigError(f"plan: a {kind} config is not a training job "
                          f"({', '.join(m.name for m in methods.all_methods() if m.train_memory is not None)})")
    m = method.get("train_memory")(job, target_config, act)
    B, T = job.train.batch_size, m.max_length
    tokens = B * T
    trained, keep, teacher, module_act = m.trained, m.keep, m.teacher, m.module_act

    # the frozen target: weights in the compute dtype, sharded under FSDP / ZeRO-3 (one layer gathered)
    layer_params = (target_params - 2 * V * H) // max(L, 1)
    target_w = target_params * act
    if sharding.shards_target:
        target_w = target_w // sharding.ranks + layer_params * act
    target_act = activation_bytes(tc, tokens, 0, act)  # one layer's transient workspace, no grad
    n_opt = sharding.ranks if sharding.shards_optimizer else 1
    n_w = sharding.ranks if sharding.shards_target else 1
    parts = {
        "target_weights": int(target_w),
        "module_weights": int(trained * 4 // n_w),
        "gradients": int(trained * 4 // n_opt),
        "optimizer": int(trained * 8 // n_opt),
        "activations": int(target_act + tokens * (keep + teacher) + module_act),
        "overhead": OVERHEAD,
    }
    total = sum(parts.values())
    device = GPUS.get(gpu) if isinstance(gpu, str) else int(gpu)
    if device is None:
        raise ConfigError(f"unknown GPU '{gpu}' (known: {', '.join(GPUS)}, or a size in bytes)")
    return {"kind": kind, "gpu": gpu, "device_bytes": device, "sharding": sharding.kind, "ranks": sharding.ranks,
            "mixed_precision": sharding.mixed_precision, "batch_size": B, "max_length": T,
            "target_params": target_params, "target_active_params": target_active, "trained_params": trained, "bytes": parts, "total_bytes": total,
            "fits": total <= 0.9 * device}


@dataclass
class JobMemory:
    """What a method's job adds to the frozen target's memory (`Method.train_memory` returns one)."""

    max_length: int  # tokens per row of a micro-batch
    trained: int  # trained parameters
    keep: int  # bytes per token kept for the step (captured features)
    teacher: int  # bytes per token of teacher logits
    module_act: int  # the trained module's activation bytes for the whole micro-batch


def format_plan(p: dict) -> str:
    g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    lines = [f"training memory per GPU: {p['kind']} job, {p['ranks']} x {p['gpu']} ({p['sharding']}, "
             f"{p['mixed_precision']}), micro-batch {p['batch_size']} x {p['max_length']} tokens",
             f"  target {p['target_params'] / 1e9:.2f}B params (frozen{_active(p)}), trained "
             f"{p['trained_params'] / 1e6:.1f}M"]
    lines += [f"  {k:<15} {g(v)}" for k, v in p["bytes"].items()]
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"  {'total':<15} {g(p['total_bytes'])} of {g(p['device_bytes'])}: {verdict} (90% of the device)")
    return "\n".join(lines)


def _active(p: dict) -> str:
    active = p.get("target_active_params", p["target_params"])
    return "" if active == p["target_params"] else f"; {active / 1e9:.2f}B active per token, a mixture of experts"


def plan_config(config_path: str | Path, target: str | Path | None = None, accelerate: str | Path | None = None,
                gpu: str = "H100-80GB", ranks: int | None = None, overrides: list[str] | None = None) -> dict:
    """`draftsmith plan --config JOB.yaml`: the job preset's training memory per GPU."""
    from draftsmith.config import load_config as load_job

    job = load_job(config_path, overrides)
    return training_plan(job, load_target_config(str(target or job.target)), read_accelerate(accelerate, ranks), gpu)
