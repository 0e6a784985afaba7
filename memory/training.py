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

The planned row is the job's longest: max_length tokens, of which `--learned N` are loss positions (default:
all); with `prompt_context` P the step runs on P + N of them (`planned_row`). `fit_advice` lists the changes
that make a plan fit. It is an estimate of the peak, not a measurement: a preset whose total is within 90% of the
device is flagged. Checked here on the meta device only (no GPU on this machine).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from draftsmith import methods
from draftsmith.config import show
from draftsmith.errors import ConfigError
from draftsmith.memory.serving import GIB, GPUS, activation_bytes, load_target_config, param_counts
from draftsmith.reading import is_int, read_json
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


MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")  # accelerate's mixed_precision values
MAX_RANKS = 1 << 16


def read_accelerate(path: str | Path | None, ranks: int | None = None) -> Sharding:
    """The sharding an accelerate config file describes (None: one GPU, no sharding). The file is read by the
    bounded YAML loader (config.read_yaml: an alias bomb, a file that is not UTF-8 or not a mapping is one
    line), and every field the plan reads is checked (`_accelerate_fields`): one ConfigError naming the file
    and the field."""
    if ranks is not None and not is_int(ranks, 1, MAX_RANKS):
        raise ConfigError(f"--gpus {ranks}: expected an int in 1..{MAX_RANKS}")
    if path is None:
        return Sharding("replicate", ranks or 1)
    from draftsmith.config import read_yaml

    path = Path(path)
    cfg = read_yaml(path)
    n, mp, dist = _accelerate_fields(cfg, path)
    n = ranks or n
    if dist == "FSDP":
        return Sharding("fsdp", n, mp)
    if dist == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        if not isinstance(ds, dict):
            raise ConfigError(f"{path}: deepspeed_config is {show(ds)}: expected a mapping")
        stage = ds.get("zero_stage")
        if stage is None and ds.get("deepspeed_config_file"):
            stage, bf16 = _deepspeed_file(path, ds["deepspeed_config_file"])
            mp = "bf16" if bf16 else mp
        elif stage is not None and not is_int(stage, 0, 3):
            raise ConfigError(f"{path}: deepspeed_config.zero_stage is {show(stage)}: expected 0, 1, 2 or 3")
        stage = stage or 0
        return Sharding("zero3" if stage == 3 else "zero2" if stage == 2 else "replicate", n, mp)
    return Sharding("replicate", n, mp)


def _accelerate_fields(cfg: dict, path: Path) -> tuple[int, str, str]:
    """(num_processes, mixed_precision, distributed_type) of an accelerate config, each checked."""
    from accelerate.utils import DistributedType

    n = cfg.get("num_processes")
    if n is not None and not is_int(n, 1, MAX_RANKS):
        raise ConfigError(f"{path}: num_processes is {show(n)}: expected an int >= 1 (at most {MAX_RANKS})")
    mp = cfg.get("mixed_precision")
    mp = "no" if mp is False else mp  # YAML 1.1 reads a bare `no` as false
    if mp is not None and mp not in MIXED_PRECISION:
        raise ConfigError(f"{path}: mixed_precision is {show(mp)}: expected one of {', '.join(MIXED_PRECISION)}")
    dist = cfg.get("distributed_type")
    known = [t.value for t in DistributedType]
    if dist is not None and not (isinstance(dist, str) and dist.upper() in known):
        raise ConfigError(f"{path}: distributed_type is {show(dist)}: expected one of {', '.join(known)}")
    return n or 1, mp or "bf16", (dist or "NO").upper()


def _deepspeed_file(path: Path, name) -> tuple[int, bool]:
    """(ZeRO stage, bf16 on) of the DeepSpeed JSON an accelerate config names, relative to where accelerate
    launches (the checkout: configs/accelerate/x.yaml -> the folder two above)."""
    if not isinstance(name, str):
        raise ConfigError(f"{path}: deepspeed_config.deepspeed_config_file is {show(name)}: expected a path")
    ds_file = Path(name)
    parents = path.resolve().parents
    if not ds_file.is_file() and len(parents) > 2 and (parents[2] / ds_file).is_file():
        ds_file = parents[2] / ds_file
    if not ds_file.is_file():
        raise ConfigError(f"{ds_file}: no such file (the deepspeed_config_file of {path})")
    try:
        doc = read_json(ds_file)
    except (OSError, ValueError, RecursionError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{ds_file}: cannot be read ({type(e).__name__})"
        raise ConfigError(why.splitlines()[0]) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{ds_file}: expected a JSON object (a DeepSpeed config), got {show(doc)}")
    zero, bf16 = doc.get("zero_optimization") or {}, doc.get("bf16") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"{ds_file}: zero_optimization is {show(zero)}: expected a mapping {{stage: ...}}")
    stage = zero.get("stage", 0)
    if not is_int(stage, 0, 3):
        raise ConfigError(f"{ds_file}: zero_optimization.stage is {show(stage)}: expected 0, 1, 2 or 3")
    if not isinstance(bf16, dict):
        raise ConfigError(f"{ds_file}: bf16 is {show(bf16)}: expected a mapping {{enabled: ...}}")
    return stage, bf16.get("enabled") in (True, "auto")


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


def max_length_of(job) -> int:
    return job.data.max_length if hasattr(job, "data") and hasattr(job.data, "max_length") else job.max_length


def planned_row(job, learned: int | None = None) -> tuple[int, int]:
    """(window, learned): the tokens of the planned row a step runs on, and its loss positions. The planned row
    is the longest one: max_length tokens whose last `learned` are learned (None: all of them). With
    `prompt_context` P (EAGLE, DFlash) only P tokens before the first learned one are kept
    (data/batching.py's window): the row shrinks to P + learned."""
    T = max_length_of(job)
    a = min(learned or T, T)
    p = getattr(job, "prompt_context", None)
    return (min(T, p + a) if p is not None else T), a


def training_plan(job, target_config, sharding: Sharding, gpu: str | int = "H100-80GB", learned: int | None = None,
                  target_params: tuple[int, int] | None = None) -> dict:
    """Bytes per GPU of a training job (an EagleJobConfig, MedusaJobConfig or DistillConfig) on its longest row,
    of which `learned` tokens are loss positions (None: all; `planned_row`). `target_params`: the target's (total,
    active) parameters when the caller counted them already (`param_counts`). Module docstring."""
    family(target_config)  # a family outside the table: one line
    tc = text_config(target_config)
    act = DTYPE_BYTES.get(sharding.mixed_precision, 2)
    H, V, L = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers
    target_params, target_active = target_params or param_counts(target_config)
    kind = getattr(job, "config_kind", "?")
    method = next((m for m in methods.all_methods() if m.train_memory is not None
                   and getattr(m.get("config"), "config_kind", None) == kind), None)
    if method is None:
        raise ConfigError(f"plan: a {kind} config is not a training job "
                          f"({', '.join(m.name for m in methods.all_methods() if m.train_memory is not None)})")
    window, learned = planned_row(job, learned)
    cut = dataclasses.replace(job, max_length=window) if window < max_length_of(job) else job
    m = method.get("train_memory")(cut, target_config, act, learned)
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
        # features for every token of the window, teacher logits at its loss positions
        "activations": int(target_act + tokens * keep + B * learned * teacher + module_act),
        "overhead": OVERHEAD,
    }
    total = sum(parts.values())
    device = GPUS.get(gpu) if isinstance(gpu, str) else int(gpu)
    if device is None:
        raise ConfigError(f"unknown GPU '{gpu}' (known: {', '.join(GPUS)}, or a size in bytes)")
    return {"kind": kind, "gpu": gpu, "device_bytes": device, "sharding": sharding.kind, "ranks": sharding.ranks,
            "mixed_precision": sharding.mixed_precision, "batch_size": B, "max_length": max_length_of(job),
            "window": T, "learned": learned, "prompt_context": getattr(job, "prompt_context", None),
            "target_params": target_params, "target_active_params": target_active, "trained_params": trained,
            "bytes": parts, "total_bytes": total,
            "fits": total <= 0.9 * device}


@dataclass
class JobMemory:
    """What a method's job adds to the frozen target's memory (`Method.train_memory` returns one)."""

    max_length: int  # tokens per row of a micro-batch
    trained: int  # trained parameters
    keep: int  # bytes per token kept for the step (captured features)
    teacher: int  # bytes per token of teacher logits
    module_act: int  # the trained module's activation bytes for the whole micro-batch


def fit_advice(job, target_config, sharding: Sharding, gpu: str | int, learned: int | None = None) -> list[dict]:
    """What makes a plan that does not fit fit, as changes applied one after another, cheapest to the user first,
    until one fits: one row per micro-batch (gradient accumulation keeps the rows per step); ZeRO-3 / FSDP,
    which shard the frozen target's weights over the ranks (not the activations: each rank still runs its
    whole rows); `prompt_context`, where rows learn fewer tokens than they hold (the longest prompt context
    that fits); fewer training-time-test steps (EAGLE); and last a shorter max_length (the longest that fits).
    Each entry: {"change": the overrides or launch change, "total_bytes": the plan's total with it, "fits"}."""
    params = param_counts(target_config)

    def plan(j, s):
        return training_plan(j, target_config, s, gpu, learned, params)

    out: list[dict] = []

    def step(change: str, j, s) -> bool:
        p = plan(j, s)
        out.append({"change": change, "total_bytes": p["total_bytes"], "fits": p["fits"]})
        return p["fits"]

    if plan(job, sharding)["fits"]:
        return out
    B = job.train.batch_size
    if B > 1:
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, batch_size=1,
                                                                 grad_accum=job.train.grad_accum * B))
        if step(f"train.batch_size=1 train.grad_accum={job.train.grad_accum}", job, sharding):
            return out
    if not sharding.shards_target and sharding.ranks > 1:
        sharding = Sharding("zero3", sharding.ranks, sharding.mixed_precision)
        if step("ZeRO-3 (--config_file configs/accelerate/deepspeed_zero3.yaml) or FSDP (fsdp.yaml): "
                "the target's weights sharded", job, sharding):
            return out
    T = max_length_of(job)
    if hasattr(job, "prompt_context") and learned is not None and learned < T:
        best = _largest(2, T - learned, lambda p: plan(dataclasses.replace(job, prompt_context=p), sharding)["fits"])
        if best is not None:
            job = dataclasses.replace(job, prompt_context=best)
            step(f"prompt_context={best}", job, sharding)
            return out
    if getattr(job, "ttt_steps", 1) > 1:
        best = _largest(1, job.ttt_steps - 1, lambda n: plan(dataclasses.replace(job, ttt_steps=n), sharding)["fits"])
        if best is not None:
            step(f"ttt_steps={best}", dataclasses.replace(job, ttt_steps=best), sharding)
            return out
    key = "data.max_length" if hasattr(job, "data") and hasattr(job.data, "max_length") else "max_length"
    best = _largest(1, T // 1024, lambda k: plan(_with_length(job, k * 1024), sharding)["fits"])
    if best is not None:
        step(f"{key}={best * 1024}", _with_length(job, best * 1024), sharding)
    return out


def _with_length(job, n: int):
    if hasattr(job, "data") and hasattr(job.data, "max_length"):
        return dataclasses.replace(job, data=dataclasses.replace(job.data, max_length=n))
    return dataclasses.replace(job, max_length=n)


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in lo..hi with fits(n), for a `fits` that holds below some n and fails above it (bisection)."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def format_plan(p: dict) -> str:
    g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    lines = [f"training memory per GPU: {p['kind']} job, {p['ranks']} x {p['gpu']} ({p['sharding']}, "
             f"{p['mixed_precision']}), micro-batch {p['batch_size']} x {p['max_length']} tokens",
             f"  target {p['target_params'] / 1e9:.2f}B params (frozen{_active(p)}), trained "
             f"{p['trained_params'] / 1e6:.1f}M"]
    if p["window"] < p["max_length"] or p["learned"] < p["window"]:
        lines.append(f"  the longest row: {p['window']} tokens stepped on"
                     + (f" (prompt_context {p['prompt_context']})" if p["prompt_context"] is not None else "")
                     + f", {p['learned']} of them learned")
    lines += [f"  {k:<15} {g(v)}" for k, v in p["bytes"].items()]
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"  {'total':<15} {g(p['total_bytes'])} of {g(p['device_bytes'])}: {verdict} (90% of the device)")
    for i, a in enumerate(p.get("advice", [])):
        lines.append(f"  {'to fit:' if i == 0 else '   then:'} {a['change']} -> {g(a['total_bytes'])}"
                     + ("" if a["fits"] else " (still does not fit)"))
    if not p["fits"] and p.get("advice") is not None and not any(a["fits"] for a in p["advice"]):
        lines.append("  no change above makes it fit on this GPU")
    return "\n".join(lines)


def _active(p: dict) -> str:
    active = p.get("target_active_params", p["target_params"])
    return "" if active == p["target_params"] else f"; {active / 1e9:.2f}B active per token, a mixture of experts"


def plan_config(config_path: str | Path, target: str | Path | None = None, accelerate: str | Path | None = None,
                gpu: str = "H100-80GB", ranks: int | None = None, overrides: list[str] | None = None,
                learned: int | None = None, advise: bool = False) -> dict:
    """`draftsmith plan --config JOB.yaml`: the job preset's training memory per GPU on its longest row (`learned`
    loss positions of it; None: all), with `advise` the changes that make it fit (`fit_advice`)."""
    from draftsmith.config import load_config as load_job

    job = load_job(config_path, overrides)
    target_config = load_target_config(str(target or job.target))
    sharding = read_accelerate(accelerate, ranks)
    p = training_plan(job, target_config, sharding, gpu, learned)
    if advise:
        p["advice"] = fit_advice(job, target_config, sharding, gpu, learned)
    return p
