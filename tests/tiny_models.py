"""Tiny random models with a real tokenizer, for fast tests (imported by conftest.py and by tests).

The tokenizer is a byte-level BPE trained in a fraction of a second on a small built-in corpus, with
ChatML special tokens and a chat template, so the data pipeline's chat formatting and loss masks run on
the same code paths as with SmolLM2. The models are 2-layer Llamas with hidden size 64.
"""

from __future__ import annotations

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
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **{"tie_word_embeddings": True, **overrides},
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
