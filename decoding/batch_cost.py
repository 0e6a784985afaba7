"""The cost model along the batch dimension: what speculation buys a server at each concurrency.

decoding/cost.py prices a chain at batch 1 on draftsmith's own decoder: S(k) = E[tokens | k] / (v(k) + k·c).
A serving engine decodes many requests at once, and what one verify step costs depends on how many requests
share it: at low concurrency a step is bound by reading the weights, and k+1 tokens per request cost about what
one does; as the batch grows the step becomes bound by compute, and every drafted token is paid for whether it
is accepted or not. So the cost is measured on the engine at each concurrency c (`draftsmith serve-bench`):

    t1(c)   the target's decode step with c requests in flight: the plain server's time per output token
            (each of its steps emits one token per request), = Σ decode seconds / Σ (output tokens - 1)
    tk(c)   the step with the drafter at its chain length k: drafting k tokens and verifying k+1 per request,
            = Σ decode seconds / Σ verify steps (vLLM counts each request's steps: num_spec_steps)
    r(c)    = tk(c) / t1(c), the step's cost in target steps at that batch (v(k) + k·c of the batch-1 model)

and the decode rate's speedup at c is predicted as

    S_decode(c) = E[tokens | k] / r(c)

with E from vLLM's own per-request acceptance (accepted per position over verify steps: decoding/cost.py's
expected_tokens, 1 + Σ_{d<k} accepted_at[d] / steps, the measured τ at the measured k; k' <= k never
extrapolates). A served request is more than its decode steps: its prompt is prefilled first, and a drafter that
reads the target's features prefills its own layers too (measured: EAGLE-3's time to first token on smollm2-135m
is about twice the plain server's). With c requests in flight the output rate is c requests' tokens over one
request's latency, so the served speedup is the ratio of latencies,

    S(c) = (TTFT_plain + n·t1(c)) / (TTFT_drafter + n·t1(c) / S_decode(c))

with n the output tokens after the first (means over the run's requests). serve-bench takes TTFT and n measured
and predicts the decode part from the acceptance and r(c): per domain, with r(c) and t1(c) of the mixed run and
the domain's own acceptance, TTFT and n, against the domain's measured speedup (`Served`).

A chain shorter than the one measured (k' < k) is priced by linear interpolation, r(c, k') = 1 + (r(c) - 1)·k'/k:
the drafter's steps and the verified tokens both grow with k', and only k' = k and k' = 0 (r = 1) were measured,
so the recommendation for k' strictly between them rests on that assumption (the report says so). At each
concurrency the k' in 0..k with the largest S_decode(c, k') is recommended (vLLM's per-batch-size setting changes
the decode steps only); k' = 0 is "off": the drafter costs more than it saves there, in its decode steps or, where
the served S(c) at the best k' stays below 1, in its prefill. vLLM (0.32) takes such a choice per batch size as
`num_speculative_tokens_per_batch_size`: inclusive ranges of batch sizes, each with its k (0 allowed), the first
starting at 1 (`schedule` writes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from draftsmith.decoding.cost import expected_tokens


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) by linear interpolation between the closest ranks (numpy's default):
    position (n - 1)·p/100 in the sorted values. None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p is {p!r}, expected 0..100")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None where either is missing or den is not positive (a speedup with no baseline)."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def step_ratio(plain_step_s: float | None, spec_step_s: float | None) -> float | None:
    """r(c) = tk(c) / t1(c): one speculative step (draft k, verify k+1 per request) in target steps."""
    return ratio(spec_step_s, plain_step_s)


def step_ratio_at(r: float, k: int, k2: int) -> float:
    """r(c, k') for a chain of k' <= k, interpolated linearly between r(c, 0) = 1 and the measured r(c, k)."""
    if not 0 <= k2 <= k or k < 1:
        raise ValueError(f"chain length {k2} outside 0..{k} (the measured k)")
    return 1.0 + (r - 1.0) * k2 / k


def predicted_speedup(accepted_at: list[float], steps: float, k: int, r: float | None) -> float | None:
    """S(c) = E[tokens | k] / r(c) (module docstring); None without a measured r."""
    if r is None or r <= 0:
        return None
    return expected_tokens(accepted_at, steps, k) / r


@dataclass(frozen=True)
class Served:
    """What a request costs at one concurrency, measured on the engine (module docstring): `t1` the plain decode
    step (s), `ttft_plain` / `ttft_drafter` the mean time to first token without / with the drafter (s), `n` the
    mean output tokens after the first."""

    t1: float
    ttft_plain: float
    ttft_drafter: float
    n: float

    def speedup(self, decode_speedup: float | None) -> float | None:
        """S(c) = (TTFT_plain + n·t1) / (TTFT_drafter + n·t1 / S_decode); None without a decode speedup."""
        if decode_speedup is None or decode_speedup <= 0:
            return None
        return (self.ttft_plain + self.n * self.t1) / (self.ttft_drafter + self.n * self.t1 / decode_speedup)


def recommend_k(accepted_at: list[float], steps: float, k: int, r: float | None,
                served: Served | None = None) -> dict:
    """The chain length k' in 0..k with the largest predicted S_decode(c, k') (ties: the shorter chain), and the
    table it was chosen from; k' = 0 ("off") predicts 1.0, plain decoding. With `served`, a best k' whose served
    speedup S(c) is below 1 (the drafter's prefill costs more than its decode steps save) is "off" too
    (`off_by_prefill`). None (k' unknown) where r is not measured."""
    if r is None or r <= 0 or steps <= 0:
        return {"k": None, "predicted_speedup_by_k": {}}
    table = {0: 1.0}
    for k2 in range(1, k + 1):
        table[k2] = expected_tokens(accepted_at, steps, k2) / step_ratio_at(r, k, k2)
    best = max(table, key=lambda x: (round(table[x], 9), -x))
    whole = served.speedup(table[best]) if served is not None and best else None
    off = whole is not None and whole < 1.0
    return {"k": 0 if off else best, "predicted_decode_speedup": table[best], "predicted_speedup": whole,
            "off_by_prefill": off, "predicted_decode_speedup_by_k": {str(x): v for x, v in table.items()}}


def schedule(ks: dict[int, int], max_batch: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` from a k per measured concurrency: concurrency c_i covers the
    batch sizes c_i .. c_{i+1} - 1 (the first from 1, the last up to max_batch), neighbouring ranges with the
    same k merged. [[start, end, k], ...]; k = 0 turns speculation off for that range."""
    if not ks:
        return []
    cs = sorted(ks)
    if max_batch < cs[-1]:
        raise ValueError(f"max batch {max_batch} is below the largest measured concurrency {cs[-1]}")
    out: list[list[int]] = []
    for i, c in enumerate(cs):
        start = 1 if i == 0 else c
        end = cs[i + 1] - 1 if i + 1 < len(cs) else max_batch
        if out and out[-1][2] == ks[c]:
            out[-1][1] = end
        else:
            out.append([start, end, ks[c]])
    return out
