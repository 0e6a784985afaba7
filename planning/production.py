"""Production α: acceptance counters from a serving engine, as the per-domain table retraining reads.

Two sources, one output shape (the `domains` / `overall` rows of an evaluation report, which is what
`retrain.decide.staleness` and `domain_policy` consume):

1. vLLM's Prometheus text exposition: the running server's endpoint (`http://host:8000/metrics`, read
   directly) or a dump of it (`curl http://host:8000/metrics > dump.prom`). vLLM (v1 engine,
   `vllm/v1/spec_decode/metrics.py`) counts, per `model_name` (and `engine`) label,
       vllm:spec_decode_num_drafts_total                 verification steps that carried a draft
       vllm:spec_decode_num_draft_tokens_total           drafted tokens
       vllm:spec_decode_num_accepted_tokens_total        accepted drafted tokens
       vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
   and finished requests in vllm:request_success_total. α = accepted / draft tokens, τ = 1 + accepted /
   drafts (vLLM's own "mean acceptance length"), per-position acceptance = accepted_per_pos[i] / drafts.
   The counters are cumulative since the server started: give an earlier dump as `since` to get the window
   between the two. Each server process's start time (`process_start_time_seconds`, one per process by its
   labels where a multi-API-server vLLM runs several) tells a restart from a scale-out: a process that kept its
   start counts its difference, one that restarted its counts since, a new one all it has (`vllm_alpha`). A
   counter series appears once: position="0" and "00" are one series, refused, never summed.
   Every counter is checked as it enters: a count is finite and >= 0, positions are 0..k-1, accepted tokens
   come with the drafted tokens they are divided by; a URL is read through net.py (a byte cap and a deadline).
   vLLM has no notion of a domain: `model_domains` maps a served model name (one per deployment, or a
   LoRA/adapter name per traffic class) to a domain; unmapped models keep their name.
2. Request logs (a folder of *.jsonl / *.jsonl.gz read by planning/logs.py, each line checked once as the
   traffic line of fleet/traffic_record.py, the reader retraining uses too) whose rows carry the engine's
   per-request counters, one of:
   a. vLLM's own (`--per-request-spec-decode-metrics summary|detailed`): `speculative_decoding`, as the fleet's
      traffic middleware logs it (fleet/middleware.py), or `metrics.speculative_decoding` of a raw response:
      RequestSpecDecodeMetrics.to_dict() (vllm/v1/metrics/stats.py), a histogram h over the draft tokens j
      accepted per verify step. The scheduler feeds it and the Prometheus counters of source 1 from the same
      step (make_spec_decoding_stats, vllm/v1/core/sched/scheduler.py), so summed over requests
          drafts = num_spec_steps = Σ h[j],   drafted = num_draft_tokens,   accepted = Σ j·h[j],
          accepted at position i = Σ_{j>i} h[j]   (SpecDecodingStats.observe_draft counts positions 0..j-1)
      are exactly the counters' deltas over the same requests. Checked as they enter: h a list of ints >= 0
      of length num_spec_tokens + 1, Σh == num_spec_steps, Σj·h == num_accepted_draft_tokens, accepted <=
      drafted <= k·steps, the two rates what the counts give, and with `detailed` per_step_accepted /
      per_step_drafted of length num_spec_steps, summing to the totals, each step's accepted <= its drafted
      <= k, and the accepted ones making up h;
   b. a gateway's `draft_tokens` + `accepted_tokens` (+ optional `drafts`): α, and τ only with `drafts`;
   c. SGLang's `meta_info` style `spec_verify_ct` + `completion_tokens` (τ = completion_tokens / spec_verify_ct):
      τ, and α only with `draft_tokens`.
   Each row counts in its own terms: α sums the accepted and drafted tokens of the rows that count drafted
   tokens, τ the accepted tokens and verify steps of the rows that count steps, each group keeping the two sums
   apart (`alpha_requests`, `tau_requests`; `note` says so where the rows differ), so a τ-only row's accepted
   tokens never inflate α. A row whose counters break a rule (more accepted than drafted included) is one bad
   row (`file:line: field ...`), skipped and counted in `malformed`; a row with none (a stream logged without
   `include_usage`) is counted in `uncounted`, a refused request (status != 200, an error) in `refused`, a row
   holding text UTF-8 cannot encode in `unencodable`. Rows are grouped by their `domain` field, else by a
   routing policy's classifier applied to the row's text (decoding/routing.py: the policy's router, the
   keywords of the prompt text or of a chat's last user message), else "unknown"; the `max_domains` largest
   groups by requests keep their name, the rest are "other" (`merged_domains`). Per-position acceptance is given
   for a group only when every one of its drafts was counted by position (source a).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from draftsmith import net
from draftsmith.errors import ConfigError, DataError, show
from draftsmith.fleet.traffic_record import TrafficRecord
from draftsmith.formatting import fmt_num, md_cell, md_row
from draftsmith.planning.logs import MAX_DOMAINS, cap_domains, log_files, traffic
from draftsmith.reading import is_int

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

PREFIX = "vllm:spec_decode_"


def parse_prometheus(text: str, source: str = "metrics") -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition (comments skipped); a bad
    line is one DataError naming `source` (the file or URL) and the line."""
    out = []
    # lines end at "\n" alone (the format's rule): str.splitlines would also split inside a label value holding
    # a carriage return or U+2028, both legal there
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip(" \t\r")
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise DataError(f"{source} line {n}: not a Prometheus sample: {show(line)}")
        labels = {k: re.sub(r'\\(.)', lambda e: "\n" if e[1] == "n" else e[1], v)
                  for k, v in _LABEL.findall(m["labels"] or "")}
        try:
            value = float(m["value"])
        except ValueError:
            raise DataError(f"{source} line {n}: value {m['value']!r} is not a number") from None
        out.append((m["name"], labels, value))
    return out


def _counter(name: str) -> str:
    """Counter samples are exposed as <name>_total; `_created` timestamps are not counts."""
    return name[:-6] if name.endswith("_total") else name


START = "process_start_time_seconds"  # prometheus_client's process collector: when the server process started
REQUIRED = {"num_accepted_tokens": "num_draft_tokens", "num_accepted_tokens_per_pos": "num_drafts"}
MAX_POSITION_DIGITS = 6  # vLLM labels draft positions 0..k-1: a handful


def _new_counts() -> dict:
    return {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": defaultdict(float), "requests": 0.0,
            "seen": set()}


def _process(labels: dict[str, str], starts: dict[tuple, float]) -> tuple | None:
    """The process a counter sample belongs to: the start-time sample whose labels (pid="...") the counter's own
    labels carry, the most specific one; None where none or several fit (counters summed over processes, as
    Prometheus' multiprocess mode exposes a multi-API-server vLLM's). One unlabelled start time (one server
    process) owns every counter."""
    fits = [p for p in starts if all(labels.get(k) == v for k, v in p)]
    most = max((len(p) for p in fits), default=-1)
    best = [p for p in fits if len(p) == most]
    return best[0] if len(best) == 1 else None


def _position(labels: dict[str, str], name: str, model: str, source: str) -> int:
    pos = labels.get("position", "")
    if not (pos.isascii() and pos.isdigit() and len(pos) <= MAX_POSITION_DIGITS):
        raise DataError(f"{source}: {name} of model {model!r}: position={pos!r} is not a draft position "
                        "(an int >= 0); refused")
    return int(pos)


def _vllm_counts(text: str, label: str, source: str = "vllm metrics") -> tuple[dict[tuple, dict], dict]:
    """Per (process, model `label`): the speculative-decoding counters of one dump, checked as they enter; and the
    dump's process start times ({labels: seconds}), which tell a restart between two dumps (`_process`: the
    process a counter belongs to, None where the counters are summed over processes).

    A sample is one series (its name and labels); a series seen twice is refused, never summed: a position label
    is read by its integer value, so `position="0"` and `position="00"` are one series."""
    samples = parse_prometheus(text, source)
    starts: dict[tuple, float] = {}
    for name, labels, value in samples:
        if name == START:
            key = tuple(sorted(labels.items()))
            if key in starts:
                raise DataError(f"{source}: {START}{_shown(key)} appears twice: which process started when is "
                                "unknown; refused")
            starts[key] = value
    counts: dict[tuple, dict] = defaultdict(_new_counts)
    series: dict[tuple, str] = {}
    for name, labels, value in samples:
        base = _counter(name)
        if name == START or name.endswith("_created") or not (base == "vllm:request_success"
                                                             or base.startswith(PREFIX)):
            continue
        model = labels.get(label, "")
        if not (math.isfinite(value) and value >= 0):
            raise DataError(f"{source}: {name} of model {model!r} is {value}, not a count (a NaN is never read as 0)")
        key = base[len(PREFIX):] if base.startswith(PREFIX) else "requests"
        pos = _position(labels, name, model, source) if key == "num_accepted_tokens_per_pos" else None
        one = (base, tuple(sorted((k, v) for k, v in labels.items() if k != "position")), pos)
        if one in series:
            said = f"position={labels.get('position')!r} is position {pos} again (position={series[one]!r} before)"
            raise DataError(f"{source}: {name} of model {model!r}: " + (said if pos is not None else
                            f"the series{_shown(one[1])} appears twice") + " in one series; refused, never summed")
        series[one] = labels.get("position", "")
        c = counts[(_process(labels, starts), model)]
        c["seen"].add(key)
        if key == "requests":
            c["requests"] += value
        elif key == "num_drafts":
            c["drafts"] += value
        elif key == "num_draft_tokens":
            c["draft_tokens"] += value
        elif key == "num_accepted_tokens":
            c["accepted"] += value
        elif pos is not None:
            c["per_pos"][pos] += value
    for (proc, model), c in sorted(counts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        where = repr(model) if not proc else f"{model!r} of process {_shown(proc)}"
        # a counter missing beside the one it divides: summed as 0, it would make α or a position's rate
        # anything (accepted tokens over no drafted tokens)
        for have, need in REQUIRED.items():
            if have in c["seen"] and need not in c["seen"]:
                raise DataError(f"{source}: {where}: {PREFIX}{have}_total but no {PREFIX}{need}_total, "
                                "what it is divided by: its acceptance cannot be counted; refused")
        if sorted(c["per_pos"]) != list(range(len(c["per_pos"]))):
            raise DataError(f"{source}: {where}: per-position counters at positions {sorted(c['per_pos'])[:10]}: "
                            "vLLM counts every position 0..k-1, some are missing; refused")
    return counts, starts


def _shown(labels: tuple) -> str:
    """A process (or series) by its labels, as /metrics writes them: {pid="101"}."""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


def _row(drafts: float, draft_tokens: float, accepted: float, per_pos: dict[int, float], requests: float,
         accepted_alpha: float | None = None, accepted_tau: float | None = None) -> dict:
    """One table row. `accepted_alpha` / `accepted_tau`: the accepted tokens of the groups that count drafted
    tokens / drafts (the overall row: a group without the divisor adds nothing to either ratio)."""
    positions = [per_pos[i] for i in sorted(per_pos)]
    a_alpha = accepted if accepted_alpha is None else accepted_alpha
    a_tau = accepted if accepted_tau is None else accepted_tau
    return {
        "n_prompts": int(requests),
        "drafts": int(drafts),
        "proposed": int(draft_tokens),
        "accepted": int(accepted),
        "alpha": a_alpha / draft_tokens if draft_tokens else None,
        "tau": 1.0 + a_tau / drafts if drafts else None,
        # vLLM's per-position rate: P(position i accepted) over all drafts (already cumulative in i)
        "per_position_acceptance": [p / drafts for p in positions] if drafts else [],
    }


def _inconsistent(g: dict) -> str | None:
    """Why a group's counters cannot be one engine's counts, or None: every count finite and >= 0, no more
    accepted than drafted tokens, no position accepted more often than there were drafts."""
    for k in ("drafts", "draft_tokens", "accepted", "requests"):
        if not (math.isfinite(g[k]) and g[k] >= 0):
            return f"{k} is {g[k]}, not a count"
    if g["draft_tokens"] > 0 and g["accepted"] > g["draft_tokens"]:
        return (f"{g['accepted']:.0f} accepted tokens > {g['draft_tokens']:.0f} drafted: counters of different "
                "servers or windows mixed, alpha would be above 1")
    bad = next((i for i, v in g["per_pos"].items() if not (math.isfinite(v) and 0 <= v <= g["drafts"])), None)
    if bad is not None:
        return f"position {bad} accepted {g['per_pos'][bad]} times in {g['drafts']:.0f} drafts"
    return None


def _table(groups: dict[str, dict], source: str) -> dict:
    for name, g in sorted(groups.items()):
        problem = _inconsistent(g)
        if problem:
            raise DataError(f"{source}: {name!r}: {problem}; refused")
    domains = {d: _row(g["drafts"], g["draft_tokens"], g["accepted"], g["per_pos"], g["requests"])
               for d, g in sorted(groups.items()) if g["draft_tokens"] > 0 or g["drafts"] > 0}
    if not domains:
        raise DataError(f"{source}: no speculative-decoding counters with drafted tokens found")
    tot: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": defaultdict(float), "requests": 0.0}
    for g in groups.values():
        for k in ("drafts", "draft_tokens", "accepted", "requests"):
            tot[k] += g[k]
        for i, v in g["per_pos"].items():
            tot["per_pos"][i] += v
    if any(g["drafts"] > 0 and not g["per_pos"] for g in groups.values()):
        tot["per_pos"] = {}  # a group's drafts were not counted by position: over all drafts, no position's rate
    # SGLang's logs count no drafted tokens (τ only): their accepted tokens stay out of the overall α
    by_alpha = sum(g["accepted"] for g in groups.values() if g["draft_tokens"] > 0)
    by_tau = sum(g["accepted"] for g in groups.values() if g["drafts"] > 0)
    return {"kind": "production_alpha", "source": source, "domains": domains,
            "overall": _row(tot["drafts"], tot["draft_tokens"], tot["accepted"], tot["per_pos"], tot["requests"],
                            by_alpha, by_tau)}


def vllm_alpha(text: str, since: str | None = None, model_domains: dict[str, str] | None = None,
               label: str = "model_name", source: str = "vllm metrics", since_source: str | None = None) -> dict:
    """Per-domain α table from a vLLM /metrics dump (minus an earlier dump `since`, if given).

    The counters are cumulative per server process, and each process's start time
    (`process_start_time_seconds`, one per process — by its labels, pid="..." — where a multi-API-server vLLM
    runs several) tells what happened to it between the dumps (`_baselines`): a process in both with the same
    start counts its difference, one that restarted counts since its restart (what it counted before its end
    is lost, which the table says: `restarted`), a new one counts all it has. Counters that went down with no
    start time to tell why are refused."""
    now, started = _vllm_counts(text, label, source)
    before, started_before = (_vllm_counts(since, label, since_source or f"{source} (--since)") if since
                              else ({}, {}))
    now, baselines, note = _baselines(now, before, started, started_before) if since else (now, {}, None)
    groups: dict[str, dict] = defaultdict(lambda: {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
                                                   "per_pos": defaultdict(float), "requests": 0.0})
    for (proc, model), c in now.items():
        b = baselines.get((proc, model))
        g = groups[(model_domains or {}).get(model, model)]
        for k in ("drafts", "draft_tokens", "accepted", "requests"):
            delta = c[k] - (b[k] if b else 0.0)
            if delta < 0:
                raise DataError(f"{source}: counter {k} of model {model!r} went down since the earlier dump "
                                + ("(the server restarted): use a dump taken after the restart"
                                   if not (started and started_before) else "though its process did not restart "
                                   f"({START} unchanged): dumps of different servers?"))
            g[k] += delta
        for i, v in c["per_pos"].items():
            g["per_pos"][i] += v - (b["per_pos"].get(i, 0.0) if b else 0.0)
    table = _table(groups, source)
    if note:
        table["restarted"] = note
    return table


def _by_model(counts: dict[tuple, dict]) -> dict[tuple, dict]:
    """The groups of a dump summed over processes: {(None, model): counts}."""
    out: dict[tuple, dict] = defaultdict(_new_counts)
    for (_, model), c in counts.items():
        o = out[(None, model)]
        for k in ("drafts", "draft_tokens", "accepted", "requests"):
            o[k] += c[k]
        for i, v in c["per_pos"].items():
            o["per_pos"][i] += v
    return out


def _baselines(now: dict, before: dict, started: dict, started_before: dict) -> tuple[dict, dict, str | None]:
    """The later dump's (process, model) groups, what to subtract from each, and what the table must say.

    - every counter of both dumps belongs to one process (`_process`): process by process, a process with the
      same start time in both is subtracted, one that restarted or is new is not (its counts since it started
      all fall in the window); one gone from the later dump lost what it counted after the earlier one;
    - counters summed over processes, each process with its start time: when every process of the earlier dump
      is in the later one with the same start (only new ones came), the sums' difference is exact (a new
      process started from 0 inside the window); else the dumps cannot be matched per process and the later
      dump alone is the count (what the server counted since its processes started), and the table says so;
    - no start times (either dump): the sums' difference; a counter that went down is refused by the caller."""
    if not started or not started_before:
        return _by_model(now), _by_model(before), None
    if all(p is not None for p, _ in now) and all(p is not None for p, _ in before):
        kept = {p for p, t in started.items() if started_before.get(p) == t}
        restarted = sorted(p for p in started if p in started_before and p not in kept)
        gone = sorted(p for p in started_before if p not in started)
        note = None
        if restarted == [()] and not gone:  # one unlabelled server process
            note = (f"the server restarted between the dumps ({START} {started_before[()]:.0f} -> "
                    f"{started[()]:.0f}): the counts are those since the restart")
        elif restarted or gone:
            note = "; ".join(
                [f"process {_shown(p)} restarted between the dumps ({START} {started_before[p]:.0f} -> "
                 f"{started[p]:.0f}): its counts are those since its restart" for p in restarted]
                + [f"process {_shown(p) or '(unlabelled)'} is gone from the later dump: what it counted after the "
                   "earlier one is lost" for p in gone])
        return now, {k: c for k, c in before.items() if k[0] in kept}, note
    if started_before.items() <= started.items():
        return _by_model(now), _by_model(before), None
    changed = sorted(p for p in started_before if started.get(p) != started_before[p])
    what = ", ".join(f"{_shown(p) or '(unlabelled)'} " + ("restarted" if p in started else "is gone")
                     for p in changed[:4])
    return _by_model(now), {}, (f"the dumps cannot be matched per process (their counters are summed over "
                                f"processes; process {what}): the counts are the later dump's, since its "
                                "processes started")


def _count(meta: dict, key: str) -> float:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{key} is {show(value)}, expected a count (a finite number >= 0)")
    return float(value)


MAX_SPEC_TOKENS = 1024  # vLLM's num_speculative_tokens is a handful; a k past this is no engine's


def _spec_int(sd: dict, key: str, where: str, lo: int = 0, hi: int | None = None) -> int:
    value = sd.get(key)
    if not is_int(value, lo, hi):
        raise ValueError(f"{where}.{key} is {show(value)}, expected an int "
                         + (f">= {lo}" if hi is None else f"in {lo}..{hi}"))
    return value


def _spec_steps(sd: dict, where: str, k: int, steps: int, totals: tuple[int, int], hist: list[int]) -> None:
    """`detailed`'s per-step arrays (null or absent at `summary`, and when no step ran): one entry per verify
    step, summing to the totals, each step's accepted <= its drafted <= k, the accepted ones making up `hist`."""
    acc, dra = sd.get("per_step_accepted"), sd.get("per_step_drafted")
    if acc is None and dra is None:
        return
    for key, value in (("per_step_accepted", acc), ("per_step_drafted", dra)):
        if not (isinstance(value, list) and len(value) == steps and all(is_int(v, 0, k) for v in value)):
            raise ValueError(f"{where}.{key} is {show(value)}, expected {steps} ints in 0..{k} (one per "
                             "verify step, num_spec_steps)")
    if sum(acc) != totals[1] or sum(dra) != totals[0]:
        raise ValueError(f"{where}.per_step_accepted / per_step_drafted sum to {sum(acc)} / {sum(dra)}, not "
                         f"num_accepted_draft_tokens {totals[1]} / num_draft_tokens {totals[0]}")
    bad = next((i for i, (a, d) in enumerate(zip(acc, dra, strict=True)) if a > d), None)
    if bad is not None:
        raise ValueError(f"{where}.per_step_accepted[{bad}] is {acc[bad]} > per_step_drafted[{bad}] {dra[bad]}")
    seen = Counter(acc)
    if any(seen[j] != h for j, h in enumerate(hist)):
        raise ValueError(f"{where}.acceptance_histogram {show(hist)} is not the histogram of per_step_accepted")


def spec_decoding(sd, where: str) -> tuple[float, float, float, list[float]]:
    """(drafts, drafted tokens, accepted tokens, accepted per position) of vLLM's per-request metrics, or a
    ValueError naming the field that breaks a rule (module docstring, source 2a). The one reader of them: the
    traffic log's rows here, a streamed answer's final usage chunk in serve-bench (benchmark/serve_client.py)."""
    if not isinstance(sd, dict):
        raise ValueError(f"{where} is {show(sd)}, expected vLLM's per-request metrics (a JSON object)")
    k = _spec_int(sd, "num_spec_tokens", where, 1, MAX_SPEC_TOKENS)
    steps, drafted = _spec_int(sd, "num_spec_steps", where), _spec_int(sd, "num_draft_tokens", where)
    accepted = _spec_int(sd, "num_accepted_draft_tokens", where)
    hist = sd.get("acceptance_histogram")
    if not (isinstance(hist, list) and len(hist) == k + 1 and all(is_int(h, 0) for h in hist)):
        raise ValueError(f"{where}.acceptance_histogram is {show(hist)}, expected {k + 1} ints >= 0 "
                         "(num_spec_tokens + 1: steps that accepted 0..k draft tokens)")
    if sum(hist) != steps:
        raise ValueError(f"{where}.acceptance_histogram sums to {sum(hist)}, not num_spec_steps {steps}")
    if sum(j * h for j, h in enumerate(hist)) != accepted:
        raise ValueError(f"{where}.acceptance_histogram counts {sum(j * h for j, h in enumerate(hist))} accepted "
                         f"tokens, not num_accepted_draft_tokens {accepted}")
    if not accepted <= drafted <= k * steps:
        raise ValueError(f"{where}.num_draft_tokens is {drafted}: expected num_accepted_draft_tokens {accepted} "
                         f"<= it <= num_spec_tokens x num_spec_steps {k * steps}")
    for key, want in (("mean_acceptance_length", 1.0 + accepted / steps if steps else 1.0),
                      ("draft_acceptance_rate", accepted / drafted if drafted else 0.0)):
        value = sd.get(key)
        if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                      and math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12)):
            raise ValueError(f"{where}.{key} is {show(value)}, but the counts give {want!r}")
    _spec_steps(sd, where, k, steps, (drafted, accepted), hist)
    return float(steps), float(drafted), float(accepted), _positions(hist)


def _positions(hist: list[int]) -> list[float]:
    """Accepted at position i = Σ_{j>i} h[j]: a step that accepted j draft tokens accepted positions 0..j-1
    (vLLM's SpecDecodingStats.observe_draft); suffix sums, one pass."""
    out, above = [], 0
    for h in reversed(hist[1:]):
        above += h
        out.append(float(above))
    return out[::-1]


def _vllm_metrics(record: TrafficRecord) -> tuple[object, str] | None:
    """vLLM's per-request metrics of a row and where they sit: logged (`speculative_decoding`) or a raw
    response's (`metrics.speculative_decoding`); None where the row carries none."""
    if record.speculative_decoding is not None:
        return record.speculative_decoding, "speculative_decoding"
    metrics = record.extra.get("metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics is {show(metrics)}, expected a JSON object (a response's per-request metrics)")
    sd = metrics.get("speculative_decoding")
    return None if sd is None else (sd, "metrics.speculative_decoding")


@dataclass(frozen=True)
class Counted:
    """One request's counters, each in its own terms: `drafts` (verify steps that carried a draft, τ's divisor)
    and `drafted` (drafted tokens, α's divisor) are None where the engine does not count them, never 0."""

    drafts: float | None
    drafted: float | None
    accepted: float
    per_pos: list[float] | None = None  # accepted per draft position, over `drafts` (vLLM's only)


def _gateway(meta: dict) -> Counted:
    """A gateway's draft_tokens + accepted_tokens (+ drafts): α, and τ where the drafts are counted."""
    drafted, accepted = _count(meta, "draft_tokens"), _count(meta, "accepted_tokens")
    if accepted > drafted:
        raise ValueError(f"accepted_tokens {accepted:g} > draft_tokens {drafted:g}: more accepted than drafted")
    drafts = _count(meta, "drafts") if meta.get("drafts") is not None else None
    if drafts == 0 and accepted > 0:
        raise ValueError(f"accepted_tokens {accepted:g} in drafts 0: no draft, nothing to accept")
    return Counted(drafts, drafted, accepted)


def _sglang(meta: dict) -> Counted:
    """SGLang's spec_verify_ct + completion_tokens: completion tokens = verify steps + accepted drafts, so τ
    is exact; α only where the drafted tokens are counted too."""
    drafts, completion = _count(meta, "spec_verify_ct"), _count(meta, "completion_tokens")
    if completion < drafts:
        raise ValueError(f"completion_tokens {completion:g} < spec_verify_ct {drafts:g}: every verify step "
                         "emits a token")
    drafted = _count(meta, "draft_tokens") if meta.get("draft_tokens") is not None else None
    if drafted is not None and completion - drafts > drafted:
        raise ValueError(f"completion_tokens {completion:g} - spec_verify_ct {drafts:g} accepted > draft_tokens "
                         f"{drafted:g}: more accepted than drafted")
    return Counted(drafts, drafted, completion - drafts)


def _request_counters(record: TrafficRecord) -> Counted | None:
    """One request log row's counters, None for a request logged without any, or a ValueError naming the field
    that breaks a rule (module docstring, source 2)."""
    found = _vllm_metrics(record)
    if found is not None:
        steps, drafted, accepted, per_pos = spec_decoding(*found)
        return Counted(steps, drafted, accepted, per_pos)
    meta = record.extra.get("meta_info") or record.extra
    if not isinstance(meta, dict):
        raise ValueError(f"meta_info is {show(meta)}, expected a JSON object")
    if "draft_tokens" in meta and "accepted_tokens" in meta:
        return _gateway(meta)
    if "spec_verify_ct" in meta and "completion_tokens" in meta:
        return _sglang(meta)
    return None


def _classifier(policy: str | Path | None):
    """(declared domain, the row's text) -> domain: the declared one, else the routing policy's own
    classification of the text (RoutedProposer.classify: its router kind and keywords, decoding/routing.py; the
    text is fleet/traffic_record.py's: a completion prompt, or a chat's last user message), else "unknown"."""
    if policy is None:
        return lambda domain, text: domain or "unknown"
    from draftsmith.decoding.routing import RoutedProposer, load_policy

    router = RoutedProposer(load_policy(policy), {})  # classification only: no proposer is built
    return lambda domain, text: router.classify(domain, text) or "unknown"


SUMS = ("requests", "alpha_requests", "draft_tokens", "accepted_alpha", "tau_requests", "drafts", "accepted_tau",
        "accepted", "pos_drafts")


def _group() -> dict:
    """A domain's sums, kept per counter kind: α's (rows counting drafted tokens) and τ's (rows counting verify
    steps) apart, so no row's accepted tokens are divided by another kind's divisor."""
    return {**dict.fromkeys(SUMS, 0.0), "per_pos": defaultdict(float)}


def _add(g: dict, c: Counted) -> None:
    g["requests"] += 1
    g["accepted"] += c.accepted
    if c.drafted is not None:
        g["alpha_requests"] += 1
        g["draft_tokens"] += c.drafted
        g["accepted_alpha"] += c.accepted
    if c.drafts is not None:
        g["tau_requests"] += 1
        g["drafts"] += c.drafts
        g["accepted_tau"] += c.accepted
        if c.per_pos is not None:
            g["pos_drafts"] += c.drafts
            for i, v in enumerate(c.per_pos):
                g["per_pos"][i] += v


def _merge(groups: dict[str, dict], max_domains: int | None) -> tuple[dict[str, dict], int]:
    """The groups under cap_domains' names (planning/logs.py: the largest by requests keep theirs, the rest
    are one "other"), and how many names were folded."""
    names = cap_domains(Counter({d: g["requests"] for d, g in groups.items()}), max_domains)
    merged: dict[str, dict] = defaultdict(_group)
    for d, g in groups.items():
        m = merged[names[d]]
        for k in SUMS:
            m[k] += g[k]
        for i, v in g["per_pos"].items():
            m["per_pos"][i] += v
    return dict(merged), sum(1 for d, n in names.items() if d != n)


def _log_row(g: dict) -> dict:
    """One table row: α over the rows that count drafted tokens, τ over those that count verify steps, a
    per-position rate only when every draft was counted by position."""
    per_pos = g["per_pos"] if g["drafts"] and g["pos_drafts"] == g["drafts"] else {}
    return {**_row(g["drafts"], g["draft_tokens"], g["accepted"], per_pos, g["requests"], g["accepted_alpha"],
                   g["accepted_tau"]),
            "alpha_requests": int(g["alpha_requests"]), "tau_requests": int(g["tau_requests"])}


def _mixed(total: dict) -> str | None:
    """What was combined, where the rows do not all count both divisors (module docstring, source 2)."""
    n, a, t = (int(total[k]) for k in ("requests", "alpha_requests", "tau_requests"))
    if a == n and t == n:
        return None
    return (f"alpha from the {a} requests that count drafted tokens, tau from the {t} that count verify steps, "
            f"of {n} counted: each rate over its own rows, never one kind's accepted tokens over another's divisor")


def log_alpha(folder: str | Path, policy: str | Path | None = None, max_domains: int | None = MAX_DOMAINS,
              drafter_version: str | None = None, since: float | None = None, first: int | None = None) -> dict:
    """Per-domain α table from request logs carrying per-request speculative counters (module docstring,
    source 2). The files are read and each row checked by planning/logs.py (what cannot be read is named in
    `bad` and skipped; refused and unencodable rows are counted, never used); a row whose counters break a rule
    is one more bad row, named. `policy`: a routing policy file whose classifier gives a row without a
    `domain` its domain. `max_domains`: the largest domains by requests keep their name, the rest are "other".
    `drafter_version`: only the requests that version served alone (the traffic line's label; a request during
    which a swap happened counts for no version); `since`: only requests that arrived at or after these epoch
    seconds (a canary's window); `first`: only the earliest `first` counted requests of those, by arrival (the
    canary judges exactly its N requests, however many came while it looked)."""
    classify = _classifier(policy)
    logs = log_files(folder, "request logs")
    if since is not None:  # a line is written after its request arrived: a file last written before holds none
        logs.files = [f for f in logs.files if f.stat().st_mtime >= since - 1.0]
    groups: dict[str, dict] = defaultdict(_group)
    uncounted, kept = 0, []
    for path, number, record, _ in traffic(logs):
        if drafter_version is not None and (record.drafter_version != drafter_version or record.drafter_swapped):
            continue
        if since is not None and (record.seconds is None or record.seconds < since):
            continue
        try:
            counted = _request_counters(record)
        except ValueError as e:
            logs.reject(f"{path}:{number}", str(e))
            continue
        if counted is None:
            uncounted += 1  # served without speculation, or logged without the engine's counters
            continue
        kept.append((record.seconds or 0.0, len(kept), record, counted))
    for _, _, record, counted in (sorted(kept)[:first] if first is not None else kept):
        _add(groups[classify(record.domain, record.text)], counted)
    if not any(g["draft_tokens"] > 0 or g["drafts"] > 0 for g in groups.values()):
        raise DataError(f"{folder}: no request carries speculative-decoding counters (speculative_decoding, "
                        f"draft_tokens + accepted_tokens, or spec_verify_ct + completion_tokens; {uncounted} rows "
                        f"without, {logs.malformed} malformed, {logs.refused} refused{logs.first_bad()})")
    groups, merged = _merge(groups, max_domains)
    total = _group()
    for g in groups.values():
        for k in SUMS:
            total[k] += g[k]
        for i, v in g["per_pos"].items():
            total["per_pos"][i] += v
    table = {"kind": "production_alpha", "source": str(folder),
             "domains": {d: _log_row(g) for d, g in sorted(groups.items()) if g["draft_tokens"] > 0 or g["drafts"] > 0},
             "overall": _log_row(total)}
    note = _mixed(total)
    if note:
        table["note"] = note
    table.update(malformed=logs.malformed, bad=logs.bad, uncounted=uncounted, refused=logs.refused,
                 unencodable=logs.unencodable, merged_domains=merged)
    return table


def is_url(source) -> bool:
    return str(source).startswith(("http://", "https://"))


def read_metrics(source: str | Path, timeout: float = 30.0, max_bytes: int | None = None) -> str:
    """The Prometheus text of `source`: a running server's /metrics endpoint (an http(s) URL, e.g.
    http://127.0.0.1:8000/metrics of `vllm serve`) or a dump of one (a file). Either is read up to `max_bytes`
    (default net.METRICS_MAX_BYTES) and must be UTF-8; a URL must answer in full within `timeout` seconds (a
    deadline for the whole answer, net.py). Anything else is one DataError naming the URL or file."""
    cap = net.METRICS_MAX_BYTES if max_bytes is None else max_bytes
    if not is_url(source):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"production metrics not found: {path}")
        if path.stat().st_size > cap:
            raise DataError(f"{path}: {path.stat().st_size} bytes, larger than {cap} bytes: not a /metrics dump; "
                            "refused")
        return net.decode(path.read_bytes(), str(path), "the file")
    try:
        return net.request(str(source), deadline=timeout, max_bytes=cap).text()
    except net.NetError as e:
        raise DataError(f"{e.url}: no metrics read ({e.reason})" if e.status is None else str(e)) from None


def production_alpha(path: str | Path, since: str | Path | None = None,
                     model_domains: dict[str, str] | None = None, save: str | Path | None = None,
                     timeout: float = 30.0, max_bytes: int | None = None, policy: str | Path | None = None,
                     max_domains: int | None = MAX_DOMAINS) -> dict:
    """A running server's /metrics URL or a Prometheus dump (a file), or request logs (a folder / a .jsonl
    file) -> the per-domain α table. `since`: an earlier dump (file or URL read now), the window between the
    two. `save`: keep the metrics text read (the `since` of the next check). `timeout`, `max_bytes`: the
    bounds of each read (read_metrics). `policy`: a routing policy file classifying logged requests that
    declare no domain (request logs only: /metrics counts per served model, mapped by `model_domains`).
    `max_domains`: request logs only, the domains named in the table (the largest; the rest are "other")."""
    if not is_url(path):
        path = Path(path)
        if not path.exists():
            raise DataError(f"production metrics not found: {path}")
        if path.is_dir() or path.name.endswith((".jsonl", ".jsonl.gz")):
            return log_alpha(path, policy, max_domains)
    if policy is not None:
        raise ConfigError(f"routing policy {policy}: it classifies logged requests, and {net.safe_url(str(path))} "
                          "is /metrics (counted per served model: map model names to domains instead)")
    text = read_metrics(path, timeout, max_bytes)
    earlier = read_metrics(since, timeout, max_bytes) if since else None
    table = vllm_alpha(text, earlier, model_domains, source=net.safe_url(str(path)),
                       since_source=net.safe_url(str(since)) if since else None)
    if save:
        from draftsmith.outputs import atomic_write_text

        atomic_write_text(save, text)
    return table


def render(table: dict) -> str:
    """The table as Markdown. Domains, model names, the source and the logs' bad lines are outside text: each
    goes through formatting.md_cell, so none can forge a row."""
    lines = [f"# Production acceptance ({md_cell(table['source'])})", "",
             "| domain | requests | drafts | drafted | accepted | α | τ | per-position |",
             "|---|---|---|---|---|---|---|---|"]
    if table.get("restarted"):
        lines[1:1] = ["", f"Note: {md_cell(table['restarted'])}."]
    for d, r in list(table["domains"].items()) + [("overall", table["overall"])]:
        lines.append(md_row(d, r["n_prompts"], r["drafts"], r["proposed"], r["accepted"], fmt_num(r["alpha"]),
                            fmt_num(r["tau"]), fmt_num(r["per_position_acceptance"], ".2f")))
    if table.get("uncounted") or table.get("malformed"):
        lines += ["", f"Log rows without counters: {table.get('uncounted', 0)}; malformed rows skipped: "
                      f"{table.get('malformed', 0)}" + (f" (first: {md_cell(table['bad'][0])})" if table.get("bad")
                                                        else "")]
    return "\n".join(lines) + "\n"
