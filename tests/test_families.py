"""Every target family of targets/families.py, every method, every export.

For each family (the mixture-of-experts ones too: Qwen3-MoE, gpt-oss, Llama 4's text decoder, DeepSeek-V3;
tests/tiny_models.py) a tiny random model (the family's own transformers config class, hidden 64) is saved as a
local HF folder with a tokenizer and loaded as a user's target is. Then: self-distilled data (a few rows,
through `draftsmith data`) -> Medusa heads, EAGLE-3 and EAGLE-1 heads and a distilled draft (a few steps
each) -> greedy speculative decoding equal to the target's greedy output -> export to every stack that
takes the kind, verified -> for EAGLE-3, speculators loads the export and its draft logits equal
draftsmith's on the same inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import FAMILY_NAMES, NO_PAD, build_tiny_family, plain_linears_one_thread, prompt_rows

from draftsmith.errors import ConfigError
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.training import TrainConfig, train

PROMPTS = ["What is the capital of France?", "Add 2 and 3.", "Write a loop in Python.", "Summarize the passage.",
           "How many clips did Natalia sell?", "Translate the sentence into French.", "def add(a, b):",
           "Name a fox."]


@pytest.fixture(autouse=True)
def _plain_linears():
    with plain_linears_one_thread():
        yield


def _train_cfg(tmp: Path, name: str, steps: int = 3) -> TrainConfig:
    return TrainConfig(lr=3e-3, max_steps=steps, batch_size=4, warmup_steps=0, output_dir=str(tmp / f"{name}-run"),
                       resume="never", progress=False, log_every=10, eval_every=0, eval_batches=1)


def _data(target, tmp: Path) -> list[dict]:
    """A few rows the target writes itself, through the data pipeline (chat template, loss masks, pad id)."""
    rows = prompt_rows(target, tmp, PROMPTS)
    assert len(rows) == len(PROMPTS) and all(sum(r["loss_mask"]) > 0 for r in rows)
    return rows


def _lossless(target, spec: str, rows: list[dict], plain: dict) -> None:
    """Greedy speculative decoding with the artifact gives the target's own greedy tokens."""
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    prompts = [rows[i]["input_ids"][: list(rows[i]["loss_mask"]).index(1)] for i in range(2)]
    if "tokens" not in plain:
        plain["tokens"] = speculative_generate(target, None, prompts, 10, k=0).tokens
    fast = speculative_generate(target, build_proposer(spec, target), prompts, 10, k=3)
    assert fast.tokens == plain["tokens"], spec
    assert fast.stats.proposed > 0, spec


def _export_all(art: Path, target, tmp: Path, stacks: list[str], consumer: str | None = None) -> dict:
    """Export for every stack in `stacks`, each verified by re-reading it against its stack's spec; the
    `consumer` stack's export is also run by its real consumer (transformers assisted generation,
    speculators), which reads the same layout the other stacks get where a kind has one layout."""
    from draftsmith.export import export_artifact
    from draftsmith.layouts.verify import VERIFIERS

    out = {}
    for stack in stacks:
        full = stack == consumer
        res = export_artifact(art, stack, tmp / f"{art.name}-{stack}", target=target, verify=full)
        if stack == "vllm":  # a warning exactly where the measured vLLM refuses this family and kind
            from draftsmith import artifact
            from draftsmith.export.vllm import layout_of, refusal

            manifest = artifact.load_manifest(art)
            expected = refusal(manifest["target"]["architecture"]["model_type"], layout_of(manifest))
            assert [c for c in res.checks if c.startswith("WARNING: vLLM")] == ([f"WARNING: {expected}"] if expected
                                                                              else []), res.checks
        if not full:
            res.checks = VERIFIERS[res.format](res.out, None)
        assert res.checks and (res.out / "serve.md").is_file() and (res.out / "README.md").is_file()
        out[stack] = res
    return out


def _speculators_parity(export_dir: Path, art: Path, target, rows: list[dict]) -> None:
    """speculators' Eagle3DraftModel on the export and draftsmith's head on the artifact: the same draft logits
    (step 0 and the first training-time-test step) for the same tokens and target features."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from draftsmith.capture.forward import capture_forward
    from draftsmith.eagle.export import load_speculators
    from draftsmith.eagle.model import load_eagle, shift_left

    head, _ = load_eagle(art, target)
    config = Eagle3SpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = str(target.folder)
    model = load_speculators(export_dir, config)
    # the draft reads the target's plain embedding rows (no Gemma sqrt(H) scale), as vLLM / SGLang do
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    ids = torch.tensor([rows[0]["input_ids"][:12]])
    T = ids.shape[1]
    cap = capture_forward(target.model, ids, layers=head.config.target_layers, want_logits=False)
    feats = torch.cat([cap.layers[i] for i in head.config.target_layers], dim=-1)
    with torch.no_grad():
        ours = head(ids, feats, steps=2)  # ttt_tokens "target": step 1 at base t reads x_{t+2}, as speculators does
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():  # speculators reads x_{t+1} at base t (the caller shifts), positions 0..T-1
        model(hidden_states=feats, input_ids=shift_left(ids, 1), document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(T)[None], ttt_steps=2)
    hook.remove()
    assert len(seen) == 2
    for step in range(2):
        torch.testing.assert_close(seen[step][0], head.logits(ours.hidden[step])[0], rtol=1e-4, atol=1e-4)
    assert not torch.equal(seen[0], seen[1])  # the second step is a step of its own, compared as one


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_method_and_export_on_every_family(family, tiny_tokenizer, tmp_path):
    from draftsmith.distill.job import DistillConfig
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.medusa.job import MedusaJob, MedusaJobConfig
    from draftsmith.runner.train import run
    from draftsmith.targets import load_target
    from draftsmith.targets.families import family as family_of
    from draftsmith.targets.families import full_attention_rope

    folder = build_tiny_family(family, tiny_tokenizer, tmp_path / family)
    target = load_target(str(folder))
    assert family_of(target.config).model_type == family
    assert (target.tokenizer.pad_token_id is None) == (family in NO_PAD)
    rows = _data(target, tmp_path)
    no_eval = EvalAfterTraining(enabled=False)

    # Medusa heads
    mcfg = MedusaJobConfig(target=str(folder), data="in-memory", output=str(tmp_path / "medusa"), num_heads=2,
                           calibration_rows=2, tree_budget=4, max_length=64, train=_train_cfg(tmp_path, "medusa"),
                           evaluate=no_eval)
    medusa = Path(train(MedusaJob(mcfg, target, rows), mcfg.train).artifact)
    plain = {}
    _lossless(target, f"medusa:{medusa}", rows, plain)
    _export_all(medusa, target, tmp_path, ["vllm", "trtllm", "hf"], consumer="vllm")

    # EAGLE-3 and EAGLE-1: the Llama draft layer whatever the family
    theta = full_attention_rope(target.config)["rope_theta"]
    heads = {}
    for version in ("eagle3", "eagle1"):
        ecfg = EagleJobConfig(target=str(folder), data="in-memory", output=str(tmp_path / version), version=version,
                              ttt_steps=2 if version == "eagle3" else 1, draft_vocab_size=128, max_length=64,
                              train=_train_cfg(tmp_path, version), evaluate=no_eval)
        heads[version] = Path(train(EagleJob(ecfg, target, rows), ecfg.train).artifact)
        _lossless(target, f"eagle:{heads[version]}", rows, plain)
    e3 = _export_all(heads["eagle3"], target, tmp_path, ["vllm", "sglang", "trtllm", "hf"], consumer="vllm")
    _export_all(heads["eagle1"], target, tmp_path, ["sglang", "trtllm"], consumer="sglang")
    for stack, res in e3.items():  # the target's full-attention RoPE base in every spelling
        cfg = json.loads((res.out / "config.json").read_text())
        layer = cfg.get("transformer_layer_config", cfg)
        assert layer["model_type"] == "llama" and layer["rope_theta"] == theta, stack
        assert layer["rope_parameters"]["rope_theta"] == theta, stack
    assert any(c.startswith("speculators") for c in e3["vllm"].checks), e3["vllm"].checks
    _speculators_parity(e3["vllm"].out, heads["eagle3"], target, rows)

    # a DFlash block drafter (Qwen3-style layers whatever the family), served as one layout by vLLM and SGLang
    from draftsmith.dflash.job import DFlashJob, DFlashJobConfig

    fcfg = DFlashJobConfig(target=str(folder), data="in-memory", output=str(tmp_path / "dflash"), block_size=4,
                           anchors_per_row=8, max_length=64, train=_train_cfg(tmp_path, "dflash"), evaluate=no_eval)
    dflash = Path(train(DFlashJob(fcfg, target, rows), fcfg.train).artifact)
    _lossless(target, f"dflash:{dflash}", rows, plain)
    _export_all(dflash, target, tmp_path, ["vllm", "sglang"], consumer="vllm")

    # DSpark on the same backbone: the Markov head and the confidence head over this family's vocabulary
    from draftsmith.dspark.job import DSparkJob, DSparkJobConfig

    scfg = DSparkJobConfig(target=str(folder), data="in-memory", output=str(tmp_path / "dspark"), block_size=4,
                           anchors_per_row=8, max_length=64, markov_rank=8, train=_train_cfg(tmp_path, "dspark"),
                           evaluate=no_eval)
    dspark = Path(train(DSparkJob(scfg, target, rows), scfg.train).artifact)
    _lossless(target, f"dspark:{dspark}", rows, plain)
    _export_all(dspark, target, tmp_path, ["vllm"], consumer="vllm")

    # a distilled draft of the target's own family
    dcfg = DistillConfig()
    dcfg.target, dcfg.train = str(folder), _train_cfg(tmp_path, "distill")
    dcfg.train.batch_size, dcfg.evaluate.enabled, dcfg.draft.num_layers = 2, False, 1
    dcfg.data.eval_fraction = 0.25
    draft = Path(run("draft", dcfg, target=target, rows=rows).artifact)
    _lossless(target, f"draft:{draft}", rows, plain)
    _export_all(draft, target, tmp_path, ["vllm", "sglang", "trtllm", "hf"], consumer="hf")


def test_a_family_outside_the_table_is_one_line(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from draftsmith.eagle.model import EagleHead
    from draftsmith.medusa.job import MedusaJob, MedusaJobConfig
    from draftsmith.targets import Target, freeze

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer)))
    with pytest.raises(ConfigError, match="target family 'gpt2' is not in draftsmith's table") as e:
        EagleHead.from_target(gpt2, "eagle3")
    assert "\n" not in str(e.value) and "decoder layers" in str(e.value)
    target = Target("gpt2", freeze(gpt2), tiny_tokenizer, "gpt2")
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1], "row_id": i} for i in range(4)]
    with pytest.raises(ConfigError, match="'gpt2' is not in draftsmith's table"):
        MedusaJob(MedusaJobConfig(train=TrainConfig(resume="never")), target, rows)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3", "qwen3_moe"])
def test_a_draft_layer_no_stack_loads_is_refused_before_training(family, tiny_tokenizer, tmp_path):
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family(family, tiny_tokenizer, tmp_path / family)))
    rows = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1], "row_id": i} for i in range(8)]
    cfg = EagleJobConfig(target="x", data="x", output=str(tmp_path / "e"), draft_layer="target", draft_vocab_size=32)
    with pytest.raises(ConfigError) as e:
        EagleJob(cfg, target, rows)
    assert "\n" not in str(e.value)
    if family == "phi3":  # no widened EAGLE-3 attention from a fused qkv_proj at all
        assert "draft_layer: target is not available for phi3" in str(e.value)
        return
    if family == "qwen3_moe":  # a router and experts in a one-layer draft: no stack builds it
        assert "not available for qwen3_moe targets (a mixture-of-experts layer" in str(e.value)
        assert "draft_layer: llama" in str(e.value)
        return
    assert "no serving stack loads" in str(e.value) and "draft_layer: llama" in str(e.value)
    cfg.exportable = False  # draftsmith's own decoder runs it: trains, and export refuses it with one line
    job = EagleJob(cfg, target, rows)
    assert job.build_module().config.model_type == family


def test_gemma_head_reads_plain_embedding_rows(tiny_tokenizer, tmp_path):
    """Gemma's model scales its embedding by sqrt(H) in its forward; the serving stacks' EAGLE drafters look
    the row up plainly, and so does draftsmith's head."""
    from draftsmith.eagle.model import EagleHead
    from draftsmith.heads.vocab import build_draft_vocab
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family("gemma3_text", tiny_tokenizer, tmp_path / "g")))
    emb = target.model.get_input_embeddings()
    ids = torch.tensor([[3, 4, 5]])
    assert not torch.allclose(emb(ids), emb.weight[ids])  # the module scales
    head = EagleHead.from_target(target.model, "eagle3",
                                 draft_vocab=build_draft_vocab(torch.ones(len(tiny_tokenizer)), 32))
    assert torch.equal(head.embed(ids), emb.weight[ids])
