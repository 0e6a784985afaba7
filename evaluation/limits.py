"""Bounds an evaluation checks before it decodes: every prompt file is a file, every prompt has text, and
every prompt and its answer fit the target's context."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import ConfigError
from draftsmith.evaluation.domains import EvalPrompt, format_prompt
from draftsmith.targets.context import check_fits


def check_prompt_files(files: list[str]) -> None:
    """No --prompts entry is a folder (load_prompts names a missing file)."""
    from draftsmith.storage import data_path

    for f in files:
        if Path(f).is_dir() or data_path(f).is_dir():
            raise ConfigError(f"--prompts {f}: a folder, not a prompt file (give its .jsonl files)")


def fit_context(target, rows: list[EvalPrompt], max_new_tokens: int, template_kwargs: dict | None = None) -> None:
    """Refuse (one line naming the prompt's file:line) a prompt that, formatted with the target's chat
    template, leaves no room for `max_new_tokens` in the target's context."""
    for row in rows:
        if not (row.text or "").strip():
            raise ConfigError(f"prompt {row.source}: empty (no text to decode from)")
        check_fits(target, len(format_prompt(target.tokenizer, row.text, template_kwargs)), max_new_tokens,
                   f"prompt {row.source}")
