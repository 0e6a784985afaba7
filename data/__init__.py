"""Data: prompt sources, chat formatting with loss masks, and self-distillation by the target itself.

    from draftsmith.data import generate_dataset, load_distilled, tokenize_conversation, load_prompts

Its names are imported on first use (lazy.py).
"""

from __future__ import annotations

from draftsmith import lazy

__getattr__ = lazy.names(__name__, {
    "DataConfig": "draftsmith.data.config",
    "generate_dataset": "draftsmith.data.generate",
    "load_distilled": "draftsmith.data.generate",
    "load_prompts": "draftsmith.data.sources",
    "read_provenance": "draftsmith.data.generate",
    "tokenize_conversation": "draftsmith.data.masks",
})
__all__ = [
    "DataConfig", "generate_dataset", "load_distilled", "load_prompts", "read_provenance",
    "tokenize_conversation"
]
