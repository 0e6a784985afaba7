"""One scheduled retraining run: measure → (if stale) retrain → gate → promote, with a run record.

Exit codes (for cron / Kubernetes alerting):
    0   nothing to do (fresh) or a candidate was promoted
    10  stale, but the candidate was rejected by the gate (current version kept)
    11  stale, but there was no traffic to retrain on
    12  another run holds the registry's lock (nothing was done; try again later)
    1   error (the record says which); 2 bad configuration (one line on stderr)

A run is keyed by an `attempt` id (hash of the current version and the traffic sample), and every
stage writes under registry/staging/<attempt>/: the data pipeline resumes its chunks and the training
loop resumes its checkpoints, so a run killed at any point is completed by the next one, while
`current.json` keeps naming a complete version throughout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

from draftsmith import methods, net
from draftsmith.artifact import load_manifest, now_iso, update_manifest
from draftsmith.checks import inspect_artifact
from draftsmith.checksums import sha256_json
from draftsmith.config import load_config, to_dict
from draftsmith.errors import ArtifactError, ConfigError, DataError, DraftsmithError
from draftsmith.locks import LockHeld, RunLock
from draftsmith.retrain.config import RetrainConfig
from draftsmith.retrain.decide import Verdict, domain_policy, gate, recorded_alpha, staleness
from draftsmith.retrain.registry import Registry
from draftsmith.retrain.traffic import TrafficRow, read_traffic, write_prompt_file
from draftsmith.targets.fingerprint import differences

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_REJECTED, EXIT_NO_TRAFFIC, EXIT_LOCKED = 0, 1, 10, 11, 12


def _measure(target, kind: str, path: Path, prompts: list[str] | None, limit: int | None, cfg: RetrainConfig) -> dict:
    from draftsmith.evaluation import evaluate

    # α and losslessness decide (losslessness against HF generate, the independent reference); speed does
    # not: one timed run a prompt and no cost model. α is measured in the shape that serves the version
    # (`measured_as`: vLLM's chain or block of k where the config promotes to vLLM); its report names it
    return evaluate(target, f"{kind}:{path}", prompts=prompts, limit_per_domain=limit,
                    max_new_tokens=cfg.measure.max_new_tokens, k=cfg.measure.k, seed=cfg.traffic.seed,
                    cost_model=False, repeats=1, remeasure=0, as_served=cfg.measured_as)


def _production(m, kept: Path, max_domains: int | None = None) -> dict:
    """Production α for the staleness check. `production_since: last` takes the window since this job's previous
    check: the metrics read then are kept beside the registry (`kept`); the first check, or one after the server
    restarted (its counters went down), reads the counters since the server started, and says so. Request logs
    are read with the domain cap the traffic is read with (`traffic.max_domains`), so the domains found stale are
    the domains the candidate trains on (None: the reader's own default)."""
    from draftsmith.errors import DataError
    from draftsmith.planning.logs import MAX_DOMAINS
    from draftsmith.planning.production import production_alpha

    max_domains = MAX_DOMAINS if max_domains is None else max_domains

    since, save = m.production_since, None
    if since == "last":
        since, save = (kept if kept.is_file() else None), kept
    try:
        prod = production_alpha(m.production, since, m.production_model_domains, save=save,
                                policy=m.production_policy, max_domains=max_domains)
        prod["since"] = str(since) if since else "server start"
        if prod.get("restarted"):  # told by process_start_time_seconds: the counts are those since the restart
            prod["since"] = "server start (restarted since the last check)"
    except DataError as e:
        if not (m.production_since == "last" and since and "went down" in str(e)):
            raise
        log.warning("production: %s; reading the counters since the server started", e)
        prod = production_alpha(m.production, None, m.production_model_domains, save=save,
                                policy=m.production_policy, max_domains=max_domains)
        prod["since"] = "server start (restarted since the last check)"
    return prod


def _summary(report: dict) -> dict:
    domains = {d: {k: row.get(k) for k in ("alpha", "tau", "n_prompts", "lossless")}
               for d, row in (report.get("domains") or {}).items()}
    return {"overall": {k: (report.get("overall") or {}).get(k) for k in ("alpha", "tau", "lossless")},
            "domains": domains}


def split_traffic(rows: list[TrafficRow], eval_share: float, max_eval: int, seed: int):
    """Per domain: a held-out share to measure α on, the rest to train on (never both)."""
    rng = random.Random(seed)
    by_domain: dict[str, list[TrafficRow]] = {}
    for r in rows:
        by_domain.setdefault(r.domain, []).append(r)
    held, train = [], []
    for domain in sorted(by_domain):
        group = sorted(by_domain[domain], key=lambda r: (r.timestamp, r.prompt))
        rng.shuffle(group)
        n_eval = min(max_eval, max(1, int(round(len(group) * eval_share))))
        held += group[:n_eval]
        train += group[n_eval:]
    return held, train


def _train_candidate(cfg: RetrainConfig, target, work: Path, data_path: Path, warm_start: Path | None) -> Path:
    """Train a candidate of the registry's kind with the job preset + a bounded budget (from the data's own
    capture cache when it has one: the fleet's states, data/served.py)."""
    from draftsmith.data.generate import CAPTURE_DIR

    out = work / "candidate"
    method = methods.get(cfg.artifact_kind)
    overrides = [f"{method.data_key}={data_path}", f"train.max_steps={cfg.budget.max_steps}",
                 f"train.output_dir={work / 'train'}", "train.resume=auto", "evaluate.enabled=false",
                 f"target={cfg.target}", *cfg.budget.job_overrides]
    if cfg.traffic.captures:
        overrides.append(f"capture_cache={data_path / CAPTURE_DIR}")
    if method.output_key is not None:
        overrides.insert(1, f"{method.output_key}={out}")
    if warm_start is not None:
        overrides.append(f"train.warm_start={warm_start}")
    from draftsmith.runner.train import train_method

    return train_method(method, cfg.job_config, overrides)


def _job_needs(cfg: RetrainConfig, target) -> dict:
    """What the registry's job reads of the target per token (methods.Method.features), from its preset."""
    method = methods.get(cfg.artifact_kind)
    if method.features is None:
        raise ConfigError(f"traffic.captures: {cfg.artifact_kind} jobs read no captured states: set "
                          "traffic.captures: null to retrain by regenerating the traffic's answers")
    job_cfg = load_config(cfg.job_config, [f"target={cfg.target}", *cfg.budget.job_overrides],
                          cls=methods.resolve(method.config))
    return methods.resolve(method.features)(job_cfg, target)


def _served_data(cfg: RetrainConfig, target, work: Path, train_rows: list[TrafficRow], old_data: str | None,
                 held_rows: list[TrafficRow] = ()) -> Path:
    """The candidate's data from the states the fleet computed while serving the training rows (data/served.py:
    their captures, joined by response id; nothing of the target runs but its final norm and lm_head), with a
    replay share of the current version's rows and their states. A response id on two rows of the sample (a
    client that sent one X-Request-Id twice; `held_rows` counted too) names neither: no capture joins them, so
    a held-out request's states never train the candidate through it (counted, `served.shared_in_traffic`)."""
    from collections import Counter

    from draftsmith.data.generate import PROVENANCE
    from draftsmith.data.served import import_served
    from draftsmith.reading import read_json

    out = work / "data_mixed"
    if (out / PROVENANCE).is_file() and "replay" in read_json(out / PROVENANCE):
        return out  # finished by an earlier run of this attempt
    needs = _job_needs(cfg, target)
    logged = Counter(r.request_id for r in [*train_rows, *held_rows] if r.request_id)
    shared = {rid for rid, n in logged.items() if n > 1}
    domains = {r.request_id: r.domain for r in train_rows if r.request_id and r.request_id not in shared}
    if not domains:
        raise DataError(f"traffic.captures: none of the {len(train_rows)} training rows of {cfg.traffic.dir} carries "
                        f"a response id of its own ('id', which fleet/middleware.py logs; {len(shared)} "
                        "shared by several rows): no capture can be joined to them")
    # the top-k logits' logsumexp is kept whenever top-k is, as a capture by the target keeps it (the replay's)
    prov = import_served(cfg.traffic.captures, target, out, needs["layers"], topk=needs["topk"],
                         last_hidden=needs["last_hidden"], logsumexp=needs["logsumexp"] or needs["topk"] > 0,
                         domains=domains,
                         only=set(domains), hidden_dtype=target.dtype, progress=False)
    prov["served"]["shared_in_traffic"] = sum(1 for r in train_rows if r.request_id in shared)
    log.info("served states: %d rows from %d captures (%d skipped, %d sharing a response id; %d training "
             "rows sharing one in the traffic)", prov["counts"]["rows"], prov["served"]["requests"],
             prov["served"]["skipped"], prov["served"]["shared"], prov["served"]["shared_in_traffic"])
    _replay_served(cfg, target, out, old_data, prov, needs)
    return out


def _replay_served(cfg: RetrainConfig, target, out: Path, old_data: str | None, prov: dict, needs: dict) -> None:
    """Add a replay share of the current version's rows to the served set, their states copied from its capture
    cache into the served set's (the job reads one cache). Rows whose states that cache lacks (a version trained
    without one, or of what the job reads) are captured by the target: only they run it, and the record says
    how many."""
    from draftsmith.capture.cache import ShardWriter, capture_dataset
    from draftsmith.data.generate import CAPTURE_DIR, PROVENANCE, load_distilled, write_rows
    from draftsmith.outputs import atomic_write_json

    new = [dict(r) for r in load_distilled(out, target)]
    frac, picked, missing = cfg.budget.replay_fraction, [], []
    if frac > 0 and old_data and Path(old_data).is_dir():
        old = load_distilled(old_data, target).shuffle(seed=cfg.traffic.seed)
        picked = [dict(r) for r in old.select(range(min(int(round(len(new) * frac / (1 - frac))), len(old))))]
    reader = _old_states(Path(old_data) / CAPTURE_DIR, target) if picked else None
    if picked:
        with ShardWriter(out / CAPTURE_DIR, needs["layers"], needs["topk"], target.dtype,
                         fingerprint=target.fingerprint()) as writer:
            missing = [r for r in picked if not (reader is not None and r["row_id"] in reader
                                                 and _copy_states(reader, writer, r["row_id"]))]
    if missing:
        log.warning("replay: %d of %d rows of the current version have no states kept: the target captures them",
                    len(missing), len(picked))
        capture_dataset(target, missing, out / CAPTURE_DIR, needs["layers"], needs["topk"], hidden_dtype=target.dtype,
                        last_hidden=needs["last_hidden"], progress=False)
    if picked:
        write_rows(out, new + picked)
    prov["replay"] = {"from": old_data, "rows": len(picked), "fraction": frac, "captured_by_target": len(missing)}
    atomic_write_json(out / PROVENANCE, prov)


def _old_states(cache: Path, target):
    """The current version's capture cache, if it is one of this target's (else None, said in a warning)."""
    from draftsmith.capture.cache import ShardReader
    from draftsmith.targets.fingerprint import check_compatible

    if not cache.is_dir():
        return None
    try:
        reader = ShardReader(cache)
        check_compatible(reader.fingerprint or {}, target.fingerprint(), what=f"capture cache {cache}")
    except DraftsmithError as e:
        log.warning("replay: the current version's states are not used (%s)", e)
        return None
    return reader


def _copy_states(reader, writer, row_id: int) -> bool:
    """One row's states from a version's cache into the served one; False where the old cache lacks a layer or
    the logits the job reads."""
    t = reader.get(row_id)
    layers = {i: t.get(f"layer.{i}") for i in writer.layers}
    if any(v is None for v in layers.values()) or (writer.topk and "topk_values" not in t) or (
            writer.has_last_hidden and "last_hidden" not in t) or (writer.has_logsumexp and "topk_logsumexp" not in t):
        return False
    k = writer.topk
    writer.add(row_id, layers, t["topk_values"][:, :k] if k else None, t["topk_indices"][:, :k] if k else None,
               t.get("last_hidden") if writer.has_last_hidden else None,
               t.get("topk_logsumexp") if writer.has_logsumexp else None)
    return True


def _build_data(cfg: RetrainConfig, target, work: Path, train_rows: list[TrafficRow], old_data: str | None,
                held_rows: list[TrafficRow] = ()) -> Path:
    """Self-distil the traffic prompts with the current target, then mix in a replay share of old data; with
    `traffic.captures`, take the fleet's own answers and states instead (_served_data)."""
    if cfg.traffic.captures:
        return _served_data(cfg, target, work, train_rows, old_data, held_rows)
    import datasets

    from draftsmith.data import generate_dataset, load_distilled
    from draftsmith.data.config import DomainRule, SourceConfig
    from draftsmith.data.generate import load_data_config

    prompts = work / "traffic_train.jsonl"
    write_prompt_file(train_rows, prompts)
    preset = load_data_config(cfg.data_config, list(cfg.budget.data_overrides))
    domains = sorted({r.domain for r in train_rows})
    source = SourceConfig(name="traffic", type="jsonl", path=str(prompts), turns="turns", domain="traffic",
                          domain_rules=[DomainRule("category", f"^{re.escape(d)}$", d) for d in domains])
    data_cfg = dataclasses.replace(preset, sources=[source], output_dir=str(work / "data"), target=cfg.target,
                                   max_rows=None)
    fresh = work / "data"
    if not (fresh / "provenance.json").is_file():
        generate_dataset(data_cfg, target, progress=False)
    new = load_distilled(fresh, target)
    mixed = new
    if old_data and cfg.budget.replay_fraction > 0 and not Path(old_data).is_dir():
        log.warning("replay: the current version's data %s is gone: training on new traffic only", old_data)
    if old_data and cfg.budget.replay_fraction > 0 and Path(old_data).is_dir():
        try:
            old = load_distilled(old_data, target)
        except DraftsmithError as e:  # e.g. the target changed: nothing to replay
            log.warning("no replay data: %s", e)
        else:
            n_old = int(round(len(new) * cfg.budget.replay_fraction / (1 - cfg.budget.replay_fraction)))
            n_old = min(n_old, len(old))
            if n_old:
                old = old.shuffle(seed=cfg.traffic.seed).select(range(n_old))
                mixed = datasets.concatenate_datasets([new, old.cast(new.features)])
    mixed_dir = work / "data_mixed"
    if not (mixed_dir / "provenance.json").is_file():
        from draftsmith.outputs import atomic_dir, atomic_write_json
        from draftsmith.reading import read_json

        prov = read_json(fresh / "provenance.json")
        prov["replay"] = {"from": old_data, "rows": len(mixed) - len(new), "fraction": cfg.budget.replay_fraction}
        with atomic_dir(mixed_dir, overwrite=True) as tmp:
            mixed.save_to_disk(str(tmp / "dataset"))
            atomic_write_json(tmp / "provenance.json", prov)
    return mixed_dir


def retrain_once(cfg: RetrainConfig, init: str | None = None) -> tuple[int, dict]:
    """Run one scheduled retraining. Returns (exit code, run record)."""
    from draftsmith.targets import load_target

    target = load_target(cfg.target)
    reg = Registry(Path(cfg.registry), target.name, cfg.artifact_kind)
    record: dict = {"started": now_iso(), "config": to_dict(cfg), "registry": str(reg.base)}
    with RunLock(reg.base / ".lock") as lock:
        if lock.broke_stale:
            record["broke_stale_lock"] = lock.broke_stale
        try:
            code = _run(cfg, reg, record, target, init)
        except DraftsmithError as e:
            record.update(outcome="error", error=str(e))
            code = EXIT_ERROR
        except Exception as e:  # a bug: still recorded, so the scheduler's alert has something to show
            record.update(outcome="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            code = EXIT_ERROR
        except (KeyboardInterrupt, SystemExit) as e:  # SIGTERM from the scheduler (see run_retrain), Ctrl-C
            record.update(outcome="interrupted", error=f"{type(e).__name__}: the run was stopped; the next run "
                          "resumes it", finished=now_iso(), exit_code=EXIT_ERROR, current=_safe_current(reg))
            record["record_path"] = str(reg.write_run_record(record))
            raise
        record.update(finished=now_iso(), exit_code=code, current=_safe_current(reg))
        record["record_path"] = str(reg.write_run_record(record))
    return code, record


def _safe_current(reg: Registry) -> str | None:
    try:
        return reg.current()
    except DraftsmithError:  # a missing version, or a current.json that is not JSON: the record says why
        return None


def _run(cfg: RetrainConfig, reg: Registry, record: dict, target, init: str | None) -> int:
    if init is not None:
        return _initialise(cfg, reg, record, init)
    a = _open_attempt(cfg, reg, record, target)
    cur_traffic, verdict = _judge(cfg, reg, record, target, a)
    settled = _settled(cfg, reg, record, a, cur_traffic, verdict)
    if settled is not None:
        return settled
    record["attempt"] = a.attempt
    data_path = _build_data(cfg, target, a.work, a.train_rows, (a.manifest.get("data") or {}).get("path"),
                            a.held_rows)
    warm = a.path if (cfg.budget.warm_start and not a.hard) else None
    candidate = _train_candidate(cfg, target, a.work, data_path, warm)
    cand_traffic, cand_base, decision = _gate_candidate(cfg, record, target, a, candidate, cur_traffic)
    if decision.yes and cfg.gate.serve_check:
        decision = _serve_check(cfg, record, target, a, candidate)
    if not decision.yes:
        rejected = reg.base / "rejected" / a.attempt
        shutil.rmtree(rejected, ignore_errors=True)
        rejected.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(candidate), rejected)
        shutil.rmtree(a.work, ignore_errors=True)
        record.update(outcome="rejected", rejected_candidate=str(rejected))
        return EXIT_REJECTED
    update_manifest(candidate, traffic_eval=_summary(cand_traffic), baseline_eval=_summary(cand_base))
    version = promote(reg, candidate, {
        "parent": a.current, "reason": verdict.reasons, "attempt": a.attempt, "data": str(data_path),
        "traffic_digest": a.traffic_digest,
        "budget": asdict(cfg.budget), "gate": decision.reasons,
    }, data_path, "; ".join(decision.reasons))
    reg.write_policy(domain_policy(cand_traffic, cfg.policy_alpha_floor, version))
    if (a.work / "export").is_dir():  # what the fleet serves next, checked in vLLM: kept beside the version
        (reg.base / "exports").mkdir(exist_ok=True)
        os.replace(a.work / "export", reg.base / "exports" / version)
        record["export"] = str(reg.base / "exports" / version)
    shutil.rmtree(a.work, ignore_errors=True)
    record.update(outcome="promoted", version=version)
    if cfg.promote.servers:
        return _in_place(cfg, reg, record, a, version)
    return EXIT_OK


def _in_place(cfg: RetrainConfig, reg: Registry, record: dict, a: _Attempt, version: str) -> int:
    """The promoted version swapped into the running servers and watched (retrain/promote.py); a rollback
    marks this attempt rejected, so the same candidate is not trained again on the same traffic."""
    from draftsmith.retrain.promote import promote_in_place

    done = promote_in_place(reg, version, cfg, previous=a.current)
    record["in_place"] = {k: done.get(k) for k in ("outcome", "record_path", "error")}
    if done["outcome"] == "swap_failed":
        record.update(outcome="swap_failed", error=f"promotion in place: {done.get('error')}")
        return EXIT_ERROR
    if done["outcome"] == "rolled_back":
        marker = reg.base / "rejected" / a.attempt
        marker.mkdir(parents=True, exist_ok=True)
        from draftsmith.outputs import atomic_write_json

        atomic_write_json(marker / "rolled_back.json", {"version": version, "promotion": done["record_path"]})
        record.update(outcome="rolled_back", rejected_candidate=str(marker))
        return EXIT_REJECTED
    return EXIT_OK


def _initialise(cfg: RetrainConfig, reg: Registry, record: dict, init: str) -> int:
    """`retrain --init ARTIFACT`: the registry's first version, checked as serving will read it."""
    manifest = load_manifest(init, kind=cfg.artifact_kind)
    problems, _ = inspect_artifact(init)  # files, checksums, tensor names and shapes: what serving will read
    if problems:
        raise ArtifactError(f"retrain --init {init}: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    staged = reg.staging / f"init-{sha256_json(manifest['created'])[:8]}"
    shutil.copytree(init, staged, dirs_exist_ok=True)
    version = reg.publish(staged, {"parent": None, "reason": "initial version", "source": str(init)})
    reg.set_current(version, "initial version")
    record.update(outcome="initialised", version=version)
    return EXIT_OK


@dataclasses.dataclass
class _Attempt:
    """The current version and the traffic sample one run judges it on (its `attempt` id keys both)."""

    current: str
    path: Path
    manifest: dict
    hard: list  # fingerprint differences between the version's target and this one: it must be retrained
    weights_changed: bool
    held_file: Path  # the held-out traffic prompts, capped per domain
    train_rows: list[TrafficRow]
    held_rows: list[TrafficRow]  # the held-out rows themselves (held_file holds their prompts)
    traffic_digest: str
    attempt: str
    work: Path  # registry/staging/<attempt>/: every stage of this attempt writes (and resumes) there


def _open_attempt(cfg: RetrainConfig, reg: Registry, record: dict, target) -> _Attempt:
    current = reg.current()
    if current is None:
        raise DraftsmithError(f"registry {reg.base} has no current version: run with --init ARTIFACT first")
    path = reg.path(current)
    manifest = reg.manifest(current)
    record["current_before"] = current
    fp = target.fingerprint()
    hard = differences(manifest["target"], fp)
    weights_changed = manifest["target"].get("weights_hash") not in (None, fp.get("weights_hash"))
    sample = read_traffic(cfg.traffic.dir, cfg.traffic.window_days, cfg.traffic.max_per_domain, cfg.traffic.seed,
                          max_domains=cfg.traffic.max_domains)
    record["traffic"] = {"per_domain": sample.per_domain, "malformed": sample.malformed, "files": sample.files,
                         "bad_rows": sample.bad, "outside_window": sample.outside_window, "refused": sample.refused,
                         "unencodable": sample.unencodable, "merged_domains": sample.merged_domains}
    if sample.malformed:
        log.warning("traffic: %d malformed rows or files skipped; first: %s", sample.malformed, sample.bad[0])
    held, train_rows = split_traffic(sample.rows, cfg.traffic.eval_share, cfg.traffic.max_eval_per_domain,
                                     cfg.traffic.seed)
    traffic_digest = sha256_json(sorted(r.prompt for r in sample.rows))[:16]
    attempt = sha256_json([current, sorted(r.prompt for r in sample.rows)])[:12]
    work = reg.staging / attempt
    work.mkdir(parents=True, exist_ok=True)
    return _Attempt(current=current, path=path, manifest=manifest, hard=hard, weights_changed=weights_changed,
                    held_file=write_prompt_file(held, work / "traffic_eval.jsonl"), train_rows=train_rows,
                    held_rows=held, traffic_digest=traffic_digest, attempt=attempt, work=work)


def _judge(cfg: RetrainConfig, reg: Registry, record: dict, target, a: _Attempt) -> tuple[dict, object]:
    """Is the current version stale? Measured on the held-out traffic against the acceptance it recorded,
    and on production's acceptance where configured: (its traffic report, the verdict)."""
    # the held-out traffic file is already capped per domain: no limit
    cur_traffic = {} if a.hard else _measure(target, cfg.artifact_kind, a.path, [str(a.held_file)], None, cfg)
    recorded = recorded_alpha(a.manifest, str(a.path / "manifest.json"))
    verdict = staleness(cur_traffic, recorded, a.hard, a.weights_changed, cfg.thresholds)
    if cfg.measure.production and not a.hard:
        prod = _production(cfg.measure, reg.base / "production-last.prom", cfg.traffic.max_domains)
        record["production"] = {"source": prod["source"], "since": prod.get("since"), "domains": prod["domains"],
                                "overall": prod["overall"]}
        seen = staleness(prod, recorded, [], False, cfg.thresholds)
        verdict.reasons += [f"production: {r}" for r in seen.reasons]
        verdict.yes = verdict.yes or seen.yes
    record["current_traffic"] = _summary(cur_traffic) if cur_traffic else None
    record["stale"] = verdict.to_json()
    return cur_traffic, verdict


def _settled(cfg: RetrainConfig, reg: Registry, record: dict, a: _Attempt, cur_traffic: dict, verdict) -> int | None:
    """The exit code where this run trains nothing (fresh; stale with nothing new to train on; this very
    candidate rejected before), else None."""
    if not verdict.yes:
        reg.write_policy(domain_policy(cur_traffic, cfg.policy_alpha_floor, a.current))
        shutil.rmtree(a.work, ignore_errors=True)
        record["outcome"] = "fresh"
        return EXIT_OK
    if not a.train_rows:
        record["outcome"] = "stale_no_traffic"
        return EXIT_NO_TRAFFIC
    if (not a.hard and not a.weights_changed
            and (a.manifest.get("lineage") or {}).get("traffic_digest") == a.traffic_digest):
        # the current version was trained on exactly this traffic: retraining would repeat that run
        reg.write_policy(domain_policy(cur_traffic, cfg.policy_alpha_floor, a.current))
        shutil.rmtree(a.work, ignore_errors=True)
        record["outcome"] = "stale_same_traffic"
        record["note"] = ("still stale, but the current version was trained on this same traffic; "
                          "waiting for new traffic")
        return EXIT_OK
    if (reg.base / "rejected" / a.attempt).exists():
        # this exact candidate (same current version, same traffic) was trained and rejected before
        record.update(outcome="rejected_before", rejected_candidate=str(reg.base / "rejected" / a.attempt))
        shutil.rmtree(a.work, ignore_errors=True)
        return EXIT_REJECTED
    return None


def _gate_candidate(cfg: RetrainConfig, record: dict, target, a: _Attempt, candidate: Path,
                    cur_traffic: dict) -> tuple[dict, dict, object]:
    """The candidate against the current version, on the held-out traffic and the baseline prompts:
    (candidate's traffic report, its baseline report, the gate's decision). A current version made for
    another target is no reference: the candidate is gated against zero acceptance."""
    baseline = cfg.measure.baseline_prompts or None
    cand_traffic = _measure(target, cfg.artifact_kind, candidate, [str(a.held_file)], None, cfg)
    cand_base = _measure(target, cfg.artifact_kind, candidate, baseline, cfg.measure.baseline_limit_per_domain, cfg)
    cur_base = {} if a.hard else _measure(target, cfg.artifact_kind, a.path, baseline,
                                          cfg.measure.baseline_limit_per_domain, cfg)
    decision = (gate(cur_traffic, cand_traffic, cur_base, cand_base, cfg.gate) if not a.hard else
        gate({"overall": {"alpha": 0.0}}, cand_traffic, {"overall": {"alpha": 0.0}}, cand_base, cfg.gate))
    record.update(candidate_traffic=_summary(cand_traffic), candidate_baseline=_summary(cand_base),
                  current_baseline=_summary(cur_base) if cur_base else None, gate=decision.to_json())
    return cand_traffic, cand_base, decision


def _serve_check(cfg: RetrainConfig, record: dict, target, a: _Attempt, candidate: Path):
    """The serving engine's verdict on a candidate the gate passed (`gate.serve_check`): exported for vLLM and
    run there on the held-out traffic, it must load and decode what vLLM alone decodes. Returns the decision."""
    from draftsmith.export.api import export_artifact
    from draftsmith.export.serve_check import serve_check

    export = a.work / "export"
    if not (export / "draftsmith.json").is_file():
        export_artifact(candidate, "vllm", export, target, num_speculative_tokens=cfg.measure.k, overwrite=True)
    report = serve_check(export, target, prompts=[str(a.held_file)], out=a.work / "serve-check", k=cfg.measure.k,
                         max_new_tokens=cfg.measure.max_new_tokens, limit_per_domain=cfg.traffic.max_eval_per_domain,
                         evaluate=False, card=False)
    ok = bool(report.get("loaded") and report.get("lossless"))
    record["serve_check"] = {k: report.get(k) for k in ("loaded", "error", "lossless", "n_prompts", "vllm")}
    failure = report.get("error") or "first differing prompt " + str(report.get("first_differing_prompt"))
    why = ("vLLM serves the candidate losslessly (serve-check)" if ok else
           f"vLLM {'did not load' if not report.get('loaded') else 'decoded differently with'} the candidate "
           f"(serve-check: {failure})")
    return Verdict(ok, list(record["gate"]["reasons"]) + [why])


def promote(reg: Registry, candidate: Path, lineage: dict, data_path: Path, reason: str) -> str:
    """Publish a candidate, keep the data it was trained on beside the registry's versions (the next run
    replays it after `staging` is cleaned, and so on after any number of promotions), point current at it."""
    version = reg.publish(candidate, lineage)
    reg.keep_data(version, data_path)
    reg.set_current(version, reason)
    return version


def run_retrain(config_path: str | None, overrides: list[str], init: str | None = None) -> int:
    import signal

    cfg = load_config(config_path, overrides, cls=RetrainConfig)
    # a scheduler stops a job with SIGTERM (Kubernetes activeDeadlineSeconds, systemd TimeoutStopSec): turn it
    # into SystemExit so the run record is still written and the lock released (143 = 128 + SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code, record = retrain_once(cfg, init)
    except LockHeld as e:  # not a configuration error: a scheduler retries this one later
        print(f"draftsmith: {e}; nothing done (exit {EXIT_LOCKED})", file=sys.stderr)
        return EXIT_LOCKED
    outcome = record.get("outcome")
    print(f"retrain: {outcome} (exit {code}); current = {record.get('current')}; record: {record.get('record_path')}")
    if record.get("stale"):
        for reason in record["stale"]["reasons"]:
            print(f"  stale: {reason}")
    if record.get("gate"):
        for reason in record["gate"]["reasons"]:
            print(f"  gate: {reason}")
    if record.get("error"):
        print(f"  error: {net.redact(record['error'])}")
    return code


def promote_command(config_path: str | None, overrides: list[str], version: str | None, servers: list[str] | None,
                    rollback: bool) -> int:
    """`draftsmith promote` (retrain/promote.py), under the registry's lock: no retraining run promotes meanwhile."""
    from draftsmith.retrain.promote import promote_in_place, roll_back
    from draftsmith.targets import target_name

    cfg = load_config(config_path, overrides, cls=RetrainConfig)
    if servers:
        cfg.promote.servers = list(servers)
    reg = Registry(Path(cfg.registry), target_name(cfg.target), cfg.artifact_kind)
    with RunLock(reg.base / ".lock"):
        if rollback:
            done = roll_back(reg, cfg)
        else:
            if not cfg.promote.servers:
                raise ConfigError("promote.servers: no server to promote into (--servers URL ...)")
            current = reg.current()
            version = version or current
            if version is None:
                raise ArtifactError(f"registry {reg.base}: no current version to promote")
            previous = current if current != version else None
            done = promote_in_place(reg, version, cfg, previous)
    print(f"promote: {done['outcome']}; record: {done['record_path']}")
    for key in ("swap", "canary", "rollback"):
        if done.get(key):
            print(f"  {key}: {json.dumps(done[key], default=str)[:600]}")
    return {"rolled_back": EXIT_REJECTED if not rollback else EXIT_OK, "swap_failed": EXIT_ERROR,
            "rollback_failed": EXIT_ERROR}.get(done["outcome"], EXIT_OK)
