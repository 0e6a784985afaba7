"""Linear layers over a few rows on CPU: `W @ xᵀ` where this machine computes it faster than `x @ Wᵀ`.

Decoding lives on forwards over a few rows: plain decoding feeds the target one token a step, a target
verifies k+1 tokens, an EAGLE head expands a handful of tree nodes, a draft re-reads the tokens just accepted.
For the target's weights (hundreds of MB, so every product streams them from memory) the BLAS in the torch
CPU wheel (MKL) is not equally good at every row count, and how it ranks them depends on the CPU. Measured on
SmolLM2-135M's own linears, swept in forward order (2 threads; `draftsmith bench gemm`):

    one row,  F.linear (a matrix-vector product)       42 ms per forward's worth of linears
    one row,  W @ [x; 0]ᵀ (the two-column product)     25 ms
    two rows, F.linear                                 62 ms
    two rows, W @ xᵀ                                    23 ms

so on that AMD EPYC a one-token step — the step plain decoding takes every time — was the slowest forward of
all (68 ms, against 38 ms for two tokens), and every speculative speedup measured there mixed what speculation
buys with the cheaper kernel only the speculative runs took. The matrix-vector kernel is slow there whether it
runs on one thread or two: this is not a threading problem but the kernel, so the fix is to send one row
through the two-column product too, padded with a zero row (the extra column is free: the product is
bound by reading W, not by arithmetic).

Which product wins at which row count is *measured at load* (`calibrate`, ~2 s for a 135M target, run by
`targets.loading.freeze` on a float32 CPU target), separately for ordinary projections and for vocabulary
projections (≥ VOCAB_OUT outputs), and applies to everything that runs on that machine: plain decoding (the
baseline), the verifier, the heads, the data engine. `describe()` is what reports record. Only inference
takes this path (no tensor needs a gradient), on CPU, in float32; everything else goes to `F.linear`. The
result equals `F.linear` up to float summation order (the tests check it). DRAFTSMITH_ROWS_LINEAR=0 turns the
path off (plain `F.linear` everywhere); HF `generate`, the outside reference in reports, runs with it off
(`disabled()`), as a user's own model would.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

ENABLED = os.environ.get("DRAFTSMITH_ROWS_LINEAR", "1") != "0"

VOCAB_OUT = 8192  # a projection with at least this many outputs is a vocabulary projection (an lm_head)
SMALL_ROWS = 8  # before any measurement: the transposed product for 2..SMALL_ROWS rows of an ordinary projection
VOCAB_ROWS = 64  # ... and for 2..VOCAB_ROWS rows of a vocabulary projection
# row counts `calibrate` measures; a count in between takes the answer of the largest measured count below it,
# and a count past the last takes F.linear (many rows are a real matrix product, where BLAS is at home)
# how much of a class's weights `calibrate` reads per sweep: well past any CPU cache, so the products run from
# memory as in a forward (SmolLM2-135M's ordinary projections are 420 MB, its lm_head 113 MB)
SWEEP_BYTES = 256 * 2**20
MEASURED_ROWS = {"small": (1, 2, 3, 4, 5, 6, 8, 12, 16), "vocab": (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)}


@dataclass
class Plan:
    """Per class of projection ("small", "vocab"): (rows, transposed?) at the measured row counts, ascending."""

    rows: dict[str, list[tuple[int, bool]]]
    source: str = "default"  # "default" (nothing measured yet) or "measured"
    sweep_ms: dict = field(default_factory=dict)  # class -> rows -> {"linear": ms, "transposed": ms}
    threads: int | None = None

    def transposed(self, cls: str, rows: int) -> bool:
        table = self.rows.get(cls) or []
        i = bisect.bisect_right(table, (rows, True)) - 1
        return i >= 0 and table[i][1] and rows <= table[-1][0]


def _default_plan() -> Plan:
    return Plan({"small": [(1, False), (2, True), (SMALL_ROWS, True), (SMALL_ROWS + 1, False)],
                 "vocab": [(1, False), (2, True), (VOCAB_ROWS, True), (VOCAB_ROWS + 1, False)]})


_plan = _default_plan()
_measured: dict[tuple, Plan] = {}  # by the shapes of a model's linears and the thread count


def _class(weight: torch.Tensor) -> str:
    return "vocab" if weight.shape[0] >= VOCAB_OUT else "small"


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() == 0:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not ENABLED or not _eligible(x, weight):
        return False
    return _plan.transposed(_class(weight), x.numel() // max(x.shape[-1], 1))


def _transposed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:  # the two-column product, second column zero (see the module docstring)
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # consumers reduce over the last dim: keep it dense
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ xᵀ)ᵀ` where that is the faster product (see above)."""
    if not _transposed(x, weight):
        return F.linear(x, weight, bias)
    return _transposed_product(x, weight, bias)


@contextlib.contextmanager
def disabled():
    """Plain `F.linear` everywhere inside the block (the stock kernels, e.g. for an outside reference)."""
    global ENABLED
    saved, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = saved


def _sample(weights: list[torch.Tensor], budget: int = SWEEP_BYTES) -> list[torch.Tensor]:
    """The weights a sweep reads, in module order, up to `budget` bytes (a large matrix contributes its first
    rows): enough to come from memory as in a forward, few enough that a 70B model calibrates as fast as a
    135M one. The rows kept of a projection are contiguous, so its product runs the same kernel."""
    out, left = [], budget
    for w in weights:
        if left <= 0:
            break
        rows = min(w.shape[0], max(left // (w.shape[1] * w.element_size()), 1))
        out.append(w[:rows] if rows < w.shape[0] else w)
        left -= rows * w.shape[1] * w.element_size()
    return out


def _sweep(weights: list[torch.Tensor], inputs: dict, rows: int, way: str) -> float:
    """Seconds to multiply `rows` rows by every weight in turn, one way ("linear" or "transposed")."""
    t0 = time.perf_counter()
    for w in weights:
        x = inputs[(rows, w.shape[1])]
        F.linear(x, w) if way == "linear" else _transposed_product(x, w, None)
    return time.perf_counter() - t0


@torch.no_grad()
def calibrate(model: nn.Module, repeats: int = 3) -> Plan | None:
    """Measure, on this machine, F.linear against the transposed product over `model`'s own float32 CPU
    linears at the row counts of MEASURED_ROWS, and make the faster one the plan. Each class's linears are
    swept in module order, so the weights come from memory as in a forward; the two ways alternate, and each
    keeps its fastest of `repeats` sweeps (after a warm-up sweep): the question is which kernel is faster, and
    another process on the cores only ever adds time, so a median taken on a busy machine can pick the slower
    kernel. Returns the plan (also kept as the active one), or None when the
    model has no such linears or the path is off. The same shapes are measured once per process."""
    global _plan
    if not ENABLED:
        return None
    # a ZeRO-3-partitioned weight is a placeholder (its rows live on other ranks): nothing here to time
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and m.weight.dim() == 2]
    if not linears:
        return None
    key = (tuple((m.weight.shape[0], m.weight.shape[1]) for m in linears), torch.get_num_threads())
    if key in _measured:
        _plan = _measured[key]
        return _plan
    g = torch.Generator().manual_seed(0)
    plan = Plan({}, source="measured", threads=torch.get_num_threads())
    for cls, counts in MEASURED_ROWS.items():
        weights = _sample([m.weight for m in linears if _class(m.weight) == cls])
        if not weights:
            continue
        inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], generator=g) for n in counts for w in weights}
        times: dict[int, dict[str, list[float]]] = {n: {"linear": [], "transposed": []} for n in counts}
        for rep in range(repeats + 1):  # the first round warms up
            for n in counts:
                for way in ("linear", "transposed") if rep % 2 else ("transposed", "linear"):
                    dt = _sweep(weights, inputs, n, way)
                    if rep:
                        times[n][way].append(dt)
        best = {n: {way: min(v) for way, v in t.items()} for n, t in times.items()}
        plan.rows[cls] = [(n, best[n]["transposed"] < best[n]["linear"]) for n in counts]
        plan.sweep_ms[cls] = {n: {way: round(s * 1e3, 3) for way, s in m.items()} for n, m in best.items()}
    _measured[key] = _plan = plan
    return plan


def describe() -> dict:
    """What reports record: whether the path is on, where its plan came from, and which row counts take it."""
    return {
        "enabled": ENABLED,
        "plan": _plan.source,
        "threads": _plan.threads,
        "transposed_rows": {cls: [n for n, t in table if t] for cls, table in _plan.rows.items()},
        "sweep_ms": _plan.sweep_ms,
    }


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
    from draftsmith.targets import kvcache

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


def report(target, rows: list[int], context: int = 256, repeats: int = 7) -> str:
    """`draftsmith bench gemm`: the plan measured when `target` loaded, then whole forwards over each row count
    of `rows` with the path off and on (`compare`), as a table."""
    d = describe()
    lines = [f"{target.name}: plan {d['plan']}, {d['threads']} threads; transposed product at rows "
             f"{d['transposed_rows']}"]
    for cls, table in d["sweep_ms"].items():
        lines.append(f"  {cls} projections, ms per sweep (linear / transposed): "
                     + ", ".join(f"{n}: {t['linear']:.1f}/{t['transposed']:.1f}" for n, t in table.items()))
    res = compare(target, rows, context, repeats)
    base = res[rows[0]]
    lines += [f"whole forwards, context {context}, median of {repeats}, interleaved",
              "| rows | F.linear ms | this module ms | ratio | v (F.linear) | v (this module) |",
              "|---|---|---|---|---|---|"]
    for n in rows:
        a, b = res[n]["linear"], res[n]["rows"]
        lines.append(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {a / base['linear']:.2f} "
                     f"| {b / base['rows']:.2f} |")
    return "\n".join(lines)
