"""Reasoning targets: where a response's thinking span lies, and what a data source does with it.

Qwen3 and its successors answer with a thinking span first (`<think>\\n...\\n</think>\\n\\n`, then the answer);
DeepSeek-R1-style models are given the opening tag in the prompt and write only the closing one. A data
source's `reasoning` policy says what its rows do with that span, for kept and regenerated answers alike:

  keep  the span is trained on like the answer;
  drop  the span is removed from the response, so the row's text no longer holds it (a chat template may
        still write an empty block of its own: Qwen3's does for an answer without thinking);
  mask  the span stays in the row as context, out of the loss: the learned tokens start after the closing tag.

The span is read the way Qwen3's own template reads it (`content.split('</think>')`): everything up to and
including the first closing tag. A response that opens a block and never closes it (cut by max_new_tokens)
is all thinking. The tags come from the data config (`chat.think_tags`, default `<think>` / `</think>`).
"""

from __future__ import annotations

from collections.abc import Sequence

POLICIES = ("keep", "drop", "mask")
DEFAULT_TAGS = ("<think>", "</think>")


def thinking_end(text: str, tags: Sequence[str] = DEFAULT_TAGS) -> int:
    """Characters of `text` the thinking span takes, from the start (0: the text holds none)."""
    opening, closing = tags
    at = text.find(closing)
    if at >= 0:
        return at + len(closing)
    return len(text) if text.lstrip().startswith(opening) else 0


def answer_start(text: str, tags: Sequence[str] = DEFAULT_TAGS) -> int:
    """Where the answer begins: after the thinking span and the whitespace that follows it."""
    end = thinking_end(text, tags)
    return end + len(text[end:]) - len(text[end:].lstrip()) if end else 0


def drop_thinking(text: str, tags: Sequence[str] = DEFAULT_TAGS) -> str:
    """`text` without its thinking span (and the whitespace after it); unchanged when it holds none."""
    return text[answer_start(text, tags):]


def thinking_tokens(tokenizer, ids: Sequence[int], tags: Sequence[str] = DEFAULT_TAGS) -> int:
    """How many of the generated `ids` the thinking span takes: the shortest prefix whose text holds the
    closing tag (all of them when the text opens a block that never closes, 0 when it holds none).

    A binary search over decoded prefixes, since a long trace (8-32k tokens) must not be decoded once per
    token; holding the closing tag only grows with the prefix, so the search is exact.
    """
    def text(n: int) -> str:
        return tokenizer.decode(list(ids[:n]), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    whole = text(len(ids))
    if thinking_end(whole, tags) == 0:
        return 0
    if tags[1] not in whole:  # opened and never closed
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if tags[1] in text(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
