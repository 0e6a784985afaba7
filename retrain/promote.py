"""A registry version swapped into running vLLM servers without a restart, watched by a canary, rolled back on its
own when it does worse than its gate measured (docs/retraining.md, "Promotion in place").

    promote_in_place(reg, version, cfg)    swap -> canary -> (keep | roll back), one record in the registry
    roll_back(reg, cfg)                    `draftsmith promote --rollback`: the last promotion undone by hand

Each server runs draftsmith's worker extension and route (fleet/drafter_swap.py, fleet/drafter_route.py):
draftsmith asks what it serves (GET /draftsmith/drafter), checks the export against it here — the target the
server runs (its text config's config_hash) must be the export's, the method (export format) the same — and
only then asks for the swap (POST), which the server checks again against the files (checksums, tensor
names, shapes, dtypes, config) and applies between two engine steps, the old drafter serving on where anything
fails. A server that refuses, fails or times out takes every server already swapped back to what it served.

The canary reads the servers' traffic log (fleet/middleware.py writes each request's drafter version) for this
version alone, since the swap: over the next `canary.requests` requests (bounded by `canary.timeout_s`) each
domain's α, counted by vLLM per request, is held to `min_ratio` x the α the gate measured for it (the version's
manifest `traffic_eval`) and to `alpha_floor`; a domain below either takes the fleet back to the previous
version (swapped back in place) and the registry's `current` back to it. Every promotion writes
`<registry>/promotions/<time>.json`: the servers' answers with their timings, the canary's numbers and verdict,
the rollback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from draftsmith import net
from draftsmith.artifact import now_iso
from draftsmith.errors import ArtifactError, ConfigError, DataError
from draftsmith.retrain.config import CanaryConfig, PromoteConfig, RetrainConfig
from draftsmith.retrain.registry import Registry

log = logging.getLogger(__name__)

ROUTE = "/draftsmith/drafter"
ANSWER_BYTES = 1 << 20
POLL_S = 0.5  # each look reads only the log files written since the swap


def _token(pcfg: PromoteConfig) -> str:
    token = (os.environ.get(pcfg.token_env) or "").strip()
    if not token:
        raise ConfigError(f"promote.token_env: ${pcfg.token_env} is not set (the servers' bearer token; no token, "
                          "no promotion)")
    net.hold_secret(token)  # never in a record, a log line or an error
    return token


def _call(url: str, token: str, timeout: float, body: dict | None = None) -> dict:
    """One call of a server's drafter route: its JSON answer, whatever the status (the route answers each
    failure with one line in `error`); a server that does not answer is {"ok": False, "error": ...}."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    data = None if body is None else json.dumps(body).encode()
    try:
        doc = net.request(url.rstrip("/") + ROUTE, data, deadline=timeout + 30.0, max_bytes=ANSWER_BYTES,
                          headers=headers, method="GET" if body is None else "POST").json()
    except net.NetError as e:
        detail = e.detail
        try:
            doc = json.loads(detail) if detail.startswith("{") else None
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            return {**doc, "status": e.status}
        # an answer longer than what an error keeps of it (net.ERROR_BODY_BYTES): the route writes `error` first
        head = re.match(r'\{"ok": false, "error": "((?:[^"\\]|\\.)*)', detail)
        return {"ok": False, "status": e.status, "error": json.loads(f'"{head.group(1)}"') if head else
                f"{e.url}: {e.reason}"}
    return doc if isinstance(doc, dict) else {"ok": False, "error": f"{url}: the route answered {type(doc).__name__}"}


def served_config_hash(worker: dict) -> str | None:
    """The config_hash (targets/fingerprint.py) of the target a worker runs, from the text config it reported."""
    from draftsmith.checksums import sha256_json
    from draftsmith.targets.fingerprint import summary_of

    config = (worker.get("served_target") or {}).get("config")
    return sha256_json(summary_of(config)) if isinstance(config, dict) else None


def check_against(info: dict, guard: dict, export: Path, url: str) -> None:
    """The export against what a server serves, before any swap: one ArtifactError naming what differs."""
    workers = info.get("workers") or []
    if not info.get("ok") or not workers:
        raise ArtifactError(f"{net.safe_url(url)}: cannot tell what it serves ({info.get('error') or 'no workers'})")
    for w in workers:
        if guard.get("format") != w.get("format"):
            raise ArtifactError(f"{export / 'draftsmith.json'}: format {guard.get('format')!r}, the server at "
                                f"{net.safe_url(url)} serves {w.get('format')!r}: another method needs a restart")
        want = (guard.get("target") or {}).get("config_hash")
        served = served_config_hash(w)
        if want != served:
            raise ArtifactError(f"{export / 'draftsmith.json'}: target.config_hash {str(want)[:12]} is not the target "
                                f"{net.safe_url(url)} runs ({str(served)[:12]}): made for another target")


def push(servers: list[str], export: Path, version: str, token: str, timeout: float) -> tuple[bool, list[dict]]:
    """Swap `export` (labelled `version`) into every server, or into none: a server that refuses or fails takes
    those already swapped back to what they served. Returns (all swapped, one result per server)."""
    from draftsmith.layouts.common import read_guard

    guard, results = read_guard(export), []
    for url in servers:
        info = _call(url, token, timeout)
        worker = (info.get("workers") or [{}])[0]
        result = {"url": net.safe_url(url), "previous": {"version": worker.get("version"), "path": worker.get("path")}}
        results.append(result)
        try:
            check_against(info, guard, export, url)
        except ArtifactError as e:
            result.update(ok=False, error=str(e))
            break
        start, result["at"] = time.monotonic(), round(time.time(), 3)
        answer = _call(url, token, timeout, {"path": str(export.resolve()), "version": version})
        result.update(ok=bool(answer.get("ok")), seconds=round(time.monotonic() - start, 3),
                      engine_seconds=answer.get("seconds"), error=answer.get("error"))
        if not result["ok"]:
            break
    if all(r.get("ok") for r in results) and len(results) == len(servers):
        return True, results
    for r, url in zip(results, servers):  # undo the ones that went through
        if r.get("ok") and r["previous"]["path"]:
            back = _call(url, token, timeout, {"path": r["previous"]["path"],
                                               "version": r["previous"]["version"] or "previous"})
            r["undone"] = {"ok": bool(back.get("ok")), "error": back.get("error")}
    return False, results


def canary(traffic: str | Path, version: str, since: float, expected: dict[str, float], c: CanaryConfig,
           overall: float | None = None) -> dict:
    """The new version's per-request α per domain over its next `c.requests` requests (module docstring):
    {"verdict": "kept" | "rolled_back" | "inconclusive", "requests", "domains": {d: {alpha, expected, n}},
    "reasons"}."""
    from draftsmith.planning.production import log_alpha

    end, table = time.monotonic() + c.timeout_s, None
    while True:
        try:  # the verdict is on the version's first `requests` requests, however many came while it looked
            table = log_alpha(traffic, drafter_version=version, since=since, first=c.requests)
        except DataError:  # nothing counted for this version yet
            table = None
        n = int((table or {}).get("overall", {}).get("n_prompts") or 0)
        if n >= c.requests or time.monotonic() >= end:
            break
        time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
    return judge(table, expected, c, overall)


def judge(table: dict | None, expected: dict[str, float], c: CanaryConfig, overall: float | None = None) -> dict:
    """The canary's verdict on a table of the new version's served α (planning/production.log_alpha's) against
    the gate's α per domain (`expected`; domains matched without case: the evaluator writes them in lower case,
    clients as they like), else the gate's `overall` α for a domain it did not measure apart."""
    n = int((table or {}).get("overall", {}).get("n_prompts") or 0)
    out = {"requests": n, "wanted": c.requests, "domains": {}, "reasons": []}
    expected = {d.casefold(): a for d, a in expected.items()}
    for domain, row in sorted(((table or {}).get("domains") or {}).items()):
        alpha, want = row.get("alpha"), expected.get(domain.casefold(), overall)
        out["domains"][domain] = {"alpha": alpha, "gate_alpha": want, "requests": row.get("n_prompts")}
        if alpha is None or (row.get("n_prompts") or 0) < c.min_domain_requests:
            continue
        if want is not None and alpha < c.min_ratio * want:
            out["reasons"].append(f"{domain}: served alpha {alpha:.3f} below {c.min_ratio:.2f} x the gate's "
                                  f"{want:.3f}")
        if alpha < c.alpha_floor:
            out["reasons"].append(f"{domain}: served alpha {alpha:.3f} below the floor {c.alpha_floor:.3f}")
    if out["reasons"]:
        out["verdict"] = "rolled_back"
    elif n < c.requests:
        out["verdict"] = "rolled_back" if c.rollback_when_inconclusive else "inconclusive"
        out["reasons"].append(f"{n} of {c.requests} requests counted for this version within the canary's time")
    else:
        out["verdict"] = "kept"
    return out


def export_of(reg: Registry, version: str, k: int, target_spec: str) -> Path:
    """The version's vLLM export (`<registry>/exports/<version>`, made by retrain's serve-check), exported here
    when the version has none yet (the registry's first version)."""
    export = reg.base / "exports" / version
    if (export / "draftsmith.json").is_file():
        return export
    from draftsmith.export.api import export_artifact
    from draftsmith.targets import load_target

    export.parent.mkdir(exist_ok=True)
    export_artifact(reg.path(version), "vllm", export, load_target(target_spec), num_speculative_tokens=k)
    return export


def promote_in_place(reg: Registry, version: str, cfg: RetrainConfig, previous: str | None) -> dict:
    """Swap `version` into cfg.promote.servers, run the canary, roll back below its floor (module docstring).
    The registry's current is `version` while it serves, `previous` again after a rollback. Returns the record
    (also written to <registry>/promotions/)."""
    from draftsmith.retrain.decide import recorded_alpha

    p = cfg.promote
    token = _token(p)
    export = export_of(reg, version, cfg.measure.k, cfg.target)
    record: dict = {"kind": "promotion", "started": now_iso(), "version": version, "previous": previous,
                    "export": str(export), "servers": p.servers}
    since = time.time()
    ok, record["swap"] = push(p.servers, export, version, token, p.timeout_s)
    if not ok:
        record.update(outcome="swap_failed", error=next((r.get("error") for r in record["swap"] if not r.get("ok")),
                                                        None))
        if previous is not None:
            reg.set_current(previous, f"{version} could not be swapped into the fleet: {record['error']}")
        return _finish(reg, record)
    reg.set_current(version, "promoted in place into " + ", ".join(net.safe_url(u) for u in p.servers))
    if p.canary.requests == 0:
        record["outcome"] = "swapped"
        return _finish(reg, record)
    manifest = reg.manifest(version)
    expected = recorded_alpha(manifest, str(reg.path(version) / "manifest.json"))
    overall = ((manifest.get("traffic_eval") or {}).get("overall") or {}).get("alpha")
    record["canary"] = canary(p.canary.traffic or cfg.traffic.dir, version, since, expected, p.canary,
                              overall if isinstance(overall, int | float) else None)
    if record["canary"]["verdict"] != "rolled_back":
        record["outcome"] = "kept"
        return _finish(reg, record)
    record["rollback"] = _swap_back(reg, record["swap"], p, token, previous,
                                    "canary: " + "; ".join(record["canary"]["reasons"]))
    record["rollback"]["served_by_the_version"] = _served(p.canary.traffic or cfg.traffic.dir, version, since)
    record["outcome"] = "rolled_back"
    return _finish(reg, record)


def _served(traffic: str | Path, version: str, since: float) -> int | None:
    """How many counted requests `version` served in all (the canary judged the first N of them)."""
    from draftsmith.planning.production import log_alpha

    try:
        return int(log_alpha(traffic, drafter_version=version, since=since)["overall"]["n_prompts"])
    except DataError:
        return None


def _swap_back(reg: Registry, swapped: list[dict], p: PromoteConfig, token: str, previous: str | None,
               reason: str) -> dict:
    """Every server back to what it served before the swap; current back to `previous`."""
    out = {"reason": reason, "servers": []}
    for r, url in zip(swapped, p.servers):
        prev = r.get("previous") or {}
        start, at = time.monotonic(), round(time.time(), 3)
        body = {"path": prev.get("path"), "version": prev.get("version") or "previous"}
        answer = _call(url, token, p.timeout_s, body)
        out["servers"].append({"url": net.safe_url(url), "ok": bool(answer.get("ok")), "to": prev, "at": at,
                               "seconds": round(time.monotonic() - start, 3), "error": answer.get("error")})
    if previous is not None and previous in reg.versions():
        reg.set_current(previous, f"rolled back: {reason}")
    return out


def _finish(reg: Registry, record: dict) -> dict:
    record["finished"] = now_iso()
    record["record_path"] = str(reg.write_promotion(record))
    log.info("promotion of %s: %s", record["version"], record["outcome"])
    return record


def roll_back(reg: Registry, cfg: RetrainConfig) -> dict:
    """`draftsmith promote --rollback`: the servers of the last promotion that was kept back to what they served
    before it, and current back to its previous version."""
    last = reg.last_promotion()
    if last is None or last.get("outcome") not in ("kept", "swapped"):
        raise DataError(f"registry {reg.base}: no kept promotion to roll back (last: "
                        f"{None if last is None else last.get('outcome')})")
    p = cfg.promote
    # the configured URLs (a record keeps them with their secrets redacted), else the record's
    p = PromoteConfig(servers=list(p.servers or last.get("servers") or []), token_env=p.token_env,
                      timeout_s=p.timeout_s, canary=p.canary)
    record = {"kind": "promotion", "started": now_iso(), "version": last.get("previous"),
              "previous": last.get("version"), "servers": p.servers, "undoes": last.get("record_path")}
    record["rollback"] = _swap_back(reg, last.get("swap") or [], p, _token(p), last.get("previous"),
                                    "by hand (draftsmith promote --rollback)")
    record["outcome"] = "rolled_back" if all(s["ok"] for s in record["rollback"]["servers"]) else "rollback_failed"
    return _finish(reg, record)
