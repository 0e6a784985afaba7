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

import dataclasses
import datetime as _dt
import logging
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass

import torch

from draftsmith.decoding.budget import VerifyCost
from draftsmith.decoding.draft import DraftProposer
from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.generate import GenerationStats, speculative_generate
from draftsmith.decoding.proposer import Proposer, TreeSpec, draft_dtype
from draftsmith.errors import ConfigError
from draftsmith.evaluation import cost
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.domains import EvalPrompt, default_prompt_files, format_prompt, load_prompts
from draftsmith.evaluation.limits import check_prompt_files, fit_context
from draftsmith.targets import gemm
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import pad_token_id

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


@dataclass
class Entry:
    """One proposer decoding every prompt of the run: the main one ("spec"), a side-by-side one
    ("cmp:ENTRY"), or the main one under adaptive k ("adaptive"); `kw` is how `speculative_generate`
    decodes it (k, tree, cost, adaptive)."""

    name: str
    proposer: Proposer
    kw: dict
    draft_dtype: str | None = None  # what its network runs in (None: it has none to cast)


@dataclass
class Setup:
    """A run's settings, resolved: the target that verifies, the prompts, the spec tree and every entry."""

    cfg: EvalConfig
    target: object
    original_target: object | None  # the run's target when the proposer brings its own verifier (Medusa-2)
    prop: Proposer
    spec: TreeSpec
    rows: list[EvalPrompt]
    files: list[str]
    gen_kw: dict
    entries: list[Entry]
    assistant: object | None = None  # a draft model for HF assisted generation
    verify_cost: VerifyCost | None = None
    tree_cost: dict | None = None

    @property
    def main(self) -> Entry:
        return self.entries[0]

    @property
    def compared(self) -> list[Entry]:
        return [e for e in self.entries if e.name.startswith("cmp:")]


def evaluate(target, proposer: str | Proposer = "ngram", prompts: list[str] | None = None,
             config: EvalConfig | None = None, command: str | None = None, **overrides) -> dict:
    """Evaluate `proposer` on `target` (a Target or a target spec string) and return the report dict.

    Settings come from `config` (an EvalConfig) updated with keyword `overrides` (EvalConfig field names).
    The run: settings -> every prompt decoded by each run (`decode_prompts`) -> a pure aggregation per domain
    (`aggregate`) -> the cost model, references and the report.
    """
    cfg = config or EvalConfig()
    if prompts is not None:
        overrides["prompts"] = list(map(str, prompts))
    if isinstance(proposer, str):
        overrides["proposer"] = proposer
    cfg = dataclasses.replace(cfg, **overrides)
    setup = build_setup(target, proposer, cfg)
    from draftsmith.evaluation.cost import CpuShare

    with CpuShare() as share:  # tokens/s and every speedup are timed in here
        per_prompt = decode_prompts(setup)
    depth = setup.spec.depth
    domains = {name: aggregate([r for r in per_prompt if r["domain"] == name], depth)
               for name in sorted({r["domain"] for r in per_prompt})}
    overall = aggregate(per_prompt, depth)
    cost_model, recommended, policy = _cost_model(setup, per_prompt, domains, overall)
    for d in list(domains.values()) + [overall]:
        d.pop("_stats")
    name = cfg.proposer if isinstance(proposer, str) else proposer.name
    report = _report(setup, name, command, per_prompt, domains, overall, cost_model, recommended, policy)
    report["contention"] = contention(share.others)
    return report


def contention(share: float | None) -> dict:
    """How busy the machine was while the prompts were decoded. Above cost.BUSY_SHARE the measured tokens/s
    and speedups say how busy the machine was, not how fast the decoding is: the report says so."""
    from draftsmith.evaluation.cost import BUSY_SHARE, contended

    return {"other_cpu_share": share, "threshold": BUSY_SHARE, "speedups_valid": not contended(share),
            "note": None if not contended(share) else
            f"other processes used {100 * share:.0f}% of the CPU while the prompts were decoded: tokens/s and "
            f"speedups are not valid (rerun on a quiet machine); acceptance (alpha, tau) and losslessness still hold"}


def build_setup(target, proposer: str | Proposer, cfg: EvalConfig) -> Setup:
    """Load what the run needs and decide how each entry decodes: the spec tree (the proposer's own under
    `tree_from_proposer`), the side-by-side entries' shapes and dtypes, adaptive k's controller, and the
    trees cut by the cost model measured here."""
    if isinstance(target, str):
        from draftsmith.targets import load_target

        target = load_target(target, device=cfg.device, dtype=cfg.dtype)
    prop = proposer if isinstance(proposer, Proposer) else build_proposer(cfg.proposer, target)
    original_target = None
    if prop.verifier_target is not None:
        original_target, target = target, prop.verifier_target
    device = target.device
    drafts_in = draft_dtype(cfg.draft_dtype, target.dtype, device)
    cast = prop.use_dtype(drafts_in)
    if cfg.tree_from_proposer:
        spec = prop.default_tree_spec()
        if spec is None:
            raise ConfigError(f"proposer '{cfg.proposer}' has no tree of its own: give tree branching factors")
        cfg = dataclasses.replace(cfg, tree=list(spec.branching))
    else:
        spec = TreeSpec(tuple(cfg.tree)) if cfg.tree else TreeSpec.chain(cfg.k)
    files = cfg.prompts or [str(p) for p in default_prompt_files()]
    check_prompt_files(files)
    rows = load_prompts(files, cfg.limit_per_domain, cfg.seed)
    fit_context(target, rows, cfg.max_new_tokens)
    eos = list(target.eos_token_ids)
    entries = [Entry("spec", prop, dict(tree=spec, k=None) if cfg.tree else dict(k=cfg.k),
                     dtype_name(drafts_in) if cast else None)]
    if cfg.adaptive:
        from draftsmith.decoding.adaptive import AdaptiveK

        log.info("adaptive k: measuring v(k), k = 0..%d, for the controller", cfg.k)
        controller = AdaptiveK(cost.measure_verify_cost(target, cfg.cost_context, cfg.k, 3, cfg.seed)["v"], k_max=cfg.k)
        entries.append(Entry("adaptive", prop, dict(k=cfg.k, adaptive=controller)))
    prop.route(domain=rows[0].domain, text=rows[0].text)  # a routed proposer measures with a route chosen
    entries += [_compare(s, target, cfg, drafts_in) for s in cfg.compare]
    setup = Setup(cfg, target, original_target, prop, spec, rows, files,
                  dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, eos_ids=eos), entries,
                  assistant=prop.model if isinstance(prop, DraftProposer) and cfg.hf_reference else None)
    if cfg.prune_tree and not spec.is_chain:
        _cut_trees(setup)
        gpu = prop.gpu_tree() if cfg.gpu_tree else None
        if gpu is not None:  # uncut: what a GPU verifies, decoded here for its τ (its speed is this CPU's)
            gpu[0].use_dtype(drafts_in)
            setup.entries.append(Entry("gpu_tree", gpu[0], dict(tree=gpu[1], k=None), setup.main.draft_dtype))
    return setup


def _compare(entry: str, target, cfg: EvalConfig, drafts_in: torch.dtype) -> Entry:
    """A side-by-side entry `PROPOSER[@SHAPE][@DTYPE]` (see `_compare_entry`) as it decodes in this run."""
    name, shape, own_dtype = _compare_entry(entry)
    other = build_proposer(name, target)
    if other.verifier_target is not None:
        raise ConfigError(f"compare '{entry}': a Medusa-2 artifact is verified by its own adapted target, not by "
                          f"the target of this run; evaluate it in a run of its own")
    other_dtype = draft_dtype(own_dtype, target.dtype, target.device) if own_dtype else drafts_in
    other_cast = other.use_dtype(other_dtype)
    if shape is None:  # the run's own shape: the proposer's tree under --tree auto, else a chain of --k
        own = other.default_tree_spec() if cfg.tree_from_proposer else None
    elif shape == "tree":
        own = other.default_tree_spec()
        if own is None:
            raise ConfigError(f"compare '{entry}': proposer '{name}' has no tree of its own: give @tree=B1,B2,...")
    elif isinstance(shape, TreeSpec):
        own = shape
    else:  # "chain" (of --k) or a chain of K tokens
        own = None
    kw = dict(tree=own, k=None) if own is not None else dict(k=shape if isinstance(shape, int) else cfg.k)
    return Entry(f"cmp:{entry}", other, kw, dtype_name(other_dtype) if other_cast else None)


def _cut_trees(setup: Setup) -> None:
    """Scored trees (Medusa, EAGLE-2) are cut every step to the nodes that pay: v(n) with a tree mask,
    measured here before decoding, over every node count a tree of this run can have. A tree that is the
    same every step (Medusa's) is cut once, up front."""
    cfg, trees = setup.cfg, [e for e in setup.entries if e.kw.get("tree") is not None]
    n_max = max(e.kw["tree"].capacity() for e in trees)
    log.info("measuring v(n), n = 0..%d tree nodes, to size the trees", n_max)
    setup.tree_cost = cost.measure_verify_cost(setup.target, cfg.cost_context, n_max, min(cfg.cost_repeats, 5),
                                               cfg.seed, tree_mask=True)
    setup.verify_cost = VerifyCost.from_measurement(setup.tree_cost)
    for e in trees:
        e.kw["cost"] = setup.verify_cost
        e.kw["tree"] = e.proposer.fit_tree(e.kw["tree"], setup.verify_cost)
    setup.spec = setup.main.kw["tree"]
    log.info("tree cut to at most %d nodes, branching %s, by the cost model", setup.spec.capacity(),
             list(setup.spec.branching))


def decode_prompts(setup: Setup) -> list[dict]:
    """Decode every prompt with every run — plain decoding ("base"), each entry, HF generate ("hf") — in an
    order that rotates prompt by prompt, so that a drift in machine load hits each alike; one record per
    prompt with each run's statistics and whether its output is the target's."""
    cfg, target, prop = setup.cfg, setup.target, setup.prop
    tok, gen_kw = target.tokenizer, setup.gen_kw
    eos = gen_kw["eos_ids"]
    pad = pad_token_id(target)

    def runner(name: str):
        if name == "base":
            return lambda ids, seed, n: speculative_generate(target, None, [ids], n, k=0, seed=seed, **gen_kw)
        if name == "hf":
            return lambda ids, seed, n: _hf_generate(target.model, ids, dataclasses.replace(cfg, max_new_tokens=n),
                                                     eos, pad)
        e = next(e for e in setup.entries if e.name == name)
        return lambda ids, seed, n: speculative_generate(target, e.proposer, [ids], n, seed=seed, **e.kw, **gen_kw)

    names = ["base", "spec"] + (["hf"] if cfg.hf_reference else []) + [e.name for e in setup.entries[1:]]
    runs = {name: runner(name) for name in names}
    warm = format_prompt(tok, setup.rows[0].text)  # every code path once, not counted
    for name in names:
        if name != "adaptive":
            runs[name](warm, cfg.seed, min(8, cfg.max_new_tokens))

    per_prompt = []
    for i, row in enumerate(setup.rows):
        ids = format_prompt(tok, row.text)
        routed_as = prop.route(domain=row.domain, text=row.text) if prop.routes else None
        prop.reset_stats()
        out: dict = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            out[name] = runs[name](ids, cfg.seed + i, cfg.max_new_tokens)
            if name == "spec" and prop.tracks_branches:
                out["branches"] = prop.branch_stats()
        rec = _record(setup, row, ids, out, routed_as, eos, pad)
        per_prompt.append(rec)
        sp, base = rec["spec"], rec["base"]
        log.info("[%d/%d] %s %s: %d tokens, alpha %s, tau %.2f, %.1f tok/s vs %.1f plain%s%s", i + 1, len(setup.rows),
                 row.domain, row.source, rec["new_tokens"], f"{sp.alpha:.2f}" if sp.alpha is not None else "-",
                 sp.tau or 0, sp.new_tokens / sp.wall_time, base.new_tokens / base.wall_time,
                 f" vs {rec['hf_tokens'] / rec['hf_time']:.1f} HF" if "hf_time" in rec else "",
                 "" if rec["lossless"] is not False else " NOT LOSSLESS")
    return per_prompt


def _record(setup: Setup, row: EvalPrompt, ids: list[int], out: dict, routed_as, eos: list[int], pad) -> dict:
    """One prompt's record from its runs' results (greedy: each output compared with plain decoding's)."""
    cfg, prop = setup.cfg, setup.prop
    greedy = cfg.temperature == 0
    base = out["base"]

    def same(result) -> bool | None:
        return (result.tokens[0] == base.tokens[0]) if greedy else None

    rec = {"domain": row.domain, "source": row.source, "prompt_tokens": len(ids), "base": base.stats,
           "spec": out["spec"].stats, "new_tokens": len(out["spec"].tokens[0]), "lossless": same(out["spec"])}
    if prop.routes:
        rec["route"] = prop.route_name()
        rec["routed_as"] = routed_as
    if prop.tracks_branches:
        rec["branches"] = out["branches"]
    if setup.compared:
        rec["compare"] = {e.name[4:]: (out[e.name].stats, same(out[e.name])) for e in setup.compared}
    if "gpu_tree" in out:
        rec["gpu_tree"] = (out["gpu_tree"].stats, same(out["gpu_tree"]))
    if "adaptive" in out:
        ad = out["adaptive"]
        rec["adaptive"] = ad.stats
        rec["adaptive_k"] = ad.k_history[0]
        rec["adaptive_lossless"] = same(ad)
    if "hf" in out:
        eos_set = set(eos)
        hf_tokens, hf_time = out["hf"]
        hf_tokens = _strip_after_eos(hf_tokens, eos_set)
        rec["hf_tokens"], rec["hf_time"] = len(hf_tokens), hf_time
        rec["hf_matches_baseline"] = (hf_tokens == base.tokens[0]) if greedy else None
        if setup.assistant is not None:
            as_tokens, as_time = _hf_generate(setup.target.model, ids, cfg, eos, pad, assistant_model=setup.assistant)
            as_tokens = _strip_after_eos(as_tokens, eos_set)
            rec["assisted_tokens"], rec["assisted_time"] = len(as_tokens), as_time
            rec["assisted_matches_baseline"] = (as_tokens == base.tokens[0]) if greedy else None
    return rec


def _all_or_none(flags: list) -> bool | None:
    """Lossless over several prompts: None when any is unknown (sampling), else whether all are."""
    return None if any(f is None for f in flags) else all(flags)


def aggregate(recs: list[dict], depth: int) -> dict:
    """Per-prompt records -> the report's summary of them (`_summary`, plus routes, branches, side-by-side
    entries and adaptive k where the records have them). `_stats` keeps the merged statistics of the main
    entry for the cost model; the caller drops it."""
    s, b = GenerationStats(), GenerationStats()
    for r in recs:
        s.merge(r["spec"])
        b.merge(r["base"])
    out = _summary(s, b, len(recs), _all_or_none([r["lossless"] for r in recs]), depth,
                   sum(r.get("hf_tokens", 0) for r in recs), sum(r.get("hf_time", 0.0) for r in recs))
    out["_stats"] = s
    if recs and "route" in recs[0]:
        counts: dict[str, int] = {}
        for r in recs:
            counts[r["route"]] = counts.get(r["route"], 0) + 1
        out["route"] = max(counts, key=counts.get)
        out["routes"] = counts
    if recs and "branches" in recs[0]:
        out["branches"] = _sum_branches([r["branches"] for r in recs])
    def beside(pairs: list[tuple]) -> dict:  # another entry's (stats, lossless) per prompt, summarised
        c = GenerationStats()
        for st, _ in pairs:
            c.merge(st)
        summ = _summary(c, b, len(recs), _all_or_none([same for _, same in pairs]), 0, 0, 0.0)
        return {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup", "lossless",
                                           "per_position_acceptance", "conditional_acceptance", "verified_nodes_per_step")}

    if recs and "compare" in recs[0]:
        out["compare"] = {name: beside([r["compare"][name] for r in recs]) for name in recs[0]["compare"]}
    if recs and "gpu_tree" in recs[0]:
        out["gpu_tree"] = beside([r["gpu_tree"] for r in recs])
    if recs and "adaptive" in recs[0]:
        a = GenerationStats()
        for r in recs:
            a.merge(r["adaptive"])
        ks = [k for r in recs for k in r["adaptive_k"]]
        summ = _summary(a, b, len(recs), _all_or_none([r["adaptive_lossless"] for r in recs]), 0, 0, 0.0)
        out["adaptive"] = {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup", "lossless",
                                                      "proposed", "accepted", "target_forwards")}
        out["adaptive"]["mean_k"] = sum(ks) / len(ks) if ks else None
        out["adaptive"]["plain_step_share"] = sum(1 for k in ks if k == 0) / len(ks) if ks else None
    return out


def _cost_model(setup: Setup, per_prompt: list[dict], domains: dict, overall: dict) -> tuple[dict, dict, dict]:
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
    if not cfg.cost_model:
        return cost_model, recommended, policy
    log.info("measuring the cost model v(k), k = 0..%d", max(cfg.cost_k_max, spec.depth))
    cost_model.update(cost.measure_verify_cost(setup.target, cfg.cost_context, max(cfg.cost_k_max, spec.depth),
                                               cfg.cost_repeats, cfg.seed))
    v = cost_model["v"]
    for name, d in list(domains.items()) + [("overall", overall)]:
        st: GenerationStats = d["_stats"]
        rec = cost.recommend_k(st.accepted_per_position, st.proposed_per_position, st.target_forwards, v, c) \
            if spec.is_chain else None
        d["predicted_speedup"] = cost.predicted_speedup(st.accepted_per_position, st.proposed_per_position,
                                                        st.target_forwards, spec.depth, v, c) \
            if spec.is_chain and str(spec.depth) in v else None
        if rec is not None:
            recommended[name] = {"k": rec["k"], "predicted_speedup": rec["predicted_speedup"]}
        if name != "overall":
            policy[name] = _policy(d, rec, cfg.policy_threshold)
    return cost_model, recommended, policy


def _references(setup: Setup, per_prompt: list[dict], overall: dict) -> dict:
    """Plain decoding's speed, and HF generate (and assisted generation) beside it: speed and same output."""
    references: dict = {"plain_decoding_tokens_per_s": overall["baseline_tokens_per_s"]}
    if not setup.cfg.hf_reference:
        return references
    hf_tok = sum(r.get("hf_tokens", 0) for r in per_prompt)
    hf_time = sum(r.get("hf_time", 0.0) for r in per_prompt)
    hf_tps = hf_tok / hf_time if hf_time > 0 else None
    flags = [r.get("hf_matches_baseline") for r in per_prompt]
    references["hf_generate"] = {"tokens_per_s": hf_tps, "matches_plain_decoding": _all_or_none(flags),
                                 "n_mismatch": sum(1 for f in flags if f is False)}
    references["plain_vs_hf_generate"] = (overall["baseline_tokens_per_s"] / hf_tps) if hf_tps else None
    if setup.assistant is not None:
        a_tok = sum(r.get("assisted_tokens", 0) for r in per_prompt)
        a_time = sum(r.get("assisted_time", 0.0) for r in per_prompt)
        references["hf_assisted_generate"] = {
            "tokens_per_s": a_tok / a_time if a_time > 0 else None,
            "matches_target_greedy": _all_or_none([r.get("assisted_matches_baseline") for r in per_prompt]),
        }
    return references


def _report(setup: Setup, proposer_name: str, command: str | None, per_prompt: list[dict], domains: dict,
            overall: dict, cost_model: dict, recommended: dict, policy: dict) -> dict:
    cfg, spec, target = setup.cfg, setup.spec, setup.target
    original = setup.original_target
    return {
        "command": command or " ".join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine_info(target.device),
        "target": {"name": target.name, "spec": target.spec, "fingerprint": (original or target).fingerprint(),
                   **({"adapted": "the artifact's LoRA adapter merged (Medusa-2)"} if original else {})},
        "proposer": proposer_name,
        "settings": {
            "max_new_tokens": cfg.max_new_tokens, "k": None if cfg.tree else cfg.k, "tree": cfg.tree,
            "tree_max_nodes": spec.max_nodes, "prune_tree": setup.verify_cost is not None,
            "tree_verified": list(spec.branching) if cfg.tree else None,  # after a cut by the cost model
            "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
            "limit_per_domain": cfg.limit_per_domain, "seed": cfg.seed, "prompt_files": setup.files,
            "adaptive": cfg.adaptive, "compare": list(cfg.compare),
            "gpu_tree": next(({"tree": list(e.kw["tree"].branching), "tree_max_nodes": e.kw["tree"].max_nodes}
                              for e in setup.entries if e.name == "gpu_tree"), None),
            "draft_dtype": setup.main.draft_dtype,  # None: the proposer has no network to cast
            "compare_settings": {e.name[4:]: {"k": e.kw["k"],
                                              "tree": list(e.kw["tree"].branching) if e.kw.get("tree") else None,
                                              "tree_max_nodes": e.kw["tree"].max_nodes if e.kw.get("tree") else None,
                                              "draft_dtype": e.draft_dtype}
                                 for e in setup.compared},
        },
        "domains": domains,
        "overall": overall,
        "cost_model": cost_model,
        "recommended_k": recommended,
        "policy": policy,
        "memory": memory_info(target.device),
        "references": _references(setup, per_prompt, overall),
        "prompts": [{k: v for k, v in r.items() if k not in ("base", "spec", "adaptive", "adaptive_k", "compare",
                                                              "gpu_tree")} | {
            "alpha": r["spec"].alpha, "tau": r["spec"].tau,
            "tokens_per_s": r["spec"].new_tokens / r["spec"].wall_time if r["spec"].wall_time else None,
            "baseline_tokens_per_s": r["base"].new_tokens / r["base"].wall_time if r["base"].wall_time else None,
        } for r in per_prompt],
    }


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
