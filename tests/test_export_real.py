"""Real-model export checks on smollm2-135m: a layer-truncated draft runs as transformers' assistant_model
with output identical to the target's greedy output; a freshly initialised EAGLE-3 head exported in the
speculators format loads in speculators (skipped without it) and runs a forward pass."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith import artifact
from draftsmith.errors import ConfigError
from draftsmith.export.api import export_artifact
from draftsmith.layouts.verify import read_header

pytestmark = pytest.mark.real


def test_real_draft_assisted_generation(real_target, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    t = real_target
    cfg = AutoConfig.from_pretrained(t.folder)
    cfg.num_hidden_layers = 2  # first 2 layers + embeddings + norm + lm_head
    cfg.layer_types = None
    draft = AutoModelForCausalLM.from_config(cfg)
    sd = {k: v for k, v in t.model.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    manifest = artifact.make_manifest("draft", t.fingerprint(), {"builder": "truncated", "layers": 2})

    def writer(tmp):
        draft.save_pretrained(tmp)
        t.tokenizer.save_pretrained(tmp)

    art = artifact.save_artifact(tmp_path / "draft", manifest, writer=writer)
    res = export_artifact(art, "hf", tmp_path / "hf", t, num_speculative_tokens=4)
    assert any("assistant_model" in c for c in res.checks), res.checks
    print("\n".join(res.checks))


def test_real_eagle3_speculators(real_target, tmp_path):
    pytest.importorskip("speculators")
    t = real_target
    c = t.text_config
    H, inter, nh, nkv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    hd, N, V = H // nh, 8192, t.vocab_size
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return 0.02 * torch.randn(*shape, generator=g)

    keep = torch.randperm(V, generator=g)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    state = {
        "layer.self_attn.q_proj.weight": r(nh * hd, 2 * H), "layer.self_attn.k_proj.weight": r(nkv * hd, 2 * H),
        "layer.self_attn.v_proj.weight": r(nkv * hd, 2 * H), "layer.self_attn.o_proj.weight": r(H, nh * hd),
        "layer.mlp.gate_proj.weight": r(inter, H), "layer.mlp.up_proj.weight": r(inter, H),
        "layer.mlp.down_proj.weight": r(H, inter),
        "layer.input_layernorm.weight": torch.ones(H), "layer.post_attention_layernorm.weight": torch.ones(H),
        "layer.hidden_norm.weight": torch.ones(H), "fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H),
        "lm_head.weight": t.model.lm_head.weight.detach()[keep].clone(), "d2t": keep - torch.arange(N), "t2d": t2d,
    }
    cfg = {"version": 3, "aux_layers": [2, 15, 27], "norm_before_residual": True}
    art = artifact.save_artifact(tmp_path / "eagle", artifact.make_manifest("eagle", t.fingerprint(), cfg),
                                 state, cfg)
    res = export_artifact(art, "vllm", tmp_path / "vllm", t)
    config = json.loads((res.out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 16, 28]
    assert read_header(res.out / "model.safetensors")["lm_head.weight"] == ((N, H), "F32")
    assert any(x.startswith("speculators") for x in res.checks), res.checks
    print("\n".join(res.checks))
    with pytest.raises(ConfigError, match="norm_before_residual: true"):  # SGLang's layer would not honour it
        export_artifact(art, "sglang", tmp_path / "sglang", t)
    cfg["norm_before_residual"] = False
    art = artifact.save_artifact(tmp_path / "eagle-nbr-off", artifact.make_manifest("eagle", t.fingerprint(), cfg),
                                 state, cfg)
    sg = export_artifact(art, "sglang", tmp_path / "sglang", t)
    assert (json.loads((sg.out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            == [2, 15, 27])
