"""Running a target in bfloat16 where the hardware multiplies bf16 natively, with float32 logits.

CPUs with AVX512-BF16 or AMX-BF16 run bf16 matrix products through oneDNN at more than twice the fp32 rate:
on this project's 2-core EPYC, SmolLM2-shaped GEMMs ran at 338-427 GFLOP/s in bf16 against 116-197 in fp32
(BENCHMARKS.md, "The target in bfloat16"). So jobs that only run the target forward (writing self-distilled
data) can use bf16 there, as they would on a GPU.

The price is fidelity: bf16 rounding changes the target's greedy token at a near-tie, and greedy text
diverges from there. Keeping the lm_head in float32 (the body's bf16 output upcast, the fp32 weights) halves
the changed tokens: on SmolLM2's own greedy answers the bf16 body + fp32 head picks the fp32 target's token
at 99.2% of positions, the all-bf16 model at 98.4% (KL 0.0009 nats per position).
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16) that oneDNN uses.

    DRAFTSMITH_CPU_BF16=0 (or 1) overrides what the flags say: `auto` precisions then stay float32 (or
    use bf16). The test suite sets 0, so its numbers do not depend on the machine it runs on."""
    env = os.environ.get("DRAFTSMITH_CPU_BF16")
    if env in ("0", "1"):
        return env == "1"
    return _flags_have_bf16(cpuinfo)


@functools.lru_cache(maxsize=4)
def _flags_have_bf16(cpuinfo: str) -> bool:
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return any(f in flags for f in _BF16_FLAGS)
    return False


def inference_dtype(device: torch.device, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """The dtype for forward-only target work: `auto` = bf16 on a CUDA device that supports it or on a CPU
    with native bf16, else float32; anything else is resolved like `targets.select_dtype`."""
    from draftsmith.targets.device import select_dtype

    if dtype != "auto":
        return select_dtype(device, dtype)
    if device.type == "cuda":
        return select_dtype(device, None)
    return torch.bfloat16 if device.type == "cpu" and cpu_native_bf16() else torch.float32


class Float32Logits(nn.Module):
    """An lm_head that upcasts its (bf16) input and multiplies by float32 weights: float32 logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `module`'s floating-point parameters to `dtype` in place and return it; buffers keep their dtype.

    `module.to(bf16)` would also round the rotary embedding's inverse frequencies (a float buffer) to bf16:
    8 bits of mantissa put the angle at position 300 off by up to half a radian in the fastest-turning
    dimensions. HF's rotary module computes in float32 from whatever `inv_freq` holds, and casts cos/sin to
    the activations' dtype itself, so the buffers can stay float32 (as HF leaves them for a model it loads
    in bf16). At prompt + 96 tokens the rounded copy agreed with float32 about as well (99.15% vs 99.18% of
    greedy tokens, BENCHMARKS.md "The target in bfloat16"); longer contexts would show it more."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def inference_copy(model, dtype: torch.dtype, fp32_logits: bool = True):
    """`model` to run forward-only in `dtype`: the model itself when it already has that dtype, else a copy.

    The caller's model is never changed (it may go on to train heads in float32). With `fp32_logits` and a
    float32 source cast to a 16-bit dtype, the copy keeps the lm_head in float32 (`Float32Logits`).
    """
    current = next(model.parameters()).dtype
    if current == dtype:
        return model
    head = model.get_output_embeddings()
    keep_head = (fp32_logits and current == torch.float32 and dtype in (torch.bfloat16, torch.float16)
        and isinstance(head, nn.Linear))
    out = cast_parameters(copy.deepcopy(model), dtype)
    if keep_head:
        out.set_output_embeddings(Float32Logits(head.weight, head.bias))
    return out.eval().requires_grad_(False)
