"""The CUDA forms of what every other test runs on the CPU: each method trains on one GPU through the one
runner's Accelerator (placement from `accelerator.device`, bf16 autocast where the GPU has it), its head is
read back onto the GPU, and greedy speculative decoding there equals the target's own `generate` on the same
GPU token for token (the reference is transformers', not draftsmith's plain decoding); a bf16 draft beside a
float32 target stays lossless. Skipped where torch sees no CUDA device (CI, the CPU machines): `make test-gpu`
runs them on a GPU node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import distilled_rows, make_target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_target(tiny_tokenizer, tmp_path_factory):
    from draftsmith.targets import load_target

    folder = tmp_path_factory.mktemp("gpu-target")
    make_target(tiny_tokenizer, seed=5, layers=4, folder=folder)
    return load_target(str(folder), device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def rows(cuda_target):
    return distilled_rows(cuda_target, n=32, new=24)


def _train_cfg(tmp: Path, name: str):
    from draftsmith.training import TrainConfig

    return TrainConfig(lr=3e-3, max_steps=12, batch_size=4, warmup_steps=0, output_dir=str(tmp / f"{name}-run"),
                       resume="never", progress=False, log_every=4, eval_every=0, eval_batches=1,
                       mixed_precision="bf16" if torch.cuda.is_bf16_supported() else "no")


def _job(method: str, target, rows, tmp: Path):
    from draftsmith.dflash.job import DFlashJob, DFlashJobConfig
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.medusa.job import MedusaJob, MedusaJobConfig

    common = dict(target=target.spec, data="in-memory", output=str(tmp / method), max_length=64,
                  train=_train_cfg(tmp, method), evaluate=EvalAfterTraining(enabled=False))
    if method == "medusa":
        return MedusaJob(MedusaJobConfig(num_heads=2, calibration_rows=2, tree_budget=4, **common), target, rows)
    if method == "eagle3":
        return EagleJob(EagleJobConfig(version="eagle3", ttt_steps=2, draft_vocab_size=128, **common), target, rows)
    if method == "eagle31":
        return EagleJob(EagleJobConfig(version="eagle3", ttt_steps=2, draft_vocab_size=128, fc_norm=True,
                                       norm_output=True, **common), target, rows)
    return DFlashJob(DFlashJobConfig(block_size=4, anchors_per_row=8, **common), target, rows)


def _hf_greedy(target, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            g = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("method", ["medusa", "eagle3", "eagle31", "dflash"])
def test_trains_on_the_gpu_and_decodes_as_generate_does(method, cuda_target, rows, tmp_path):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.training import train

    job = _job(method, cuda_target, rows, tmp_path)
    result = train(job, job.cfg.train)
    losses = [r["loss"] for r in result.history if r.get("type") == "train"]
    assert result.artifact is not None and result.steps == 12 and len(losses) == 3, result.metrics
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert cuda_target.model.device.type == "cuda"
    assert not any(p.requires_grad for p in cuda_target.model.parameters())  # the target stayed frozen
    kind = "eagle" if method.startswith("eagle") else method
    proposer = build_proposer(f"{kind}:{result.artifact}", cuda_target)
    prompts = [r["input_ids"][:4] for r in rows[:3]]
    fast = speculative_generate(cuda_target, proposer, prompts, 16, k=3, eos_ids=[])
    assert fast.tokens == _hf_greedy(cuda_target, prompts, 16), method
    assert fast.stats.proposed > 0


def test_a_bf16_dflash_draft_beside_a_float32_target_stays_lossless(cuda_target, rows, tmp_path):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.training import train

    job = _job("dflash", cuda_target, rows, tmp_path)
    art = train(job, job.cfg.train).artifact
    proposer = build_proposer(f"dflash:{art}", cuda_target)
    assert proposer.use_dtype(torch.bfloat16)
    prompts = [r["input_ids"][:4] for r in rows[3:6]]
    fast = speculative_generate(cuda_target, proposer, prompts, 16, k=3, eos_ids=[])
    assert fast.tokens == _hf_greedy(cuda_target, prompts, 16)
