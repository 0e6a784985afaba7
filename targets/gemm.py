"""Linear layers over a few rows on CPU: `W @ xᵀ` instead of `x @ Wᵀ`.

Speculative decoding lives on forwards over a few rows: a target verifying k+1 tokens, an EAGLE head
expanding a handful of tree nodes, a draft re-reading the tokens just accepted. On the project's CPU box
(MKL 2024.2 as shipped in the torch 2.13 CPU wheel, AMD EPYC, AVX2, 2 threads) `F.linear` with 2-8 rows
is far slower than its 1-row matrix-vector product, while the same product written as `W @ xᵀ` is not.
Measured on SmolLM2-135M (median of 7, interleaved, context 256; see BENCHMARKS.md):

    rows fed to the target        1      2      3      4      5      8     16
    F.linear            (ms)   68.6  109.3  142.1  121.9  113.3  117.8  133.7
    W @ xᵀ, this module (ms)   67.5   78.1   87.4   80.1   88.4  113.0  122.0

so verifying 2-5 tokens costs 1.15-1.3 one-token steps instead of 1.6-2.1. For a vocabulary projection
(49,152 x 576) the transposed product wins up to ~64 rows, which also speeds the data engine's batched
decode steps; for the small projections it loses past ~8 rows. Only inference takes this path (no tensor
needs a gradient), on CPU, in float32 — where it was measured; everything else goes to `F.linear`.
The result equals `F.linear` up to float summation order (the tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 8  # most rows sent the transposed way for an ordinary projection
VOCAB_ROWS = 64  # ... and for a projection with at least VOCAB_OUT outputs (an lm_head)
VOCAB_OUT = 8192


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() == 0:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    limit = VOCAB_ROWS if weight.shape[0] >= VOCAB_OUT else SMALL_ROWS
    if not 2 <= rows <= limit:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ xᵀ)ᵀ` when that is the faster product (see above)."""
    if not _transposed(x, weight):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, flat.t()).t().contiguous()  # consumers reduce over the last dim: keep it dense
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


class RowsLinear(nn.Linear):
    """An `nn.Linear` whose forward is `rows_linear`; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_linear(x, self.weight, self.bias)


def use_rows_linear(model: nn.Module) -> int:
    """Switch every plain `nn.Linear` in `model` to `RowsLinear` in place; returns how many.

    Subclasses of nn.Linear (LoRA layers, quantised layers) keep their own forward."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowsLinear
            n += 1
    return n
