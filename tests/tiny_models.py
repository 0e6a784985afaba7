"""Tiny random models with a real tokenizer, for fast tests (imported by conftest.py and by tests).

The tokenizer is a byte-level BPE trained in a fraction of a second on a small built-in corpus, with
ChatML special tokens and a chat template, so the data pipeline's chat formatting and loss masks run on
the same code paths as with SmolLM2. The models are 2-layer Llamas with hidden size 64.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether? The answer is 72.",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Summarize the following passage in one sentence. Translate the sentence into French.",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "import os\nimport sys\n\nclass Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **{"tie_word_embeddings": True, "max_position_embeddings": 512, **overrides},
    )
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; scale the embeddings so greedy paths are decisive and varied.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model.eval()


def make_target(tokenizer, seed=0, layers=2, hidden=64, folder: Path | None = None, **overrides):
    from draftsmith.targets import Target, freeze

    model = freeze(build_tiny_llama(len(tokenizer), seed=seed, layers=layers, hidden=hidden, **overrides))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if folder is not None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return Target(f"tiny-llama-s{seed}", model, tokenizer, str(folder or "tiny"), folder)


# --- one tiny random model of every target family (targets/families.py) --------------------------------
DENSE_FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
MOE_FAMILY_NAMES = ("qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3")
FAMILY_NAMES = DENSE_FAMILY_NAMES + MOE_FAMILY_NAMES
NO_PAD = ("llama", "mistral")  # Llama 3 and Mistral tokenizers have no pad token


def family_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 4):
    """The HF config of a tiny `family` model: the family's own config class, its distinguishing features
    kept (RoPE bases that are not 10000, Qwen2's q/k/v bias, Qwen3's q/k norms, Phi-3's fused projections,
    Gemma 3's sliding layers and scaled embedding, the image-text checkpoint's nested text config)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=None if family in NO_PAD else 0)
    head_dim = hidden // 4
    if family == "llama":  # Llama 3: RoPE base 500000, untied lm_head
        return tf.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**common, head_dim=head_dim, sliding_window=None, rope_theta=1000000.0,
                                tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=head_dim, rope_theta=1000000.0, tie_word_embeddings=True)
    if family == "phi3":
        return tf.Phi3Config(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if family in MOE_FAMILY_NAMES:
        return _moe_config(tf, family, common, head_dim, layers)
    text = dict(common, head_dim=head_dim, sliding_window=128, query_pre_attn_scalar=head_dim,
                layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**text)
    if family == "gemma3":
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1, eos_token_id=2,
                               pad_token_id=0, bos_token_id=1)
    raise ValueError(f"no tiny builder for family {family!r}")


def _moe_config(tf, family: str, common: dict, head_dim: int, layers: int):
    """A tiny mixture-of-experts config: 4 experts, 2 routed per token (Llama 4 routes 1 and adds a shared
    expert, as its checkpoints do), experts half the dense MLP's width, the family's other features kept:
    Qwen3-MoE's q/k norms, gpt-oss's attention sinks, biased projections and alternating sliding layers
    (window 16: the tests' rows run past it), DeepSeek-V3's latent attention and leading dense layer, Llama 4's
    chunked layers and RoPE-free layers."""
    hidden = common["hidden_size"]
    moe = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)
    if family == "qwen3_moe":  # Qwen3-30B-A3B / 235B-A22B: every layer routed, top-k weights renormalised
        return tf.Qwen3MoeConfig(**common, **moe, head_dim=head_dim, num_experts=4, moe_intermediate_size=hidden // 2,
                                 norm_topk_prob=True, rope_theta=1000000.0, tie_word_embeddings=False)
    if family == "gpt_oss":  # gpt-oss-20b / 120b: the experts' width is intermediate_size
        return tf.GptOssConfig(**dict(common, intermediate_size=hidden // 2), **moe, head_dim=head_dim,
                               num_local_experts=4, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                               rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 16, "rope_theta": 150000.0})
    if family == "deepseek_v3":  # DeepSeek-V3 / R1: multi-head latent attention, one dense layer first; the
        # latent is the published 512 + 64 wide (vLLM's CPU MLA kernel takes no other), the heads tiny. The router
        # fields transformers' class does not declare are written as V3's config.json has them: vLLM reads them
        # (without topk_method it builds no e_score_correction_bias and fails on the checkpoint's)
        return tf.DeepseekV3Config(**dict(common, num_key_value_heads=4), **moe, n_routed_experts=4,
                                   topk_method="noaux_tc", scoring_func="sigmoid",
                                   n_shared_experts=1, moe_intermediate_size=hidden // 2, first_k_dense_replace=1,
                                   n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=48, qk_rope_head_dim=64,
                                   qk_nope_head_dim=16, v_head_dim=16, head_dim=64, tie_word_embeddings=False)
    if family == "llama4_text":  # Llama 4 Scout / Maverick text decoder
        return tf.Llama4TextConfig(**common, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=1,
                                   intermediate_size_mlp=2 * hidden, interleave_moe_layer_step=1,
                                   attention_chunk_size=16, no_rope_layer_interval=4, tie_word_embeddings=False)
    raise ValueError(f"no tiny builder for family {family!r}")


def build_tiny_family(family: str, tokenizer, folder: Path, seed: int = 0, hidden: int = 64, layers: int = 4):
    """A tiny random `family` model and its tokenizer saved as an HF folder; returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, len(tokenizer), hidden, layers)).eval()
    with torch.no_grad():  # decisive, varied greedy paths (near-uniform logits otherwise)
        model.get_input_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if family in NO_PAD:
        import copy

        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.pad_token = None
        model.generation_config.pad_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompt_rows(target, tmp: Path, prompts: list[str], out: str = "data"):
    """Rows the target writes itself for `prompts`, through the data pipeline (chat template, loss masks, pad
    id), in tmp/out; returns the dataset."""
    import json

    from draftsmith.data import generate_dataset, load_distilled
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig

    src = tmp / f"{out}-prompts.jsonl"
    src.write_text("".join(json.dumps({"q": p}) + "\n" for p in prompts))
    cfg = DataConfig(sources=[SourceConfig(name="mixed", path=str(src), prompt="q", domain="chat")],
                     output_dir=str(tmp / out), generation=GenerationConfig(max_new_tokens=16, batch_size=8, threads=1))
    generate_dataset(cfg, target, progress=False)
    return load_distilled(tmp / out, target)


def assert_same_rows(ds, ref, at_least: float = 0.9) -> None:
    """Rows of two data runs on the same prompts (another engine, a server): complete, once each, masked on their
    answer; where the two wrote the same text, the rows are the same token for token (ids and masks)."""
    from draftsmith.data.masks import masked_spans

    assert sorted(ds["row_id"]) == sorted(ref["row_id"]) and len(set(ds["row_id"])) == len(ref)
    by_id = {r["row_id"]: r for r in ref}
    same = 0
    for row in ds:
        assert len(masked_spans(row["input_ids"], row["loss_mask"])) == 1
        other = by_id[row["row_id"]]
        if row["response"] == other["response"]:
            same += 1
            assert row["input_ids"] == other["input_ids"] and row["loss_mask"] == other["loss_mask"]
    assert same >= at_least * len(ref), f"only {same} of {len(ref)} rows agree"


def distilled_rows(target, n: int = 48, prompt_len: int = 4, new: int = 24, seed: int = 0) -> list[dict]:
    """Self-distilled rows: random prompts answered greedily by the target (loss on the answer)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, target.vocab_size, (n, prompt_len), generator=g)
    with torch.no_grad():
        out = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                    min_new_tokens=new, do_sample=False)
    return [{"input_ids": row.tolist(), "loss_mask": [0] * prompt_len + [1] * new, "domain": "synthetic",
             "row_id": i} for i, row in enumerate(out)]


def cache_hub_dataset(cache: Path, repo_id: str, rows: list[dict], split: str = "train") -> None:
    """Leave `rows` in the datasets cache the way `datasets.load_dataset(repo_id)` leaves a download, so that a
    `type: hub` source reads them offline (HF_DATASETS_OFFLINE=1) as it reads a set downloaded before: the
    `<org>___<name>/default/0.0.0/<hash>/` folder with dataset_info.json and `<name>-<split>.arrow`, where
    <name> is the dataset's name in datasets' snake case (ShareGPT_Vicuna -> share_gpt_vicuna)."""
    import shutil

    from datasets import Dataset
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo_id.split("/")
    snake = camelcase_to_snakecase(name)
    work = cache / "downloads-src" / f"{org}___{snake}"
    work.mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(str(work / f"{split}.parquet"))
    builder = Parquet(cache_dir=str(work / "built"), dataset_name=snake, config_name="default",
                      data_files={split: str(work / f"{split}.parquet")}, hash="0123456789abcdef")
    builder.download_and_prepare()
    config_dir = Path(builder.cache_dir).parents[1]  # <snake>/default-<id>/0.0.0/<hash> -> default-<id>
    (cache / f"{org}___{snake}").mkdir(parents=True, exist_ok=True)
    shutil.move(str(config_dir), str(cache / f"{org}___{snake}" / "default"))


# --- a tiny reasoning target: Qwen3's real chat template, and a Qwen3 that thinks before it answers ----------
QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3" / "chat_template.jinja"
THINK_TAGS = ("<think>", "</think>")


def build_qwen3_tokenizer(vocab_size: int = 320):
    """The tiny tokenizer with Qwen3's chat template (tests/fixtures/qwen3, verbatim) and Qwen3's thinking tags
    as added tokens that are not special (as in Qwen3's tokenizer: they stay in decoded text)."""
    tok = build_tiny_tokenizer(vocab_size)
    tok.add_tokens(list(THINK_TAGS))
    tok.chat_template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    return tok


def build_thinking_qwen3(tokenizer, folder: Path, thought: str = "The quick", answer: str = "Paris",
                         seed: int = 0) -> Path:
    """A tiny Qwen3 whose greedy answer to any prompt ending in the generation prompt (thinking on) is
    `<think>{thought}</think>{answer}<|im_end|>`, saved as an HF folder; returns the folder.

    Every layer's output projections are zero, so the last hidden state is the current token's embedding
    (normalised), and the untied lm_head row of token f(a) is token a's embedding: the greedy next token after
    a is f(a), a chain through the script. A real transformers model, so the data engines, capture and training
    run on it as on any target; only its weights are chosen.
    """
    from transformers import AutoModelForCausalLM

    config = family_config("qwen3", len(tokenizer))
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                           add_generation_prompt=True)
    last = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    enc = tokenizer.convert_tokens_to_ids
    chain = [last, enc(THINK_TAGS[0])] + tokenizer(thought, add_special_tokens=False)["input_ids"]
    chain += [enc(THINK_TAGS[1])] + tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(set(chain)) != len(chain):
        raise ValueError(f"the script's tokens repeat ({chain}); the next token depends on the last one only")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        head = model.lm_head.weight
        head.zero_()
        for a, b in zip(chain, chain[1:]):
            head[b] = emb[a]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def plain_linears_one_thread():
    """F.linear on one thread while the block runs: the CPU kernel plan (targets/gemm.py, tested in test_gemm.py)
    would measure each tiny target's shapes afresh, seconds per target that test nothing a family, an expert or
    a template changes; hidden-64 models need one thread and then wait on no other process's cores."""
    from draftsmith.targets import gemm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with gemm.disabled():
            yield
    finally:
        torch.set_num_threads(threads)
