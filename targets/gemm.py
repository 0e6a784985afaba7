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

Other CPUs and BLAS builds may rank the two products differently: `python -m draftsmith.targets.gemm`
measures both side by side on a target, and DRAFTSMITH_ROWS_LINEAR=0 turns this path off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

ENABLED = os.environ.get("DRAFTSMITH_ROWS_LINEAR", "1") != "0"

SMALL_ROWS = 8  # most rows sent the transposed way for an ordinary projection
VOCAB_ROWS = 64  # ... and for a projection with at least VOCAB_OUT outputs (an lm_head)
VOCAB_OUT = 8192


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not ENABLED or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() == 0:
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


@torch.no_grad()
def compare(target, rows: list[int], context: int = 256, repeats: int = 7) -> dict[int, dict[str, float]]:
    """Median seconds of a target forward over `rows` new tokens (KV cache of `context` tokens), with
    F.linear and with this module's path, interleaved so that load changes hit both alike."""
    global ENABLED
    from draftsmith.decoding import kvcache

    model = target.model
    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    cache = kvcache.new_cache(model)
    model(input_ids=torch.randint(0, vocab, (1, context), generator=g), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    new = torch.randint(0, vocab, (1, max(rows)), generator=g)

    def run(n: int) -> float:
        pos = torch.arange(context, context + n)[None]
        t0 = time.perf_counter()
        model(input_ids=new[:, :n], past_key_values=cache, position_ids=pos, use_cache=True)
        dt = time.perf_counter() - t0
        kvcache.crop(cache, context)
        return dt

    times: dict[int, dict[str, list[float]]] = {n: {"linear": [], "rows": []} for n in rows}
    saved = ENABLED
    try:
        for rep in range(repeats + 1):  # the first round warms up
            for n in rows:
                for name in ("linear", "rows"):
                    ENABLED = name == "rows"
                    dt = run(n)
                    if rep:
                        times[n][name].append(dt)
    finally:
        ENABLED = saved
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    from draftsmith.targets.loading import load_target

    ap = argparse.ArgumentParser(prog="python -m draftsmith.targets.gemm",
                                 description="F.linear vs W @ x^T in a target forward over a few rows")
    ap.add_argument("target", nargs="?", default=None)
    ap.add_argument("--rows", default="1,2,3,4,5,8,12,16,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    target = load_target(args.target)
    rows = [int(r) for r in args.rows.split(",")]
    res = compare(target, rows, args.context, args.repeats)
    base = res[rows[0]]
    print(f"{target.name}, context {args.context}, median of {args.repeats}, {torch.get_num_threads()} threads")
    print("| rows | F.linear ms | W @ x^T ms | ratio | v (F.linear) | v (W @ x^T) |")
    print("|---|---|---|---|---|---|")
    for n in rows:
        a, b = res[n]["linear"], res[n]["rows"]
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {a / base['linear']:.2f} | {b / base['rows']:.2f} |")


if __name__ == "__main__":
    main()
