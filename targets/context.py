"""The target's context window: how many positions a prompt and its answer may take together.

Every stage that feeds the target (data generation, evaluation) fits its requests inside this window, so no
row is written longer than the target can read and no prompt is decoded past its positions.
"""

from __future__ import annotations

from draftsmith.errors import ConfigError

MAX_NEW_TOKENS = 1 << 20  # any max_new_tokens above this is a typo (1e9), whatever the target


def context_window(target) -> int | None:
    """`max_position_embeddings` of the target's text config, or None where the config gives none."""
    n = getattr(target.text_config, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_fits(target, prompt_len: int, max_new_tokens: int, what: str) -> None:
    """A prompt of `prompt_len` tokens and up to `max_new_tokens` more fit the target's context, or a
    ConfigError in one line naming `what` (the prompt's file:line)."""
    ctx = context_window(target)
    if ctx is not None and prompt_len + max_new_tokens > ctx:
        raise ConfigError(f"{what}: a prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} is more than "
                          f"the target's context of {ctx} positions (max_position_embeddings); lower max_new_tokens "
                          "or leave the prompt out")


def answer_room(target, prompt_len: int, max_new_tokens: int, what: str) -> int:
    """How many tokens an answer to a prompt of `prompt_len` tokens may take: `max_new_tokens`, cut to what is
    left of the target's context (so no written row is longer than the target reads); a prompt that fills the
    context is a DataError in one line naming `what`."""
    from draftsmith.errors import DataError

    ctx = context_window(target)
    if ctx is None:
        return max_new_tokens
    if prompt_len >= ctx:
        raise DataError(f"{what}: a prompt of {prompt_len} tokens leaves no room in the target's context of {ctx} "
                        "positions (max_position_embeddings); lower generation.max_prompt_tokens")
    return min(max_new_tokens, ctx - prompt_len)
