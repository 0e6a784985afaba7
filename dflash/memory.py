"""What a DFlash draft costs in memory, for `draftsmith plan`: serving (its parameters and the KV cache of its
layers: one context entry per verified token and layer) and training (the tapped features it reads, and the
activations of every block a row trains at once). The counting rules common to every method live in
memory/serving.py and memory/training.py."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.memory.serving import ArtifactShape, weights_params
from draftsmith.memory.training import JobMemory, layer_bytes_per_token, meta_params
from draftsmith.targets.families import text_config


def shape(path: Path, target_config) -> ArtifactShape:
    """A DFlash draft: its parameters, and a KV cache of its layers (shaped like the target's attention)."""
    c = json.loads((path / "config.json").read_text())
    layer = c.get("layer_config") or {}
    t = text_config(target_config)

    class _Layers:
        num_hidden_layers = c["num_layers"]
        num_attention_heads = layer.get("num_attention_heads", t.num_attention_heads)
        num_key_value_heads = layer.get("num_key_value_heads", getattr(t, "num_key_value_heads", None))
        hidden_size = c.get("hidden_size", t.hidden_size)
        head_dim = layer.get("head_dim", getattr(t, "head_dim", None))

    return ArtifactShape("dflash", weights_params(path), _Layers(), c["num_layers"])


def job_memory(job, target_config, act: int, learned: int | None = None) -> JobMemory:
    """`Method.train_memory` of a DFlash job: per row, `anchors_per_row` blocks of `block_size` queries over the
    row's context keys, through `num_layers` layers, and their logits over the full vocabulary (or the draft's
    reduced one, `draft_vocab_size`). The anchors are drawn from the learned positions, whatever their number:
    `learned` changes nothing."""
    from draftsmith.dflash.job import default_layers
    from draftsmith.dflash.model import DFlashConfig, DFlashDraft, layer_config_dict

    tc = text_config(target_config)
    H, V, L, B, T = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, job.train.batch_size, job.max_length
    layers = list(job.target_layers or default_layers(L, job.num_layers))
    N = job.draft_vocab_size
    cfg = DFlashConfig(H, V, layers, job.num_layers, job.block_size, 0, layer_config_dict(target_config), N)
    trained = meta_params(lambda: DFlashDraft(cfg))
    keep = len(layers) * H * act + (H * act if job.loss == "kd" else 0)  # tapped layers (+ last hidden for kd)
    queries = job.anchors_per_row * job.block_size  # per row
    lc = cfg.layer_config
    per_query = layer_bytes_per_token(lc) * act * job.num_layers + 2 * (N or V) * 4  # + logits, softmax, fp32
    context_kv = 2 * T * lc["num_key_value_heads"] * lc["head_dim"] * act * job.num_layers  # per row
    scores = lc["num_attention_heads"] * queries * (T + queries) * act * job.num_layers  # attention, per row
    return JobMemory(T, trained, keep, 0, B * (queries * per_query + context_kv + scores))
