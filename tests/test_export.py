"""Export: key names and shapes pinned per format, verification catches broken exports, round trips,
transformers assisted generation and speculators loading as real consumers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import artifact
from draftsmith.errors import ConfigError
from draftsmith.export.api import export_artifact, import_export, verify_export
from draftsmith.layouts.verify import VerificationError, read_header

H, NH, NKV, HD, INTER = 64, 4, 2, 16, 128


@pytest.fixture(scope="module")
def deep_target(tiny_tokenizer, tmp_path_factory):
    """A 4-layer tiny target: EAGLE-3 needs three distinct feature layers."""

    from tiny_models import make_target

    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("deep_target"))


# --- artifact builders (tiny) ------------------------------------------------------------------------
def make_draft_artifact(target, path):
    """A layer-truncated copy of the target (1 of 2 layers + embeddings + norm + lm_head)."""
    from transformers import LlamaForCausalLM

    cfg = target.model.config.to_dict()
    cfg["num_hidden_layers"] = 1
    cfg.pop("layer_types", None)
    from transformers import LlamaConfig

    draft = LlamaForCausalLM(LlamaConfig(**cfg))
    sd = {k: v for k, v in target.model.state_dict().items() if ".layers.1." not in k}
    draft.load_state_dict(sd, strict=False)
    draft.generation_config = target.model.generation_config
    manifest = artifact.make_manifest("draft", target.fingerprint(), {"builder": "truncated", "layers": 1})

    def writer(tmp):
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)

    return artifact.save_artifact(path, manifest, writer=writer)


def make_medusa_artifact(target, path, share=False, heads=3, layers=1, draft_vocab_size=None):
    from draftsmith.heads.vocab import build_draft_vocab
    from draftsmith.medusa.model import MedusaHeads, MedusaTree

    torch.manual_seed(3)
    vocab = None
    if draft_vocab_size:
        vocab = build_draft_vocab(torch.arange(target.vocab_size) % 13, draft_vocab_size)
    m = MedusaHeads.from_target(target.config, heads, layers, share, lm_head=target.model.lm_head, draft_vocab=vocab)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    manifest = artifact.make_manifest("medusa", target.fingerprint(), {})
    cfg = {"hidden_size": H, "vocab_size": target.vocab_size, "num_heads": heads, "num_layers": layers,
           "share_lm_head": share, "draft_vocab_size": draft_vocab_size}
    tree = MedusaTree([(0,), (1,), (0, 0), (0, 0, 0)])

    def writer(tmp):
        (tmp / "tree.json").write_text(json.dumps(tree.to_json()))

    return artifact.save_artifact(path, manifest, m.state_dict(), cfg, writer=writer)


def eagle_state(version: int, vocab: int, draft_vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return 0.1 * torch.randn(*shape, generator=g)

    first_in = 2 * H if version == 3 else H
    s = {
        "layer.self_attn.q_proj.weight": r(NH * HD, first_in), "layer.self_attn.k_proj.weight": r(NKV * HD, first_in),
        "layer.self_attn.v_proj.weight": r(NKV * HD, first_in), "layer.self_attn.o_proj.weight": r(H, NH * HD),
        "layer.mlp.gate_proj.weight": r(INTER, H), "layer.mlp.up_proj.weight": r(INTER, H),
        "layer.mlp.down_proj.weight": r(H, INTER), "layer.post_attention_layernorm.weight": 1 + r(H),
    }
    if version == 3:
        s.update({"layer.input_layernorm.weight": 1 + r(H), "layer.hidden_norm.weight": 1 + r(H),
                  "fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(draft_vocab, H)})
        keep = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        s["t2d"], s["d2t"] = t2d, keep - torch.arange(draft_vocab)
    else:
        s.update({"fc.weight": r(H, 2 * H), "fc.bias": r(H)})
    return s


def make_eagle_artifact(target, path, version=3, draft_vocab=100, **state_over):
    state = eagle_state(version, target.vocab_size, draft_vocab)
    state.update(state_over)
    cfg = {"version": version, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
           "intermediate_size": INTER, "rms_norm_eps": 1e-5}
    if version == 3:
        cfg["aux_layers"] = [0, 1, -1]  # draftsmith convention: outputs of layers 0, 1 and the last (3)
    manifest = artifact.make_manifest("eagle", target.fingerprint(), {})
    return artifact.save_artifact(path, manifest, state, cfg)


# --- draft models ----------------------------------------------------------------------------------------
def test_draft_export_hf_assisted_generation_matches_target(tiny_target, tmp_path):
    art = make_draft_artifact(tiny_target, tmp_path / "draft")
    res = export_artifact(art, "hf", tmp_path / "out", tiny_target, num_speculative_tokens=3)
    out = res.out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == tiny_target.vocab_size and cfg["num_hidden_layers"] == 1
    assert json.loads((out / "generation_config.json").read_text())["num_assistant_tokens"] == 3
    assert (out / "tokenizer.json").read_bytes() == (tiny_target.folder / "tokenizer.json").read_bytes()
    assert "model.layers.0.self_attn.q_proj.weight" in read_header(out / "model.safetensors")
    assert any("assistant_model" in c for c in res.checks), res.checks
    guard = json.loads((out / "draftsmith.json").read_text())
    assert guard["target"] == tiny_target.fingerprint() and guard["artifact"]["kind"] == "draft"


@pytest.mark.parametrize("stack,needle", [("vllm", '"method": "draft_model"'), ("sglang", "STANDALONE"),
                                          ("trtllm", "decoding_type: DraftTarget")])
def test_draft_export_serve_commands(tiny_target, tmp_path, stack, needle):
    art = make_draft_artifact(tiny_target, tmp_path / "draft")
    res = export_artifact(art, stack, tmp_path / stack, tiny_target, verify=False)
    serve = (res.out / "serve.md").read_text()
    assert needle in serve and str(res.out) in serve
    assert verify_export(res.out)  # spec + tokenizer checks from disk alone


def test_draft_export_catches_renamed_tensor(tiny_target, tmp_path):
    art = make_draft_artifact(tiny_target, tmp_path / "draft")
    out = export_artifact(art, "vllm", tmp_path / "o", verify=False).out
    sd = load_file(out / "model.safetensors")
    sd["model.layers.0.mlp.gate.weight"] = sd.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(sd, out / "model.safetensors")
    with pytest.raises(VerificationError, match=r"missing tensor 'model.layers.0.mlp.gate_proj.weight'.*"
                                                r"unexpected tensor 'model.layers.0.mlp.gate.weight'"):
        verify_export(out)


# --- Medusa ------------------------------------------------------------------------------------------------
def test_medusa_vllm_layout_pinned(tiny_target, tmp_path):
    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    res = export_artifact(art, "vllm", tmp_path / "v", tiny_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 1
    assert cfg["medusa_fc_bias"] is True and cfg["truncated_vocab_size"] == cfg["vocab_size"] == tiny_target.vocab_size
    hdr = read_header(res.out / "model.safetensors")
    assert set(hdr) == {f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias")} | {
        f"lm_heads.{h}.weight" for h in range(3)}
    assert hdr["lm_heads.2.weight"] == ((tiny_target.vocab_size, H), "F32")
    assert '"method": "medusa"' in (res.out / "serve.md").read_text()
    # the draft length is the number of heads: vLLM sizes its Medusa by num_speculative_tokens
    assert '"num_speculative_tokens": 3' in (res.out / "serve.md").read_text()
    assert json.loads((res.out / "draftsmith.json").read_text())["num_speculative_tokens"] == 3


@pytest.mark.parametrize("k", [2, 4])
def test_medusa_vllm_draft_length_other_than_its_heads_is_refused(tiny_target, tmp_path, k):
    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    with pytest.raises(ConfigError, match=f"num_heads is 3 but num_speculative_tokens {k}"):
        export_artifact(art, "vllm", tmp_path / "v", tiny_target, num_speculative_tokens=k)
    assert not (tmp_path / "v").exists()


def test_medusa_vllm_shared_lm_head_is_one_copy_with_original_lm_head(tiny_target, tmp_path):
    """Heads on the target's own lm_head: vLLM's `original_lm_head` reads lm_heads.0 into one lm_head for all
    heads, so it is written once (not K copies of a vocabulary-sized matrix), and reads back into every head."""
    from draftsmith.medusa.model import load_medusa

    art = make_medusa_artifact(tiny_target, tmp_path / "m", share=True)
    res = export_artifact(art, "vllm", tmp_path / "v", tiny_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["original_lm_head"] is True
    t = load_file(res.out / "model.safetensors")
    assert [k for k in t if k.startswith("lm_heads.")] == ["lm_heads.0.weight"]
    assert torch.equal(t["lm_heads.0.weight"], tiny_target.model.lm_head.weight)
    back = import_export(res.out, tmp_path / "back")
    h0, _, _ = load_medusa(art, tiny_target)
    h1, _, _ = load_medusa(back, tiny_target)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(h0(x), h1(x))  # one shared product vs one per head: rounding apart
    bad = json.loads((res.out / "config.json").read_text())
    bad["original_lm_head"] = False  # then vLLM would leave lm_heads.1.. at random init: verification says so
    (res.out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(VerificationError, match="missing tensor 'lm_heads.1.weight'"):
        verify_export(res.out)


def test_medusa_trtllm_layout_shared_lm_head_and_tree(tiny_target, tmp_path):
    art = make_medusa_artifact(tiny_target, tmp_path / "m", share=True, layers=2)
    res = export_artifact(art, "trtllm", tmp_path / "t", tiny_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert {cfg["medusa_num_heads"], cfg["medusa_num_layers"]} == {3, 2}
    t = load_file(res.out / "medusa_lm_head.safetensors")
    assert set(t) == {f"{h}.{ell}.linear.{p}" for h in range(3) for ell in range(2) for p in ("weight", "bias")} | {
        f"{h}.2.weight" for h in range(3)}
    for h in range(3):  # share_lm_head: the target's lm_head written into every head
        assert torch.equal(t[f"{h}.2.weight"], tiny_target.model.lm_head.weight)
    serve = (res.out / "serve.md").read_text()
    assert "--speculative_decoding_mode medusa" in serve and "--medusa_choices='[[0], [1], [0, 0], [0, 0, 0]]'" in serve
    assert "does not serve Medusa" in serve  # the PyTorch backend refuses Medusa: the engine flow is given


def test_medusa_sglang_refused(tiny_target, tmp_path):
    from draftsmith.errors import ConfigError

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    with pytest.raises(ConfigError, match="SGLang has no Medusa"):
        export_artifact(art, "sglang", tmp_path / "s", tiny_target)


@pytest.mark.parametrize("stack", ["vllm", "trtllm"])
def test_medusa_round_trip_same_weights_same_predictions(tiny_target, tmp_path, stack):
    from draftsmith.medusa.model import load_medusa

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    out = export_artifact(art, stack, tmp_path / "x", tiny_target).out
    back = import_export(out, tmp_path / "back")
    h0, tree0, _ = load_medusa(art, tiny_target)
    h1, tree1, _ = load_medusa(back, tiny_target)
    s0, s1 = h0.state_dict(), h1.state_dict()
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert tree0.paths == tree1.paths
    x = torch.randn(2, 5, H)
    assert torch.equal(h0(x), h1(x))


def test_medusa_draft_vocabulary_goes_to_vllm_as_a_token_map_and_back(tiny_target, tmp_path):
    from draftsmith.medusa.model import load_medusa

    art = make_medusa_artifact(tiny_target, tmp_path / "m", draft_vocab_size=40)
    res = export_artifact(art, "vllm", tmp_path / "v", tiny_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["truncated_vocab_size"] == 40 and cfg["vocab_size"] == tiny_target.vocab_size
    t = load_file(res.out / "model.safetensors")
    h0, _, _ = load_medusa(art, tiny_target)
    assert t["lm_heads.0.weight"].shape == (40, H)
    assert torch.equal(t["token_map"], torch.nonzero(h0.t2d).flatten())  # row r scores target id token_map[r]
    assert "d2t" not in t and "t2d" not in t
    # what vLLM does with it: scatter each head's 40 logits into the full vocabulary, -inf elsewhere
    x = torch.randn(3, H)
    full = torch.full((3, tiny_target.vocab_size), float("-inf"))
    full[:, t["token_map"]] = h0.head_logits(0, x)
    assert torch.equal(full.argmax(-1), h0.to_target(h0.head_logits(0, x).argmax(-1)))
    back = import_export(res.out, tmp_path / "back")
    h1, _, _ = load_medusa(back, tiny_target)
    s0, s1 = h0.state_dict(), h1.state_dict()
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    # a token map with the wrong length is caught by the verifier
    t["token_map"] = t["token_map"][:39].contiguous()
    save_file(t, res.out / "model.safetensors")
    with pytest.raises(VerificationError, match="token_map"):
        verify_export(res.out)
    with pytest.raises(ConfigError, match="no token map"):  # TensorRT-LLM's layout has none
        export_artifact(art, "trtllm", tmp_path / "t", tiny_target)


def test_medusa_wrong_shape_caught(tiny_target, tmp_path):
    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    out = export_artifact(art, "vllm", tmp_path / "v", verify=False).out
    sd = load_file(out / "model.safetensors")
    sd["blocks.1.layers.0.weight"] = sd["blocks.1.layers.0.weight"][:, :32].contiguous()
    save_file(sd, out / "model.safetensors")
    with pytest.raises(VerificationError,
                       match=r"'blocks.1.layers.0.weight' has shape \[64, 32\], expected \[64, 64\]"):
        verify_export(out)


# --- EAGLE ------------------------------------------------------------------------------------------------
def test_eagle3_speculators_layout_and_layer_ids(deep_target, tmp_path):
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    res = export_artifact(art, "vllm", tmp_path / "v", deep_target)
    cfg = json.loads((res.out / "config.json").read_text())
    hdr = read_header(res.out / "model.safetensors")
    assert hdr["layers.0.self_attn.q_proj.weight"] == ((NH * HD, 2 * H), "F32")
    assert hdr["fc.weight"] == ((H, 3 * H), "F32") and hdr["lm_head.weight"] == ((100, H), "F32")
    assert hdr["d2t"] == ((100,), "I64") and hdr["t2d"] == ((deep_target.vocab_size,), "BOOL")
    assert "layers.0.hidden_norm.weight" in hdr and not any(k.startswith("midlayer.") for k in hdr)
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(deep_target.folder)
    ds = json.loads((res.out / "draftsmith.json").read_text())["eagle"]["aux_layers_draftsmith"]
    assert ds == [0, 1, 3]  # [0, 1, -1] resolved on the 4-layer target
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM id = draftsmith id + 1
    assert '"method": "eagle3"' in (res.out / "serve.md").read_text()


def test_eagle_head_with_a_non_llama_layer_is_refused(deep_target, tmp_path):
    """The stacks' EAGLE drafters are Llama layers: a head trained with a Gemma 3 layer cannot be served."""
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    cfg = json.loads((art / "config.json").read_text())
    cfg["layer_config"] = {"model_type": "gemma3_text"}
    (art / "config.json").write_text(json.dumps(cfg))
    for stack in ("vllm", "sglang", "trtllm", "hf"):
        with pytest.raises(ConfigError, match="draft_layer: llama"):
            export_artifact(art, stack, tmp_path / stack, deep_target)


@pytest.mark.parametrize("stack", ["sglang", "trtllm"])
def test_eagle3_midlayer_layout(deep_target, tmp_path, stack):
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    res = export_artifact(art, stack, tmp_path / stack, deep_target)
    cfg = json.loads((res.out / "config.json").read_text())
    hdr = read_header(res.out / "model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in hdr and "midlayer.hidden_norm.weight" in hdr
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 100
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"
    ds = json.loads((res.out / "draftsmith.json").read_text())["eagle"]["aux_layers_draftsmith"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ds  # SGLang/TRT-LLM: output-of-layer ids
    serve = (res.out / "serve.md").read_text()
    assert ("--speculative-algorithm EAGLE3" in serve) if stack == "sglang" else ("decoding_type: Eagle3" in serve)


def test_eagle3_full_vocab_has_no_maps(deep_target, tmp_path):
    V = deep_target.vocab_size
    art = make_eagle_artifact(deep_target, tmp_path / "e", draft_vocab=V)
    res = export_artifact(art, "sglang", tmp_path / "s", deep_target)
    assert "d2t" not in read_header(res.out / "model.safetensors")


def test_eagle3_d2t_off_by_one_caught(deep_target, tmp_path):
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    out = export_artifact(art, "sglang", tmp_path / "s", verify=False).out
    sd = load_file(out / "model.safetensors")
    sd["d2t"] = sd["d2t"] + 1
    save_file(sd, out / "model.safetensors")
    with pytest.raises(VerificationError, match="d2t is inconsistent with t2d"):
        verify_export(out)


def test_eagle1_bias_per_stack(deep_target, tmp_path):
    from draftsmith.errors import ConfigError

    art = make_eagle_artifact(deep_target, tmp_path / "e1", version=1)
    sg = export_artifact(art, "sglang", tmp_path / "sg", deep_target).out
    hdr = read_header(sg / "model.safetensors")
    assert "fc.bias" in hdr and "layers.0.input_layernorm.weight" not in hdr
    with pytest.raises(ConfigError, match="non-zero fc.bias"):
        export_artifact(art, "vllm", tmp_path / "v", deep_target)
    art0 = make_eagle_artifact(deep_target, tmp_path / "e0", version=1, **{"fc.bias": torch.zeros(H)})
    v = export_artifact(art0, "vllm", tmp_path / "v0", deep_target).out
    assert "fc.bias" not in read_header(v / "model.safetensors")
    # a missing fc bias where SGLang requires one is caught
    sd = load_file(sg / "model.safetensors")
    del sd["fc.bias"]
    save_file(sd, sg / "model.safetensors")
    with pytest.raises(VerificationError, match="missing tensor 'fc.bias'"):
        verify_export(sg)


@pytest.mark.parametrize("stack", ["vllm", "sglang"])
def test_eagle3_round_trip_same_weights(deep_target, tmp_path, stack):
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    out = export_artifact(art, stack, tmp_path / "x", deep_target).out
    back = import_export(out, tmp_path / "back")
    _, s0 = artifact.load_artifact(art, "eagle", deep_target)
    _, s1 = artifact.load_artifact(back, "eagle", deep_target)
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["aux_layers"] == json.loads((out / "draftsmith.json").read_text())["eagle"]["aux_layers_draftsmith"]


# --- EAGLE-3.1 in the midlayer layout: the keys and tensors SGLang's and TensorRT-LLM's loaders read ------------
def make_eagle31_artifact(target, path, **switches):
    """An EAGLE-3 head with EAGLE-3.1's switches (`fc_norm`: one norm per fused layer, `norm_before_fc`: one over
    their concatenation, `norm_output`: no tensor of its own) and `norm_before_residual`; its norms are away from
    one, so a norm a stack dropped would show."""
    g = torch.Generator().manual_seed(6)
    state = eagle_state(3, target.vocab_size, 100)
    if switches.get("fc_norm"):
        state.update({f"fc_norm.{i}.weight": 1 + 0.1 * torch.randn(H, generator=g) for i in range(3)})
    if switches.get("norm_before_fc"):
        state["input_norm.weight"] = 1 + 0.1 * torch.randn(3 * H, generator=g)
    cfg = {"version": 3, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
           "intermediate_size": INTER, "rms_norm_eps": 1e-5, "aux_layers": [0, 1, -1],
           **{k: bool(switches.get(k)) for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")}}
    return artifact.save_artifact(path, artifact.make_manifest("eagle", target.fingerprint(), {}), state, cfg)


@pytest.mark.parametrize("stack", ["sglang", "trtllm"])
def test_eagle31_fc_norm_and_norm_output_in_the_keys_the_loaders_read(deep_target, tmp_path, stack):
    """SGLang's llama_eagle3.py and TensorRT-LLM's Eagle3DraftModel read `fc_norm` and `norm_output` at the top of
    config.json (both off when absent) and build one RMSNorm per fused layer, `fc_norm.k.weight` [target hidden];
    the export writes exactly that, the verifier reads it back, and import-export restores the same head."""
    art = make_eagle31_artifact(deep_target, tmp_path / "e", fc_norm=True, norm_output=True)
    res = export_artifact(art, stack, tmp_path / stack, deep_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_fc"]) == (True, True, False)
    assert cfg["eagle_config"]["norm_before_fc"] is False  # where TensorRT-LLM reads the single norm's switch
    hdr = read_header(res.out / "model.safetensors")
    assert [hdr.get(f"fc_norm.{i}.weight") for i in range(3)] == [((H,), "F32")] * 3
    assert "input_norm.weight" not in hdr and "midlayer.hidden_norm.weight" in hdr
    assert any("tensors match the eagle3-midlayer spec" in c for c in res.checks), res.checks
    serve = (res.out / "serve.md").read_text()
    assert ("PR #24663" in serve) if stack == "sglang" else ("PR #14988" in serve)
    back = import_export(res.out, tmp_path / "back")
    _, s0 = artifact.load_artifact(art, "eagle", deep_target)
    _, s1 = artifact.load_artifact(back, "eagle", deep_target)
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    acfg = json.loads((back / "config.json").read_text())
    assert (acfg["fc_norm"], acfg["norm_output"], acfg["norm_before_fc"]) == (True, True, False)


def test_eagle31_norm_before_fc_exports_for_trtllm_and_is_refused_for_sglang(deep_target, tmp_path):
    """TensorRT-LLM reads the single norm over the concatenated features (`input_norm.weight` [3 H]) when
    `eagle_config.norm_before_fc` is set; SGLang's loader builds no such norm and would drop the tensor silently."""
    art = make_eagle31_artifact(deep_target, tmp_path / "e", norm_before_fc=True)
    res = export_artifact(art, "trtllm", tmp_path / "t", deep_target)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["eagle_config"]["norm_before_fc"] is True and cfg["norm_before_fc"] is True
    assert cfg["fc_norm"] is False and cfg["norm_output"] is False
    assert read_header(res.out / "model.safetensors")["input_norm.weight"] == ((3 * H,), "F32")
    with pytest.raises(ConfigError, match="EAGLE-3.1 head \\(norm_before_fc\\).*sglang") as e:
        export_artifact(art, "sglang", tmp_path / "s", deep_target)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_trtllm_refuses_norm_before_residual(deep_target, tmp_path):
    """TensorRT-LLM's EAGLE-3 layer keeps the un-normalised feature as its residual, as SGLang's does."""
    art = make_eagle31_artifact(deep_target, tmp_path / "e", norm_before_residual=True)
    for stack, name in (("trtllm", "TensorRT-LLM"), ("sglang", "SGLang")):
        with pytest.raises(ConfigError, match=f"norm_before_residual: true, which {name}'s EAGLE-3 layer"):
            export_artifact(art, stack, tmp_path / stack, deep_target)


def test_eagle31_midlayer_keys_are_verified(deep_target, tmp_path):
    """What a loader would read otherwise than trained is caught on re-reading: a switch left out (the loader's
    default is off), a norm tensor the config does not ask for (dropped silently), a missing one (left at its
    init), and TensorRT-LLM's `eagle_config.norm_before_fc` disagreeing with the top-level switch."""
    art = make_eagle31_artifact(deep_target, tmp_path / "e", fc_norm=True, norm_output=True)
    out = export_artifact(art, "sglang", tmp_path / "s", deep_target).out
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("fc_norm", "norm_output"):
        path.write_text(json.dumps({k: v for k, v in cfg.items() if k != key}))
        with pytest.raises(VerificationError, match=f"config lacks {key}"):
            verify_export(out)
    path.write_text(json.dumps({**cfg, "fc_norm": False}))
    with pytest.raises(VerificationError, match="unexpected tensor 'fc_norm.0.weight'"):
        verify_export(out)
    path.write_text(json.dumps(cfg))
    sd = load_file(out / "model.safetensors")
    del sd["fc_norm.1.weight"]
    save_file(sd, out / "model.safetensors")
    with pytest.raises(VerificationError, match="missing tensor 'fc_norm.1.weight'"):
        verify_export(out)
    art = make_eagle31_artifact(deep_target, tmp_path / "e2", norm_before_fc=True)
    out = export_artifact(art, "trtllm", tmp_path / "t", deep_target).out
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerificationError, match="eagle_config.norm_before_fc False != norm_before_fc True"):
        verify_export(out)


def test_eagle3_speculators_loads_and_runs(deep_target, tmp_path):
    pytest.importorskip("speculators")
    art = make_eagle_artifact(deep_target, tmp_path / "e")
    res = export_artifact(art, "vllm", tmp_path / "v", deep_target)
    assert any(c.startswith("speculators") for c in res.checks), res.checks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eagle3_half_precision_head_exports_and_speculators_runs_it(deep_target, tmp_path, dtype):
    """A bf16 / fp16 head (the shipped zoo head is bf16) exports verified: speculators runs it in its own dtype."""
    pytest.importorskip("speculators")
    state = {k: (v.to(dtype) if v.is_floating_point() else v)
             for k, v in eagle_state(3, deep_target.vocab_size, 100).items()}
    art = make_eagle_artifact(deep_target, tmp_path / "e", **state)
    res = export_artifact(art, "vllm", tmp_path / "v", deep_target)
    assert any(c.startswith("speculators") for c in res.checks), res.checks
    assert (read_header(res.out / "model.safetensors")["fc.weight"][1]
            == {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype])
    assert json.loads((res.out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")


# --- compatibility guard and CLI -----------------------------------------------------------------------
def test_guard_readable_by_check_and_refuses_other_target(tiny_target, other_target, tmp_path):
    from draftsmith.checks import read_fingerprint
    from draftsmith.errors import FingerprintMismatch

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    out = export_artifact(art, "vllm", tmp_path / "v", tiny_target).out
    fp, source = read_fingerprint(out)
    assert source == "manifest.json" or source == "draftsmith.json"
    assert fp == tiny_target.fingerprint()
    assert not (out / "manifest.json").exists()  # the guard is the export's only fingerprint file
    with pytest.raises(FingerprintMismatch):
        export_artifact(art, "vllm", tmp_path / "w", other_target)


def test_cli_export(tiny_target, tmp_path, capsys):
    from draftsmith.cli import main

    art = make_medusa_artifact(tiny_target, tmp_path / "m")
    rc = main(["export", "--artifact", str(art), "--to", "trtllm", "--out", str(tmp_path / "c"),
               "--target", str(tiny_target.folder)])
    assert rc == 0, capsys.readouterr().err
    assert "verified:" in capsys.readouterr().out
    rc = main(["export", "--artifact", str(tmp_path / "nope"), "--to", "vllm", "--out", str(tmp_path / "d"),
               "--target", str(tiny_target.folder)])
    assert rc == 2


@pytest.mark.parametrize("version", [3, 1])
def test_heads_eagle_artifact_exports_everywhere(deep_target, tmp_path, version):
    """Artifacts saved the way eagle/job.py saves them export to every stack that takes them."""
    from dataclasses import asdict

    eagle_mod = pytest.importorskip("draftsmith.eagle.model")
    vocab = None
    if version == 3:
        counts = torch.bincount(torch.randint(0, deep_target.vocab_size, (2000,)), minlength=deep_target.vocab_size)
        from draftsmith.heads.vocab import build_draft_vocab

        vocab = build_draft_vocab(counts, 64)
    layers = [0, 1, 3] if version == 3 else None  # the default on 4 layers repeats one (reported)
    head = eagle_mod.EagleHead.from_target(deep_target.model, version=version, target_layers=layers, draft_vocab=vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01)
    cfg = {**asdict(head.config)}
    art = artifact.save_artifact(tmp_path / "a", artifact.make_manifest("eagle", deep_target.fingerprint(), cfg),
                                 dict(head.state_dict()), cfg)
    stacks = ["vllm", "sglang", "trtllm"] + (["hf"] if version == 3 else [])
    for stack in stacks:
        if version == 1 and stack == "vllm":
            continue  # fc.bias is non-zero here: vLLM refuses (tested above)
        res = export_artifact(art, stack, tmp_path / stack, deep_target)
        back = import_export(res.out, tmp_path / f"back-{stack}")
        _, s0 = artifact.load_artifact(art, "eagle")
        _, s1 = artifact.load_artifact(back, "eagle")
        s0 = {k: v for k, v in s0.items() if "embed_tokens" not in k}
        assert s0.keys() == s1.keys(), (stack, s0.keys() ^ s1.keys())
        assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_a_head_built_by_speculators_imports_and_warm_starts_training(deep_target, tmp_path):
    """An EAGLE-3 head the speculators package built and saved itself (no draftsmith.json): import-export reads
    it into an artifact that loads (its vLLM layer ids 1, 2, 3 become draftsmith's 0, 1, 2) with speculators'
    exact tensors, and training warm-started from it begins at those tensors."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel
    from tiny_models import prompt_rows
    from transformers import LlamaConfig

    from draftsmith.eagle.export import canonical_name
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.eagle.model import load_eagle
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import train
    from draftsmith.training.config import TrainConfig

    V, N = deep_target.vocab_size, 100
    g = torch.Generator().manual_seed(4)
    keep = torch.randperm(V, generator=g)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    layer = LlamaConfig(**{**deep_target.config.to_dict(), "num_hidden_layers": 1, "tie_word_embeddings": False})
    torch.manual_seed(4)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=keep - torch.arange(N), verifier_name_or_path=str(deep_target.folder),
        target_layer_ids=[1, 2, 3], draft_attn_impl="sdpa", draft_vocab_size=N, norm_before_residual=False, ttt_steps=2)
    with torch.no_grad():  # speculators starts its norms at one: move them, so a norm left at init would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "speculators")
    theirs = {canonical: t for n, t in model.state_dict().items()
              if (canonical := canonical_name(n)) is not None and not canonical.startswith("?")}

    art = import_export(tmp_path / "speculators", tmp_path / "imported", fingerprint=deep_target.fingerprint())
    head, _ = load_eagle(art, deep_target)
    assert head.config.target_layers == [0, 1, 2] and head.config.draft_vocab_size == N
    ours = head.state_dict()
    assert theirs.keys() <= ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)

    rows = prompt_rows(deep_target, tmp_path, ["What is the capital of France?", "def add(a, b):"])

    def run(name: str, warm: str | None) -> dict[str, torch.Tensor]:
        tc = TrainConfig(lr=1e-12, max_steps=1, batch_size=1, warmup_steps=0, output_dir=str(tmp_path / f"{name}-run"),
                         resume="never", progress=False, eval_every=0, eval_batches=1, warm_start=warm)
        cfg = EagleJobConfig(target=str(deep_target.folder), data="in-memory", output=str(tmp_path / name),
                             version="eagle3", target_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=N, max_length=64,
                             train=tc, evaluate=EvalAfterTraining(enabled=False))
        out = Path(train(EagleJob(cfg, deep_target, rows), tc).artifact)
        return load_eagle(out, deep_target)[0].state_dict()

    warm, cold = run("warm", str(art)), run("cold", None)
    for k in theirs:  # one step at lr 1e-12 leaves the warm start's weights where speculators put them
        torch.testing.assert_close(warm[k], theirs[k], rtol=0, atol=1e-6)
    assert not torch.allclose(cold["fc.weight"], theirs["fc.weight"])  # a cold start does not, so the check can fail
