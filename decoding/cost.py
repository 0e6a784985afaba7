"""The cost model, measured on the machine it runs on (docs/evaluation.md, "The cost model").

Speedup of a chain of k draft tokens:

    S(k) = E[tokens | k] / (v(k) + k·c)

  v(k)  time of one target forward over k+1 new tokens with a KV cache of realistic length, divided by
        the time of a 1-token step (v(0) = 1). On a GPU v stays near 1 for small k; on a 2-core CPU it
        grows with k, which is why k is chosen from measurements instead of assumed.
  c     one proposer step relative to one target step (n-gram lookup: ~0; a draft model: its forward).
  E     expected tokens per verification step = 1 + Σ_{d=1..k} P(first d drafts accepted), with P taken
        over ALL steps (a step whose proposal is empty or short counts as not reaching d), so E(k) is the
        measured τ at the measured k (Leviathan et al. 2023 §3.3 give the i.i.d. special case
        E = (1 - α^(k+1)) / (1 - α)). Beyond the measured depth, P is extrapolated geometrically with the
        last measured conditional acceptance.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from draftsmith.decoding.proposer import as_model
from draftsmith.decoding.verify import tree_attention
from draftsmith.targets import kvcache

log = logging.getLogger(__name__)

# other processes' share of the machine's CPU time above which a timing is flagged as contended: a quiet
# machine shows a few percent (the shell, the kernel); a test run or a training job beside it shows 40-100%
BUSY_SHARE = 0.2
# /proc/stat counts in clock ticks (10 ms at the usual USER_HZ of 100): a block shorter than a few ticks of
# all cores' time reads a share of 0 or 1 from one tick's rounding, so below this it is not read at all
MIN_READ_CPU_S = 0.05


def contended(share: float | None) -> bool:
    """Whether other processes' CPU share during a timing (`CpuShare.others`) makes it untrustworthy."""
    return share is not None and share > BUSY_SHARE


def _machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat (Linux); None elsewhere.
    Hypervisor steal counts as busy: another guest used that core."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


class CpuShare:
    """How much of the machine other processes used while a block ran (a timing's contention check).

        with CpuShare() as share:
            ...timed work...
        share.others   # fraction of all cores' time used by other processes (None: not measurable here,
                       # or the block was too short for /proc/stat's clock ticks to tell)

    Our own CPU time (every thread of this process) is subtracted from the machine's busy time, so a run
    that keeps both cores busy by itself reads ~0.
    """

    def __init__(self) -> None:
        self.others: float | None = None

    def __enter__(self) -> CpuShare:
        self._machine = _machine_cpu_s()
        self._own = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        end = _machine_cpu_s()
        if self._machine is None or end is None:
            return
        busy, total = end[0] - self._machine[0], end[1] - self._machine[1]
        own = time.process_time() - self._own
        if total >= MIN_READ_CPU_S:
            self.others = min(max((busy - own) / total, 0.0), 1.0)

    @property
    def busy(self) -> bool:
        return contended(self.others)


def forward_timer(target, context_length: int, n_max: int, seed: int = 0, tree_mask: bool = False):
    """A function n -> seconds of one target forward over n new tokens (n <= n_max) on a KV cache of
    `context_length` random tokens, the cache cropped back after each (so every call sees the same context).

    tree_mask: feed every forward of more than one token with the verifier's 4-D tree mask (a tree's
    verify forward; a mask's shape, not its pattern, sets the cost) instead of the causal one of a chain."""
    model = as_model(target)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (1, context_length), generator=g).to(device)
    new = torch.randint(0, vocab, (1, n_max), generator=g).to(device)
    cache = kvcache.new_cache(model)
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def run(n: int) -> float:
        pos = torch.arange(context_length, context_length + n, device=device)[None]
        mask = None
        if tree_mask and n > 1:
            mask, pos = tree_attention(list(range(-1, n - 2)), context_length, dtype, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        model(input_ids=new[:, :n], attention_mask=mask, past_key_values=cache, position_ids=pos, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        kvcache.crop(cache, context_length)
        return dt

    return run


@torch.no_grad()
def measure_verify_cost(target, context_length: int = 256, k_max: int = 16, repeats: int = 9,
                        seed: int = 0, tree_mask: bool = False) -> dict:
    """v(k) for k = 0..k_max: median time of a (k+1)-token forward on a `context_length` cache / 1-token time.

    The ks are interleaved over the repeats. The median, not the fastest repeat: the decoder pays a forward's
    typical cost (v from the fastest repeats read v(1) = 1.02 against 1.15, and EAGLE's trees grew from 2.9
    to 3.4 verified nodes a step without getting faster; the fastest times stay in the result as
    `t_forward_min_s`). Another process slows large forwards more than small ones: a v(n) taken beside a test
    run read v(1) = 1.71 and cut every tree to almost nothing. So `other_cpu_share` reports how much of the
    machine other processes used meanwhile; above `BUSY_SHARE` the result says so and a warning is logged.
    tree_mask: as in `forward_timer`.
    """
    run = forward_timer(target, context_length, k_max + 1, seed, tree_mask)
    for _ in range(2):  # warm-up
        run(1)
        run(k_max + 1)
    times: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
    with CpuShare() as share:
        for _ in range(repeats):  # interleave ks so load changes hit every k alike
            for k in range(k_max + 1):
                times[k].append(run(k + 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[0]
    if share.busy:
        log.warning("v(n) was measured while other processes used %.0f%% of the CPU: it overstates what larger "
                    "verify forwards cost, so trees and k come out too small; measure on a quiet machine",
                    100 * share.others)
    return {
        "context_length": context_length, "repeats": repeats,
        "t_step_s": base,
        "t_forward_s": {str(k): med[k] for k in med},
        "t_forward_min_s": {str(k): min(v) for k, v in times.items()},
        "v": {str(k): med[k] / base for k in med},
        "other_cpu_share": share.others,
        "contended": share.busy,
    }


def expected_tokens(accepted_at: list[int], steps: int, k: int) -> float:
    """E[tokens | k] = 1 + Σ_{d<k} P_d with P_d = accepted_at[d] / steps, extrapolated past the data."""
    if steps <= 0:
        return 1.0
    probs = [a / steps for a in accepted_at]
    e = 1.0
    for d in range(k):
        if d < len(probs):
            p = probs[d]
        elif probs and probs[-1] > 0:
            prev = probs[-2] if len(probs) > 1 else 1.0
            ratio = min(probs[-1] / prev, 1.0) if prev > 0 else 0.0
            p = probs[-1] * ratio ** (d - len(probs) + 1)
        else:
            p = 0.0
        e += p
    return e


def expected_cost(proposed_at: list[int], steps: int, k: int, v: dict[str, float], c: float) -> float:
    """Mean cost of one step, in target steps, if the chain limit were k: Σ_steps v(l) + l·c over the
    steps' proposal lengths l (from the measured length distribution, cut at k). A proposer that always
    fills its chain (a draft model) gives v(k) + k·c; n-gram proposals are often shorter or empty, and a
    step with an empty proposal costs v(0) = 1. Steps that filled the measured limit are assumed to fill k."""
    if steps <= 0:
        return v["0"]
    depth = len(proposed_at)
    reached = [steps] + list(proposed_at) + [0]
    total = 0.0
    for length in range(depth + 1):
        n = reached[length] - reached[length + 1]  # steps whose proposal had exactly this length
        if n <= 0:
            continue
        used = k if length == depth else min(length, k)
        total += n * (v[str(used)] + used * c)
    return total / steps


def predicted_speedup(accepted_at: list[int], proposed_at: list[int], steps: int, k: int, v: dict[str, float],
                      c: float) -> float:
    """S(k) = E[tokens | k] / E[cost | k] (module docstring)."""
    return expected_tokens(accepted_at, steps, k) / expected_cost(proposed_at, steps, k, v, c)


def recommend_k(accepted_at: list[int], proposed_at: list[int], steps: int, v: dict[str, float], c: float,
                k_max: int | None = None) -> dict:
    """argmax_k S(k) over k = 0..k_max (k = 0: do not speculate). k_max defaults to the measured depth, so
    the recommendation never rests on extrapolated acceptance; evaluate with a larger k to look further."""
    k_max = len(proposed_at) if k_max is None else k_max
    ks = [k for k in map(int, v) if k <= k_max]
    table = {k: predicted_speedup(accepted_at, proposed_at, steps, k, v, c) for k in ks}
    best = max(table, key=lambda k: (round(table[k], 9), -k))
    return {"k": best, "predicted_speedup": table[best],
            "predicted_speedup_by_k": {str(k): x for k, x in table.items()}}


def tau_from_alpha(alpha: float | None, k: int) -> float | None:
    """τ predicted from α assuming i.i.d. acceptance: (1 - α^(k+1)) / (1 - α) (Leviathan et al. 2023, eq. 1)."""
    if alpha is None:
        return None
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
