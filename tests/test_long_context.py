"""Long rows: an EAGLE-3 head trains on 8,192-token rows of a tiny target whose context holds them, through the
long-context preset; `draftsmith plan` sizes an 8B target at 8k / 16k / 32k tokens on H100-80GB and A100-40GB,
with what ZeRO-3 / FSDP, the learned share of a row and `prompt_context` do to it, and says what makes a plan
that does not fit fit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import make_target

from draftsmith.memory.serving import load_target_config
from draftsmith.memory.training import plan_config

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "configs" / "llama3.1-8b-instruct"
PRESET = LLAMA / "eagle3-16k.yaml"
ZERO2 = ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"
ZERO3 = ROOT / "configs" / "accelerate" / "deepspeed_zero3.yaml"


def _plan(length: int, acc=ZERO2, gpu="H100-80GB", learned=None, advise=False, more=()):
    return plan_config(LLAMA / "eagle3.yaml", LLAMA / "target-config.json", acc, gpu, None,
                       [f"max_length={length}", "train.batch_size=1", *more], learned, advise)


def test_the_8b_plan_grows_with_the_row_and_zero3_shards_only_the_weights():
    """Per GPU, activations grow faster than the row (the TTT masks are quadratic in it); ZeRO-3 divides the
    frozen target's weights over the 8 ranks (plus one gathered layer) and leaves every rank its whole
    activations, so that only 8k on an H100 fits as eagle3.yaml has it (seven TTT steps)."""
    z2 = {n: _plan(n) for n in (8192, 16384, 32768)}
    z3 = {n: _plan(n, ZERO3) for n in (8192, 16384, 32768)}
    acts = [z2[n]["bytes"]["activations"] for n in (8192, 16384, 32768)]
    assert acts[0] < acts[1] < acts[2] and acts[2] / acts[1] > acts[1] / acts[0] > 2  # superlinear
    for n in z2:
        a, b = z2[n]["bytes"], z3[n]["bytes"]
        assert (z2[n]["sharding"], z3[n]["sharding"]) == ("zero2", "zero3")
        assert b["activations"] == a["activations"] and b["optimizer"] == a["optimizer"]
        params = z2[n]["target_params"]
        assert a["target_weights"] == params * 2
        assert params * 2 / 8 < b["target_weights"] < params * 2 / 8 + 0.5 * 2**30
    fits = {(n, gpu): _plan(n, ZERO3, gpu)["fits"] for n in (8192, 16384, 32768) for gpu in ("H100-80GB", "A100-40GB")}
    assert fits == {(8192, "H100-80GB"): True, (16384, "H100-80GB"): False, (32768, "H100-80GB"): False,
                    (8192, "A100-40GB"): False, (16384, "A100-40GB"): False, (32768, "A100-40GB"): False}


def test_learned_tokens_and_prompt_context_cut_the_step():
    """A 32k row that learns only its last 2,048 tokens: EAGLE's later TTT steps and its logits run on those
    alone. prompt_context then cuts the row itself to that many prompt tokens before them (window), which is
    the whole step; without a learned count the plan is the worst case and prompt_context changes nothing."""
    full = _plan(32768)
    short = _plan(32768, learned=2048)
    cut = _plan(32768, learned=2048, more=["prompt_context=256"])
    assert (short["window"], short["learned"]) == (32768, 2048) and (cut["window"], cut["learned"]) == (2304, 2048)
    a = [p["bytes"]["activations"] for p in (full, short, cut)]
    assert a[0] > 8 * a[1] and a[1] > 2.5 * a[2]  # the masks go first, then the steps over the prompt
    assert _plan(32768, more=["prompt_context=256"])["bytes"] == full["bytes"]  # every token learned: no cut
    assert cut["bytes"]["target_weights"] == full["bytes"]["target_weights"]  # the weights do not care


@pytest.mark.parametrize("gpu", ["H100-80GB", "A100-40GB"])
def test_the_advice_makes_the_plan_fit(gpu):
    """At 32k on ZeRO-2 with two rows per micro-batch nothing fits; the advice goes one row per micro-batch, then
    ZeRO-3, then (every token learned) fewer TTT steps or (rows that learn few of their tokens) prompt_context,
    and its last change is the first that fits."""
    base = _plan(32768, gpu=gpu, more=["train.batch_size=2"], advise=True)
    changes = [a["change"].split(" ")[0] for a in base["advice"]]
    assert not base["fits"] and changes[:2] == ["train.batch_size=1", "ZeRO-3"]
    assert changes[2].startswith("ttt_steps=") and base["advice"][-1]["fits"]
    assert not any(a["fits"] for a in base["advice"][:-1])
    totals = [base["total_bytes"]] + [a["total_bytes"] for a in base["advice"]]
    assert totals == sorted(totals, reverse=True)
    # rows that learn 2,048 of their tokens: the same 32k row fits an H100 as it is, an A100 with ZeRO-3; a 64k
    # one on an A100 needs prompt_context too, the longest that fits (one token more does not)
    assert _plan(32768, learned=2048, gpu=gpu, more=["train.batch_size=2"])["fits"] == (gpu == "H100-80GB")
    docs = _plan(65536, learned=2048, gpu="A100-40GB", more=["train.batch_size=2"], advise=True)
    assert [a["change"].split(" ")[0].split("=")[0] for a in docs["advice"]] == [
        "train.batch_size", "ZeRO-3", "prompt_context"]
    p = int(docs["advice"][-1]["change"].split("=")[1])
    assert docs["advice"][-1]["fits"] and 2 < p < 65536 - 2048
    assert _plan(65536, ZERO3, "A100-40GB", 2048, more=[f"prompt_context={p}"])["fits"]
    assert not _plan(65536, ZERO3, "A100-40GB", 2048, more=[f"prompt_context={p + 1}"])["fits"]


def test_the_16k_preset_fits_the_gpus_it_names():
    from draftsmith.config import load_config

    job = load_config(PRESET)
    assert (job.max_length, job.train.batch_size, job.ttt_steps) == (16384, 1, 6)
    assert "configs/accelerate/deepspeed_zero3.yaml" in PRESET.read_text()
    h100 = plan_config(PRESET, LLAMA / "target-config.json", ZERO3, "H100-80GB", advise=True)
    assert h100["fits"] and h100["advice"] == []
    a100 = plan_config(PRESET, LLAMA / "target-config.json", ZERO3, "A100-40GB", advise=True)
    assert not a100["fits"] and [a["change"] for a in a100["advice"]] == ["ttt_steps=2"]
    assert load_target_config(LLAMA / "target-config.json").max_position_embeddings >= 16384


# --- training on 8k rows -----------------------------------------------------------------------------------------

LONG = 8192


@pytest.fixture(scope="module")
def long_target(tiny_tokenizer):
    """A 4-layer tiny Llama whose context holds 16k tokens (the preset's rows)."""
    return make_target(tiny_tokenizer, seed=3, layers=4, max_position_embeddings=2 * LONG)


def _long_rows(target, n: int = 3, answer: int = 32) -> list[dict]:
    """Rows of LONG tokens: a random prompt, then the target's own greedy answer (the learned part)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        prompt = torch.randint(3, target.vocab_size, (1, LONG - answer), generator=g)
        with torch.no_grad():
            out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=answer,
                                        min_new_tokens=answer, do_sample=False)
        rows.append({"input_ids": out[0].tolist(), "loss_mask": [0] * (LONG - answer) + [1] * answer,
                     "domain": "long", "row_id": i})
    return rows


def _job_cfg(tmp: Path, *more: str):
    from draftsmith.config import load_config

    return load_config(PRESET, [
        "target=tiny", "data=in-memory", f"output={tmp / 'artifact'}", "target_layers=[0,1,2]", "ttt_steps=2",
        "draft_vocab_size=128", f"max_length={LONG}", "eval_fraction=0.34", f"train.output_dir={tmp / 'run'}",
        "train.max_steps=2", "train.lr=1e-3", "train.warmup_ratio=0", "train.mixed_precision='no'",
        "train.resume=never", "train.progress=false", "train.log_every=1", "train.eval_every=0",
        "train.loggers=[jsonl]", "evaluate.enabled=false", *more])


@pytest.mark.slow
def test_eagle3_trains_on_8k_rows_through_the_long_preset(long_target, tmp_path):
    """The 16k preset, cut to the tiny target: two optimizer steps on 8,192-token rows, each batch one whole row
    (nothing truncated), finite losses, an artifact that loads back; with prompt_context the same rows step on
    the answer and that many prompt tokens only."""
    from draftsmith.eagle.job import EagleJob
    from draftsmith.eagle.model import load_eagle
    from draftsmith.training import train

    rows = _long_rows(long_target)
    cfg = _job_cfg(tmp_path)
    job = EagleJob(cfg, long_target, rows)
    assert job.collate(job.train_rows()[:1])["input_ids"].shape == (1, LONG)
    result = train(job, cfg.train)
    losses = [r["loss"] for r in result.history if r["type"] == "train"]
    assert result.steps == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    head, _ = load_eagle(result.artifact, long_target)
    assert head.config.ttt_steps == 2
    cut = EagleJob(_job_cfg(tmp_path / "cut", "prompt_context=64"), long_target, rows)
    assert cut.collate(cut.train_rows()[:1])["input_ids"].shape == (1, 64 + 32)
