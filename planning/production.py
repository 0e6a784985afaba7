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
   between the two (across a restart, told by `process_start_time_seconds`, the counts since the restart).
   Every counter is checked as it enters: a count is finite and >= 0, positions are 0..k-1, accepted tokens
   come with the drafted tokens they are divided by; a URL is read through net.py (a byte cap and a deadline). vLLM has no notion of a domain: `model_domains` maps a served model name (one per
   deployment, or a LoRA/adapter name per traffic class) to a domain; unmapped models keep their name.
2. Request logs (a folder of *.jsonl / *.jsonl.gz read by planning/logs.py, the traffic format of
   retrain/traffic.py) whose rows carry the engine's per-request counters, one of:
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
   b. a gateway's `draft_tokens` + `accepted_tokens` (+ optional `drafts`);
   c. SGLang's `meta_info` style `spec_verify_ct` + `completion_tokens` (τ = completion_tokens / spec_verify_ct).
   A row whose counters break a rule is one bad row (`file:line: field ...`), skipped and counted in
   `malformed`; a row with none (a stream logged without `include_usage`, an error) is counted in
   `uncounted`. Rows are grouped by their `domain` field, else by a routing policy's classifier applied to the
   row's prompt (decoding/routing.py: the policy's router, the keywords of the prompt text or of a chat's last
   user message), else "unknown". Per-position acceptance is given for a group only when every one of its
   drafts was counted by position (source a); α and τ for every group.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from draftsmith import net
from draftsmith.config import show
from draftsmith.errors import ConfigError, DataError
from draftsmith.planning.logs import log_files, records
from draftsmith.storage import is_int

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

PREFIX = "vllm:spec_decode_"


def parse_prometheus(text: str, source: str = "metrics") -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition (comments skipped); a bad
    line is one DataError naming `source` (the file or URL) and the line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise DataError(f"{source} line {n}: not a Prometheus sample: {line[:80]!r}")
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


def _vllm_counts(text: str, label: str, source: str = "vllm metrics") -> tuple[dict[str, dict], dict]:
    """Per model (`label`): the speculative-decoding counters of one dump, checked as they enter; and the
    dump's process start times ({labels: seconds}), which tell a restart between two dumps."""
    counts: dict[str, dict] = defaultdict(lambda: {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
                                                   "per_pos": defaultdict(float), "requests": 0.0, "seen": set()})
    starts: dict = {}
    for name, labels, value in parse_prometheus(text, source):
        if name == START:
            starts[tuple(sorted(labels.items()))] = value
            continue
        if name.endswith("_created"):
            continue
        base = _counter(name)
        model = labels.get(label, "")
        if (base == "vllm:request_success" or base.startswith(PREFIX)) and not (math.isfinite(value) and value >= 0):
            raise DataError(f"{source}: {name} of model {model!r} is {value}, not a count (a NaN is never read as 0)")
        if base == "vllm:request_success":
            counts[model]["requests"] += value
            continue
        if not base.startswith(PREFIX):
            continue
        key = base[len(PREFIX):]
        c = counts[model]
        c["seen"].add(key)
        if key == "num_drafts":
            c["drafts"] += value
        elif key == "num_draft_tokens":
            c["draft_tokens"] += value
        elif key == "num_accepted_tokens":
            c["accepted"] += value
        elif key == "num_accepted_tokens_per_pos":
            pos = labels.get("position", "")
            if not (pos.isascii() and pos.isdigit() and len(pos) <= 6):  # vLLM labels draft positions 0..k-1
                raise DataError(f"{source}: {name} of model {model!r}: position={pos!r} is not a draft position "
                                "(an int >= 0); refused")
            c["per_pos"][int(pos)] += value
    for model, c in sorted(counts.items()):
        # a counter missing beside the one it divides: summed as 0, it would make α or a position's rate
        # anything (accepted tokens over no drafted tokens)
        for have, need in REQUIRED.items():
            if have in c["seen"] and need not in c["seen"]:
                raise DataError(f"{source}: {model!r}: {PREFIX}{have}_total but no {PREFIX}{need}_total, "
                                "what it is divided by: its acceptance cannot be counted; refused")
        if sorted(c["per_pos"]) != list(range(len(c["per_pos"]))):
            raise DataError(f"{source}: {model!r}: per-position counters at positions {sorted(c['per_pos'])[:10]}: "
                            "vLLM counts every position 0..k-1, some are missing; refused")
    return counts, starts


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

    A restart between the two dumps (`process_start_time_seconds` differs) restarted every counter from 0:
    subtracting the earlier values would mix two processes (and, once the new counts pass the old ones,
    silently). The after-dump alone is then the window's count (all of it happened after the earlier dump,
    since the restart did); what the old process counted between the earlier dump and its end is lost, which
    the table says (`restarted`). Counters that went down with no start time to tell why are refused."""
    now, started = _vllm_counts(text, label, source)
    before, started_before = (_vllm_counts(since, label, since_source or f"{source} (--since)") if since
                              else ({}, {}))
    restarted = None
    if started and started_before and started != started_before:
        restarted = (f"the server restarted between the dumps ({START} {min(started_before.values()):.0f} -> "
                     f"{min(started.values()):.0f}): the counts are those since the restart")
        before = {}
    groups: dict[str, dict] = defaultdict(lambda: {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
                                                   "per_pos": defaultdict(float), "requests": 0.0})
    for model, c in now.items():
        b = before.get(model)
        g = groups[(model_domains or {}).get(model, model)]
        for k in ("drafts", "draft_tokens", "accepted", "requests"):
            delta = c[k] - (b[k] if b else 0.0)
            if delta < 0:
                raise DataError(f"{source}: counter {k} of model {model!r} went down since the earlier dump "
                                "(the server restarted): use a dump taken after the restart")
            g[k] += delta
        for i, v in c["per_pos"].items():
            g["per_pos"][i] += v - (b["per_pos"].get(i, 0.0) if b else 0.0)
    table = _table(groups, source)
    if restarted:
        table["restarted"] = restarted
    return table


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


def _spec_decoding(sd, where: str) -> tuple[float, float, float, list[float]]:
    """(drafts, drafted tokens, accepted tokens, accepted per position) of vLLM's per-request metrics, or a
    ValueError naming the field that breaks a rule (module docstring, source 2a)."""
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


def _vllm_metrics(row: dict) -> tuple[object, str] | None:
    """vLLM's per-request metrics of a row and where they sit: logged (`speculative_decoding`) or a raw
    response's (`metrics.speculative_decoding`); None where the row carries none."""
    if row.get("speculative_decoding") is not None:
        return row["speculative_decoding"], "speculative_decoding"
    metrics = row.get("metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics is {show(metrics)}, expected a JSON object (a response's per-request metrics)")
    sd = metrics.get("speculative_decoding")
    return None if sd is None else (sd, "metrics.speculative_decoding")


def _request_counters(row: dict) -> tuple[float, float, float, list[float] | None] | None:
    """(drafts, drafted tokens, accepted tokens, accepted per position or None) of one request log row, None
    for a request logged without counters, or a ValueError naming the field that breaks a rule (module
    docstring, source 2)."""
    found = _vllm_metrics(row)
    if found is not None:
        return _spec_decoding(*found)
    meta = row.get("meta_info") or row
    if not isinstance(meta, dict):
        raise ValueError(f"meta_info is {show(meta)}, expected a JSON object")
    if "draft_tokens" in meta and "accepted_tokens" in meta:
        drafted, accepted = _count(meta, "draft_tokens"), _count(meta, "accepted_tokens")
        drafts = _count(meta, "drafts") if meta.get("drafts") is not None else 0.0
        return drafts, drafted, accepted, None  # more accepted than drafted: the group's check refuses the log
    if "spec_verify_ct" in meta and "completion_tokens" in meta:
        # SGLang: completion tokens = verify steps + accepted drafts; drafted count is not reported,
        # so α is left to the engines that report it and only τ is exact
        drafts, completion = _count(meta, "spec_verify_ct"), _count(meta, "completion_tokens")
        if completion < drafts:
            raise ValueError(f"completion_tokens {completion:g} < spec_verify_ct {drafts:g}: every verify step "
                             "emits a token")
        drafted = _count(meta, "draft_tokens") if meta.get("draft_tokens") is not None else 0.0
        return drafts, drafted, completion - drafts, None
    return None


def prompt_text(prompt) -> str | None:
    """The text a router classifies: a completion prompt's text, or a chat's last user message (its text
    parts joined); None for token ids or anything else (the row is then "unknown" to the keywords)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        return None
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, {"type": "image_url"}]
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else None


def _classifier(policy: str | Path | None):
    """(declared domain, prompt) -> domain: the declared one, else the routing policy's own classification
    (RoutedProposer.classify: its router kind and keywords, decoding/routing.py), else "unknown"."""
    if policy is None:
        return lambda domain, prompt: domain or "unknown"
    from draftsmith.decoding.routing import RoutedProposer, load_policy

    router = RoutedProposer(load_policy(policy), {})  # classification only: no proposer is built
    return lambda domain, prompt: router.classify(domain, prompt_text(prompt)) or "unknown"


def _group() -> dict:
    return {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": defaultdict(float), "requests": 0.0,
            "pos_drafts": 0.0}


def _add(g: dict, counted: tuple[float, float, float, list[float] | None]) -> None:
    drafts, drafted, accepted, per_pos = counted
    g["drafts"] += drafts
    g["draft_tokens"] += drafted
    g["accepted"] += accepted
    g["requests"] += 1
    if per_pos is not None:
        g["pos_drafts"] += drafts
        for i, v in enumerate(per_pos):
            g["per_pos"][i] += v


def log_alpha(folder: str | Path, policy: str | Path | None = None) -> dict:
    """Per-domain α table from request logs carrying per-request speculative counters (module docstring,
    source 2). The files are read by planning/logs.py (what cannot be read is named in `bad` and skipped); a
    row whose counters break a rule is one more bad row, named. `policy`: a routing policy file whose
    classifier gives a row without a `domain` its domain."""
    classify = _classifier(policy)
    logs = log_files(folder, "request logs")
    groups: dict[str, dict] = defaultdict(_group)
    uncounted = 0
    for path, number, row, _ in records(logs):
        try:
            counted = _request_counters(row)
            declared = row.get("domain")
            if declared is not None and not isinstance(declared, str):
                raise ValueError(f"domain is {show(declared)}, expected a string")
            domain = classify(declared, row.get("prompt")) if counted is not None else None
        except ValueError as e:
            logs.reject(f"{path}:{number}", str(e))
            continue
        if counted is None:
            uncounted += 1  # served without speculation, or logged without the engine's counters
            continue
        _add(groups[domain], counted)
    if not any(g["draft_tokens"] > 0 or g["drafts"] > 0 for g in groups.values()):
        raise DataError(f"{folder}: no request carries speculative-decoding counters (speculative_decoding, "
                        f"draft_tokens + accepted_tokens, or spec_verify_ct + completion_tokens; {uncounted} rows "
                        f"without, {logs.malformed} malformed{logs.first_bad()})")
    for g in groups.values():
        if g["pos_drafts"] != g["drafts"]:
            g["per_pos"] = defaultdict(float)  # some drafts were not counted by position: no per-position rate
    table = _table(groups, str(folder))
    table["malformed"], table["bad"], table["uncounted"] = logs.malformed, logs.bad, uncounted
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
                     timeout: float = 30.0, max_bytes: int | None = None, policy: str | Path | None = None) -> dict:
    """A running server's /metrics URL or a Prometheus dump (a file), or request logs (a folder / a .jsonl
    file) -> the per-domain α table. `since`: an earlier dump (file or URL read now), the window between the
    two. `save`: keep the metrics text read (the `since` of the next check). `timeout`, `max_bytes`: the
    bounds of each read (read_metrics). `policy`: a routing policy file classifying logged requests that
    declare no domain (request logs only: /metrics counts per served model, mapped by `model_domains`)."""
    if not is_url(path):
        path = Path(path)
        if not path.exists():
            raise DataError(f"production metrics not found: {path}")
        if path.is_dir() or path.name.endswith((".jsonl", ".jsonl.gz")):
            return log_alpha(path, policy)
    if policy is not None:
        raise ConfigError(f"routing policy {policy}: it classifies logged requests, and {net.safe_url(str(path))} "
                          "is /metrics (counted per served model: map model names to domains instead)")
    text = read_metrics(path, timeout, max_bytes)
    earlier = read_metrics(since, timeout, max_bytes) if since else None
    table = vllm_alpha(text, earlier, model_domains, source=net.safe_url(str(path)),
                       since_source=net.safe_url(str(since)) if since else None)
    if save:
        from draftsmith.storage import atomic_write_text

        atomic_write_text(save, text)
    return table


def render(table: dict) -> str:
    f = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"# Production acceptance ({table['source']})", "",
             "| domain | requests | drafts | drafted | accepted | α | τ | per-position |", "|---|---|---|---|---|---|---|---|"]
    if table.get("restarted"):
        lines[1:1] = ["", f"Note: {table['restarted']}."]
    for d, r in list(table["domains"].items()) + [("overall", table["overall"])]:
        pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"][:8])
        lines.append(f"| {d} | {r['n_prompts']} | {r['drafts']} | {r['proposed']} | {r['accepted']} | "
                     f"{f(r['alpha'])} | {f(r['tau'])} | {pos} |")
    if table.get("uncounted") or table.get("malformed"):
        lines += ["", f"Log rows without counters: {table.get('uncounted', 0)}; malformed rows skipped: "
                      f"{table.get('malformed', 0)}" + (f" (first: {table['bad'][0]})" if table.get("bad") else "")]
    return "\n".join(lines) + "\n"
