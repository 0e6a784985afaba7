"""The decode loop: every prompt decoded by every run of the evaluation, one record per prompt (per turn, for
a multi-turn prompt).

The runs: our plain decoding ("base", k = 0, the same code path as speculation: the baseline and the
lossless reference), speculative decoding with the proposer ("spec"), HF `generate` ("hf", greedy, with the
stock kernels a user's own model runs: the outside reference for our baseline's speed and output), and each
further entry of the Setup (side-by-side proposers, adaptive k, GPU-sized trees decoded untimed for their τ).
A warm-up prompt is decoded first and not counted. How the timed runs are timed is evaluation/timing.py's.

The baseline is the fastest plain decoding this machine does: its one-token step goes through the few-row
kernel plan measured at load (targets/gemm.py), the same plan the verifier's forwards use, so a speedup
is what speculation buys and not a kernel only the speculative runs take; `machine.few_row_kernels`
records the plan. HF generate runs with that plan off.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.hf import cut_at_eos, hf_generate, left_padded
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.verify import sync
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.domains import EvalPrompt, format_prompt
from draftsmith.evaluation.setup import Setup
from draftsmith.evaluation.timing import busy_at_start, measure, median_run, quiet_count
from draftsmith.evaluation.turns import Conversation
from draftsmith.targets import gemm
from draftsmith.targets.families import pad_token_id

log = logging.getLogger(__name__)


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
    setup.busy = (cfg.repeats > 1 or cfg.remeasure > 0) and busy_at_start()
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


def _decode_one(setup: Setup, runs: dict, timed: list[str], i: int, turn: int, conv: Conversation,
                ids: list[int], n: int, eos: list[int], pad) -> dict:
    """One measured generation, the n-th of the run (turn `turn` of row i): every run decodes `ids`; its record,
    with plain decoding's answer under `_answer` for the conversation's next turn."""
    cfg, row = setup.cfg, conv.row
    # a conversation is routed by its declared domain and what its user has written so far
    routed_as = _route(setup, row.domain, "\n".join(row.turns[: turn + 1]) if row.turns else row.text)
    # turn 1 keeps the seed a single-turn run gives its row; a later turn one of its own
    seed = cfg.seed + i + turn * len(setup.rows)
    measured, own_stats, rounds = measure(setup, runs, timed, n, ids, seed)
    out = {name: median_run(measured[name], cfg.repeats) for name in timed}
    for name in runs:
        if untimed(name):  # decoded for its acceptance only: its speed is not what it reports
            out[name] = runs[name](ids, seed, cfg.max_new_tokens)[0]
    out.update(own_stats)
    rec = _record(setup, row, ids, out, routed_as, eos, pad)
    rec["source"] = conv.source(turn)
    rec["turn"] = turn + 1
    rec["timing"] = {"rounds": rounds, "measurements": {
        name: [[round(sec, 6), None if sh is None else round(sh, 4)] for _, sec, sh in measured[name]]
        for name in timed}, "quiet": {name: quiet_count(measured[name]) >= cfg.repeats for name in timed}}
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


def _hf_generate(model, ids: list[int], cfg: EvalConfig, eos: list[int], pad: int | None,
                 **extra) -> tuple[list[int], float]:
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


def _timed(result):
    return result, result.stats.wall_time


def untimed(name: str) -> bool:
    """Runs decoded once per prompt, for acceptance only: an uncut GPU-sized tree (the proposer's, "gpu_tree",
    or a side-by-side entry's, "gpu:ENTRY"), whose speed on this CPU is not reported."""
    return name == "gpu_tree" or name.startswith("gpu:")


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
        rec["self_consistent"] = all_or_none([rec["self_consistent"]]
                                             + [consistent(out[e.name]) for e in setup.compared])
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


def all_or_none(flags: list) -> bool | None:
    """Lossless over several prompts: None when any is unknown (sampling), else whether all are."""
    return None if any(f is None for f in flags) else all(flags)


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
