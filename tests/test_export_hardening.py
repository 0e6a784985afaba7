"""What an EAGLE / Medusa export must carry for the stacks that serve it, beyond names and shapes: the RoPE
base in every spelling a reader looks for, no SGLang export of a head SGLang computes differently, the
served name of the target (`--verifier`), and a model card from the artifact's manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_family

from draftsmith.errors import ConfigError
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.export.api import verify_export
from draftsmith.layouts.verify import VerificationError
from draftsmith.training import TrainConfig, train


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _eagle(family: str, tokenizer, tmp: Path, **kw):
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family(family, tokenizer, tmp / family)))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, target.vocab_size, (12,), generator=g).tolist(),
             "loss_mask": [0] * 4 + [1] * 8, "row_id": i, "domain": "x"} for i in range(8)]
    cfg = EagleJobConfig(target="x", data="x", output=str(tmp / f"{family}-eagle"), ttt_steps=2, draft_vocab_size=64,
                         max_length=32, evaluate=EvalAfterTraining(enabled=False),
                         train=TrainConfig(max_steps=1, batch_size=4, resume="never", progress=False, eval_every=0,
                                           eval_batches=1, output_dir=str(tmp / f"{family}-run")), **kw)
    return target, Path(train(EagleJob(cfg, target, rows), cfg.train).artifact)


def test_rope_base_is_written_in_every_spelling_and_verified(tiny_tokenizer, tmp_path):
    from draftsmith.export import export_artifact

    target, art = _eagle("qwen3", tiny_tokenizer, tmp_path)  # RoPE base 1,000,000: not the 10,000 fallback
    res = export_artifact(art, "sglang", tmp_path / "sglang", target=target)
    assert any("RoPE base 1000000.0" in c for c in res.checks), res.checks
    path = res.out / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["rope_theta"] == 1000000.0 and cfg["rope_parameters"]["rope_theta"] == 1000000.0
    assert cfg["rope_scaling"] is None  # plain RoPE
    del cfg["rope_theta"]  # what transformers 5 writes: SGLang's Llama layer would rotate with base 10000
    path.write_text(json.dumps(cfg))
    with pytest.raises(VerificationError, match="lacks rope_theta"):
        verify_export(res.out)
    cfg.update(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    path.write_text(json.dumps(cfg))
    with pytest.raises(VerificationError, match="the target's full-attention RoPE base 1000000.0"):
        verify_export(res.out)  # no target given: the base recorded at export time


def test_llama31_rope_scaling_reaches_the_draft_layer():
    from draftsmith.eagle.export import rope_problems
    from draftsmith.eagle.model import _hf_layer_config, layer_config_dict
    from draftsmith.memory.serving import load_target_config

    root = Path(__file__).resolve().parent.parent
    layer = layer_config_dict(load_target_config(root / "configs" / "llama3.1-8b-instruct" / "target-config.json"))
    assert layer["rope_theta"] == 500000.0 and layer["rope_scaling"]["rope_type"] == "llama3"
    assert layer["rope_parameters"]["factor"] == 8.0
    assert rope_problems(layer, 500000.0) == []
    assert "rope_scaling does not carry" in rope_problems({**layer, "rope_scaling": None}, 500000.0)[0]
    hf = _hf_layer_config(layer)  # the draft's own layer rotates with the same scaled RoPE
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["rope_theta"] == 500000.0


def test_sglang_refuses_norm_before_residual_and_vllm_takes_it(tiny_tokenizer, tmp_path):
    from draftsmith.export import export_artifact

    target, art = _eagle("llama", tiny_tokenizer, tmp_path, norm_before_residual=True)
    with pytest.raises(ConfigError, match="norm_before_residual: true, which SGLang's EAGLE-3 layer") as e:
        export_artifact(art, "sglang", tmp_path / "sglang", target=target)
    assert "\n" not in str(e.value) and not (tmp_path / "sglang").exists()
    res = export_artifact(art, "vllm", tmp_path / "vllm", target=target)
    assert json.loads((res.out / "config.json").read_text())["norm_before_residual"] is True


def test_mistral_own_layer_is_a_llama_layer_and_exports(tiny_tokenizer, tmp_path):
    from draftsmith.export import export_artifact

    target, art = _eagle("mistral", tiny_tokenizer, tmp_path, draft_layer="target")
    assert json.loads((art / "config.json").read_text())["layer_config"]["model_type"] == "mistral"
    res = export_artifact(art, "vllm", tmp_path / "vllm", target=target, verifier="mistralai/Mistral-7B-Instruct-v0.3")
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "mistralai/Mistral-7B-Instruct-v0.3"
    assert "vllm serve mistralai/Mistral-7B-Instruct-v0.3" in (res.out / "serve.md").read_text()
    assert any(c.startswith("speculators") for c in res.checks)  # loads the local weights all the same


def test_model_card_from_manifest_and_evaluation(tiny_tokenizer, tmp_path):
    from draftsmith import artifact
    from draftsmith.export import export_artifact

    target, art = _eagle("qwen2", tiny_tokenizer, tmp_path)
    res = export_artifact(art, "vllm", tmp_path / "plain", target=target, verifier="Qwen/Qwen2.5-7B-Instruct")
    card = (res.out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: draftsmith") and "base_model: Qwen/Qwen2.5-7B-Instruct" in card
    assert "Not evaluated by draftsmith" in card and "vllm serve Qwen/Qwen2.5-7B-Instruct" in card
    assert "model type `qwen2`" in card and "train rows: 7" in card
    artifact.update_manifest(art, eval={"domains": {"math": {"n_prompts": 3, "alpha": 0.5, "tau": 1.75,
                                                             "lossless": True}},
                                        "overall": {"n_prompts": 3, "alpha": 0.5, "tau": 1.75, "lossless": True}})
    card = (export_artifact(art, "vllm", tmp_path / "evaluated", target=target).out / "README.md").read_text()
    assert "| math | 3 | 0.500 | 1.75 | yes |" in card and "| overall | 3 | 0.500 | 1.75 | yes |" in card
    assert "base_model" not in card  # a local folder is not a hub id


def test_serve_checks_own_side_decodes_the_first_turns_vllm_decodes(tiny_target, tmp_path):
    """serve-check sends vLLM each prompt's first user turn; draftsmith's side of the comparison decodes the same
    generations, not the later turns of a multi-turn prompt as well."""
    from draftsmith.export.serve_check import draftsmith_side

    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"category": "multiturn", "turns": ["Name a fox.", "And a second one?"]}) + "\n"
                       + json.dumps({"category": "multiturn", "turns": ["What is rain?"]}) + "\n")
    overall, proposer = draftsmith_side(None, tiny_target, [str(prompts)], k=2, max_new_tokens=6, limit=None, seed=0,
                                        method="ngram", workdir=tmp_path)
    assert proposer == "ngram:3" and overall["n_prompts"] == 2 and overall["lossless"] is True
