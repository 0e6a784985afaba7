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

from draftsmith.decoding import calibration, cost
from draftsmith.decoding.budget import VerifyCost
from draftsmith.decoding.cost import CpuShare
from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.generate import GenerationStats, speculative_generate
from draftsmith.decoding.hf import cut_at_eos, hf_generate, left_padded
from draftsmith.decoding.proposer import Proposer, TreeSpec, draft_dtype, side_by_side_entry
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.verify import sync
from draftsmith.errors import ConfigError
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.domains import (
    EvalPrompt,
    default_prompt_files,
    format_prompt,
    load_prompts,
    only_domains,
)
from draftsmith.evaluation.limits import check_prompt_files, fit_context, leave_out_long
from draftsmith.evaluation.turns import Conversation
from draftsmith.targets import gemm
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import pad_token_id

log = logging.getLogger(__name__)


def _hf_generate(model, ids: list[int], cfg: EvalConfig, eos: list[int], pad: int | None, **extra) -> tuple[list[int], float]:
    """One prompt through transformers' generate (decoding/hf.py), timed: its new tokens and seconds."""
    device = next(model.parameters()).device
    x, mask = left_padded([ids], pad, device)
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    sync(device)
    t0 = time.perf_counter()
    with gemm.disabled():  # the kernels a user's own model runs with
        tokens = hf_generate(model, x, mask, cfg.max_new_tokens, sampling, eos, pad, **extra)[0]
    sync(device)
    return tokens, time.perf_counter() - t0


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
            st = _entry_stats(r, key)
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
        tps, btps, hf = rate(self.tokens, self.seconds), rate(self.base_tokens, self.base_seconds), \
            rate(self.hf_tokens, self.hf_seconds)
        fastest = max((x for x in (btps, hf) if x), default=None)
        return {"tokens_per_s": tps, "baseline_tokens_per_s": btps, "hf_generate_tokens_per_s": hf,
                "speedup": tps / fastest if tps and fastest else None,
                "fastest_plain": None if fastest is None else ("draftsmith" if fastest == btps else "hf_generate"),
                "speedup_vs_plain": tps / btps if tps and btps else None,
                "speedup_vs_hf_generate": tps / hf if tps and hf else None, "n_timed": self.n}


def _entry_stats(rec: dict, key: str) -> GenerationStats:
    if key == "spec":
        return rec["spec"]
    if key == "adaptive":
        return rec["adaptive"]
    return rec["compare"][key][0]


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
    turns: list[int] | None = None  # turns measured per row (evaluation/turns.py); None: one each
    turns_cut: list[dict] = dataclasses.field(default_factory=list)  # rows the context cut short, with why
    left_out: list[dict] = dataclasses.field(default_factory=list)  # shipped prompts longer than the context
    # the machine is busy throughout (other processes' CPU share above cost.BUSY_SHARE when the run started, or
    # through two whole rounds of a prompt): each prompt gets one round, for its acceptance and losslessness,
    # until a round is quiet again; the prompts decoded so are counted, their speedups not measured
    busy: bool = False
    busy_prompts: int = 0

    @property
    def main(self) -> Entry:
        return self.entries[0]

    @property
    def compared(self) -> list[Entry]:
        return [e for e in self.entries if e.name.startswith("cmp:")]

    @property
    def compared_gpu_trees(self) -> list[Entry]:
        """The side-by-side entries' GPU-sized trees ("gpu:ENTRY"), decoded untimed for their τ."""
        return [e for e in self.entries if e.name.startswith("gpu:")]


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
    with CpuShare() as share:
        per_prompt = decode_prompts(setup)
    chain_cost = _measure_chain_cost(setup)
    judge_timing(per_prompt, _speed_limit_cost(setup, chain_cost), cfg.hf_reference)
    depth = setup.spec.depth
    domains = {name: aggregate([r for r in per_prompt if r["domain"] == name], depth)
               for name in sorted({r["domain"] for r in per_prompt})}
    overall = aggregate(per_prompt, depth)
    cost_model, recommended, policy = _cost_model(setup, per_prompt, domains, overall, chain_cost)
    for d in list(domains.values()) + [overall]:
        d.pop("_stats")
    name = cfg.proposer if isinstance(proposer, str) else proposer.name
    report = _report(setup, name, command, per_prompt, domains, overall, cost_model, recommended, policy)
    report["contention"] = contention(share.others, per_prompt, cfg)
    report["contention"]["busy_prompts"] = setup.busy_prompts
    if setup.busy_prompts:
        report["contention"]["note"] = (
            f"the machine was busy throughout {setup.busy_prompts} of {len(per_prompt)} prompts: they were decoded "
            f"once each for acceptance and losslessness, their speedups not measured; "
            + (report["contention"]["note"] or ""))
    return report


def _measure_chain_cost(setup: Setup) -> dict | None:
    """v(k), k = 0..max(cost_k_max, depth), measured here (cost_model on), else None."""
    cfg = setup.cfg
    if not cfg.cost_model:
        return None
    k_max = max(cfg.cost_k_max, setup.spec.depth)
    log.info("measuring the cost model v(k), k = 0..%d", k_max)
    return cost.measure_verify_cost(setup.target, cfg.cost_context, k_max, cfg.cost_repeats, cfg.seed)


def _speed_limit_cost(setup: Setup, chain_cost: dict | None):
    """v(n) for the impossible-speedup check: the cheapest a forward over n nodes was seen to be (fastest
    repeats, so that a measurement under load does not make a real speedup look impossible); the tree
    measurement for trees, the chain one otherwise; None (v = 1) when neither was measured."""
    measured = setup.tree_cost if setup.tree_cost is not None else chain_cost
    if not measured or "t_forward_min_s" not in measured:
        return None
    t = measured["t_forward_min_s"]
    v = [t[str(n)] / t["0"] for n in range(len(t))]
    return lambda n: v[min(n, len(v) - 1)]


def contention(share: float | None, per_prompt: list[dict] | None = None, cfg: EvalConfig | None = None) -> dict:
    """How busy the machine was while the prompts were decoded, and which timings are valid. Validity follows
    from the per-prompt checks (`judge_timing`): each run measured quietly (re-measured when not), and no
    speedup above what τ and v allow. `other_cpu_share` is the whole run's average, for the record only."""
    from draftsmith.decoding.cost import BUSY_SHARE, contended

    invalid = [{"prompt": r["source"], "domain": r["domain"], "entry": e, "reason": why}
               for r in per_prompt or [] for e, why in r["timing"].get("invalid", {}).items()]
    if per_prompt is None:  # a caller with only the run's average (older reports)
        valid = not contended(share)
    else:
        valid = not invalid
    n = len(per_prompt or [])
    bad = len({i["prompt"] for i in invalid})
    return {"other_cpu_share": share, "threshold": BUSY_SHARE, "speedups_valid": valid,
            "repeats": cfg.repeats if cfg else None, "remeasure": cfg.remeasure if cfg else None,
            "prompts": n, "prompts_with_invalid_timing": bad, "invalid": invalid,
            "note": None if valid else
            f"speedups not valid for {bad} of {n} prompts (timed on a busy machine, or an impossible speedup): "
            f"they are left out of every summary and of the policy; acceptance (alpha, tau) and "
            f"losslessness still hold for all of them"}


def build_setup(target, proposer: str | Proposer, cfg: EvalConfig) -> Setup:
    """Load what the run needs and decide how each entry decodes: the spec tree (the proposer's own under
    `tree_from_proposer`), the side-by-side entries' shapes and dtypes, adaptive k's controller, and the
    trees cut by the cost model measured here."""
    if isinstance(target, str):
        from draftsmith.targets import load_target

        target = load_target(target, device=cfg.device, dtype=cfg.dtype)
    _check_cost_context(target, cfg)
    prop = proposer if isinstance(proposer, Proposer) else build_proposer(cfg.proposer, target)
    original_target = None
    if prop.verifier_target is not None:
        original_target, target = target, prop.verifier_target
    drafts_in = draft_dtype(cfg.draft_dtype, target.dtype, target.device)
    cast = prop.use_dtype(drafts_in)
    spec, cfg = _spec_tree(prop, cfg)
    rows, files, left_out, turns, turns_cut = _eval_rows(target, cfg)
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
                  assistant=prop.assistant_model if cfg.hf_reference else None, turns=turns, turns_cut=turns_cut,
                  left_out=left_out)
    # a chain whose proposer estimates each token's acceptance (DSpark's confidence) is cut like a scored tree
    if cfg.prune_tree and (not spec.is_chain or prop.estimates_acceptance):
        _cut_trees(setup)
    if cfg.prune_tree:
        _add_gpu_trees(setup, spec, drafts_in)
    return setup


def _check_cost_context(target, cfg: EvalConfig) -> None:
    """The cost model's timed forwards read `cost_context` cached positions and up to cost_k_max + 1 new ones: all
    must lie inside the target's context, or v(k) is measured on positions the target never reads. Refused at
    the start, before anything is decoded."""
    from draftsmith.targets.context import context_window

    ctx = context_window(target)
    if ctx is not None and cfg.cost_context + cfg.cost_k_max + 1 > ctx:
        raise ConfigError(f"cost_context {cfg.cost_context} (+ cost_k_max {cfg.cost_k_max} + 1 verified positions) is "
                          f"more than the target's context of {ctx} positions (max_position_embeddings): lower "
                          "cost_context")


def _spec_tree(prop: Proposer, cfg: EvalConfig) -> tuple[TreeSpec, EvalConfig]:
    """The shape the main entry decodes: the proposer's own tree under `tree_from_proposer` (written back into
    the config, so the report names it), else the configured tree, else a chain of k."""
    if cfg.tree_from_proposer:
        spec = prop.default_tree_spec()
        if spec is None:
            raise ConfigError(f"proposer '{cfg.proposer}' has no tree of its own: give tree branching factors")
        return spec, dataclasses.replace(cfg, tree=list(spec.branching))
    return (TreeSpec(tuple(cfg.tree)) if cfg.tree else TreeSpec.chain(cfg.k)), cfg


def _eval_rows(target, cfg: EvalConfig) -> tuple[list, list[str], list[dict], list, list[dict]]:
    """The prompts the run decodes and what it leaves out of them: (rows, prompt files, prompts left out for
    the target's context, each row's turns, the rows measured on fewer turns than they have)."""
    files = cfg.prompts or [str(p) for p in default_prompt_files(cfg.split)]
    check_prompt_files(files)
    rows = only_domains(load_prompts(files, cfg.limit_per_domain, cfg.seed), cfg.domains, files)
    left_out: list[dict] = []
    if not cfg.prompts:  # the shipped sets: a short-context target is measured on what it can read
        rows, left_out = leave_out_long(target, rows, cfg.max_new_tokens, cfg.chat_template_kwargs)
        if left_out:
            log.warning("%d shipped prompts left out: longer than the target's context (%s, ...)", len(left_out),
                        left_out[0]["reason"])
        if not rows:
            raise ConfigError(f"no shipped eval prompt fits the target's context with max_new_tokens "
                              f"{cfg.max_new_tokens} ({left_out[0]['reason']}, ...)")
    turns, turns_cut = fit_context(target, rows, cfg.max_new_tokens, cfg.chat_template_kwargs, cfg.turns)
    for c in turns_cut:
        log.warning("prompt %s: measured on %d of its %d turns: %s", c["prompt"], c["measured"], c["turns"],
                    c["reason"])
    return rows, files, left_out, turns, turns_cut


def _add_gpu_trees(setup: Setup, spec: TreeSpec, drafts_in: torch.dtype) -> None:
    """Beside the proposer's own shape, tree or chain (DFlash's own shape is its block's chain), and beside
    every side-by-side tree, the GPU-sized tree uncut: what a GPU verifies, decoded here for its τ (its speed
    is this CPU's), so several heads' τ at a GPU's budget come from one run. `spec`: the main entry's shape
    as decided, before the cost model cut it."""
    cfg, prop, target = setup.cfg, setup.prop, setup.target
    if not cfg.gpu_tree:
        return
    if not spec.is_chain or cfg.tree_from_proposer:
        gpu = prop.gpu_tree()
        if gpu is not None:
            gpu[0].use_dtype(drafts_in)
            setup.entries.append(Entry("gpu_tree", gpu[0], dict(tree=gpu[1], k=None), setup.main.draft_dtype))
    for e in setup.compared:
        _, shape, own_dtype = side_by_side_entry(e.name[4:])
        decodes_a_tree = shape == "tree" or isinstance(shape, TreeSpec) or (shape is None and cfg.tree_from_proposer)
        other = e.proposer.gpu_tree() if decodes_a_tree and e.kw.get("tree") is not None else None
        if other is not None:  # cast as _compare cast the entry itself
            other[0].use_dtype(draft_dtype(own_dtype, target.dtype, target.device) if own_dtype else drafts_in)
            setup.entries.append(Entry(f"gpu:{e.name[4:]}", other[0], dict(tree=other[1], k=None), e.draft_dtype))


def _compare(entry: str, target, cfg: EvalConfig, drafts_in: torch.dtype) -> Entry:
    """A side-by-side entry `PROPOSER[@SHAPE][@DTYPE]` (see `side_by_side_entry`) as it decodes in this run."""
    name, shape, own_dtype = side_by_side_entry(entry)
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
    if not trees:  # every entry decodes a chain of --k (no --tree): nothing to cut, nothing to measure for it
        return
    n_max = max(e.kw["tree"].capacity() for e in trees)
    log.info("measuring v(n), n = 0..%d tree nodes, to size the trees", n_max)
    setup.tree_cost = cost.measure_verify_cost(setup.target, cfg.cost_context, n_max, min(cfg.cost_repeats, 5),
                                               cfg.seed, tree_mask=True)
    setup.verify_cost = VerifyCost.from_measurement(setup.tree_cost)
    for e in trees:
        e.kw["cost"] = setup.verify_cost
        e.kw["tree"] = e.proposer.fit_tree(e.kw["tree"], setup.verify_cost)
    if setup.main.kw.get("tree") is None:  # the main entry is a chain of --k; side-by-side trees were cut
        return
    setup.spec = setup.main.kw["tree"]
    log.info("tree cut to at most %d nodes, branching %s, by the cost model", setup.spec.capacity(),
             list(setup.spec.branching))


def decode_prompts(setup: Setup) -> list[dict]:
    """Decode every prompt with every run — plain decoding ("base"), each entry, HF generate ("hf") — and time
    it robustly: per prompt, `repeats` rounds in which every timed run decodes once, the order rotating round
    by round and prompt by prompt, so that a drift or a burst of machine load hits each alike. Each run's
    share of the CPU used by other processes is read around it; a prompt whose runs were not quiet often
    enough gets up to `remeasure` more rounds. Each run's time is the median of its quiet measurements. One
    record per prompt with each run's statistics (from its median run), its measurements, and whether its
    output is the target's. A multi-turn prompt is decoded turn by turn, one record per turn, each turn's
    context holding the answers plain decoding gave to the turns before it (evaluation/turns.py)."""
    cfg, target = setup.cfg, setup.target
    tok = target.tokenizer
    eos = setup.gen_kw["eos_ids"]
    pad = pad_token_id(target)
    runs = _runners(setup, eos, pad)
    timed = [n for n in runs if not untimed(n)]
    warm = format_prompt(tok, setup.rows[0].text, cfg.chat_template_kwargs)  # every code path once, not counted
    for name, run in runs.items():
        if name != "adaptive":
            run(warm, cfg.seed, min(8, cfg.max_new_tokens))

    # a run that times nothing twice (repeats 1, no re-measuring) has no rounds to save
    setup.busy = (cfg.repeats > 1 or cfg.remeasure > 0) and _busy_at_start()
    per_prompt = []
    for i, row in enumerate(setup.rows):
        conv = Conversation(row, cfg.chat_template_kwargs)
        for turn in range(setup.turns[i] if setup.turns else 1):
            ids = conv.prompt(tok, turn)
            rec = _decode_one(setup, runs, timed, i, turn, conv, ids, len(per_prompt), eos, pad)
            per_prompt.append(rec)
            # the context of the next turn is what plain decoding answered (evaluation/turns.py)
            conv.answered(tok, rec.pop("_answer"), set(eos))
    return per_prompt


def _busy_at_start(seconds: float = 2.0) -> bool:
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


def _decode_one(setup: Setup, runs: dict, timed: list[str], i: int, turn: int, conv: Conversation,
                ids: list[int], n: int, eos: list[int], pad) -> dict:
    """One measured generation, the n-th of the run (turn `turn` of row i): every run decodes `ids`; its record,
    with plain decoding's answer under `_answer` for the conversation's next turn."""
    cfg, row = setup.cfg, conv.row
    # a conversation is routed by its declared domain and what its user has written so far
    routed_as = _route(setup, row.domain, "\n".join(row.turns[: turn + 1]) if row.turns else row.text)
    # turn 1 keeps the seed a single-turn run gives its row; a later turn one of its own
    seed = cfg.seed + i + turn * len(setup.rows)
    measured, own_stats, rounds = _measure(setup, runs, timed, n, ids, seed)
    out = {name: _median_run(measured[name], cfg.repeats) for name in timed}
    for name in runs:
        if untimed(name):  # decoded for its acceptance only: its speed is not what it reports
            out[name] = runs[name](ids, seed, cfg.max_new_tokens)[0]
    out.update(own_stats)
    rec = _record(setup, row, ids, out, routed_as, eos, pad)
    rec["source"] = conv.source(turn)
    rec["turn"] = turn + 1
    rec["timing"] = {"rounds": rounds, "measurements": {
        name: [[round(sec, 6), None if sh is None else round(sh, 4)] for _, sec, sh in measured[name]]
        for name in timed}, "quiet": {name: _quiet_count(measured[name]) >= cfg.repeats for name in timed}}
    _log_prompt(setup, n, rec, rounds)
    rec["_answer"] = list(out["base"].tokens[0])
    return rec


def _route(setup: Setup, domain: str, text: str) -> str | None:
    """Route the next request in every routed entry (the run's proposer, its GPU-sized tree, a side-by-side
    `route:` entry); returns the domain the run's own proposer routed it by (None when it does not route)."""
    for e in setup.entries[1:]:
        if e.proposer.routes and e.proposer is not setup.prop:
            e.proposer.route(domain=domain, text=text)
    return setup.prop.route(domain=domain, text=text) if setup.prop.routes else None


def _runners(setup: Setup, eos: list[int], pad) -> dict:
    """Every run a prompt is decoded with, in order, by name: each a function (ids, seed, max_new_tokens) ->
    (result, seconds)."""
    cfg, target, gen_kw = setup.cfg, setup.target, setup.gen_kw

    def runner(name: str):
        if name == "base":
            return lambda ids, seed, n: _timed(speculative_generate(target, None, [ids], n, k=0, seed=seed, **gen_kw))
        if name == "hf":
            return lambda ids, seed, n: _hf_generate(target.model, ids, dataclasses.replace(cfg, max_new_tokens=n),
                                                     eos, pad)
        e = next(e for e in setup.entries if e.name == name)
        return lambda ids, seed, n: _timed(speculative_generate(target, e.proposer, [ids], n, seed=seed, **e.kw,
                                                                **gen_kw))

    names = ["base", "spec"] + (["hf"] if cfg.hf_reference else []) + [e.name for e in setup.entries[1:]]
    return {name: runner(name) for name in names}


def _measure(setup: Setup, runs: dict, timed: list[str], i: int, ids: list[int], seed: int):
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
        short = [n for n in timed if _quiet_count(measured[n]) < cfg.repeats]
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


def _log_prompt(setup: Setup, i: int, rec: dict, rounds: int) -> None:
    sp, base = rec["spec"], rec["base"]
    log.info("[%d/%d] %s %s: %d tokens, alpha %s, tau %.2f, %.1f tok/s vs %.1f plain%s (median of %d)%s%s",
             i + 1, sum(setup.turns) if setup.turns else len(setup.rows), rec["domain"], rec["source"],
             rec["new_tokens"],
             f"{sp.alpha:.2f}" if sp.alpha is not None else "-", sp.tau or 0, sp.new_tokens / sp.wall_time,
             base.new_tokens / base.wall_time,
             f" vs {rec['hf_tokens'] / rec['hf_time']:.1f} HF" if "hf_time" in rec else "", rounds,
             "" if all(rec["timing"]["quiet"].values()) else " BUSY MACHINE",
             "" if rec["lossless"] is not False else " NOT LOSSLESS")


def untimed(name: str) -> bool:
    """Runs decoded once per prompt, for acceptance only: an uncut GPU-sized tree (the proposer's, "gpu_tree",
    or a side-by-side entry's, "gpu:ENTRY"), whose speed on this CPU is not reported."""
    return name == "gpu_tree" or name.startswith("gpu:")


def _timed(result):
    return result, result.stats.wall_time


def _quiet_count(runs: list) -> int:
    from draftsmith.decoding.cost import contended

    return sum(1 for _, _, share in runs if not contended(share))


def _median_run(runs: list, need: int):
    """The run with the median time among the quiet ones (all of them when fewer than `need` were quiet):
    its result, with its time as the run's time."""
    from draftsmith.decoding.cost import contended

    quiet = [r for r in runs if not contended(r[2])]
    pool = sorted(quiet if len(quiet) >= need else runs, key=lambda r: r[1])
    result, seconds, _ = pool[(len(pool) - 1) // 2]
    if isinstance(result, list):  # HF generate: (tokens, seconds)
        return result, seconds
    return result


def _record(setup: Setup, row: EvalPrompt, ids: list[int], out: dict, routed_as, eos: list[int], pad) -> dict:
    """One prompt's record from its runs' results. Greedy: `lossless` compares each output with HF generate's
    (stock kernels, an implementation independent of ours); `self_consistent` with our own plain decoding."""
    cfg, prop = setup.cfg, setup.prop
    greedy = cfg.temperature == 0
    base = out["base"]
    eos_set = set(eos)
    reference = None
    if "hf" in out:
        hf_tokens, hf_time = out["hf"]
        reference = cut_at_eos(hf_tokens, eos_set)[0]

    def same(result) -> bool | None:  # the independent check
        return (result.tokens[0] == reference) if greedy and reference is not None else None

    def consistent(result) -> bool | None:  # ours against ours: a bug shared by both would pass it
        return (result.tokens[0] == base.tokens[0]) if greedy else None

    rec = {"domain": row.domain, "source": row.source, "prompt_tokens": len(ids), "base": base.stats,
           "spec": out["spec"].stats, "new_tokens": len(out["spec"].tokens[0]), "lossless": same(out["spec"]),
           "self_consistent": consistent(out["spec"])}
    if prop.routes:
        rec["route"] = prop.route_name()
        rec["routed_as"] = routed_as
    if prop.tracks_branches:
        rec["branches"] = out["branches"]
    if prop.estimates_acceptance:
        rec["calibration"] = out["calibration"]
    if setup.compared:
        rec["compare"] = {e.name[4:]: (out[e.name].stats, same(out[e.name])) for e in setup.compared}
        rec["self_consistent"] = _all_or_none([rec["self_consistent"]] + [consistent(out[e.name]) for e in setup.compared])
    if "gpu_tree" in out:
        rec["gpu_tree"] = (out["gpu_tree"].stats, same(out["gpu_tree"]))
    if setup.compared_gpu_trees:
        rec["compare_gpu_tree"] = {e.name[4:]: (out[e.name].stats, same(out[e.name])) for e in setup.compared_gpu_trees}
    if "adaptive" in out:
        ad = out["adaptive"]
        rec["adaptive"] = ad.stats
        rec["adaptive_k"] = ad.k_history[0]
        rec["adaptive_lossless"] = same(ad)
    if reference is not None:
        rec["hf_tokens"], rec["hf_time"] = len(reference), hf_time
        rec["hf_matches_baseline"] = (reference == base.tokens[0]) if greedy else None
        if setup.assistant is not None:
            as_tokens, as_time = _hf_generate(setup.target.model, ids, cfg, eos, pad, assistant_model=setup.assistant)
            as_tokens = cut_at_eos(as_tokens, eos_set)[0]
            rec["assisted_tokens"], rec["assisted_time"] = len(as_tokens), as_time
            rec["assisted_matches_baseline"] = (as_tokens == reference) if greedy else None
    return rec


def _all_or_none(flags: list) -> bool | None:
    """Lossless over several prompts: None when any is unknown (sampling), else whether all are."""
    return None if any(f is None for f in flags) else all(flags)


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
    out = _summary(s, b, len(recs), _all_or_none([r["lossless"] for r in recs]), depth, Speed.of(recs, "spec"))
    out["self_consistent"] = _all_or_none([r.get("self_consistent") for r in recs])
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
        summ = _summary(c, b, len(recs), _all_or_none([same for _, same in pairs]), 0,
                        Speed.of(recs, key) if key else Speed())
        keep = ("alpha", "tau", "lossless", "per_position_acceptance", "conditional_acceptance", "verified_nodes_per_step")
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
        summ = _summary(a, b, len(recs), _all_or_none([r["adaptive_lossless"] for r in recs]), 0,
                        Speed.of(recs, "adaptive"))
        out["adaptive"] = {key: summ[key] for key in ("alpha", "tau", "tokens_per_s", "speedup", "lossless",
                                                      "proposed", "accepted", "target_forwards", "n_timed")}
        out["adaptive"]["mean_k"] = sum(ks) / len(ks) if ks else None
        out["adaptive"]["plain_step_share"] = sum(1 for k in ks if k == 0) / len(ks) if ks else None
    if by_turn and any(r.get("turn", 1) > 1 for r in recs):
        out["turns"] = {"1": _turn_summary([r for r in recs if r.get("turn", 1) == 1], depth),
                        "2+": _turn_summary([r for r in recs if r.get("turn", 1) > 1], depth)}
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
            st = _entry_stats(rec, key)
            if not (base_quiet and quiet.get(names.get(key, f"cmp:{key}"), True)):
                rounds = rec["timing"].get("rounds")
                invalid[key] = ("other processes kept the CPU busy during its measurements"
                                + (f" ({rounds} round{'s' if rounds != 1 else ''})" if rounds else ""))
            else:
                b = rec["base"]
                s = (st.new_tokens / st.wall_time) / (b.new_tokens / b.wall_time) \
                    if st.wall_time > 0 and b.wall_time > 0 and b.new_tokens else None
                nodes = st.proposed / st.target_forwards if st.target_forwards else 0.0
                bound = speedup_bound(st.tau, nodes, v)
                if s is not None and s > IMPOSSIBLE_FACTOR * bound:
                    invalid[key] = (f"impossible speedup {s:.2f}: tau {st.tau:.2f} at {nodes:.1f} verified nodes "
                                    f"a step allows at most {bound:.2f}")
            rec["timed"][key] = key not in invalid
        rec["timing"]["invalid"] = invalid


def _cost_model(setup: Setup, per_prompt: list[dict], domains: dict, overall: dict,
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
        references["lossless_not_judged"] = ("no independent reference in this run (hf_reference off): `lossless` "
                                             "is null; `self_consistent` compares with our own plain decoding")
        return references
    hf_tps = overall["hf_generate_tokens_per_s"]  # over the validly timed prompts, like plain decoding's
    flags = [r.get("hf_matches_baseline") for r in per_prompt]
    references["hf_generate"] = {"tokens_per_s": hf_tps, "matches_plain_decoding": _all_or_none(flags),
                                 "n_mismatch": sum(1 for f in flags if f is False),
                                 "role": "the independent reference: `lossless` is equality with its greedy output"}
    references["plain_vs_hf_generate"] = (overall["baseline_tokens_per_s"] / hf_tps) \
        if hf_tps and overall["baseline_tokens_per_s"] else None
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
            "split": None if cfg.prompts else cfg.split, "domains": list(cfg.domains), "repeats": cfg.repeats, "remeasure": cfg.remeasure,
            "adaptive": cfg.adaptive, "compare": list(cfg.compare),
            "chat_template_kwargs": dict(cfg.chat_template_kwargs),
            "turns": cfg.turns, "turns_cut": list(setup.turns_cut), "left_out": list(setup.left_out),
            "gpu_tree": next(({"tree": list(e.kw["tree"].branching), "tree_max_nodes": e.kw["tree"].max_nodes}
                              for e in setup.entries if e.name == "gpu_tree"), None),
            "draft_dtype": setup.main.draft_dtype,  # None: the proposer has no network to cast
            "compare_settings": {e.name[4:]: {"k": e.kw["k"],
                                              "tree": list(e.kw["tree"].branching) if e.kw.get("tree") else None,
                                              "tree_max_nodes": e.kw["tree"].max_nodes if e.kw.get("tree") else None,
                                              "draft_dtype": e.draft_dtype,
                                              "gpu_tree": next(({"tree": list(g.kw["tree"].branching),
                                                                 "tree_max_nodes": g.kw["tree"].max_nodes}
                                                                for g in setup.compared_gpu_trees
                                                                if g.name[4:] == e.name[4:]), None)}
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
                                                              "gpu_tree", "compare_gpu_tree")} | {
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
