"""Retraining building blocks: registry publishing, the run lock, traffic reading, decisions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from draftsmith.artifact import make_manifest, save_artifact
from draftsmith.errors import ArtifactError, DataError
from draftsmith.locks import LockHeld, RunLock
from draftsmith.retrain.decide import GateRule, Thresholds, domain_policy, gate, staleness
from draftsmith.retrain.registry import Registry
from draftsmith.retrain.traffic import read_traffic


def _artifact(path, fp):
    return save_artifact(path, make_manifest("medusa", fp, {}), state={})


def test_registry_publish_and_switch(tmp_path):
    fp = {"vocab_size": 1}
    reg = Registry(tmp_path, "t", "medusa")
    assert reg.current() is None and reg.versions() == []
    v1 = reg.publish(_artifact(reg.staging / "c1", fp), {"parent": None, "why": "first"})
    reg.set_current(v1, "initial")
    v2 = reg.publish(_artifact(reg.staging / "c2", fp), {"parent": v1})
    assert (v1, v2) == ("v0001", "v0002") and reg.current() == "v0001"
    assert reg.manifest(v2)["parent"] == "v0001" and reg.manifest(v2)["lineage"]["parent"] == "v0001"
    reg.set_current(v2, "promoted")
    assert reg.current() == "v0002"
    with pytest.raises(ArtifactError, match="not a complete version"):
        reg.set_current("v0009", "nope")
    (reg.staging / "half").mkdir()
    with pytest.raises(ArtifactError, match="not a draftsmith artifact"):
        reg.publish(reg.staging / "half", {})


def test_lock_excludes_and_breaks_after_kill(tmp_path):
    path = tmp_path / ".lock"
    code = ("import time;"
            "from draftsmith.locks import RunLock;"
            f"l = RunLock({str(path)!r}); l.acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=f"pid {proc.pid}"):
            RunLock(path).acquire()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    lock = RunLock(path)
    lock.acquire()  # the killed owner's lock is free at once and recorded as broken
    assert lock.broke_stale and lock.broke_stale["pid"] == proc.pid
    lock.release()
    with RunLock(path) as again:
        assert again.broke_stale is None  # a clean release leaves nothing stale


def test_read_traffic_window_sampling_and_malformed(tmp_path):
    now = time.time()
    lines = [json.dumps({"prompt": f"code {i}", "domain": "code", "timestamp": now - i * 60}) for i in range(10)]
    lines += [json.dumps({"prompt": "old", "domain": "chat", "timestamp": now - 30 * 86400})]
    lines += [json.dumps({"prompt": [{"role": "user", "content": "hi"}], "timestamp": now})]
    lines += ["{not json", json.dumps({"response": "no prompt"}), json.dumps({"prompt": "  "})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    sample = read_traffic(tmp_path, window_days=7, max_per_domain=4)
    assert sample.per_domain == {"code": 4, "unknown": 1}
    assert sample.malformed == 3
    with pytest.raises(DataError, match="no traffic logs"):
        read_traffic(tmp_path / "missing")


def _report(alpha_by_domain, lossless=True):
    domains = {d: {"alpha": a, "n_prompts": 5, "lossless": lossless} for d, a in alpha_by_domain.items()}
    overall = sum(alpha_by_domain.values()) / len(alpha_by_domain)
    return {"domains": domains, "overall": {"alpha": overall}}


def test_staleness_reasons():
    th = Thresholds(alpha_floor=0.3, max_drop=0.1)
    assert not staleness(_report({"a": 0.6}), {"a": 0.65}, [], False, th).yes
    v = staleness(_report({"a": 0.6, "b": 0.2}), {"a": 0.8}, [], False, th)
    assert v.yes and any("b: alpha 0.200 below" in r for r in v.reasons)
    assert any("a: alpha fell from 0.800" in r for r in v.reasons)
    assert staleness(_report({"a": 0.6}), {}, ["tokenizer_hash"], False, th).yes


def test_gate_rules():
    rule = GateRule(min_gain=0.02, baseline_margin=0.03)
    cur_t, cur_b = _report({"b": 0.3}), _report({"a": 0.6})
    assert gate(cur_t, _report({"b": 0.5}), cur_b, _report({"a": 0.58}), rule).yes
    assert not gate(cur_t, _report({"b": 0.31}), cur_b, _report({"a": 0.6}), rule).yes
    assert not gate(cur_t, _report({"b": 0.5}), cur_b, _report({"a": 0.5}), rule).yes
    v = gate(cur_t, _report({"b": 0.5}, lossless=False), cur_b, _report({"a": 0.6}), rule)
    assert not v.yes and "not lossless" in v.reasons[0]


def test_domain_policy():
    policy = domain_policy(_report({"a": 0.6, "b": 0.1}), 0.3, "v0002")
    assert policy["domains"]["a"]["speculate"] and not policy["domains"]["b"]["speculate"]


def test_schedule_examples_run_the_retrain_command():
    from pathlib import Path

    import yaml

    from draftsmith.config import load_config
    from draftsmith.retrain.config import RetrainConfig

    root = Path(__file__).resolve().parent.parent
    cron = yaml.safe_load((root / "configs/schedule/cronjob.yaml").read_text())
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    command = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["draftsmith", "retrain"]
    overrides = [c for c in command if "=" in c]
    cfg = load_config(root / command[command.index("--config") + 1], overrides, cls=RetrainConfig)
    assert cfg.registry == "/data/registry"
    service = (root / "configs/schedule/draftsmith-retrain.service").read_text()
    assert "draftsmith retrain --config configs/retrain.yaml" in service and "SuccessExitStatus=10 11" in service


def test_a_stopped_run_still_writes_its_record(tmp_path, tiny_target, monkeypatch):
    """SIGTERM (a scheduler's deadline) becomes SystemExit in `run_retrain`: the record says "interrupted",
    the lock is released, and the exit propagates."""
    import json

    import pytest

    from draftsmith.config import load_config
    from draftsmith.retrain import run as runmod
    from draftsmith.retrain.config import RetrainConfig

    cfg = load_config(None, [f"registry={tmp_path / 'reg'}", f"target={tiny_target.folder}"], cls=RetrainConfig)
    monkeypatch.setattr("draftsmith.targets.load_target", lambda *a, **k: tiny_target)

    def stopped(*_a, **_k):
        raise SystemExit(143)

    monkeypatch.setattr(runmod, "_run", stopped)
    with pytest.raises(SystemExit):
        runmod.retrain_once(cfg)
    records = list((tmp_path / "reg").rglob("runs/*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["outcome"] == "interrupted"
    with pytest.raises(SystemExit):  # the lock was released: a second run gets in
        runmod.retrain_once(cfg)
