"""Retraining end to end on tiny models: v1 trained on domain A; traffic moves to domain B.

The scenario the issue names: the job detects staleness, retrains, promotes v2 (higher α on B); a
second run right after does nothing; a run whose candidate is no better keeps the current version and
exits with the "rejected" code; a run killed mid-training leaves current untouched and the next run
completes. Everything is real: the data pipeline writes the traffic responses with the target, the
one training loop trains Medusa heads, the evaluator measures α.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.config import load_config
from draftsmith.retrain.config import RetrainConfig
from draftsmith.retrain.registry import Registry
from draftsmith.retrain.run import EXIT_OK, EXIT_REJECTED, retrain_once

# Two domains the tiny target learns by heart, so its greedy continuations are varied, domain-specific text.
A_LINES = ["the quick brown fox jumps over the lazy dog and runs far away",
           "a stitch in time saves nine and a penny saved is a penny earned",
           "summarize the following passage in one sentence for the reader",
           "natalia sold clips to her friends in april and then in may",
           "question what is the capital of france answer paris is the capital",
           "translate the sentence into french before you answer the question"]
B_LINES = ["def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
           "for i in range(10):\n    print(i * i)\n    total += i",
           "import os\nimport sys\n\nclass Foo:\n    def __init__(self, x):",
           "class Foo:\n    def __init__(self, x):\n        self.x = x\n        self.y = x",
           "while True:\n    x = x + 1\n    if x > 10:\n        break",
           "def mul(a, b):\n    \"\"\"Return a times b.\"\"\"\n    return a * b"]


def _prompt(line: str, words: int = 3) -> str:
    return " ".join(line.split(" ")[:words])


def _learned_target(tokenizer, folder: Path, layers: int = 2, hidden: int = 64):
    """A Llama (2 layers, hidden 64 unless told) trained to reproduce A_LINES and B_LINES after their first words."""
    import torch
    from tiny_models import make_target

    target = make_target(tokenizer, seed=5, layers=layers, hidden=hidden)
    model = target.model
    model.train().requires_grad_(True)
    # chat-formatted, as the data pipeline and the evaluator will present prompts: user = the first
    # words, assistant = the rest of the line
    seqs = []
    for line in A_LINES + B_LINES:
        for w in (1, 2, 3, 4):
            rest = line[len(_prompt(line, w)):].lstrip(" ")
            text = tokenizer.apply_chat_template([{"role": "user", "content": _prompt(line, w)},
                                                  {"role": "assistant", "content": rest}], tokenize=False)
            seqs.append(tokenizer(text).input_ids)
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(200):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    from draftsmith.targets import load_target

    return load_target(str(folder))


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def scenario(tiny_tokenizer, tmp_path_factory):
    """Config files and the initial version v1, trained briefly on domain A."""
    from draftsmith.data import generate_dataset
    from draftsmith.data.generate import load_data_config
    from draftsmith.runner.train import train_method

    root = tmp_path_factory.mktemp("retrain")
    target = _learned_target(tiny_tokenizer, root / "target")
    target_dir = str(target.folder)
    a_file = _write_jsonl(root / "a.jsonl", [{"prompt": _prompt(line, w)} for line in A_LINES for w in (2, 3, 4)])
    data_yaml = root / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({
        "kind": "data", "target": target_dir, "output_dir": str(root / "data-a"),
        "sources": [{"name": "a", "type": "jsonl", "path": str(a_file), "prompt": "prompt", "domain": "A"}],
        "generation": {"max_new_tokens": 20, "batch_size": 8, "threads": 1},
    }))
    generate_dataset(load_data_config(data_yaml), target, progress=False)
    job_yaml = root / "medusa.yaml"
    job_yaml.write_text(yaml.safe_dump({
        "kind": "medusa", "target": target_dir, "data": str(root / "data-a"), "output": str(root / "v1"),
        "num_heads": 2, "num_layers": 1, "eval_fraction": 0.2, "calibration_rows": 4, "tree_budget": 4,
        "tree_max_rank": 2, "max_length": 64,
        "train": {"lr": 1e-2, "max_steps": 40, "batch_size": 4, "warmup_steps": 0, "progress": False,
                  "output_dir": str(root / "v1.train"), "log_every": 1, "save_every": 2},
        "evaluate": {"enabled": False},
    }))
    v1 = train_method("medusa", str(job_yaml), [])
    traffic = root / "traffic"
    traffic.mkdir()
    now = time.time()
    _write_jsonl(traffic / "gateway-1.jsonl", [
        {"prompt": _prompt(line, w), "domain": "code", "timestamp": now - 60 * w}
        for line in B_LINES for w in (1, 2, 3)])
    retrain_yaml = root / "retrain.yaml"
    retrain_yaml.write_text(yaml.safe_dump({
        "kind": "retrain", "artifact_kind": "medusa", "target": target_dir, "registry": str(root / "registry"),
        "job_config": str(job_yaml), "data_config": str(data_yaml),
        "traffic": {"dir": str(traffic), "max_per_domain": 24, "eval_share": 0.25, "max_eval_per_domain": 4},
        "measure": {"baseline_prompts": [str(a_file)], "baseline_limit_per_domain": 4, "max_new_tokens": 16,
                    "k": 2},
        # v1 drafts domain B at α ≈ 0.03, the head retrained 60 steps on B's traffic at ≈ 0.2 (4 prompts of 16
        # tokens): a floor of 0.1 is crossed with a margin of several accepted tokens on each side (30 steps and a
        # floor of 0.2 hung on which rows the held-out split took: α 0.14 once row ids came from the rows' content)
        "thresholds": {"alpha_floor": 0.1, "max_drop": 0.1, "min_domain_prompts": 1},
        "gate": {"min_gain": 0.02, "baseline_margin": 0.5},
        "budget": {"max_steps": 60, "replay_fraction": 0.25,
                   "job_overrides": ["train.save_every=5", "train.lr=1e-2"]},
        "policy_alpha_floor": 0.3,
    }))
    return root, retrain_yaml, Path(v1), target


def _cfg(path: Path, *overrides: str) -> RetrainConfig:
    return load_config(path, list(overrides), cls=RetrainConfig)


def test_scenario(scenario):
    root, retrain_yaml, v1, target = scenario
    cfg = _cfg(retrain_yaml)
    reg = Registry(root / "registry", Path(cfg.target).name, "medusa")

    code, rec = retrain_once(cfg, init=str(v1))
    assert code == EXIT_OK and rec["outcome"] == "initialised" and reg.current() == "v0001"

    # A killed run (SIGKILL once training has checkpointed) leaves v1 current; the next run completes it.
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "retrain", "--config", str(retrain_yaml)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list(reg.staging.glob("*/train/checkpoints/step-*/state.json")):
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert reg.current() == "v0001" and reg.versions() == ["v0001"]

    code, rec = retrain_once(cfg)
    assert code == EXIT_OK, rec
    assert rec["outcome"] == "promoted" and rec["stale"]["yes"] and rec.get("broke_stale_lock")
    assert reg.current() == "v0002" and reg.manifest("v0002")["parent"] == "v0001"
    before = rec["current_traffic"]["domains"]["code"]["alpha"]
    after = rec["candidate_traffic"]["domains"]["code"]["alpha"]
    assert before < cfg.thresholds.alpha_floor <= after
    assert reg.manifest("v0002")["lineage"]["attempt"] == rec["attempt"]
    policy = json.loads((reg.base / "policy.json").read_text())
    assert policy["version"] == "v0002" and "code" in policy["domains"]

    # Right after, with the same configuration: nothing to do.
    code, rec = retrain_once(cfg)
    assert code == EXIT_OK and rec["outcome"] == "fresh" and reg.current() == "v0002"

    # Stale by rule, but v0002 was trained on exactly this traffic: nothing new to learn, nothing trained.
    strict = ("thresholds.alpha_floor=1.0", "gate.min_gain=0.9", "budget.max_steps=1")
    code, rec = retrain_once(_cfg(retrain_yaml, *strict))
    assert code == EXIT_OK and rec["outcome"] == "stale_same_traffic" and rec["stale"]["yes"]
    assert reg.current() == "v0002" and not list(reg.staging.glob("*/candidate"))

    # New traffic arrives; still stale, but the candidate cannot beat the current version by the margin.
    traffic = Path(cfg.traffic.dir)
    _write_jsonl(traffic / "gateway-2.jsonl", [{"prompt": _prompt(line, 2) + " again", "domain": "code",
                                                "timestamp": time.time()} for line in B_LINES])
    code, rec = retrain_once(_cfg(retrain_yaml, *strict))
    assert code == EXIT_REJECTED and rec["outcome"] == "rejected" and reg.current() == "v0002"
    assert any("does not beat" in r for r in rec["gate"]["reasons"])
    # the same attempt again is not retrained: the scheduler keeps getting the "rejected" code
    code, rec = retrain_once(_cfg(retrain_yaml, *strict))
    assert code == EXIT_REJECTED and rec["outcome"] == "rejected_before"
    records = sorted((reg.base / "runs").glob("*.json"))
    assert len(records) >= 6 and all(json.loads(p.read_text())["exit_code"] in (0, 10) for p in records)


def _served_traffic(target, root: Path) -> tuple[Path, Path]:
    """Domain B's traffic as a fleet logs and captures it: a traffic log whose rows carry their response ids
    (fleet/middleware.py) and, per request, the hidden states a capture replica's connector wrote (in vLLM's
    layer numbering, from the target's own greedy answer: tests/test_vllm_fleet_capture.py does it with vLLM)."""
    import torch
    from test_served_capture import identity, served_states

    from draftsmith.data.served import vllm_layer_ids
    from draftsmith.evaluation.domains import format_prompt
    from draftsmith.fleet.capture_file import write_capture

    traffic, captures = root / "served-traffic", root / "served-captures"
    traffic.mkdir()
    captures.mkdir()
    tok, vids, now, rows = target.tokenizer, vllm_layer_ids([], target.num_layers), time.time(), []
    for n, (line, w) in enumerate((line, w) for line in B_LINES for w in (1, 2, 3)):
        prompt = format_prompt(tok, _prompt(line, w))  # as the fleet's chat endpoint templates it
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0].tolist()
        write_capture(str(captures), f"chatcmpl-t{n}-{n:08x}", served_states(target, out, vids), out, len(prompt), vids,
                      identity(target))
        rows.append({"prompt": _prompt(line, w), "domain": "code", "id": f"chatcmpl-t{n}", "timestamp": now - n})
    _write_jsonl(traffic / "traffic-1.jsonl", rows)
    return traffic, captures


def test_retraining_from_the_fleets_states_runs_no_layer_of_the_target(scenario, monkeypatch):
    """`traffic.captures`: the candidate's rows and features come from what the fleet served and computed; from
    the traffic log to the trained candidate, not one decoder layer of the target runs (its final norm and lm_head
    give the post-norm state), and the candidate is promoted on α measured as before."""
    import torch

    import draftsmith.retrain.run as run
    from draftsmith.capture.cache import capture_dataset
    from draftsmith.data.generate import load_distilled
    from draftsmith.targets.families import decoder_layers

    root, retrain_yaml, v1, target = scenario
    traffic, captures = _served_traffic(target, root)
    # v1's rows with the states the fleet kept of them (a version trained from served states has them): the
    # replay share reads them too
    a_rows = [dict(r) for r in load_distilled(root / "data-a", target)]
    capture_dataset(target, a_rows, root / "data-a" / "capture", [], 0, hidden_dtype=torch.float32, last_hidden=True,
                    progress=False)
    cfg = _cfg(retrain_yaml, f"registry={root / 'served-registry'}", f"traffic.dir={traffic}",
               f"traffic.captures={captures}")
    assert retrain_once(cfg, init=str(v1))[0] == EXIT_OK
    calls = {"layers": 0, "watching": False}

    def count():
        calls["layers"] += calls["watching"]

    def watched(fn):
        def call(*a, **k):
            calls["watching"] = True
            try:
                return fn(*a, **k)
            finally:
                calls["watching"] = False
        return call

    monkeypatch.setattr(run, "_build_data", watched(run._build_data))
    monkeypatch.setattr(run, "_train_candidate", watched(run._train_candidate))
    layer_cls = type(decoder_layers(target.model)[0])  # every instance, whichever loader built it
    forward = layer_cls.forward

    def counted(self, *a, **k):
        count()
        return forward(self, *a, **k)

    monkeypatch.setattr(layer_cls, "forward", counted)
    code, rec = retrain_once(cfg)
    assert code == EXIT_OK and rec["outcome"] == "promoted", {k: rec.get(k)
                                                              for k in ("outcome", "error", "gate", "stale")}
    assert calls["layers"] == 0, f"{calls['layers']} decoder-layer forwards while the candidate was built and trained"
    reg = Registry(root / "served-registry", Path(cfg.target).name, "medusa")
    data = Path(reg.manifest(reg.current())["data"]["path"])
    prov = json.loads((data / "provenance.json").read_text())
    assert (prov["served"]["captures"] == str(captures)
            and prov["counts"]["per_domain"] == {"code": prov["counts"]["rows"]})
    assert (data / "capture" / "index.json").is_file()
    assert prov["replay"]["rows"] > 0 and prov["replay"]["captured_by_target"] == 0
    assert rec["candidate_traffic"]["domains"]["code"]["alpha"] >= cfg.thresholds.alpha_floor
