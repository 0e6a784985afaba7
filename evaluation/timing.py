"""Timing on a shared machine: how each prompt's runs are timed, which timings may be published, and how
busy the machine was.

Per prompt, `measure` runs `repeats` rounds in which every timed run decodes once, the order rotating round
by round and prompt by prompt, so that a drift or a burst of load hits each alike; other processes' share of
the CPU is read around each run (cost.CpuShare), and a run not quiet often enough gets up to `remeasure`
more rounds. Each run's time is the median of its quiet measurements (`median_run`). A machine busy before
the first prompt (`busy_at_start`), or through two whole rounds of one, gets one round per prompt until a
round is quiet again: acceptance and losslessness measured, speedups not.

After decoding, `judge_timing` marks per prompt and entry whether its speedup may be published: every run it
is compared with measured quietly, and the speedup within what its τ and the verify cost v allow
(`speedup_bound`); `contention` is the report's account of it. The cost model's v(k) is measured here too
(`measure_chain_cost`).
"""

from __future__ import annotations

import logging
import time

from draftsmith.decoding import cost
from draftsmith.decoding.cost import CpuShare
from draftsmith.decoding.generate import GenerationStats
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.setup import Setup

log = logging.getLogger(__name__)


def busy_at_start(seconds: float = 2.0) -> bool:
    """Whether other processes keep the CPU busy before the first prompt (their share of the machine while this
    process sleeps for `seconds`): then timing round after round cannot succeed, and the user hears so now."""
    with CpuShare() as share:
        time.sleep(seconds)
    if not cost.contended(share.others):
        return False
    log.warning("other processes use %.0f%% of the CPU (over %.0f%%): speedups cannot be timed validly on a machine "
                "this busy. Measuring acceptance and losslessness with one round per prompt; speedups are "
                "reported as not measured unless the machine quiets down.", 100 * share.others, 100 * cost.BUSY_SHARE)
    return True


def measure(setup: Setup, runs: dict, timed: list[str], i: int, ids: list[int], seed: int):
    """Prompt i's rounds: every timed run once per round, in an order rotated by prompt and round, until each
    run has `repeats` quiet measurements or `remeasure` more rounds are spent. Returns each run's
    measurements (result, seconds, other processes' CPU share), the proposer's own statistics of its first run
    (`proposer_stats`), and the number of rounds."""
    cfg, prop = setup.cfg, setup.prop
    measured: dict[str, list] = {name: [] for name in timed}
    own: dict | None = None
    rounds = 0
    while True:
        shift = (i + rounds) % len(timed)
        for name in timed[shift:] + timed[:shift]:
            if name == "spec":
                prop.reset_stats()
            with CpuShare() as share:
                result, seconds = runs[name](ids, seed, cfg.max_new_tokens)
            measured[name].append((result, seconds, share.others))
            if name == "spec" and own is None:
                own = proposer_stats(prop)
        rounds += 1
        if setup.busy:  # busy mode: one round, and timing resumes only if every run of it was read as quiet
            if not all(sh is not None and not cost.contended(sh) for sh in _latest_shares(measured, timed, 1)):
                setup.busy_prompts += 1  # this round gave acceptance and losslessness, not a speedup
                return measured, own or {}, rounds
            log.info("the machine is quiet again: timing from prompt %d on", i + 1)
            setup.busy = False
        elif rounds >= 2 and cfg.remeasure and all(sh is not None and cost.contended(sh)
                                                   for sh in _latest_shares(measured, timed, 2)):
            # a burst lasts seconds; two whole rounds of every run busy is load that more rounds will not outwait
            log.warning("other processes kept the CPU busy through two whole rounds of prompt %d: from here on one "
                        "round per prompt (acceptance and losslessness; speedups not measured) until a round is "
                        "quiet", i + 1)
            setup.busy, setup.busy_prompts = True, setup.busy_prompts + 1
            return measured, own or {}, rounds
        short = [n for n in timed if quiet_count(measured[n]) < cfg.repeats]
        if rounds >= cfg.repeats and (not short or rounds >= cfg.repeats + cfg.remeasure):
            return measured, own or {}, rounds


def proposer_stats(prop) -> dict:
    """What a proposer counts of its own run since `reset_stats`: whose branch of a merged tree was accepted
    (`branches`), its acceptance estimates against what was accepted (`calibration`: two lists)."""
    out: dict = {}
    if prop.tracks_branches:
        out["branches"] = prop.branch_stats()
    if prop.estimates_acceptance:
        out["calibration"] = [list(x) for x in prop.acceptance_estimates()]
    return out


def _latest_shares(measured: dict, timed: list[str], rounds: int) -> list[float | None]:
    """Other processes' CPU share read around each timed run of the last `rounds` rounds (None: a run too short
    for /proc/stat to read, which shows neither load nor quiet)."""
    return [sh for n in timed for _, _, sh in measured[n][-rounds:]]


def quiet_count(runs: list) -> int:
    from draftsmith.decoding.cost import contended

    return sum(1 for _, _, share in runs if not contended(share))


def median_run(runs: list, need: int):
    """The run with the median time among the quiet ones (all of them when fewer than `need` were quiet):
    its result, with its time as the run's time."""
    from draftsmith.decoding.cost import contended

    quiet = [r for r in runs if not contended(r[2])]
    pool = sorted(quiet if len(quiet) >= need else runs, key=lambda r: r[1])
    result, seconds, _ = pool[(len(pool) - 1) // 2]
    if isinstance(result, list):  # HF generate: (tokens, seconds)
        return result, seconds
    return result


def entry_stats(rec: dict, key: str) -> GenerationStats:
    if key == "spec":
        return rec["spec"]
    if key == "adaptive":
        return rec["adaptive"]
    return rec["compare"][key][0]


def measure_chain_cost(setup: Setup) -> dict | None:
    """v(k), k = 0..max(cost_k_max, depth), measured here (cost_model on), else None."""
    cfg = setup.cfg
    if not cfg.cost_model:
        return None
    k_max = max(cfg.cost_k_max, setup.spec.depth)
    log.info("measuring the cost model v(k), k = 0..%d", k_max)
    return cost.measure_verify_cost(setup.target, cfg.cost_context, k_max, cfg.cost_repeats, cfg.seed)


def speed_limit_cost(setup: Setup, chain_cost: dict | None):
    """v(n) for the impossible-speedup check: the cheapest a forward over n nodes was seen to be (fastest
    repeats, so that a measurement under load does not make a real speedup look impossible); the tree
    measurement for trees, the chain one otherwise; None (v = 1) when neither was measured."""
    measured = setup.tree_cost if setup.tree_cost is not None else chain_cost
    if not measured or "t_forward_min_s" not in measured:
        return None
    t = measured["t_forward_min_s"]
    v = [t[str(n)] / t["0"] for n in range(len(t))]
    return lambda n: v[min(n, len(v) - 1)]


# a measured speedup above max(1, τ / v(verified nodes)) by more than this factor cannot be what speculation
# bought (each verify forward costs v steps and emits τ tokens on average): timing noise moves a median of
# three by a few percent, a burst of load on one of the two runs by 2-3x
IMPOSSIBLE_FACTOR = 1.25


def speedup_bound(tau: float | None, nodes: float | None, v) -> float:
    """The largest speedup τ tokens a verify forward over `nodes` nodes can give, when v(n) (a callable, or
    None for 1 everywhere) is what that forward costs in plain steps: max(1, τ / v(⌊nodes⌋))."""
    if not tau:
        return 1.0
    cost_n = v(int(nodes or 0)) if v is not None else 1.0
    return max(1.0, tau / max(cost_n, 1e-9))


def judge_timing(per_prompt: list[dict], v, hf: bool) -> None:
    """Mark, per prompt and per timed entry, whether its speedup may be published (`rec["timed"]`), and why not
    (`rec["timing"]["invalid"]`): every run it is compared with (plain decoding, HF generate) and the entry
    itself measured quietly, and its speedup over plain decoding within what its τ and v allow."""
    for rec in per_prompt:
        quiet = rec["timing"]["quiet"]
        keys = ["spec"] + list(rec.get("compare", {})) + (["adaptive"] if "adaptive" in rec else [])
        names = {"spec": "spec", "adaptive": "adaptive"}
        rec["timed"], invalid = {}, {}
        base_quiet = quiet["base"] and (quiet.get("hf", True) if hf else True)
        for key in keys:
            st = entry_stats(rec, key)
            if not (base_quiet and quiet.get(names.get(key, f"cmp:{key}"), True)):
                rounds = rec["timing"].get("rounds")
                invalid[key] = ("other processes kept the CPU busy during its measurements"
                                + (f" ({rounds} round{'s' if rounds != 1 else ''})" if rounds else ""))
            else:
                b = rec["base"]
                s = ((st.new_tokens / st.wall_time) / (b.new_tokens / b.wall_time)
                    if st.wall_time > 0 and b.wall_time > 0 and b.new_tokens else None)
                nodes = st.proposed / st.target_forwards if st.target_forwards else 0.0
                bound = speedup_bound(st.tau, nodes, v)
                if s is not None and s > IMPOSSIBLE_FACTOR * bound:
                    invalid[key] = (f"impossible speedup {s:.2f}: tau {st.tau:.2f} at {nodes:.1f} verified nodes "
                                    f"a step allows at most {bound:.2f}")
            rec["timed"][key] = key not in invalid
        rec["timing"]["invalid"] = invalid


def contention(share: float | None, per_prompt: list[dict] | None = None, cfg: EvalConfig | None = None,
               busy_prompts: int | None = None) -> dict:
    """How busy the machine was while the prompts were decoded, and which timings are valid. Validity follows
    from the per-prompt checks (`judge_timing`): each run measured quietly (re-measured when not), and no
    speedup above what τ and v allow. `other_cpu_share` is the whole run's average, for the record only.
    `busy_prompts`: the prompts decoded once each on a machine busy throughout (Setup.busy_prompts), counted
    and named in the note."""
    from draftsmith.decoding.cost import BUSY_SHARE, contended

    invalid = [{"prompt": r["source"], "domain": r["domain"], "entry": e, "reason": why}
               for r in per_prompt or [] for e, why in r["timing"].get("invalid", {}).items()]
    if per_prompt is None:  # a caller with only the run's average (older reports)
        valid = not contended(share)
    else:
        valid = not invalid
    n = len(per_prompt or [])
    bad = len({i["prompt"] for i in invalid})
    out = {"other_cpu_share": share, "threshold": BUSY_SHARE, "speedups_valid": valid,
           "repeats": cfg.repeats if cfg else None, "remeasure": cfg.remeasure if cfg else None,
           "prompts": n, "prompts_with_invalid_timing": bad, "invalid": invalid,
           "note": None if valid else
           f"speedups not valid for {bad} of {n} prompts (timed on a busy machine, or an impossible speedup): "
           f"they are left out of every summary and of the policy; acceptance (alpha, tau) and "
           f"losslessness still hold for all of them"}
    if busy_prompts is None:
        return out
    out["busy_prompts"] = busy_prompts
    if busy_prompts:
        out["note"] = (f"the machine was busy throughout {busy_prompts} of {n} prompts: they were decoded once "
                       f"each for acceptance and losslessness, their speedups not measured; " + (out["note"] or ""))
    return out
