"""What an EAGLE head costs in memory, for `draftsmith plan`: serving (its parameters and the KV cache of its one
decoder layer) and training (the captured features it reads, the teacher logits on its vocabulary, and
the activations of its training-time-test steps). The counting rules common to every method live in
planning/memory.py and planning/train_memory.py."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.planning.memory import ArtifactShape, weights_params
from draftsmith.planning.train_memory import JobMemory, layer_bytes_per_token, meta_params
from draftsmith.targets.families import text_config


def shape(path: Path, target_config) -> ArtifactShape:
    """An EAGLE head: its parameters, and the KV cache of its one decoder layer."""
    c = json.loads((path / "config.json").read_text())
    t = text_config(target_config)

    class _Layer:  # one decoder layer of the head, attention shaped like the target's (or its own config)
        num_hidden_layers = 1
        num_attention_heads = c.get("num_attention_heads", t.num_attention_heads)
        num_key_value_heads = c.get("num_key_value_heads", getattr(t, "num_key_value_heads", None))
        hidden_size = c.get("hidden_size", t.hidden_size)
        head_dim = c.get("head_dim", getattr(t, "head_dim", None))

    return ArtifactShape("eagle", weights_params(path), _Layer(), 1)


def job_memory(job, target_config, act: int) -> JobMemory:
    """`Method.train_memory` of an EAGLE job."""
    from draftsmith.eagle.model import EagleConfig, EagleHead, layer_config_dict
    from draftsmith.eagle.variants import variant

    tc = text_config(target_config)
    H, V, L, B, T = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, job.train.batch_size, job.max_length
    tokens = B * T
    v = variant(job.version)
    layers = list(job.target_layers or v.default_layers(L))
    n = job.draft_vocab_size if v.draft_vocab else V
    cfg = EagleConfig(v.number, H, V, layers, n if v.draft_vocab else None, job.ttt_steps,
                      norm_before_fc=job.norm_before_fc, fc_norm=job.fc_norm, norm_output=job.norm_output,
                      layer_config=layer_config_dict(target_config, job.draft_layer))
    trained = meta_params(lambda: EagleHead(cfg))
    steps = job.ttt_steps
    keep = (len(layers) + v.capture()["last_hidden"]) * H * act  # captured features (+ last hidden)
    teacher = n * 4  # the target's logits on the predicted vocabulary, fp32
    lc = cfg.layer_config
    per_step = layer_bytes_per_token(lc, attn_in=v.attention_width(H)) * act + H * act + 2 * n * 4
    mask = steps * (steps + 1) // 2 * T * T * act * B  # the TTT masks over [K^0 | ... | K^j]
    return JobMemory(T, trained, keep, teacher, tokens * per_step * steps + mask)
