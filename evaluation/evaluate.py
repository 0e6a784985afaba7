"""`evaluate(...)`: run a proposer against a target per domain and build the report dict.

One evaluation is a pipeline, each step a module of this folder:

    setup.py        the settings resolved: target, proposer and its shape, prompts, turns, entries (`Setup`)
    decode.py       every prompt decoded by every run: plain decoding, the proposer, HF generate, side by side
    timing.py       how those runs are timed on a shared machine, which timings are valid, how busy it was
    aggregate.py    per-prompt records -> α, τ, speedups per domain; the cost model, recommended k, policy
    report_file.py  the report dict (report.json's schema, and its one reader); report.py writes it out

`evaluate` calls them in that order; it is read top to bottom.
"""

from __future__ import annotations

import dataclasses

from draftsmith.decoding.proposer import Proposer
from draftsmith.evaluation import timing
from draftsmith.evaluation.aggregate import cost_model_and_policy, per_domain
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.decode import decode_prompts
from draftsmith.evaluation.report_file import build_report
from draftsmith.evaluation.setup import build_setup


def evaluate(target, proposer: str | Proposer = "ngram", prompts: list[str] | None = None,
             config: EvalConfig | None = None, command: str | None = None, **overrides) -> dict:
    """Evaluate `proposer` on `target` (a Target or a target spec string) and return the report dict.

    Settings come from `config` (an EvalConfig) updated with keyword `overrides` (EvalConfig field names).
    The run: settings -> every prompt decoded by each run -> which timings are valid -> a pure aggregation per
    domain -> the cost model and policy -> the report.
    """
    cfg = config or EvalConfig()
    if prompts is not None:
        overrides["prompts"] = list(map(str, prompts))
    if isinstance(proposer, str):
        overrides["proposer"] = proposer
    cfg = dataclasses.replace(cfg, **overrides)
    setup = build_setup(target, proposer, cfg)

    with timing.CpuShare() as share:  # the whole run's load, for the record (timing.contention)
        per_prompt = decode_prompts(setup)

    chain_cost = timing.measure_chain_cost(setup)  # v(k) of the cost model, None when it is off
    timing.judge_timing(per_prompt, timing.speed_limit_cost(setup, chain_cost), cfg.hf_reference)

    domains, overall = per_domain(per_prompt, setup.spec.depth)
    cost_model, recommended, policy = cost_model_and_policy(setup, per_prompt, domains, overall, chain_cost)
    for d in list(domains.values()) + [overall]:
        d.pop("_stats")  # the merged statistics the cost model read

    name = cfg.proposer if isinstance(proposer, str) else proposer.name
    report = build_report(setup, name, command, per_prompt, domains, overall, cost_model, recommended, policy)
    report["contention"] = timing.contention(share.others, per_prompt, cfg, setup.busy_prompts)
    return report
