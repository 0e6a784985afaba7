"""What a draft model costs in memory, for `draftsmith plan`: serving (its parameters and its own KV cache,
beside the target's) and training (the distillation job's trained parameters, teacher logits and
activations). The counting rules common to every method live in memory/serving.py and memory/training.py."""

from __future__ import annotations

from pathlib import Path

from draftsmith.memory.serving import ArtifactShape, count_params
from draftsmith.memory.training import JobMemory, layer_bytes_per_token
from draftsmith.targets.families import text_config


def shape(path: Path, target_config) -> ArtifactShape:
    """A whole draft model (an HF folder): its parameters, and a KV cache of its own layers."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    return ArtifactShape("draft", count_params(cfg), cfg, text_config(cfg).num_hidden_layers, separate_model=True)


def job_memory(job, target_config, act: int, learned: int | None = None) -> JobMemory:
    """`Method.train_memory` of a draft distillation job (the draft runs every position: `learned` changes nothing)."""
    from draftsmith.distill.model import _config_for_layers

    tc = text_config(target_config)
    V = tc.vocab_size
    tokens = job.train.batch_size * job.data.max_length
    d = job.draft
    dcfg = _config_for_layers(tc, d.num_layers)
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim"):
        if getattr(d, k) is not None:
            setattr(dcfg, k, getattr(d, k))
    trained = count_params(dcfg)
    dd = dcfg.to_dict()
    teacher = (job.kd.topk * 8) if job.kd.topk else V * 4
    return JobMemory(job.data.max_length, trained, 0, teacher,
                     tokens * (d.num_layers * layer_bytes_per_token(dd) * act + 3 * V * 4))
