"""Mixture-of-experts targets beyond what every family goes through (tests/test_families.py trains, decodes and
exports every method on them): on the tiny Qwen3-MoE, gpt-oss, Llama 4 text and DeepSeek-V3 targets, the batched
data engine writes the rows transformers' own greedy `generate` writes and captures what a teacher-forced forward
computes, and greedy speculative decoding equals `generate`, past gpt-oss's sliding window and Llama 4's attention
chunk, with a chain and with a tree (DeepSeek-V3's latent attention caches a latent and a shared rotated key, not
per-head K and V); the memory plan counting every expert as weights and the routed ones as compute, on the
published shapes (configs built offline, nothing downloaded).
"""

from __future__ import annotations

import pytest
import torch
from test_decoding import TreeStub
from tiny_models import MOE_FAMILY_NAMES, build_tiny_family, plain_linears_one_thread

WINDOW = 16  # gpt-oss's sliding window and Llama 4's attention chunk in the tiny configs
NEW = 40  # tokens written past a 10-token prompt: the context runs past the window twice


@pytest.fixture(autouse=True)
def _plain_linears():
    with plain_linears_one_thread():
        yield


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_speculative_greedy_is_transformers_greedy_past_the_window(family, tiny_tokenizer, tmp_path):
    """A chain and a tree (top-2 children drafted by the target itself, so most nodes are accepted and the
    verified block sits past the window) give the tokens HF generate gives; where the target has windowed
    layers, the window changes what it writes, so a verifier attending past it would be caught."""
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family(family, tiny_tokenizer, tmp_path / family)))
    model = target.model
    prompt = torch.randint(3, target.vocab_size, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_greedy(model, prompt)
    windowed = set(getattr(model.config, "layer_types", None) or ()) - {"full_attention"}
    if windowed:
        unwindowed = build_tiny_family(family, tiny_tokenizer, tmp_path / "wide")
        wide = load_target(str(unwindowed)).model
        wide.config.sliding_window = wide.config.attention_chunk_size = 1024  # the same weights, no window in reach
        assert _hf_greedy(wide, prompt) != ref, "the window never mattered: the test could not fail"
    stub = TreeStub(model)
    for how in ({"k": 3}, {"k": None, "tree": (2, 2, 1)}):
        out = speculative_generate(target, stub, [prompt], NEW, eos_ids=[], **how)
        assert out.tokens[0] == ref, (family, how)
        assert out.stats.accepted > NEW // 2, (family, how)  # the blocks were verified, not only the bonus tokens


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_batched_engine_writes_transformers_greedy_rows_and_captures_them(family, tiny_tokenizer, tmp_path):
    """The batched data engine (data/engines/continuous.py: its own preallocated cache, rows joining as others
    leave, a shared prefix prefilled once, decode steps over row ranges) writes, for every prompt, the tokens
    transformers' greedy `generate` writes for it alone, and so does the hf engine (batched `generate`); what
    it captures while writing is what one teacher-forced forward over the finished row computes. DeepSeek-V3's
    attention caches, per layer and token, its normed latent as "keys" and its rotated shared key as "values"
    (512 and 64 wide, as published): the engine keeps each in a buffer of its own shape and reads them back
    unchanged."""
    from draftsmith.capture.forward import capture_forward
    from draftsmith.data.engines.base import Request
    from draftsmith.data.engines.continuous import CaptureSpec, ContinuousBatcher, windowed
    from draftsmith.data.engines.hf import HFEngine
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family(family, tiny_tokenizer, tmp_path / family)))
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, target.vocab_size, (9,), generator=g).tolist()
    reqs = [Request(i, shared + torch.randint(3, target.vocab_size, (n,), generator=g).tolist(), 12 + 2 * i)
            for i, n in enumerate((1, 6, 3, 9, 2, 5, 7))]
    eos = target.tokenizer.eos_token_id
    ref = {}
    for r in reqs:  # one prompt at a time, stopping at the end-of-sequence token as the engines do
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                                        do_sample=False, eos_token_id=eos)
        ref[r.key] = out[0, ids.shape[1]:].tolist()
    spec = CaptureSpec(layers=[0, -1], topk=4, last_hidden=True, dtype=torch.float32)
    engine = ContinuousBatcher(target.model, [eos], target.tokenizer.pad_token_id, batch_size=3, capture=spec)
    got, hf = {}, {}
    engine.run(reqs, lambda c: got.__setitem__(c.key, c))
    # prefilled once, except where windowed layers need every row's columns contiguous (`windowed`)
    assert (engine._prefix.length if engine._prefix else 0) == (0 if windowed(target.config) else len(shared))
    HFEngine(target.model, [eos], target.tokenizer.pad_token_id, batch_size=3).run(
        reqs, lambda c: hf.__setitem__(c.key, c.tokens))
    assert {k: c.tokens for k, c in got.items()} == ref == hf
    for c in got.values():
        full = capture_forward(target.model, torch.tensor([c.prompt_ids + c.tokens]), layers=[0, -1])
        for layer in (0, -1):
            torch.testing.assert_close(c.capture["layers"][layer], full.layers[layer][0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(c.capture["last_hidden"], full.last_hidden[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(c.capture["topk_values"], full.logits[0].topk(4).values, atol=2e-4, rtol=1e-4)


def _published(name: str):
    """The published shapes (config.json of each checkpoint), built offline from transformers' config classes."""
    import transformers as tf

    if name == "DeepSeek-V3":  # transformers' defaults are V3's shapes: 61 layers, the first 3 dense, 256 experts
        return tf.DeepseekV3Config()
    if name == "Qwen3-30B-A3B":
        return tf.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                 max_position_embeddings=40960, tie_word_embeddings=False)
    layers, experts = {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}[name]
    return tf.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, num_experts_per_tok=4,
                           layer_types=["sliding_attention", "full_attention"] * (layers // 2))


@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.5, 3.3), ("gpt-oss-20b", 20.9, 3.6),
                                                 ("gpt-oss-120b", 116.8, 5.1), ("DeepSeek-V3", 671.0, 37.55)])
def test_plan_counts_every_expert_as_weights_and_the_routed_ones_as_compute(name, total, active):
    """The model cards' numbers: Qwen counts both embeddings as active, OpenAI leaves the input embedding (a
    lookup) out. DeepSeek-V3's card gives 671B total and 37B activated per token (the checkpoint's 685B adds the
    14B multi-token-prediction module, which the causal LM does not build); counted as Qwen counts, 37.55B: 8 of
    256 routed experts and the shared one in 58 layers, 3 dense layers, latent attention, both embeddings.
    Weights are the total (every expert held), the per-token FLOPs the active count."""
    from draftsmith.distill.model import size_report
    from draftsmith.memory.serving import ArtifactShape, activation_bytes, mlp_width, param_counts, plan

    cfg = _published(name)
    n_total, n_active = param_counts(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size
    assert round(n_total / 1e9, 1) == total
    assert abs((n_active - (embedding if name.startswith("gpt-oss") else 0)) / 1e9 - active) < 0.06  # 3.35B: "3.3B"
    p = plan(cfg, ArtifactShape("none"), "H200-141GB", 4, 8192)
    assert p["weights_bytes"]["target"] == 2 * n_total and p["params"]["target_active"] == n_active
    rep = size_report(cfg, context=1)
    assert rep["non_embedding_params"] == n_total - 2 * embedding
    assert (rep["flops_per_token"] == 2 * (n_active - 2 * embedding) + 2 * embedding + 2 * cfg.num_hidden_layers *
        cfg.num_attention_heads * cfg.head_dim)
    # a token's MLP workspace is that of its routed experts (and shared ones): Qwen3-MoE 8 x 768, gpt-oss 4 x 2880,
    # DeepSeek-V3 8 x 2048 + 1 x 2048 (as wide as its dense layers' 18,432)
    assert mlp_width(cfg) == {"Q": 8 * 768, "g": 4 * 2880, "D": 9 * 2048}[name[0]]
    # one token's attention workspace: DeepSeek-V3's 128 heads of q and k at 192 dims and v and output at 128, and
    # its latents (1,536 for q, 512 + 64 for k and v); the others' q, k, v and output at head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    attention = 128 * (2 * 192 + 2 * 128) + 1536 + 512 + 64 if name[0] == "D" else (2 * heads + 2 * kv) * cfg.head_dim
    assert activation_bytes(cfg, 1, 0, 1) == 2 * cfg.hidden_size + attention + 3 * mlp_width(cfg)


def test_sharded_training_divides_every_expert_and_gathers_a_whole_layer():
    """Under FSDP / ZeRO-3 the frozen Qwen3-30B-A3B is divided over the ranks, experts included, and one whole
    decoder layer (all 128 experts) is gathered for the forward; without sharding every rank holds 30.5B."""
    from draftsmith.eagle.job import EagleJobConfig
    from draftsmith.memory.training import Sharding, format_plan, training_plan

    cfg = _published("Qwen3-30B-A3B")
    job = EagleJobConfig(target="x", data="x", output="x")
    whole = training_plan(job, cfg, Sharding("replicate", 8))
    fsdp = training_plan(job, cfg, Sharding("fsdp", 8))
    total = whole["target_params"]
    assert whole["bytes"]["target_weights"] == 2 * total  # 61 GB of bf16 target on every rank
    layer = (total - 2 * cfg.vocab_size * cfg.hidden_size) // cfg.num_hidden_layers
    assert layer > 128 * 3 * 2048 * 768  # the gathered layer holds every expert
    assert fsdp["bytes"]["target_weights"] == 2 * total // 8 + 2 * layer
    assert "30.53B params (frozen; 3.35B active per token, a mixture of experts)" in format_plan(fsdp)


def test_kv_cache_of_latent_attention_and_chunked_layers():
    """DeepSeek-V3's latent attention caches one 512 + 64 latent per layer and token (vLLM's MLA), not 128 heads of
    K and V; Llama 4's chunked layers hold at most one 8,192-token chunk, its full layers (one in four) the whole
    context."""
    import transformers as tf

    from draftsmith.memory.serving import kv_bytes_per_token

    assert kv_bytes_per_token(tf.DeepseekV3Config(), 2, 4096) == 61 * (512 + 64) * 2
    l4 = tf.Llama4TextConfig()  # Scout's text decoder: 48 layers, 8 KV heads of 128
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_per_token(l4, 2, 32768) * 32768 == per_layer * (12 * 32768 + 36 * 8192)
