"""Draft builders, LoRA merge, the distillation job through the one loop, and the saved artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.data.batching import pad_rows
from draftsmith.distill import model as B
from draftsmith.distill.job import DistillConfig, DistillJob, prompt_lengths
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.heads import lora
from draftsmith.runner.train import run

PROMPTS = ["What is the capital of France?", "Add 2 and 3.", "Write a loop in Python.", "Summarize the passage.",
           "How many clips did Natalia sell?", "Translate the sentence into French.", "def add(a, b):",
           "Question: what is 7 times 6?", "Name a fox.", "import os", "The quick brown fox", "for i in range(10):"]


def self_distilled_rows(target, n: int = 24, new_tokens: int = 12) -> list[dict]:
    """Rows like `draftsmith data` writes: chat prompt + the TARGET's own sampled response (loss-masked).
    (Sampled, seeded: the tiny random target's greedy responses repeat one token.)"""
    tok = target.tokenizer
    rows = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
        torch.manual_seed(i)
        with torch.no_grad():
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=True, top_k=0,
                                        pad_token_id=tok.pad_token_id)
        resp = out[0, len(ids):].tolist()
        rows.append({"row_id": 1000 + i, "input_ids": ids + resp, "loss_mask": [0] * len(ids) + [1] * len(resp),
                     "domain": "chat" if i % 2 else "code"})
    return rows


@pytest.fixture(scope="module")
def rows(tiny_target):
    return self_distilled_rows(tiny_target)


def tiny_cfg(tmp_path: Path, *overrides: str) -> DistillConfig:
    base = [f"train.output_dir={tmp_path / 'run'}", "train.progress=false", "train.batch_size=4",
            "train.max_steps=4", "train.lr=3e-3", "train.warmup_steps=0", "train.eval_batches=2",
            "data.eval_fraction=0.2", "evaluate.enabled=false", "draft.num_layers=1"]
    return load_config(None, base + list(overrides), cls=DistillConfig)


# ---- builders --------------------------------------------------------------------------------------

def _renamed_tokenizer(tok, token_id: int, new: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    old = next(t for t, i in vocab.items() if i == token_id)
    vocab[new] = vocab.pop(old)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=tok.bos_token,
                                   eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token)
    return fast, old


def test_tokenizer_mismatch_names_first_differing_token(tiny_target, other_target, tmp_path):
    bad, old = _renamed_tokenizer(tiny_target.tokenizer, 17, "zzqq")
    with pytest.raises(DraftsmithError, match=rf"at id 17: 'zzqq' vs {old!r}"):
        B.check_tokenizer(bad, tiny_target.tokenizer)
    B.check_tokenizer(tiny_target.tokenizer, tiny_target.tokenizer)  # identical: fine
    # other_target: a different (smaller) vocabulary -> the size difference is named
    with pytest.raises(DraftsmithError, match="300 tokens, the target's has 320"):
        B.existing_draft(other_target.folder, tiny_target)
    # a draft folder whose tokenizer has one renamed token is refused when loaded as an existing draft
    folder = tmp_path / "bad_draft"
    B.truncated_draft(tiny_target, 1).save_pretrained(folder)
    bad.save_pretrained(folder)
    with pytest.raises(DraftsmithError, match="at id 17"):
        B.existing_draft(folder, tiny_target)


def test_truncated_draft_keeps_first_layers_exactly(tiny_target):
    draft = B.truncated_draft(tiny_target, 1)
    assert draft.config.num_hidden_layers == 1 and len(B.decoder_layers(draft)) == 1
    t_state, d_state = tiny_target.model.state_dict(), draft.state_dict()
    assert set(d_state) == {k for k in t_state if ".layers.1." not in k}
    for k, v in d_state.items():
        assert torch.equal(v, t_state[k].float()), k
    # the copy is a real model: its first-layer output equals the target's first-layer output
    from draftsmith.capture.forward import capture_forward

    ids = torch.tensor([[5, 9, 30, 31, 7]])
    a = capture_forward(tiny_target.model, ids, layers=[0]).layers[0]
    b = capture_forward(draft, ids, layers=[0]).layers[0]
    torch.testing.assert_close(a, b)
    with pytest.raises(ConfigError):
        B.truncated_draft(tiny_target, 3)


def test_fresh_draft_sizes_and_embeddings(tiny_target):
    d = B.fresh_draft(tiny_target, 1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48)
    c = d.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (1, 32, 4, 48)
    assert c.vocab_size == tiny_target.vocab_size and c.model_type == tiny_target.config.model_type
    same = B.fresh_draft(tiny_target, 1)  # hidden matches: embeddings start as the target's
    assert torch.equal(same.get_input_embeddings().weight, tiny_target.model.get_input_embeddings().weight)
    rep, tgt = B.size_report(d), B.size_report(tiny_target.model)
    assert rep["non_embedding_params"] < tgt["non_embedding_params"]
    assert rep["params"] == sum(p.numel() for p in d.parameters())
    # the config-only estimate agrees with the counted parameters (gated-MLP decoder)
    assert B.size_report(tiny_target.model.config)["params"] == tgt["params"]


def test_lora_merge_equivalence(tiny_target):
    torch.manual_seed(0)
    peft_model = lora.apply_lora(B.truncated_draft(tiny_target, 2), r=4, alpha=8)
    with torch.no_grad():  # B = 0 at start: make the adapters do something
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in peft_model.parameters()) / 4
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    peft_model.eval()
    with torch.no_grad():
        a = peft_model(input_ids=ids).logits
        merged = lora.plain_model(peft_model)
        b = merged(input_ids=ids).logits
        base = B.truncated_draft(tiny_target, 2).eval()(input_ids=ids).logits
    assert not lora.is_peft(merged) and lora.is_peft(peft_model)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - base).abs().max() > 1e-3  # the adapters changed the logits, and the merge kept that


# ---- the job ---------------------------------------------------------------------------------------

def test_pad_batch_and_prompt_lengths():
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "row_id": 7},
            {"input_ids": [5, 6], "loss_mask": [0, 1], "row_id": 8}]
    b = pad_rows(rows, pad_id=0, max_length=3)
    assert b["input_ids"].tolist() == [[1, 2, 3], [5, 6, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1], [0, 1, 0]]
    assert b["row_id"].tolist() == [7, 8]
    assert prompt_lengths(b) == [2, 1]


def _eval_kd(job, module) -> float:
    module.eval()
    with torch.no_grad():
        batch = job.collate(list(job.eval_rows()))
        return job.loss(module, batch)[1]["kd"]


def test_short_distillation_lowers_kd_and_artifact_works(tiny_target, rows, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = tmp_path / "math.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q], "category": "math"}) + "\n" for q in PROMPTS[:2]))
    cfg = tiny_cfg(tmp_path, "train.max_steps=30", "train.lr=1e-2", "draft.init=fresh", "draft.hidden_size=32",
                   "draft.num_attention_heads=4", "draft.num_key_value_heads=2", "kd.divergence=jsd",
                   "evaluate.enabled=true", f"evaluate.prompts=[{prompts}]", "evaluate.limit_per_domain=2",
                   "evaluate.max_new_tokens=8", "evaluate.cost_model=false")
    job = DistillJob(cfg, tiny_target, rows)
    torch.manual_seed(cfg.train.seed)
    before = _eval_kd(job, job.build_module())
    out = run("draft", cfg, target=tiny_target, rows=rows)
    after = out.metrics["eval/kd"]
    assert after < 0.5 * before, (before, after)
    path = Path(out.artifact)
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["kind"] == "draft"
            and manifest["target"]["tokenizer_hash"] == tiny_target.fingerprint()["tokenizer_hash"])
    assert manifest["config"]["kd"]["divergence"] == "jsd" and manifest["train_seconds"] > 0
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
    # the evaluator ran on the draft and its report is in the artifact
    assert (path / "eval" / "report.json").is_file()
    math_eval = manifest["eval"]["domains"]["math"]
    assert math_eval["n_prompts"] == 2 and math_eval["lossless"] is True and 0.0 <= math_eval["alpha"] <= 1.0
    assert math_eval["tau"] >= 1.0

    # a plain HF folder: transformers loads it, and assisted generation with it is the target's greedy output
    draft = AutoModelForCausalLM.from_pretrained(path).eval()
    assert draft.config.hidden_size == 32
    ids = torch.tensor([rows[0]["input_ids"][: prompt_lengths(job.collate([rows[0]]))[0]]])
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=tiny_target.tokenizer.pad_token_id)
    with torch.no_grad():
        plain = tiny_target.model.generate(ids, **kw)
        assisted = tiny_target.model.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(plain, assisted)
    # and the draftsmith decoder's proposer accepts it for this target
    from draftsmith.distill.proposer import DraftProposer

    DraftProposer.from_path(path, tiny_target)


def test_truncated_no_kd_baseline_reports_gap_metrics(tiny_target, rows, tmp_path):
    cfg = tiny_cfg(tmp_path, "kd.ce_weight=1.0")
    out = run("draft", cfg, target=tiny_target, rows=rows)
    m = out.metrics
    assert {"eval/kd", "eval/tvd", "eval/ce"} <= set(m) and "train/tvd" not in m
    assert 0.0 <= m["eval/tvd"] <= 1.0


def test_on_policy_batches_are_sampled_by_the_draft(tiny_target, rows, tmp_path):
    cfg = tiny_cfg(tmp_path, "on_policy.fraction=1.0", "on_policy.max_new_tokens=6", "kd.divergence=tvd")
    job = DistillJob(cfg, tiny_target, rows)
    module = job.build_module()
    batch = job.collate(list(job.train_rows())[:3])
    torch.manual_seed(0)
    new = job.on_policy_batch(module, batch)
    plens = prompt_lengths(batch)
    assert prompt_lengths(new) == plens
    for b, n in enumerate(plens):
        assert new["input_ids"][b, :n].tolist() == batch["input_ids"][b, :n].tolist()  # prompt kept
        learned = int(new["loss_mask"][b].sum())
        assert 1 <= learned <= 6 and learned == int(new["attention_mask"][b].sum()) - n
    out = run("draft", cfg, target=tiny_target, rows=rows)
    assert out.metrics["train/on_policy"] == 1.0


def test_offline_topk_cache(tiny_target, rows, tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, "data.mode=offline", "data.capture_topk=8", "kd.divergence=reverse_kl")
    out = run("draft", cfg, target=tiny_target, rows=rows)
    assert "estimated disk" in capsys.readouterr().err
    assert (tmp_path / "run" / "capture" / "index.json").is_file()
    assert out.metrics["eval/kd"] >= 0
    # top-k from the cache equals top-k computed online for the same rows
    job = DistillJob(cfg, tiny_target, rows)
    batch = job.collate(list(job.eval_rows()))
    off = job.teacher(batch, online=False)
    on = job.teacher(batch, online=True)
    assert off["topk_values"].shape == (int(batch["attention_mask"].sum()), 8)
    torch.testing.assert_close(off["topk_values"], on["topk_values"], atol=1e-4, rtol=1e-4)
    # and the cache holds the full logits' logsumexp: the bucket tail is the teacher's exact tail mass
    torch.testing.assert_close(off["topk_logsumexp"], on["topk_logsumexp"], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        sel = batch["attention_mask"].bool()
        full = tiny_target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[sel]
    p_full = torch.softmax(full.float(), -1)
    exact_tail = 1 - p_full.gather(-1, on["topk_indices"]).sum(-1)
    from draftsmith.heads.losses import topk_logprobs

    log_p, _ = topk_logprobs(full, off["topk_values"], off["topk_indices"], teacher_logsumexp=off["topk_logsumexp"])
    torch.testing.assert_close(log_p[:, -1].exp(), exact_tail.clamp_min(1e-6), atol=1e-4, rtol=1e-3)
    draft = job.build_module().eval()
    exact, _ = job.loss(draft, batch)
    job.features.logsumexp = False  # as from a cache made before the logsumexp was stored
    approx, _ = job.loss(draft, batch)
    assert torch.isfinite(exact) and float(exact) != pytest.approx(float(approx), rel=1e-6)


def test_lora_job_exports_plain_model(tiny_target, rows, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "existing"
    B.truncated_draft(tiny_target, 1).save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    cfg = tiny_cfg(tmp_path, "draft.init=existing", f"draft.path={folder}", "lora.enabled=true", "lora.r=4")
    out = run("draft", cfg, target=tiny_target, rows=rows)
    model = AutoModelForCausalLM.from_pretrained(out.artifact)
    assert not any("lora" in k for k in model.state_dict())
    assert not (Path(out.artifact) / "adapter_config.json").exists()


def test_cli_and_preset(tiny_target, rows, tmp_path):
    from draftsmith.cli import main
    from draftsmith.data import generate_dataset
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/smollm2-135m/distill.yaml")
    assert cfg.draft.init == "truncated" and cfg.draft.num_layers == 3
    with pytest.raises(ConfigError, match="divergence"):
        load_config(None, ["kd.divergence=l2"], cls=DistillConfig)
    # the real data pipeline: the tiny target writes its own responses
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": q}) + "\n" for q in PROMPTS))
    data = generate_dataset(DataConfig(sources=[SourceConfig(name="p", path=str(prompts), prompt="q", domain="chat")],
                                       output_dir=str(tmp_path / "data"),
                                       generation=GenerationConfig(max_new_tokens=10, batch_size=4)),
                            tiny_target, progress=False)
    code = main(["distill", "--config", str(Path(__file__).resolve().parents[1] / "configs/smollm2-135m/distill.yaml"),
                 f"target={tiny_target.folder}", f"data.path={data}", f"train.output_dir={tmp_path / 'cli'}",
                 "train.max_steps=2", "train.batch_size=4", "train.progress=false", "draft.num_layers=1",
                 "evaluate.enabled=false", "data.eval_fraction=0.2", "train.save_every=0"])
    assert code == 0
    assert (tmp_path / "cli" / "artifact" / "manifest.json").is_file()


def test_init_only_saves_and_evaluates_the_untrained_draft(tiny_target, rows, tmp_path):
    """The "same architecture before distillation" baseline: the built draft, no step taken, evaluated."""
    from transformers import AutoModelForCausalLM

    prompts = tmp_path / "math.jsonl"
    prompts.write_text(json.dumps({"turns": [PROMPTS[0]], "category": "math"}) + "\n")
    cfg = tiny_cfg(tmp_path, "evaluate.enabled=true", f"evaluate.prompts=[{prompts}]", "evaluate.max_new_tokens=8",
                   "evaluate.cost_model=false")
    out = run("draft", cfg, target=tiny_target, rows=rows, init_only=True)
    path = Path(out.artifact)
    assert out.train_seconds == 0.0 and path == Path(cfg.train.output_dir) / "artifact"
    assert not (Path(cfg.train.output_dir) / "checkpoints").exists()  # the loop never ran
    built = DistillJob(cfg, tiny_target, rows).build_module()
    saved = AutoModelForCausalLM.from_pretrained(path)
    for name, p in built.state_dict().items():
        assert torch.equal(p, saved.state_dict()[name]), name
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["metrics"] == {"steps": 0} and manifest["eval"]["overall"]["lossless"] is True


def test_warm_start_from_a_tied_draft(tiny_target, rows, tmp_path):
    """A draft with a tied lm_head is saved without lm_head.weight; warm-starting from it (what retraining
    does) loads the head through the embedding it shares."""
    from transformers import AutoModelForCausalLM

    first = run("draft", tiny_cfg(tmp_path / "a"), target=tiny_target, rows=rows).artifact
    saved = AutoModelForCausalLM.from_pretrained(first)
    assert saved.config.tie_word_embeddings
    cfg = tiny_cfg(tmp_path / "b", f"train.warm_start={first}", "train.max_steps=1", "train.lr=1e-12",
                   "train.schedule=constant")
    second = AutoModelForCausalLM.from_pretrained(run("draft", cfg, target=tiny_target, rows=rows).artifact)
    for name, p in saved.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], p, atol=1e-6, rtol=0, msg=name)
