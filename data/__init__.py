"""Data: prompt sources, chat formatting with loss masks, and self-distillation by the target itself.

    from draftsmith.data import generate_dataset, load_distilled, tokenize_conversation, load_prompts
"""

from draftsmith.data.config import DataConfig
from draftsmith.data.generate import generate_dataset, load_distilled, read_provenance
from draftsmith.data.masks import tokenize_conversation
from draftsmith.data.sources import load_prompts

__all__ = ["DataConfig", "generate_dataset", "load_distilled", "load_prompts", "read_provenance",
           "tokenize_conversation"]
