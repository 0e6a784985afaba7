"""What an EAGLE head costs in memory, for `draftsmith plan`: serving (its parameters and the KV cache of its one
decoder layer) and training (the captured features it reads, the teacher logits on its vocabulary, and
the activations of its training-time-test steps). The counting rules common to every method live in
memory/serving.py and memory/training.py."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.memory.serving import ArtifactShape, weights_params
from draftsmith.memory.training import JobMemory, layer_bytes_per_token, meta_params
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


def job_memory(job, target_config, act: int, learned: int | None = None) -> JobMemory:
    """`Method.train_memory` of an EAGLE job whose planned row has `learned` loss positions at its end (None: all
    of its max_length). Step 0 runs every position (its keys are the context); steps >= 1 run only from the
    first learned position on (EagleHead.forward skips the bases left of it), and every step's logits are
    taken at the learned positions alone."""
    from draftsmith.eagle.model import EagleConfig, EagleHead, layer_config_dict
    from draftsmith.eagle.variants import variant

    tc = text_config(target_config)
    H, V, L, B, T = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, job.train.batch_size, job.max_length
    v = variant(job.version)
    layers = list(job.target_layers or v.default_layers(L))
    n = job.draft_vocab_size if v.draft_vocab else V
    cfg = EagleConfig(v.number, H, V, layers, n if v.draft_vocab else None, job.steps,
                      norm_before_fc=job.norm_before_fc, fc_norm=job.fc_norm, norm_output=job.norm_output,
                      layer_config=layer_config_dict(target_config, job.draft_layer))
    trained = meta_params(lambda: EagleHead(cfg))
    steps = job.steps
    A = min(learned or T, T)  # the bases steps >= 1 run on, and the positions whose logits are taken
    keep = (len(layers) + v.capture()["last_hidden"]) * H * act  # captured features (+ last hidden)
    teacher = n * 4  # the target's logits on the predicted vocabulary, fp32
    lc = cfg.layer_config
    per_base = layer_bytes_per_token(lc, attn_in=v.attention_width(H)) * act + H * act
    # fp32 logits and their softmax, per learned position and step; LK adds the target's probabilities there
    logits = (2 + (job.objective != "kl")) * n * 4
    # the TTT masks: step 0 [T, T], step j >= 1 [A, T + j·A] (its queries over [K^0 | ... | K^j]); quadratic in
    # the row's length, which is what long rows pay for first
    mask = (T * T + sum(A * (T + j * A) for j in range(1, steps))) * act * B
    return JobMemory(T, trained, keep, teacher,
                     B * ((T + (steps - 1) * A) * per_base + steps * A * logits) + mask)
