"""`evaluate(...)`: run a proposer against a target per domain and build the report dict.

For every prompt, in one process and back to back, the same chat-templated prompt is decoded by
  1. our plain decoding (k = 0, the same code path as speculation: the baseline and the lossless reference),
  2. speculative decoding with the proposer,
  3. HF `model.generate` (greedy; the outside reference for our baseline's speed and output), with the
     stock kernels a user's own model runs (targets/gemm.py off), and for a draft proposer HF assisted
     generation `generate(assistant_model=draft)`.
A warm-up prompt is decoded first and not counted.

Per domain and overall: n_prompts, alpha, tau (and tau predicted from alpha), per_position_acceptance,
tokens_per_s, baseline_tokens_per_s, speedup (= speculative tokens/s / baseline tokens/s, which equals
baseline time / speculative time when, as in greedy decoding, both emit the same tokens; the headline),
speedup_vs_hf_generate (against the outside reference), lossless (greedy: speculative tokens == baseline
tokens for every prompt; None when sampling).

The baseline is the fastest plain decoding this machine does: its one-token step goes through the few-row
kernel plan measured at load (targets/gemm.py), the same plan the verifier's forwards use, so a speedup
is what speculation buys and not a kernel only the speculative runs take; `machine.few_row_kernels`
records the plan.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import resource
import sys
import time

import torch

from draftsmith.decoding.budget import VerifyCost
from draftsmith.decoding.draft import DraftProposer
from draftsmith.decoding.generate import GenerationStats, speculative_generate
from draftsmith.decoding.proposer import Proposer, TreeSpec, build_proposer, draft_dtype
from draftsmith.errors import ConfigError
from draftsmith.evaluation import cost
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.domains import EvalPrompt, default_prompt_files, format_prompt, load_prompts
from draftsmith.targets import gemm
from draftsmith.targets.device import dtype_name

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_generate(model, ids: list[int], cfg: EvalConfig, eos: list[int], pad: int | None, **extra) -> tuple[list[int], float]:
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    kw = dict(max_new_tokens=cfg.max_new_tokens, eos_token_id=eos or None, pad_token_id=pad,
              attention_mask=torch.ones_like(x))
    if cfg.temperature > 0:
        kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad(), gemm.disabled():  # the kernels a user's own model runs with
        out = model.generate(x, **kw, **extra)
    _sync(device)
    return out[0, x.shape[1]:].tolist(), time.perf_counter() - t0


def _strip_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device),
            "few_row_kernels": gemm.describe()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def memory_info(device: torch.device) -> dict:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}  # KB on Linux
    try:
        import psutil

        out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        pass
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _compare_entry(entry: str) -> tuple[str, int | str | TreeSpec | None, str | None]:
    """`PROPOSER[@SHAPE][@DTYPE]` -> (proposer spec, how it decodes in the side-by-side run, its draft dtype).

    SHAPE: chain | chain=K | tree | tree=B1,B2,... -> "chain" (a chain of the run's --k), K, "tree" (the
    proposer's own tree) or that TreeSpec; None = the run's own shape. DTYPE: float32 | bfloat16 | float16,
    None = the run's draft_dtype. One run can so put a head's chain next to its tree, or its bf16 next to its
    float32 (`--proposer eagle:P --tree auto --compare eagle:P@chain=4 eagle:P@float32`). An '@' followed by
    anything else is part of the proposer spec (a path may hold one).
    """
    name, shape, dtype = entry, None, None
    while True:
        head, sep, opt = name.rpartition("@")
        kind, eq, arg = opt.partition("=")
        if not sep or not (kind in ("chain", "tree") or opt in _DTYPE_NAMES):
            return name, shape, dtype
        if opt in _DTYPE_NAMES:
            if dtype is not None:
                break
            dtype = opt
        elif shape is not None:
            break
        elif not eq:
            shape = kind
        else:
            try:
                sizes = tuple(int(b) for b in arg.split(","))
            except ValueError:
                sizes = ()
            if not sizes or min(sizes) < 1 or (kind == "chain" and len(sizes) != 1):
                break
            shape = sizes[0] if kind == "chain" else TreeSpec(sizes)
        name = head
    raise ConfigError(f"compare '{entry}': after '@' give one shape (chain, chain=K, tree or tree=B1,B2,..., whole "
                      f"numbers >= 1) and/or one dtype ({', '.join(_DTYPE_NAMES)})")


def _summary(spec: GenerationStats, base: GenerationStats, n_prompts: int, lossless: bool | None, depth: int,
             hf_tokens: int, hf_time: float) -> dict:
    tps = spec.new_tokens / spec.wall_time if spec.wall_time > 0 else None
    btps = base.new_tokens / base.wall_time if base.wall_time > 0 else None
    hf_tps = hf_tokens / hf_time if hf_time > 0 else None
    alpha = spec.alpha
    return {
        "n_prompts": n_prompts,
        "alpha": alpha,
        "tau": spec.tau,
        "tau_predicted_from_alpha": cost.tau_from_alpha(alpha, depth),
        "per_position_acceptance": spec.per_position_acceptance,
        "conditional_acceptance": spec.conditional_acceptance,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": btps,
        "speedup": (tps / btps) if tps and btps else None,
        "lossless": lossless,
        "hf_generate_tokens_per_s": hf_tps,
        "speedup_vs_hf_generate": (tps / hf_tps) if tps and hf_tps else None,
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


def evaluate(target, proposer: str | Proposer = "ngram", prompts: list[str] | None = None,
             config: EvalConfig | None = None, command: str | None = None, **overrides) -> dict:
    """Evaluate `proposer` on `target` (a Target or a target spec string) and return the report dict.

    Settings come from `config` (an EvalConfig) updated with keyword `overrides` (EvalConfig field names).
    """
    import dataclasses

    cfg = config or EvalConfig()
    if prompts is not None:
        overrides["prompts"] = list(map(str, prompts))
    if isinstance(proposer, str):
        overrides["proposer"] = proposer
    cfg = dataclasses.replace(cfg, **overrides)
    if isinstance(target, str):
        from draftsmith.targets import load_target

        target = load_target(target, device=cfg.device, dtype=cfg.dtype)
    prop = proposer if isinstance(proposer, Proposer) else build_proposer(cfg.proposer, target)
    original_target = None
    if getattr(prop, "verifier_target", None) is not None:
        # Medusa-2: lossless with respect to the target with the artifact's adapter merged (heads/medusa2.py);
        # plain decoding, HF generate and the cost model all use that target too
        original_target, target = target, prop.verifier_target
    model, tok = target.model, target.tokenizer
    device = target.device
    drafts_in = draft_dtype(cfg.draft_dtype, target.dtype, device)
    cast = prop.use_dtype(drafts_in)
    eos = list(target.eos_token_ids)
    eos_set = set(eos)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
    if cfg.tree_from_proposer:
        if not hasattr(prop, "default_tree_spec"):
            raise ConfigError(f"proposer '{cfg.proposer}' has no tree of its own: give tree branching factors")
        spec = prop.default_tree_spec()
        cfg = dataclasses.replace(cfg, tree=list(spec.branching))
    else:
        spec = TreeSpec(tuple(cfg.tree)) if cfg.tree else TreeSpec.chain(cfg.k)
    files = cfg.prompts or [str(p) for p in default_prompt_files()]
    rows: list[EvalPrompt] = load_prompts(files, cfg.limit_per_domain, cfg.seed)
    gen_kw = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, eos_ids=eos)
    spec_kw = dict(tree=spec, k=None) if cfg.tree else dict(k=cfg.k)
    assistant = prop.model if isinstance(prop, DraftProposer) and cfg.hf_reference else None
    routed = hasattr(prop, "route")  # decoding.routing.RoutedProposer: pick each request's route first
    branches = hasattr(prop, "branch_stats")  # decoding.multi.MultiProposer: whose branch was accepted
    controller = None
    if cfg.adaptive:
        from draftsmith.decoding.adaptive import AdaptiveK

        log.info("adaptive k: measuring v(k), k = 0..%d, for the controller", cfg.k)
        controller = AdaptiveK(cost.measure_verify_cost(target, cfg.cost_context, cfg.k, 3, cfg.seed)["v"], k_max=cfg.k)
    if routed:
        prop.route(domain=rows[0].domain, text=rows[0].text)
    # side-by-side proposers: same prompts, same process, same rotation (each with its own tree, or chain k)
    others, other_dtypes = {}, {}
    for s in cfg.compare:
        name, shape, own_dtype = _compare_entry(s)
        other = build_proposer(name, target)
        if getattr(other, "verifier_target", None) is not None:
            raise ConfigError(f"compare '{s}': a Medusa-2 artifact is verified by its own adapted target, not by "
                              f"the target of this run; evaluate it in a run of its own")
        other_dtype = draft_dtype(own_dtype, target.dtype, device) if own_dtype else drafts_in
        other_cast = other.use_dtype(other_dtype)
        if shape is None:  # the run's own shape: the proposer's tree under --tree auto, else a chain of --k
            own = other.default_tree_spec() if cfg.tree_from_proposer and hasattr(other, "default_tree_spec") else None
        elif shape == "tree":
            if not hasattr(other, "default_tree_spec"):
                raise ConfigError(f"compare '{s}': proposer '{name}' has no tree of its own: give @tree=B1,B2,...")
            own = other.default_tree_spec()
        elif isinstance(shape, TreeSpec):
            own = shape
        else:  # "chain" (of --k) or a chain of K tokens
            own = None
        others[s] = (other, dict(tree=own, k=None) if own is not None else
                     dict(k=shape if isinstance(shape, int) else cfg.k))
        other_dtypes[s] = dtype_name(other_dtype) if other_cast else None
    verify_cost = tree_cost = None
    if cfg.prune_tree and not spec.is_chain:
        # scored trees (Medusa, EAGLE-2) are cut every step to the nodes that pay: v(n) with a tree mask,
        # measured here before decoding, over every node count a tree of this run can have
        n_max = max([spec.capacity()] + [kw["tree"].capacity() for _, kw in others.values() if kw.get("tree")])
        log.info("measuring v(n), n = 0..%d tree nodes, to size the trees", n_max)
        tree_cost = cost.measure_verify_cost(target, cfg.cost_context, n_max, min(cfg.cost_repeats, 5), cfg.seed,
                                             tree_mask=True)
        verify_cost = VerifyCost.from_measurement(tree_cost)
        spec_kw["cost"] = verify_cost
        if hasattr(prop, "fit_tree"):  # a tree that is the same every step (Medusa's) is cut once, up front
            spec = prop.fit_tree(spec, verify_cost)
            spec_kw["tree"] = spec
            log.info("tree cut to %d nodes, branching %s, by the cost model", spec.capacity(), list(spec.branching))
        for other, kw in others.values():
            if kw.get("tree") is not None:
                kw["cost"] = verify_cost
                if hasattr(other, "fit_tree"):
                    kw["tree"] = other.fit_tree(kw["tree"], verify_cost)

    # warm-up (not counted): every code path once
    warm = format_prompt(tok, rows[0].text)
    speculative_generate(target, None, [warm], min(8, cfg.max_new_tokens), k=0, seed=cfg.seed, **gen_kw)
    speculative_generate(target, prop, [warm], min(8, cfg.max_new_tokens), seed=cfg.seed, **spec_kw, **gen_kw)
    for other, kw in others.values():
        speculative_generate(target, other, [warm], min(8, cfg.max_new_tokens), seed=cfg.seed, **kw, **gen_kw)
    if cfg.hf_reference:
        _hf_generate(model, warm[:], dataclasses.replace(cfg, max_new_tokens=min(8, cfg.max_new_tokens)), eos, pad)

    per_prompt = []
    for i, row in enumerate(rows):
        ids = format_prompt(tok, row.text)
        seed = cfg.seed + i
        # the three runs rotate their order prompt by prompt, so a drift in machine load hits each alike
        runs: dict = {}
        route = prop.route(domain=row.domain, text=row.text) if routed else None
        if branches:
            prop.reset_stats()
        order = ["base", "spec", "hf"] + (["adaptive"] if controller is not None else []) + \
            [f"cmp:{s}" for s in others]
        for name in order[i % len(order):] + order[: i % len(order)]:
            if name == "base":
                runs["base"] = speculative_generate(target, None, [ids], cfg.max_new_tokens, k=0, seed=seed, **gen_kw)
            elif name == "spec":
                runs["spec"] = speculative_generate(target, prop, [ids], cfg.max_new_tokens, seed=seed, **spec_kw,
                                                    **gen_kw)
                if branches:
                    runs["branches"] = prop.branch_stats()
            elif name.startswith("cmp:"):
                other, kw = others[name[4:]]
                runs[name] = speculative_generate(target, other, [ids], cfg.max_new_tokens, seed=seed, **kw, **gen_kw)
            elif name == "adaptive":
                runs["adaptive"] = speculative_generate(target, prop, [ids], cfg.max_new_tokens, k=cfg.k, seed=seed,
                                                        adaptive=controller, **gen_kw)
            elif cfg.hf_reference:
                runs["hf"] = _hf_generate(model, ids, cfg, eos, pad)
        base, sp = runs["base"], runs["spec"]
        rec = {"domain": row.domain, "source": row.source, "prompt_tokens": len(ids), "base": base.stats,
               "spec": sp.stats, "new_tokens": len(sp.tokens[0]),
               "lossless": (sp.tokens[0] == base.tokens[0]) if cfg.temperature == 0 else None}
        if routed:
            rec["route"] = _route_name(prop)
            rec["routed_as"] = route
        if branches:
            rec["branches"] = runs["branches"]
        if others:
            rec["compare"] = {s: (runs[f"cmp:{s}"].stats, (runs[f"cmp:{s}"].tokens[0] == base.tokens[0])
                                  if cfg.temperature == 0 else None) for s in others}
        if "adaptive" in runs:
            ad = runs["adaptive"]
            rec["adaptive"] = ad.stats
            rec["adaptive_k"] = ad.k_history[0]
            rec["adaptive_lossless"] = (ad.tokens[0] == base.tokens[0]) if cfg.temperature == 0 else None
        if cfg.hf_reference:
            hf_tokens, hf_time = runs["hf"]
            hf_tokens = _strip_after_eos(hf_tokens, eos_set)
            rec["hf_tokens"], rec["hf_time"] = len(hf_tokens), hf_time
            rec["hf_matches_baseline"] = (hf_tokens == base.tokens[0]) if cfg.temperature == 0 else None
            if assistant is not None:
                as_tokens, as_time = _hf_generate(model, ids, cfg, eos, pad, assistant_model=assistant)
                as_tokens = _strip_after_eos(as_tokens, eos_set)
                rec["assisted_tokens"], rec["assisted_time"] = len(as_tokens), as_time
                rec["assisted_matches_baseline"] = (as_tokens == base.tokens[0]) if cfg.temperature == 0 else None
        per_prompt.append(rec)
        log.info("[%d/%d] %s %s: %d tokens, alpha %s, tau %.2f, %.1f tok/s vs %.1f plain%s%s", i + 1, len(rows),
                 row.domain, row.source, rec["new_tokens"], f"{sp.stats.alpha:.2f}" if sp.stats.alpha is not None
                 else "-", sp.stats.tau or 0, sp.stats.new_tokens / sp.stats.wall_time,
                 base.stats.new_tokens / base.stats.wall_time,
                 f" vs {rec['hf_tokens'] / rec['hf_time']:.1f} HF" if "hf_time" in rec else "",
                 "" if rec["lossless"] is not False else " NOT LOSSLESS")

    def aggregate(recs: list[dict]) -> dict:
        s, b = GenerationStats(), GenerationStats()
        for r in recs:
            s.merge(r["spec"])
            b.merge(r["base"])
        flags = [r["lossless"] for r in recs]
        lossless = None if any(f is None for f in flags) else all(flags)
        out = _summary(s, b, len(recs), lossless, spec.depth, sum(r.get("hf_tokens", 0) for r in recs),
                       sum(r.get("hf_time", 0.0) for r in recs))
        out["_stats"] = s
        if routed:
            counts: dict[str, int] = {}
            for r in recs:
                counts[r["route"]] = counts.get(r["route"], 0) + 1
            out["route"] = max(counts, key=counts.get)
            out["routes"] = counts
        if branches:
            out["branches"] = _sum_branches([r["branches"] for r in recs])
        if others:
            out["compare"] = {}
            for name in others:
                c = GenerationStats()
                for r in recs:
                    c.merge(r["compare"][name][0])
                cflags = [r["compare"][name][1] for r in recs]
                summ = _summary(c, b, len(recs), None if any(f is None for f in cflags) else all(cflags), 0, 0, 0.0)
                out["compare"][name] = {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup",
                                                                   "lossless", "per_position_acceptance",
                                                                   "conditional_acceptance",
                                                                   "verified_nodes_per_step")}
        if controller is not None:
            a = GenerationStats()
            for r in recs:
                a.merge(r["adaptive"])
            aflags = [r["adaptive_lossless"] for r in recs]
            ks = [k for r in recs for k in r["adaptive_k"]]
            summ = _summary(a, b, len(recs), None if any(f is None for f in aflags) else all(aflags), cfg.k, 0, 0.0)
            out["adaptive"] = {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup", "lossless",
                                                          "proposed", "accepted", "target_forwards")}
            out["adaptive"]["mean_k"] = sum(ks) / len(ks) if ks else None
            out["adaptive"]["plain_step_share"] = sum(1 for k in ks if k == 0) / len(ks) if ks else None
        return out

    domains = {}
    for name in sorted({r["domain"] for r in per_prompt}):
        domains[name] = aggregate([r for r in per_prompt if r["domain"] == name])
    overall = aggregate(per_prompt)

    # cost model: v(k) measured here; c from the run (proposer time per proposed token / one target step)
    base_all = GenerationStats()
    for r in per_prompt:
        base_all.merge(r["base"])
    t_step = base_all.target_time / max(base_all.target_forwards, 1)
    spec_all: GenerationStats = overall["_stats"]
    c = (spec_all.proposer_time / max(spec_all.proposed + spec_all.pruned, 1)) / t_step if t_step > 0 else 0.0
    cost_model: dict = {"c": c, "t_step_decode_s": t_step}
    if verify_cost is not None:
        cost_model["v_tree"] = {str(n): v for n, v in enumerate(verify_cost.v)}
        cost_model["v_tree_other_cpu_share"] = tree_cost["other_cpu_share"]
    recommended: dict = {}
    policy: dict = {}
    if cfg.cost_model:
        log.info("measuring the cost model v(k), k = 0..%d", max(cfg.cost_k_max, spec.depth))
        cost_model.update(cost.measure_verify_cost(target, cfg.cost_context, max(cfg.cost_k_max, spec.depth),
                                                   cfg.cost_repeats, cfg.seed))
        v = cost_model["v"]
        for name, d in list(domains.items()) + [("overall", overall)]:
            st: GenerationStats = d["_stats"]
            rec = cost.recommend_k(st.accepted_per_position, st.proposed_per_position, st.target_forwards, v, c) \
                if spec.is_chain else None
            pred_now = cost.predicted_speedup(st.accepted_per_position, st.proposed_per_position, st.target_forwards,
                                              spec.depth, v, c) if spec.is_chain and str(spec.depth) in v else None
            d["predicted_speedup"] = pred_now
            if rec is not None:
                recommended[name] = {"k": rec["k"], "predicted_speedup": rec["predicted_speedup"]}
            if name != "overall":
                policy[name] = _policy(d, rec, cfg.policy_threshold)
    for d in list(domains.values()) + [overall]:
        d.pop("_stats")

    hf_tok = sum(r.get("hf_tokens", 0) for r in per_prompt)
    hf_time = sum(r.get("hf_time", 0.0) for r in per_prompt)
    references: dict = {"plain_decoding_tokens_per_s": overall["baseline_tokens_per_s"]}
    if cfg.hf_reference:
        hf_tps = hf_tok / hf_time if hf_time > 0 else None
        flags = [r.get("hf_matches_baseline") for r in per_prompt]
        references["hf_generate"] = {
            "tokens_per_s": hf_tps,
            "matches_plain_decoding": None if any(f is None for f in flags) else all(flags),
            "n_mismatch": sum(1 for f in flags if f is False),
        }
        references["plain_vs_hf_generate"] = (overall["baseline_tokens_per_s"] / hf_tps) if hf_tps else None
        if assistant is not None:
            a_tok = sum(r.get("assisted_tokens", 0) for r in per_prompt)
            a_time = sum(r.get("assisted_time", 0.0) for r in per_prompt)
            aflags = [r.get("assisted_matches_baseline") for r in per_prompt]
            references["hf_assisted_generate"] = {
                "tokens_per_s": a_tok / a_time if a_time > 0 else None,
                "matches_target_greedy": None if any(f is None for f in aflags) else all(aflags),
            }

    return {
        "command": command or " ".join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine_info(device),
        "target": {"name": target.name, "spec": target.spec, "fingerprint": (original_target or target).fingerprint(),
                   **({"adapted": "the artifact's LoRA adapter merged (Medusa-2)"} if original_target else {})},
        "proposer": cfg.proposer if isinstance(proposer, str) else getattr(proposer, "name", type(proposer).__name__),
        "settings": {
            "max_new_tokens": cfg.max_new_tokens, "k": None if cfg.tree else cfg.k, "tree": cfg.tree,
            "tree_max_nodes": spec.max_nodes, "prune_tree": verify_cost is not None,
            "tree_verified": list(spec.branching) if cfg.tree else None,  # after a cut by the cost model
            "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
            "limit_per_domain": cfg.limit_per_domain, "seed": cfg.seed, "prompt_files": files,
            "adaptive": cfg.adaptive, "compare": list(cfg.compare),
            "draft_dtype": dtype_name(drafts_in) if cast else None,  # None: the proposer has no network to cast
            "compare_settings": {name: {"k": kw["k"], "tree": list(kw["tree"].branching) if kw.get("tree") else None,
                                        "tree_max_nodes": kw["tree"].max_nodes if kw.get("tree") else None,
                                        "draft_dtype": other_dtypes[name]}
                                 for name, (_, kw) in others.items()},
        },
        "domains": domains,
        "overall": overall,
        "cost_model": cost_model,
        "recommended_k": recommended,
        "policy": policy,
        "memory": memory_info(device),
        "references": references,
        "prompts": [{k: v for k, v in r.items() if k not in ("base", "spec", "adaptive", "adaptive_k", "compare")} | {
            "alpha": r["spec"].alpha, "tau": r["spec"].tau,
            "tokens_per_s": r["spec"].new_tokens / r["spec"].wall_time if r["spec"].wall_time else None,
            "baseline_tokens_per_s": r["base"].new_tokens / r["base"].wall_time if r["base"].wall_time else None,
        } for r in per_prompt],
    }


def _route_name(prop) -> str:
    return getattr(prop, "active_spec", None) or ("off" if prop.active is None else prop.active[0].name)


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
