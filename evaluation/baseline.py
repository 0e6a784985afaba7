"""Is plain decoding the fastest this machine can do? The check behind every published speedup.

Plain decoding feeds the target one token a step; verification feeds it k+1. If the one-token step costs
more than a two-token forward — as it did on an AMD EPYC VM with the MKL of the torch CPU wheel, 61 ms
against 41 ms, because its matrix-vector kernel is slow there (targets/gemm.py) — then every speedup
measured against plain decoding mixes what speculation buys with a kernel only the speculative runs take.
`check_plain_step` times, interleaved on the same KV cache, the one-token step and a two-token verify
forward with the kernel plan the run uses, and the same two with the stock kernels (F.linear everywhere)
for reference; it passes when the plain step is not slower than the two-token forward (within
`tolerance`, the noise of a median of a few forwards).

    draftsmith bench baseline [TARGET] [--json out.json]     # exit 1 when the check fails

`draftsmith bench` runs it as a stage of its own (quick budget included), and the real-target test in
tests/test_gemm.py asserts it.
"""

from __future__ import annotations

import statistics

from draftsmith.decoding.cost import CpuShare, forward_timer
from draftsmith.targets import gemm

TOLERANCE = 1.10  # plain step / two-token forward; medians of interleaved forwards move by a few percent


def check_plain_step(target, context_length: int = 256, repeats: int = 9, tolerance: float = TOLERANCE,
                     seed: int = 0) -> dict:
    """Median seconds of a 1-token and a 2-token forward with this run's kernel plan and with the stock
    kernels, interleaved; `ok` when the planned 1-token step <= tolerance x the planned 2-token forward."""
    run = forward_timer(target, context_length, 2, seed)
    ways = {"plan": gemm.ENABLED, "stock": False}
    times = {(w, n): [] for w in ways for n in (1, 2)}
    saved = gemm.ENABLED
    try:
        with CpuShare() as share:
            for rep in range(repeats + 1):  # the first round warms up
                for w, on in ways.items():
                    gemm.ENABLED = on
                    for n in (1, 2) if rep % 2 else (2, 1):
                        dt = run(n)
                        if rep:
                            times[(w, n)].append(dt)
    finally:
        gemm.ENABLED = saved
    med = {f"{w}_{n}_token_s": statistics.median(v) for (w, n), v in times.items()}
    ratio = med["plan_1_token_s"] / med["plan_2_token_s"]
    return {"context_length": context_length, "repeats": repeats, **med,
            "plain_step_over_two_token": ratio, "tolerance": tolerance, "ok": ratio <= tolerance,
            "plain_step_gain_over_stock": med["stock_1_token_s"] / med["plan_1_token_s"],
            "other_cpu_share": share.others, "contended": share.busy, "kernels": gemm.describe()}


def describe(name: str, r: dict) -> str:
    """The result of `check_plain_step` on the target `name`, as printed."""
    lines = [f"{name}, context {r['context_length']}, median of {r['repeats']}, interleaved; kernel plan "
             f"{r['kernels']['plan']}: W @ xᵀ at rows {r['kernels']['transposed_rows']}",
             f"  1-token step {1e3 * r['plan_1_token_s']:.1f} ms, 2-token forward {1e3 * r['plan_2_token_s']:.1f} ms "
             f"(ratio {r['plain_step_over_two_token']:.2f}, limit {r['tolerance']:.2f}): "
             f"{'ok' if r['ok'] else 'FAILED'}",
             f"  stock kernels: 1-token {1e3 * r['stock_1_token_s']:.1f} ms, "
             f"2-token {1e3 * r['stock_2_token_s']:.1f} ms; "
             f"the plan makes plain decoding's step {r['plain_step_gain_over_stock']:.2f}x faster"]
    if r["contended"]:
        lines.append(f"  other processes used {100 * r['other_cpu_share']:.0f}% of the CPU meanwhile: "
                     "not a valid timing")
    return "\n".join(lines)
