"""Bounds an evaluation checks before it decodes: every prompt and its answer fit the target's context."""

from __future__ import annotations

from draftsmith.evaluation.domains import EvalPrompt, format_prompt
from draftsmith.targets.context import check_fits


def fit_context(target, rows: list[EvalPrompt], max_new_tokens: int) -> None:
    """Refuse (one line naming the prompt's file:line) a prompt that, formatted with the target's chat
    template, leaves no room for `max_new_tokens` in the target's context."""
    for row in rows:
        check_fits(target, len(format_prompt(target.tokenizer, row.text)), max_new_tokens, f"prompt {row.source}")
