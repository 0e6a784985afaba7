"""What Medusa heads cost to train, for `draftsmith plan --config`: the heads' parameters, the last hidden state
(and teacher top-k) kept per token, and the heads' activations. Serving them adds only their parameters
(model.safetensors), which is what `draftsmith plan` counts for a method that declares no `memory`."""

from __future__ import annotations

from draftsmith.memory.training import JobMemory, meta_params
from draftsmith.targets.families import text_config


def job_memory(job, target_config, act: int, learned: int | None = None) -> JobMemory:
    """`Method.train_memory` of a Medusa job (every head predicts at every position: `learned` changes nothing)."""
    from draftsmith.medusa.model import MedusaHeads, MedusaHeadsConfig

    tc = text_config(target_config)
    H, V = tc.hidden_size, tc.vocab_size
    tokens = job.train.batch_size * job.max_length
    n = job.draft_vocab_size or V
    cfg = MedusaHeadsConfig(H, V, job.num_heads, job.num_layers, job.share_lm_head, job.draft_vocab_size)
    trained = meta_params(lambda: MedusaHeads(cfg))
    keep = H * act + job.kd_topk * 8 * (1 if job.kd_weight > 0 else 0)
    return JobMemory(job.max_length, trained, keep, 0,
                     tokens * job.num_heads * (job.num_layers * 2 * H * act + 2 * n * 4))
