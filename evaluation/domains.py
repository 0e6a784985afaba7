"""Evaluation domains: prompts read from jsonl files, grouped by a `domain` / `category` field.

Understood row shapes (the shipped sets in prompts/eval work as they are):
  - `turns: [str, ...]` (MT-bench / EAGLE style: alpaca, gsm8k, humaneval) with `category`;
  - `instruction` (+ `instances: [{input, ...}]`), as in self-instruct's user_oriented_instructions;
  - `prompt` / `text` / `question` / `messages` (a chat list).
Single-turn evaluation formats the FIRST turn with the target's chat template (`add_generation_prompt`).

A row's domain is its `domain` field, else `category`, else the file's stem; both go through
`DOMAIN_ALIASES` (a small registry: an empty category in alpaca.jsonl means "general").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.data.chat import build_messages, has_chat_template, render_chat
from draftsmith.data.sources import (
    _FieldError,
    _text,
    extract_conversation,
    extract_turns,
    iter_jsonl,
)
from draftsmith.errors import DataError, json_kind
from draftsmith.paths import data_path, data_stem, shared_data_dir

# the four first sets, then what a chat target is asked beyond them: translation, summaries of long passages,
# answers from long passages (RAG) and two-turn conversations (MT-bench; every row carries its `domain`)
DEFAULT_PROMPT_FILES = ["alpaca.jsonl", "gsm8k.jsonl", "humaneval.jsonl", "user_oriented_instructions.jsonl",
                        "translation.jsonl", "summarization.jsonl", "rag.jsonl", "mt_bench.jsonl"]
# dev: everything that chooses (heads, recipes, trees, policies); test: the headline numbers only
SPLITS = ("dev", "test")

# file stem or category -> domain name
DOMAIN_ALIASES = {
    "alpaca": "general", "": "general", "writing": "general",
    "gsm8k": "math", "math": "math",
    "humaneval": "code", "code": "code", "coding": "code",
    "user_oriented_instructions": "instructions",
    "translation": "translation", "translate": "translation",
    "summarization": "summarization", "summarisation": "summarization", "summary": "summarization",
    "rag": "rag", "long_qa": "rag", "qa_over_passages": "rag",
    "mt_bench": "multiturn", "multiturn": "multiturn", "multi_turn": "multiturn",
}


@dataclass
class EvalPrompt:
    domain: str
    text: str  # the first user turn
    source: str  # file:line
    turns: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def default_prompt_files(split: str = "dev", root: str | Path | None = None) -> list[Path]:
    """The shipped eval sets of one split (prompts/eval/<split>/, or $DRAFTSMITH_DATA/eval/<split>/)."""
    if split not in SPLITS:
        raise DataError(f"eval split must be one of {', '.join(SPLITS)}, got {split!r}")
    root = Path(root) if root else shared_data_dir() / "eval"
    return [root / split / f for f in DEFAULT_PROMPT_FILES]


def only_domains(prompts: list[EvalPrompt], domains: list[str], files) -> list[EvalPrompt]:
    """The prompts of `domains` (all when empty), chosen after the per-domain limit so that a domain's prompts are
    the ones a run over every domain measures; a domain the files do not hold is refused in one line."""
    if not domains:
        return prompts
    wanted = [canonical_domain(d) for d in domains]
    held = sorted({p.domain for p in prompts})
    missing = [d for d in wanted if d not in held]
    if missing:
        raise DataError(f"domains: {', '.join(missing)} not in the prompt files ({len(files)} files hold "
                        f"{', '.join(held)})")
    return [p for p in prompts if p.domain in wanted]


def canonical_domain(name: str) -> str:
    key = (name or "").strip().lower()
    return DOMAIN_ALIASES.get(key, key or "general")


def _turns(row: dict) -> list[str]:
    """The user turns of one eval row, read in the first shape the row has (module docstring) by the data pipeline's
    own checks (data/sources.py): every turn non-empty text, never a value turned into the text "None" or "123".
    Anything else is a _FieldError naming the field."""
    if "turns" in row:
        return extract_turns(row, None, None, "turns")
    if "messages" in row:
        return extract_conversation(row, "messages", sharegpt=False)[1]
    if "instruction" in row:
        text = extract_turns(row, "instruction", None, None)[0]
        instances = row.get("instances")
        if instances is None or instances == []:
            return [text]
        if not isinstance(instances, list) or not isinstance(instances[0], dict):
            raise _FieldError(f"field 'instances' is not a list of objects (got {json_kind(instances)})")
        inp = instances[0].get("input")
        inp = "" if inp is None else _text(inp, "instances[0].input")
        return [f"{text}\n\n{inp}" if inp else text]
    for key in ("prompt", "text", "question", "input"):
        if key in row:
            return extract_turns(row, key, None, None)
    raise _FieldError("no prompt field (turns / instruction / prompt / text / messages)")


def _label(row: dict, key: str) -> str:
    """An optional text field (`domain`, `category`): absent or null is empty; any other non-text is an error."""
    value = row.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _FieldError(f"field '{key}' is not text (got {json_kind(value)})")
    return value.strip()


def _meta(row: dict) -> dict:
    """The ids a report carries along: text or whole numbers only."""
    for k in ("question_id", "id", "motivation_app"):
        if k in row and (isinstance(row[k], bool) or not isinstance(row[k], str | int)):
            raise _FieldError(f"field '{k}' is not text or a whole number (got {json_kind(row[k])})")
    return {k: row[k] for k in ("question_id", "id", "motivation_app") if k in row}


def read_prompt_line(row, path: Path, lineno: int, stem_domain: str) -> EvalPrompt:
    """Line `lineno` of the eval prompt file `path` as an EvalPrompt, or a DataError in one line naming the file, the
    line and the field at fault."""
    try:
        if not isinstance(row, dict):
            raise _FieldError(f"not a JSON object (got {json_kind(row)})")
        turns = _turns(row)
        raw = _label(row, "domain") or _label(row, "category")
        meta = _meta(row)
    except _FieldError as e:
        raise DataError(f"{path}:{lineno}: {e}") from None
    domain = canonical_domain(raw) if raw else stem_domain
    return EvalPrompt(domain, turns[0], f"{path.name}:{lineno}", turns, meta)


def load_prompts(files: list[str | Path], limit_per_domain: int | None = None, seed: int = 0) -> list[EvalPrompt]:
    """Read prompt files; keep at most `limit_per_domain` per domain, a seeded random choice in file order."""
    by_domain: dict[str, list[EvalPrompt]] = {}
    for f in files:
        path = data_path(f)
        if not path.is_file():
            raise DataError(f"prompt file not found: {path}")
        stem_domain = canonical_domain(data_stem(path))
        for lineno, row, error in iter_jsonl(path):
            if error is not None:  # an eval set is fixed: a bad line is an error, never a quietly smaller set
                raise DataError(f"{path}:{lineno}: {error}")
            prompt = read_prompt_line(row, path, lineno, stem_domain)
            by_domain.setdefault(prompt.domain, []).append(prompt)
    if not by_domain:
        raise DataError("no prompts in " + ", ".join(map(str, files)))
    out: list[EvalPrompt] = []
    for domain in sorted(by_domain):
        rows = by_domain[domain]
        if limit_per_domain is not None and len(rows) > limit_per_domain:
            picked = sorted(random.Random(f"{seed}:{domain}").sample(range(len(rows)), limit_per_domain))
            rows = [rows[i] for i in picked]
        out.extend(rows)
    return out


def format_prompt(tokenizer, text: str, template_kwargs: dict | None = None) -> list[int]:
    """The first turn as chat-templated token ids (plain tokenisation when there is no template);
    `template_kwargs` go to the template (e.g. `{enable_thinking: false}` for a Qwen3 target, as its data had)."""
    if has_chat_template(tokenizer):  # special-token text in the prompt stays text (data/chat.py)
        return render_chat(tokenizer, build_messages([text], []), template_kwargs=template_kwargs, tokenize=True)
    return list(tokenizer(text, split_special_tokens=True).input_ids)  # the user's text stays text
