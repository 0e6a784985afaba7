"""Mixture-of-experts targets beyond what every family goes through (tests/test_families.py trains, decodes and
exports every method on them): greedy speculative decoding equal to transformers' own `generate` on the tiny
Qwen3-MoE, gpt-oss and Llama 4 text targets, past gpt-oss's sliding window and Llama 4's attention chunk, with a
chain and with a tree; DeepSeek-V3 refused in one line; the memory plan counting every expert as weights and
the routed ones as compute, on the published shapes (configs built offline, nothing downloaded).
"""

from __future__ import annotations

import pytest
import torch
from test_decoding import TreeStub
from tiny_models import MOE_FAMILY_NAMES, build_tiny_family, family_config, plain_linears_one_thread

from draftsmith.errors import ConfigError

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


def test_deepseek_v3_is_refused_in_one_line(tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from draftsmith.eagle.model import EagleHead

    model = AutoModelForCausalLM.from_config(family_config("deepseek_v3", len(tiny_tokenizer)))
    with pytest.raises(ConfigError, match="target family 'deepseek_v3' is not in draftsmith's table") as e:
        EagleHead.from_target(model, "eagle3")
    assert "\n" not in str(e.value)


def _published(name: str):
    """The published shapes (config.json of each checkpoint), built offline from transformers' config classes."""
    import transformers as tf

    if name == "Qwen3-30B-A3B":
        return tf.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                 max_position_embeddings=40960, tie_word_embeddings=False)
    layers, experts = {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}[name]
    return tf.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, num_experts_per_tok=4,
                           layer_types=["sliding_attention", "full_attention"] * (layers // 2))


@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.5, 3.3), ("gpt-oss-20b", 20.9, 3.6),
                                                 ("gpt-oss-120b", 116.8, 5.1)])
def test_plan_counts_every_expert_as_weights_and_the_routed_ones_as_compute(name, total, active):
    """The model cards' numbers: Qwen counts both embeddings as active, OpenAI leaves the input embedding (a
    lookup) out. Weights are the total (every expert held), the per-token FLOPs the active count."""
    from draftsmith.distill.builders import size_report
    from draftsmith.planning.memory import ArtifactShape, mlp_width, param_counts, plan

    cfg = _published(name)
    n_total, n_active = param_counts(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size
    assert round(n_total / 1e9, 1) == total
    assert abs((n_active - (embedding if name.startswith("gpt-oss") else 0)) / 1e9 - active) < 0.06  # 3.35B: "3.3B"
    p = plan(cfg, ArtifactShape("none"), "H200-141GB", 4, 8192)
    assert p["weights_bytes"]["target"] == 2 * n_total and p["params"]["target_active"] == n_active
    rep = size_report(cfg, context=1)
    assert rep["non_embedding_params"] == n_total - 2 * embedding
    assert rep["flops_per_token"] == 2 * (n_active - 2 * embedding) + 2 * embedding + 2 * cfg.num_hidden_layers * \
        cfg.num_attention_heads * cfg.head_dim
    # a token's MLP workspace is that of its routed experts: Qwen3-MoE 8 x 768, gpt-oss 4 x 2880
    assert mlp_width(cfg) == (8 * 768 if name.startswith("Qwen") else 4 * 2880)


def test_sharded_training_divides_every_expert_and_gathers_a_whole_layer():
    """Under FSDP / ZeRO-3 the frozen Qwen3-30B-A3B is divided over the ranks, experts included, and one whole
    decoder layer (all 128 experts) is gathered for the forward; without sharding every rank holds 30.5B."""
    from draftsmith.eagle.job import EagleJobConfig
    from draftsmith.planning.train_memory import Sharding, format_plan, training_plan

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

    from draftsmith.planning.memory import kv_bytes_per_token

    assert kv_bytes_per_token(tf.DeepseekV3Config(), 2, 4096) == 61 * (512 + 64) * 2
    l4 = tf.Llama4TextConfig()  # Scout's text decoder: 48 layers, 8 KV heads of 128
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_per_token(l4, 2, 32768) * 32768 == per_layer * (12 * 32768 + 36 * 8192)
