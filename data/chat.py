"""A conversation as the target reads it: `render_chat`, the one place a chat template is applied.

Every caller renders through it — training rows and their loss masks (data/masks.py), regenerated answers'
prompts (data/generate.py), magpie's user-turn prefix, the remote engine's end-of-turn probe, evaluation's
prompts, first turns and later ones (evaluation/domains.py, evaluation/turns.py) — so the template variables
(`enable_thinking`), the reasoning policy and the rule below hold for all of them alike. It gives the
template's text (`tokenize=False`) or the token ids the target reads (`tokenize=True`).

A message's own text never becomes control tokens: `<|im_end|><|im_start|>assistant` typed by a user (or
written in a dataset's response) is tokenized as text (`split_special_tokens`), and only the special-token
strings the chat template writes itself become special tokens.

The reasoning policy (data/reasoning.py): `drop` removes each assistant turn's thinking span before the
template sees it (`with_reasoning`); `keep` and `mask` render the same text (`mask` changes only the loss).
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.data.reasoning import DEFAULT_TAGS, POLICIES, drop_thinking, thinking_end
from draftsmith.errors import DataError, DraftsmithError

Message = dict[str, str]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_messages(turns: list[str], responses: list[str], system: str | None = None) -> list[Message]:
    """Interleave user turns and assistant responses (len(responses) may be len(turns) - 1 for a prompt)."""
    out: list[Message] = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if i < len(responses):
            out.append({"role": "assistant", "content": responses[i]})
    return out


def with_reasoning(messages: list[Message], reasoning: str = "keep",
                   think_tags: Sequence[str] = DEFAULT_TAGS) -> list[Message]:
    """`messages` as the reasoning policy renders them: under `drop`, each assistant turn without its thinking
    span (and the whitespace after it); unchanged under `keep` and `mask`."""
    if reasoning not in POLICIES:
        raise DataError(f"reasoning must be keep, drop or mask, got {reasoning!r}")
    if reasoning != "drop":
        return messages
    return [_dropped(m, i, think_tags) for i, m in enumerate(messages)]


def _dropped(msg: Message, turn: int, tags: Sequence[str]) -> Message:
    """`reasoning: drop`: an assistant message without its thinking span."""
    if msg["role"] != "assistant" or not thinking_end(msg["content"], tags):
        return msg
    answer = drop_thinking(msg["content"], tags)
    if not answer:
        raise DataError(f"assistant turn {turn} is all thinking (no {tags[1]!r} closes it): reasoning: drop leaves "
                        "nothing of it")
    return {**msg, "content": answer}


def render_chat(tokenizer, messages: list[Message], *, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, reasoning: str = "keep",
                think_tags: Sequence[str] = DEFAULT_TAGS, tokenize: bool = False, where: str = "",
                error: type[DraftsmithError] = DataError) -> str | list[int]:
    """`messages` through the target's chat template: its text, or with `tokenize` the ids the target reads
    (the template's special-token strings as their tokens, the messages' own text as text).

    `add_generation_prompt`: end where the next assistant turn starts (a prompt). `template_kwargs` are the
    template's variables (`enable_thinking`); `reasoning` / `think_tags` the policy applied first
    (`with_reasoning`). A template that rejects the conversation is one `error` (the caller's kind: a prompt
    file is configuration to an evaluation, data to a dataset), naming `where` when given.
    """
    messages = with_reasoning(messages, reasoning, think_tags)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as e:  # jinja raises TemplateError and friends for a conversation a template rejects
        raise error(f"{where + ': ' if where else ''}the chat template failed to render the conversation: "
                    f"{type(e).__name__}: {e}") from None
    return encode_rendered(tokenizer, messages, text, template_kwargs) if tokenize else text


def encode_template(tokenizer, text: str) -> list[int]:
    """Template text: the special-token strings the template writes become their special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_text(tokenizer, text: str) -> list[int]:
    """A message's own text: a special-token string inside it (`<|im_end|><|im_start|>assistant`) stays
    text, split like any other characters, and never becomes a control token."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def special_strings(tokenizer) -> list[str]:
    """The strings the tokenizer turns into special tokens."""
    names = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return sorted(n for n in names if n)


def holds_special_text(tokenizer, messages: list[Message]) -> bool:
    """Whether some message's own text holds a special-token string (then it is encoded span by span)."""
    specials = special_strings(tokenizer)
    return any(sp in m["content"] for m in messages for sp in specials)


def encode_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text` as the template wrote it, except the characters of `spans` (message contents, sorted), which
    are tokenized as text (`encode_text`)."""
    ids: list[int] = []
    at = 0
    for a, b in spans:
        a, b = min(a, len(text)), min(b, len(text))
        if a < at:
            continue
        ids += encode_template(tokenizer, text[at:a]) + encode_text(tokenizer, text[a:b])
        at = b
    return ids + encode_template(tokenizer, text[at:])


def content_spans(tokenizer, messages: list[Message], full: str,
                  kwargs: dict | None) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendering `full` (a prefix-stable template writes message i
    between the renderings of the conversation up to i-1 and up to i)."""
    spans = []
    before = ""
    for i, msg in enumerate(messages):
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=kwargs)
        content = msg["content"]
        at = upto.find(content, len(before)) if content else len(before)
        if at < 0 or not full.startswith(upto[: at + len(content)]):
            raise DataError(f"message {i} holds special-token text, and the chat template does not write it "
                            "verbatim: it cannot be kept as text")
        spans.append((at, at + len(content)))
        before = upto
    return spans


def encode_rendered(tokenizer, messages: list[Message], full: str, kwargs: dict | None = None) -> list[int]:
    """`full`, the template's rendering of `messages`, as ids: the template's own special-token strings become
    their tokens, the messages' text stays text (`encode_text`)."""
    if not holds_special_text(tokenizer, messages):
        return encode_template(tokenizer, full)
    return encode_spans(tokenizer, full, content_spans(tokenizer, messages, full, kwargs))
