"""Bounds an evaluation checks before it decodes: every prompt file is a file, every prompt has text, and
every prompt and its answer fit the target's context (the whole conversation, for a multi-turn prompt)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import ConfigError
from draftsmith.evaluation.domains import EvalPrompt, format_prompt
from draftsmith.evaluation.turns import conversation_bound
from draftsmith.targets.context import check_fits, context_window


def check_prompt_files(files: list[str]) -> None:
    """No --prompts entry is a folder (load_prompts names a missing file)."""
    from draftsmith.paths import data_path

    for f in files:
        if Path(f).is_dir() or data_path(f).is_dir():
            raise ConfigError(f"--prompts {f}: a folder, not a prompt file (give its .jsonl files)")


def leave_out_long(target, rows: list[EvalPrompt], max_new_tokens: int,
                   template_kwargs: dict | None = None) -> tuple[list[EvalPrompt], list[dict]]:
    """The shipped eval sets hold prompts of up to ~2,700 tokens (questions over long passages): a target of a
    shorter context is measured on the prompts it can read, and each one left out is returned with its reason
    (the report keeps them). Prompt files a user names are not filtered: `fit_context` refuses a long one."""
    ctx = context_window(target)
    if ctx is None:
        return rows, []
    kept, left = [], []
    for row in rows:
        n = len(format_prompt(target.tokenizer, row.text, template_kwargs))
        if n + max_new_tokens > ctx:
            left.append({"prompt": row.source, "domain": row.domain,
                         "reason": f"{n} prompt tokens + max_new_tokens {max_new_tokens} > the target's context {ctx}"})
        else:
            kept.append(row)
    return kept, left


def fit_context(target, rows: list[EvalPrompt], max_new_tokens: int, template_kwargs: dict | None = None,
                turns: str = "all") -> tuple[list[int], list[dict]]:
    """How many turns of each row are measured, and the rows cut short, each with a one-line reason.

    A first turn that, formatted with the target's chat template, leaves no room for `max_new_tokens` in the
    target's context is refused (one line naming its file:line). The context holds the whole conversation: a
    later turn that might not fit, were every earlier answer `max_new_tokens` long, ends its row there
    (evaluation/turns.py). `turns: first` measures one turn of every row."""
    ctx = context_window(target)
    counts, cut = [], []
    for row in rows:
        if not (row.text or "").strip():
            raise ConfigError(f"prompt {row.source}: empty (no text to decode from)")
        check_fits(target, len(format_prompt(target.tokenizer, row.text, template_kwargs)), max_new_tokens,
                   f"prompt {row.source}")
        n = 1 if turns == "first" else max(1, len(row.turns))
        keep = n
        for k in range(2, n + 1):
            need = conversation_bound(target.tokenizer, row.turns[:k], max_new_tokens, template_kwargs,
                                      f"prompt {row.source}")
            if ctx is not None and need + max_new_tokens > ctx:
                keep = k - 1
                cut.append({"prompt": row.source, "domain": row.domain, "turns": n, "measured": keep,
                            "reason": f"turn {k}'s prompt, with earlier answers of up to {max_new_tokens} tokens "
                                      f"each, may take {need} tokens, and {need} + max_new_tokens {max_new_tokens} is "
                                      f"more than the target's context of {ctx} positions"})
                break
        counts.append(keep)
    return counts, cut
