"""Aggregation: per-prompt records -> the report's numbers per domain and overall.

Per domain and overall: n_prompts, alpha, tau (and tau predicted from alpha), per_position_acceptance,
tokens_per_s, baseline_tokens_per_s, speedup (= speculative tokens/s / baseline tokens/s, which equals
baseline time / speculative time when, as in greedy decoding, both emit the same tokens; the headline),
speedup_vs_hf_generate (against the outside reference), lossless (greedy: speculative tokens == the
reference's for every prompt; None when sampling), and where the run has them routes, merged trees' branches,
calibration sums, side-by-side entries, adaptive k and turn 1 against turns 2+. Acceptance counts every
prompt; speeds only the prompts whose timing is valid (evaluation/timing.py). Then the cost model: c from
the run, the recommended k and the enable/disable policy per domain.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.decoding import calibration, cost
from draftsmith.decoding.generate import GenerationStats
from draftsmith.evaluation.decode import all_or_none
from draftsmith.evaluation.setup import Setup
from draftsmith.evaluation.timing import entry_stats


def per_domain(per_prompt: list[dict], depth: int) -> tuple[dict, dict]:
    """Each domain's summary (`aggregate`, domains sorted by name) and the overall one."""
    domains = {name: aggregate([r for r in per_prompt if r["domain"] == name], depth)
               for name in sorted({r["domain"] for r in per_prompt})}
    return domains, aggregate(per_prompt, depth)


def aggregate(recs: list[dict], depth: int, by_turn: bool = True) -> dict:
    """Per-prompt records -> the report's summary of them (`_summary`, plus routes, branches, side-by-side
    entries and adaptive k where the records have them). Acceptance counts every prompt; tokens/s and
    speedups only the prompts whose timing of that entry is valid (`judge_timing`). `_stats` keeps the merged
    statistics of the main entry for the cost model; the caller drops it. Records of later turns of
    multi-turn prompts count like any other; `turns` splits them off (turn 1 against turns 2+)."""
    s, b = GenerationStats(), GenerationStats()
    for r in recs:
        s.merge(r["spec"])
        b.merge(r["base"])
    out = _summary(s, b, len(recs), all_or_none([r["lossless"] for r in recs]), depth, Speed.of(recs, "spec"))
    out["self_consistent"] = all_or_none([r.get("self_consistent") for r in recs])
    out["_stats"] = s
    if recs and "route" in recs[0]:
        counts: dict[str, int] = {}
        for r in recs:
            counts[r["route"]] = counts.get(r["route"], 0) + 1
        out["route"] = max(counts, key=counts.get)
        out["routes"] = counts
    if recs and "branches" in recs[0]:
        out["branches"] = _sum_branches([r["branches"] for r in recs])
    if recs and "calibration" in recs[0]:
        out["calibration"] = calibration.summary([p for r in recs for p in r["calibration"][0]],
                                                 [a for r in recs for a in r["calibration"][1]])
    def beside(pairs: list[tuple], key: str | None) -> dict:  # another entry's (stats, lossless) per prompt
        c = GenerationStats()
        for st, _ in pairs:
            c.merge(st)
        summ = _summary(c, b, len(recs), all_or_none([same for _, same in pairs]), 0,
                        Speed.of(recs, key) if key else Speed())
        keep = ("alpha", "tau", "lossless", "per_position_acceptance", "conditional_acceptance",
                "verified_nodes_per_step")
        if key:  # the uncut GPU-sized tree is decoded for its τ only
            keep += ("tokens_per_s", "speedup", "speedup_vs_plain", "speedup_vs_hf_generate", "n_timed")
        return {k: summ[k] for k in keep}

    if recs and "compare" in recs[0]:
        out["compare"] = {name: beside([r["compare"][name] for r in recs], name) for name in recs[0]["compare"]}
        for name in (recs[0].get("compare_gpu_tree") or {}):
            out["compare"][name]["gpu_tree"] = beside([r["compare_gpu_tree"][name] for r in recs], None)
    if recs and "gpu_tree" in recs[0]:
        out["gpu_tree"] = beside([r["gpu_tree"] for r in recs], None)
    if recs and "adaptive" in recs[0]:
        a = GenerationStats()
        for r in recs:
            a.merge(r["adaptive"])
        ks = [k for r in recs for k in r["adaptive_k"]]
        summ = _summary(a, b, len(recs), all_or_none([r["adaptive_lossless"] for r in recs]), 0,
                        Speed.of(recs, "adaptive"))
        out["adaptive"] = {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup", "lossless",
                                                      "proposed", "accepted", "target_forwards", "n_timed")}
        out["adaptive"]["mean_k"] = sum(ks) / len(ks) if ks else None
        out["adaptive"]["plain_step_share"] = sum(1 for k in ks if k == 0) / len(ks) if ks else None
    if by_turn and any(r.get("turn", 1) > 1 for r in recs):
        out["turns"] = {"1": _turn_summary([r for r in recs if r.get("turn", 1) == 1], depth),
                        "2+": _turn_summary([r for r in recs if r.get("turn", 1) > 1], depth)}
    return out


def _summary(spec: GenerationStats, base: GenerationStats, n_prompts: int, lossless: bool | None, depth: int,
             speed: Speed) -> dict:
    alpha = spec.alpha
    return {
        "n_prompts": n_prompts,
        "alpha": alpha,
        "tau": spec.tau,
        "tau_predicted_from_alpha": cost.tau_from_alpha(alpha, depth),
        "per_position_acceptance": spec.per_position_acceptance,
        "conditional_acceptance": spec.conditional_acceptance,
        **speed.fields(),
        "timing_valid": speed.n == n_prompts,
        "lossless": lossless,
        "proposed": spec.proposed,
        "pruned": spec.pruned,
        "verified_nodes_per_step": spec.proposed / spec.target_forwards if spec.target_forwards else None,
        "accepted": spec.accepted,
        "proposed_per_position": spec.proposed_per_position,
        "accepted_per_position": spec.accepted_per_position,
        "target_forwards": spec.target_forwards,
        "new_tokens": spec.new_tokens,
        "baseline_new_tokens": base.new_tokens,
        "proposer_time_s": spec.proposer_time,
        "target_time_s": spec.target_time,
        "wall_time_s": spec.wall_time,
        "baseline_wall_time_s": base.wall_time,
    }


@dataclass
class Speed:
    """Token counts and median seconds summed over the prompts whose timing of one entry is valid."""

    tokens: int = 0
    seconds: float = 0.0
    base_tokens: int = 0
    base_seconds: float = 0.0
    hf_tokens: int = 0
    hf_seconds: float = 0.0
    n: int = 0

    @staticmethod
    def of(recs: list[dict], key: str) -> Speed:
        sp = Speed()
        for r in recs:
            if not r.get("timed", {}).get(key):
                continue
            st = entry_stats(r, key)
            sp.tokens += st.new_tokens
            sp.seconds += st.wall_time
            sp.base_tokens += r["base"].new_tokens
            sp.base_seconds += r["base"].wall_time
            sp.hf_tokens += r.get("hf_tokens", 0)
            sp.hf_seconds += r.get("hf_time", 0.0)
            sp.n += 1
        return sp

    def fields(self) -> dict:
        """tokens/s of the entry, of our plain decoding and of HF generate, and the speedups: `speedup` is
        against the faster of the two plain decodings (`fastest_plain` says which), both shown beside it."""
        rate = lambda t, s: t / s if s > 0 and t else None  # noqa: E731
        tps, btps, hf = (rate(self.tokens, self.seconds), rate(self.base_tokens, self.base_seconds),
            rate(self.hf_tokens, self.hf_seconds))
        fastest = max((x for x in (btps, hf) if x), default=None)
        return {"tokens_per_s": tps, "baseline_tokens_per_s": btps, "hf_generate_tokens_per_s": hf,
                "speedup": tps / fastest if tps and fastest else None,
                "fastest_plain": None if fastest is None else ("draftsmith" if fastest == btps else "hf_generate"),
                "speedup_vs_plain": tps / btps if tps and btps else None,
                "speedup_vs_hf_generate": tps / hf if tps and hf else None, "n_timed": self.n}


def _sum_branches(items: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for item in items:
        for name, s in item.items():
            o = out.setdefault(name, {"proposed": 0, "accepted": 0, "wins": 0, "steps": 0})
            for key in o:
                o[key] += s[key]
    for o in out.values():
        o["alpha"] = o["accepted"] / o["proposed"] if o["proposed"] else None
        o["win_rate"] = o["wins"] / o["steps"] if o["steps"] else None
    return out


TURN_FIELDS = ("n_prompts", "alpha", "tau", "per_position_acceptance", "tokens_per_s", "baseline_tokens_per_s",
               "speedup", "n_timed", "lossless", "verified_nodes_per_step")


def _turn_summary(recs: list[dict], depth: int) -> dict | None:
    """The main entry's numbers over some turns, with the mean prompt length (a later turn reads a longer
    context) and the GPU-sized tree's τ where the run decoded one."""
    if not recs:
        return None
    full = aggregate(recs, depth, by_turn=False)
    out = {k: full[k] for k in TURN_FIELDS}
    out["mean_prompt_tokens"] = sum(r["prompt_tokens"] for r in recs) / len(recs)
    if "gpu_tree" in full:
        out["gpu_tree_tau"] = full["gpu_tree"]["tau"]
    return out


def cost_model_and_policy(setup: Setup, per_prompt: list[dict], domains: dict, overall: dict,
                          chain_cost: dict | None) -> tuple[dict, dict, dict]:
    """The cost model (v(k) measured here; c from the run: proposer time per proposed token / one target step),
    the recommended k per domain and the per-domain policy; sets each domain's `predicted_speedup`."""
    cfg, spec = setup.cfg, setup.spec
    base_all = GenerationStats()
    for r in per_prompt:
        base_all.merge(r["base"])
    t_step = base_all.target_time / max(base_all.target_forwards, 1)
    spec_all: GenerationStats = overall["_stats"]
    c = (spec_all.proposer_time / max(spec_all.proposed + spec_all.pruned, 1)) / t_step if t_step > 0 else 0.0
    cost_model: dict = {"c": c, "t_step_decode_s": t_step}
    if setup.verify_cost is not None:
        cost_model["v_tree"] = {str(n): v for n, v in enumerate(setup.verify_cost.v)}
        cost_model["v_tree_other_cpu_share"] = setup.tree_cost["other_cpu_share"]
    recommended: dict = {}
    policy: dict = {}
    if chain_cost is None:
        return cost_model, recommended, policy
    cost_model.update(chain_cost)
    v = cost_model["v"]
    for name, d in list(domains.items()) + [("overall", overall)]:
        st: GenerationStats = d["_stats"]
        rec = (cost.recommend_k(st.accepted_per_position, st.proposed_per_position, st.target_forwards, v, c)
            if spec.is_chain else None)
        d["predicted_speedup"] = (cost.predicted_speedup(st.accepted_per_position, st.proposed_per_position,
                                                         st.target_forwards, spec.depth, v, c)
                                  if spec.is_chain and str(spec.depth) in v else None)
        if rec is not None:
            recommended[name] = {"k": rec["k"], "predicted_speedup": rec["predicted_speedup"]}
        if name != "overall":
            policy[name] = _policy(d, rec, cfg.policy_threshold)
    return cost_model, recommended, policy


def _policy(d: dict, rec: dict | None, threshold: float) -> dict:
    """Enable speculation for a domain iff its measured speedup (same run, same prompts) reaches the
    threshold; without a measurement, iff the cost model's predicted speedup does. The cost model's best k
    is reported next to it: a domain disabled at this k may still pay off at the recommended one."""
    measured = d.get("speedup")
    predicted = d.get("predicted_speedup")
    basis, value = ("measured", measured) if measured is not None else ("predicted", predicted)
    enable = value is not None and value >= threshold
    if value is None:
        reason = "no speedup measured or predicted"
    else:
        reason = f"{basis} speedup {value:.2f} {'>=' if enable else '<'} {threshold:g}"
        if predicted is not None and basis == "measured":
            reason += f" (cost model predicts {predicted:.2f})"
    out = {"enable": enable, "threshold": threshold, "basis": basis, "measured_speedup": measured,
           "predicted_speedup": predicted, "reason": reason}
    if rec is not None:
        out["recommended_k"] = rec["k"]
        out["predicted_speedup_at_recommended_k"] = rec["predicted_speedup"]
        if rec["k"] == 0:
            out["reason"] += "; the cost model recommends k = 0 (no speculation)"
    return out
