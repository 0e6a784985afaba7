"""`draftsmith serve-bench`: served throughput by concurrency, in the real engine, with and without each drafter.

    draftsmith serve-bench [TARGET] --drafter EXPORT [--drafter EXPORT ...] --out DIR [--concurrency 1,4,16]
    draftsmith serve-bench --url plain=http://host:8000 --url NAME=http://host:8001 ... --out DIR

A vLLM server of the target is started on 127.0.0.1 (data/engines/vllm_server.py) without a drafter, then with
each vLLM export as its speculator (export/serve_check.speculative_config, `--per-request-spec-decode-metrics
detailed`), one at a time; with `--url` the servers are the user's, already running (`plain` names the one without
a drafter). Each is driven by benchmark/serve_client.py at every concurrency on the same prompts (the shipped eval
sets of one split, or --prompts): a mixed run (the domains interleaved) and, per domain, a homogeneous run of that
domain's prompts alone. Every run reports output tokens/s (all requests' output tokens over the run's wall time),
TTFT and TPOT p50/p99, and vLLM's own per-request acceptance (α, τ, per position); each drafter's speedup over the
plain server is given per concurrency and per domain.

The cost model along the batch dimension (decoding/batch_cost.py) reads the decode step's cost at each concurrency
from the same runs: the plain server's time per output token is the target's step at that batch, the drafter's time
per verify step its step with k drafted and k+1 verified tokens per request; their ratio r(c) with vLLM's
acceptance predicts the decode rate's speedup, and with each side's measured time to first token the served one
(per domain: r and the plain step of the mixed run, the domain's own acceptance), reported beside the measured one;
it picks the chain length per batch size: vLLM's `num_speculative_tokens_per_batch_size`, or off where the drafter
costs more than it saves.

Bounded in count (requests per run), bytes (each answer, net.request's cap) and time (each request's deadline and
each run's; what a run's deadline leaves unsent is counted). Timing on a shared machine: the servers and this client
share the CPU with anything else running, so measure on a quiet one (the report records the load average).
Writes report.json, report.md and tokens_per_s.png into --out (atomic writers), and the servers' logs in
--out/logs.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.benchmark.serve_client import Run, drive, served_model, stream_chat
from draftsmith.decoding import batch_cost
from draftsmith.errors import ConfigError

SCHEMA = 1


@dataclass
class Plan:
    """What every server is asked: the same prompts, at the same concurrencies, with the same bounds."""

    by_domain: dict[str, list[list[dict]]]  # domain -> each prompt's chat messages
    concurrency: list[int]
    requests: int  # per mixed run (at least the concurrency)
    domain_requests: int  # per homogeneous run; 0: none
    max_tokens: int
    request_timeout: float
    run_timeout: float
    prompts: dict | None = None  # what was read (load_plan_prompts), for the report


@dataclass
class Server:
    """One configuration: `plain`, or a drafter (its export folder, or a server given by URL)."""

    name: str
    speculative_config: dict | None = None
    url: str | None = None  # None: started here
    # fixes of vLLM's CPU kernels serve-check applies for this format (layouts.serving.VllmPatch) and a `vllm serve`
    # started here does not: recorded in the report, since the drafter's acceptance may differ where one matters
    patches_not_applied: list[str] = field(default_factory=list)

    @property
    def k(self) -> int:
        return (self.speculative_config or {}).get("num_speculative_tokens") or 0


def mixed(by_domain: dict[str, list], n: int) -> list[tuple[str, list[dict]]]:
    """n requests with the domains interleaved (round robin, each domain's prompts in order, cycled): any window of
    the run holds every domain alike."""
    domains = sorted(by_domain)
    order = []
    for i in range(max(len(v) for v in by_domain.values())):
        order += [(d, by_domain[d][i]) for d in domains if i < len(by_domain[d])]
    return [order[i % len(order)] for i in range(n)]


def homogeneous(domain: str, prompts: list, n: int) -> list[tuple[str, list[dict]]]:
    """n requests of one domain's prompts, cycled."""
    return [(domain, prompts[i % len(prompts)]) for i in range(n)]


def load_plan_prompts(files: list[str] | None, split: str, limit_per_domain: int | None, tokenizer,
                      max_prompt_tokens: int | None) -> tuple[dict[str, list[list[dict]]], dict]:
    """The prompts by domain as one-turn chats, and what was read: a prompt longer than the server takes
    (`max_prompt_tokens`, counted with the target's chat template where the tokenizer is known) is left out and
    counted."""
    from draftsmith.evaluation.domains import default_prompt_files, format_prompt, load_prompts

    given = bool(files)
    files = list(files or [str(p) for p in default_prompt_files(split)])
    by_domain: dict[str, list[list[dict]]] = {}
    too_long = 0
    for p in load_prompts(files, limit_per_domain):
        if tokenizer is not None and max_prompt_tokens is not None:
            if len(format_prompt(tokenizer, p.text)) > max_prompt_tokens:
                too_long += 1
                continue
        by_domain.setdefault(p.domain, []).append([{"role": "user", "content": p.text}])
    if not by_domain:
        raise ConfigError(f"serve-bench: no prompt of {', '.join(files)} fits the server ({too_long} longer than "
                          f"{max_prompt_tokens} tokens)")
    info = {"files": files, "split": None if given else split, "limit_per_domain": limit_per_domain,
            "domains": {d: len(v) for d, v in sorted(by_domain.items())}, "left_out_too_long": too_long}
    return by_domain, info


def _p(values: list[float]) -> dict:
    return {"p50": batch_cost.percentile(values, 50), "p99": batch_cost.percentile(values, 99)}


def _acceptance(samples) -> dict | None:
    """vLLM's per-request counters summed over a run's answers: α, τ, per position, and the sums they come from."""
    counted = [s for s in samples if s.spec is not None]
    if not counted:
        return None
    k = max(s.k for s in counted)
    steps = sum(s.spec[0] for s in counted)
    drafted, accepted = sum(s.spec[1] for s in counted), sum(s.spec[2] for s in counted)
    at = [sum(s.spec[3][d] for s in counted if d < len(s.spec[3])) for d in range(k)]
    return {"k": k, "requests": len(counted), "steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "accepted_at": at, "alpha": batch_cost.ratio(accepted, drafted),
            "tau": 1 + accepted / steps if steps else None,
            "per_position_acceptance": [a / steps if steps else None for a in at]}


def summarize(run: Run, scope: str) -> dict:
    """One run's numbers (module docstring); `step_s`: the decode step, per verify step where vLLM counted steps
    (a drafter), else per output token after the first (plain decoding: one token a step)."""
    ok = [s for s in run.samples if s.error is None]
    errors = [s.error for s in run.samples if s.error is not None]
    tokens = sum(s.output_tokens for s in ok)
    decoding = [s for s in ok if s.output_tokens > 1]
    decode_s = sum(s.decode_s for s in decoding)
    acc = _acceptance(decoding)
    per_step = acc["steps"] if acc else sum(s.output_tokens - 1 for s in decoding)
    return {"scope": scope, "concurrency": run.concurrency, "requests": len(run.samples), "ok": len(ok),
            "errors": len(errors), "first_error": errors[0] if errors else None, "not_sent": run.not_sent,
            "wall_s": run.wall_s, "output_tokens": tokens,
            "output_tokens_per_s": tokens / run.wall_s if run.wall_s > 0 and ok else None,
            "ttft_s": _p([s.ttft_s for s in ok]), "tpot_s": _p([s.tpot_s for s in decoding]),
            "ttft_mean_s": sum(s.ttft_s for s in ok) / len(ok) if ok else None,
            "tokens_after_first_mean": sum(max(s.output_tokens - 1, 0) for s in ok) / len(ok) if ok else None,
            "latency_s": _p([s.latency_s for s in ok]), "decode_s": decode_s,
            "step_s": decode_s / per_step if per_step else None,
            "acceptance": acc}


def _runs(url: str, model: str, plan: Plan) -> list[dict]:
    """Every run of one server: at each concurrency, the mixed run, then one per domain."""
    out = []
    for c in plan.concurrency:
        # c short requests at c in flight, not counted: the engine's first steps at a new batch size are slower
        drive(url, model, mixed(plan.by_domain, c), c, 8, plan.request_timeout, plan.run_timeout)
        jobs = [("mixed", mixed(plan.by_domain, max(plan.requests, c)))]
        if plan.domain_requests and len(plan.by_domain) > 1:
            jobs += [(f"domain:{d}", homogeneous(d, v, max(plan.domain_requests, c)))
                     for d, v in sorted(plan.by_domain.items())]
        for scope, items in jobs:
            run = drive(url, model, items, c, plan.max_tokens, plan.request_timeout, plan.run_timeout)
            out.append(summarize(run, scope))
            r = out[-1]
            print(f"  c={c:<3} {scope:<24} {r['ok']}/{r['requests']} ok  "
                  f"{r['output_tokens_per_s'] or 0:8.1f} tok/s  tpot p50 {(r['tpot_s']['p50'] or 0) * 1e3:7.1f} ms",
                  flush=True)
    return out


def bench_server(server: Server, target, plan: Plan, logs: Path, max_model_len: int) -> dict:
    """One configuration's runs: its server started here (and stopped) unless it was given by URL; one short
    request first, outside every run (the first answer of a fresh server pays for its warm-up)."""
    from draftsmith.data.engines.vllm_server import VllmServer

    srv = None
    if server.url is None:
        extra = ("--per-request-spec-decode-metrics", "detailed") if server.speculative_config else ()
        srv = VllmServer(target.folder, logs / f"{server.name}.log", speculative_config=server.speculative_config,
                         served_name="serve-bench", max_model_len=max_model_len,
                         max_num_seqs=max(plan.concurrency), extra=extra)
        print(f"{server.name}: starting vllm serve (log {srv.log_path})", flush=True)
        srv.start()
    try:
        url = srv.base_url if srv else server.url
        model = "serve-bench" if srv else served_model(url)
        first = next(iter(plan.by_domain.values()))[0]
        warm = stream_chat(url, model, "warm-up", first, 8, plan.request_timeout)
        if warm.error:
            raise ConfigError(f"{server.name}: the warm-up request failed: {warm.error}")
        print(f"{server.name}: {url}", flush=True)
        runs = _runs(url, model, plan)
    finally:
        if srv is not None:
            srv.stop()
    return {"speculative_config": server.speculative_config, "url": server.url, "started_here": srv is not None,
            "patches_not_applied": server.patches_not_applied, "runs": runs}


def _by_scope(runs: list[dict]) -> dict[tuple[int, str], dict]:
    return {(r["concurrency"], r["scope"]): r for r in runs}


def _served(plain: dict, spec: dict, t1: float | None) -> batch_cost.Served | None:
    """A request's measured costs at this concurrency: the plain step t1 (of the mixed run), each side's mean time
    to first token, and the output tokens after the first of the plain run."""
    parts = (t1, plain["ttft_mean_s"], spec["ttft_mean_s"], plain["tokens_after_first_mean"])
    return None if any(x is None for x in parts) else batch_cost.Served(*parts)


def _vs(plain: dict, spec: dict, r: float | None, t1: float | None) -> dict:
    """A drafter's run against the plain server's with the same prompts and concurrency: measured, and predicted from
    vLLM's acceptance in this run, r(c) and t1(c) (of the mixed run) and this run's TTFTs (decoding/batch_cost.py)."""
    acc = spec["acceptance"]
    measured = batch_cost.ratio(spec["output_tokens_per_s"], plain["output_tokens_per_s"])
    decode = batch_cost.predicted_speedup(acc["accepted_at"], acc["steps"], acc["k"], r) if acc else None
    served = _served(plain, spec, t1)
    predicted = served.speedup(decode) if served else None
    return {"speedup": measured, "predicted_speedup": predicted,
            "prediction_error": batch_cost.ratio(predicted, measured) - 1 if predicted and measured else None,
            "predicted_decode_speedup": decode,
            "tpot_speedup": batch_cost.ratio(plain["tpot_s"]["p50"], spec["tpot_s"]["p50"]),
            "ttft_ratio": batch_cost.ratio(spec["ttft_s"]["p50"], plain["ttft_s"]["p50"]),
            "output_tokens_per_s": spec["output_tokens_per_s"],
            "plain_output_tokens_per_s": plain["output_tokens_per_s"],
            "alpha": acc["alpha"] if acc else None, "tau": acc["tau"] if acc else None, "k": acc["k"] if acc else None}


def compare(plain_runs: list[dict], spec_runs: list[dict], max_batch: int) -> dict:
    """One drafter against plain decoding: per concurrency (the mixed runs) the step ratio r(c), measured and predicted
    speedup and the recommended chain length; per domain and concurrency the same with the mixed run's r(c) and t1(c);
    vLLM's `num_speculative_tokens_per_batch_size` from the recommendations."""
    plain, spec = _by_scope(plain_runs), _by_scope(spec_runs)
    by_c, by_domain, ks, costs = {}, {}, {}, {}
    for (c, scope), s in sorted(spec.items()):
        if scope != "mixed" or (c, scope) not in plain:
            continue
        t1 = plain[(c, scope)]["step_s"]
        costs[c] = (batch_cost.step_ratio(t1, s["step_s"]), t1)
        row = {**_vs(plain[(c, scope)], s, *costs[c]), "step_ratio": costs[c][0], "plain_step_s": t1}
        acc = s["acceptance"]
        rec = (batch_cost.recommend_k(acc["accepted_at"], acc["steps"], acc["k"], costs[c][0],
                                      _served(plain[(c, scope)], s, t1)) if acc else {"k": None})
        row["recommended_k"], row["recommended"] = rec["k"], rec
        if rec["k"] is not None:
            ks[c] = rec["k"]
        by_c[str(c)] = row
    for (c, scope), s in sorted(spec.items()):
        if scope.startswith("domain:") and (c, scope) in plain:
            r, t1 = costs.get(c, (None, None))
            by_domain.setdefault(scope.split(":", 1)[1], {})[str(c)] = _vs(plain[(c, scope)], s, r, t1)
    k = next((row["k"] for row in by_c.values() if row["k"]), None)
    sched = batch_cost.schedule(ks, max_batch) if ks and len(ks) == len(by_c) else []
    return {"by_concurrency": by_c, "by_domain": by_domain, "num_speculative_tokens_per_batch_size": sched,
            "verdict": _verdict(sched, k)}


def _verdict(sched: list[list[int]], k: int | None) -> str:
    if not sched:
        return "no recommendation (a concurrency without vLLM's acceptance or a plain run to compare with)"
    if all(x[2] == 0 for x in sched):
        return "off at every measured concurrency: the drafter costs more than it saves"
    if all(x[2] == k for x in sched):
        return f"on at k = {k} at every measured concurrency"
    return "k by batch size: " + ", ".join(f"{a}-{b}: {'off' if x == 0 else x}" for a, b, x in sched)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def serve_bench(target, servers: list[Server], plan: Plan, out: str | Path, max_model_len: int) -> dict:
    """Every server's runs, the comparisons, and the report written into `out` (report.json, report.md, the plot)."""
    from draftsmith.benchmark.serve_report import write_report

    out = Path(out)
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ConfigError(f"serve-bench: two servers share a name ({', '.join(names)}): each names its column")
    load_before, t0 = _load(), time.time()
    results = {s.name: bench_server(s, target, plan, out / "logs", max_model_len) for s in servers}
    max_batch = max(plan.concurrency)
    comparisons = {name: compare(results["plain"]["runs"], res["runs"], max_batch)
                   for name, res in results.items() if name != "plain" and "plain" in results}
    report = {"kind": "serve-bench", "schema": SCHEMA, "command": ["draftsmith", *sys.argv[1:]],
              "date": time.strftime("%Y-%m-%d", time.gmtime(t0)), "seconds": time.time() - t0,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_before,
                          "load_after": _load()},
              "target": getattr(target, "name", None), "concurrency": plan.concurrency, "requests": plan.requests,
              "domain_requests": plan.domain_requests, "max_tokens": plan.max_tokens, "prompts": plan.prompts,
              "servers": results, "comparisons": comparisons}
    write_report(report, out)
    return report
