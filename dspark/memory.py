"""What a DSpark draft costs in memory, for `draftsmith plan`: DFlash's count (dflash/memory.py: its parameters,
its layers' KV cache, the blocks a row trains) plus the two heads: the Markov head's V·r + N·r parameters and,
in training, a second set of logits per learned slot (the corrected ones beside the base ones)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from draftsmith.dflash.memory import job_memory as backbone_job_memory
from draftsmith.dflash.memory import shape as backbone_shape
from draftsmith.memory.serving import ArtifactShape
from draftsmith.memory.training import JobMemory
from draftsmith.targets.families import text_config


def shape(path: Path, target_config) -> ArtifactShape:
    """DFlash's shape (the parameters come from the weights file, the heads' included), as a DSpark draft."""
    return dataclasses.replace(backbone_shape(path, target_config), kind="dspark")


def job_memory(job, target_config, act: int, learned: int | None = None) -> JobMemory:
    """`Method.train_memory`: DFlash's job, plus the Markov head's parameters, and per query the corrected logits
    (float32, with their softmax) beside the base ones; with `confidence_target: overlap`, the target's last hidden
    state kept (if `loss: kd` has not) and its full-vocabulary log-probabilities per query (float32)."""
    base = backbone_job_memory(job, target_config, act, learned)
    tc = text_config(target_config)
    V, H, B = tc.vocab_size, tc.hidden_size, job.train.batch_size
    N = job.draft_vocab_size or V
    r = job.markov_rank
    heads = V * r + N * r + (H + r + 1 if job.confidence_head else 0)
    queries = job.anchors_per_row * job.block_size
    overlap = job.confidence_target == "overlap"
    keep = base.keep + (H * act if overlap and job.loss != "kd" else 0)
    return dataclasses.replace(base, trained=base.trained + heads, keep=keep,
                               module_act=base.module_act + B * queries * (2 * N * 4 + r * act + overlap * V * 4))
