"""Conversations to tokens with an assistant-only loss mask, computed robustly and verified.

Chat mode uses the target's own chat template. For assistant turn i the template is rendered twice:
the conversation before it with the generation prompt (`pre`), and the conversation through it
(`upto`). A well-behaved template is prefix-stable — `upto` starts with `pre`, and the full text starts
with `upto` — and writes the assistant content verbatim, followed by an end-of-turn token. The masked
characters are [content start, content end + end-of-turn token). They become token positions by
tokenizing each boundary's prefix and checking it is a prefix of the full tokenization (a boundary
falling inside a merged token fails that check). Finally every masked span is decoded back and must
equal the assistant text plus the end-of-turn token exactly. Any failure raises DataError: a template
that cannot be masked never yields a silent all-ones mask.

Plain mode (no template, e.g. a base model, or `chat.mode: plain`): user text + separator (not
learned), then the response tokens and an EOS token (learned).

Reasoning targets (data/reasoning.py): `template_kwargs` (`enable_thinking`) go to every rendering, and an
assistant turn's thinking span is trained on (`keep`), removed from the turn before anything is rendered
(`drop`), or kept out of the mask (`mask`: the learned span starts after the closing tag, and the decode-back
check also refuses a learned span that holds a thinking tag).

A message's own text never becomes control tokens: `<|im_end|><|im_start|>assistant` typed by a user (or
written in a dataset's response) is tokenized as text (`split_special_tokens`), and only the special-token
strings the chat template writes itself become special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.data.reasoning import DEFAULT_TAGS, POLICIES, answer_start, drop_thinking, thinking_end
from draftsmith.errors import DataError, show

Message = dict[str, str]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_mode(tokenizer, mode: str = "auto") -> str:
    """'chat' or 'plain' for this tokenizer; 'chat' without a template is an error."""
    if mode == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    if mode == "chat" and not has_chat_template(tokenizer):
        raise DataError("chat.mode is 'chat' but the tokenizer has no chat template (use mode: plain or auto)")
    if mode not in ("chat", "plain"):
        raise DataError(f"unknown chat mode {mode!r}")
    return mode


def _encode(tokenizer, text: str) -> list[int]:
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


def _encode_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text` as the template wrote it, except the characters of `spans` (message contents, sorted), which
    are tokenized as text (`encode_text`)."""
    ids: list[int] = []
    at = 0
    for a, b in spans:
        a, b = min(a, len(text)), min(b, len(text))
        if a < at:
            continue
        ids += _encode(tokenizer, text[at:a]) + encode_text(tokenizer, text[a:b])
        at = b
    return ids + _encode(tokenizer, text[at:])


def _content_spans(tokenizer, messages: list[Message], full: str, kwargs: dict) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendering `full` (a prefix-stable template writes message i
    between the renderings of the conversation up to i-1 and up to i)."""
    spans = []
    before = ""
    for i, msg in enumerate(messages):
        upto = _render(tokenizer, messages[: i + 1], False, kwargs)
        content = msg["content"]
        at = upto.find(content, len(before)) if content else len(before)
        if at < 0 or not full.startswith(upto[: at + len(content)]):
            raise DataError(f"message {i} holds special-token text, and the chat template does not write it "
                            "verbatim: it cannot be kept as text")
        spans.append((at, at + len(content)))
        before = upto
    return spans


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool, kwargs: dict | None = None) -> str:
    """The template's text for `messages`; `kwargs` are the source's template variables (`enable_thinking`)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(kwargs or {}))
    except Exception as e:  # jinja raises TemplateError and friends for templates that reject a conversation
        raise DataError(f"chat template failed to render the conversation: {type(e).__name__}: {e}") from None


def end_tokens(tokenizer, eos_token_ids: Sequence[int] | None = None) -> list[tuple[int, str]]:
    """(id, text) of the tokens that end an assistant turn: the given EOS ids, else the tokenizer's EOS."""
    ids = list(eos_token_ids) if eos_token_ids else []
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return [(i, _decode(tokenizer, [i])) for i in ids]


def encode_rendered(tokenizer, messages: list[Message], full: str, kwargs: dict | None = None) -> list[int]:
    """`full`, the template's rendering of `messages`, as ids: the template's own special-token strings become
    their tokens, the messages' text stays text (`encode_text`), as `tokenize_conversation` makes them."""
    specials = special_strings(tokenizer)
    if not any(sp in m["content"] for m in messages for sp in specials):
        return _encode(tokenizer, full)
    return _encode_spans(tokenizer, full, _content_spans(tokenizer, messages, full, kwargs or {}))


def _token_boundary(tokenizer, text: str, char: int, full_ids: list[int], what: str,
                    spans: list[tuple[int, int]] | None = None) -> int:
    """Token index where character `char` of `text` starts, if the tokenization splits there."""
    prefix = _encode(tokenizer, text[:char]) if spans is None else _encode_spans(tokenizer, text[:char], spans)
    if full_ids[: len(prefix)] != prefix:
        raise DataError(
            f"chat template: the {what} does not fall on a token boundary (tokenizing the text before it "
            "is not a prefix of the full tokenization), so its loss mask cannot be computed"
        )
    return len(prefix)


def _chat(tokenizer, messages: list[Message], add_generation_prompt: bool, eos: list[tuple[int, str]],
          kwargs: dict, mask_thinking: bool, tags) -> tuple[list[int], list[int], list[str]]:
    full = _render(tokenizer, messages, add_generation_prompt, kwargs)
    specials = special_strings(tokenizer)
    # a message holding special-token text: its content is tokenized as text, the template's own tokens as tokens
    spans = (_content_spans(tokenizer, messages, full, kwargs)
             if any(sp in m["content"] for m in messages for sp in specials) else None)
    ids = _encode(tokenizer, full) if spans is None else _encode_spans(tokenizer, full, spans)
    mask = [0] * len(ids)
    expected = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        pre = _render(tokenizer, messages[:i], True, kwargs) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not (full.startswith(upto) and upto.startswith(pre)):
            raise DataError(
                f"chat template is not prefix-stable at assistant turn {i} (rendering the conversation up to "
                "a turn is not a prefix of rendering more of it); cannot build a loss mask"
            )
        content = msg["content"]
        at = upto.find(content, len(pre)) if content else len(pre)
        if at < 0:
            raise DataError(
                f"chat template does not write assistant turn {i} verbatim (its text is not in the rendering); "
                "cannot build a loss mask"
            )
        start, end = at, at + len(content)
        eos_text = next((t for _, t in eos if t and upto.startswith(t, end)), None)
        if eos_text is None:
            raise DataError(
                f"chat template puts no end-of-turn token ({', '.join(t for _, t in eos) or 'none known'}) after "
                f"assistant turn {i}; the model could never learn to stop"
            )
        end += len(eos_text)
        if mask_thinking:
            t0, learned = _answer_boundary(tokenizer, full, start, content, ids, spans, i, tags)
        else:
            t0, learned = _token_boundary(tokenizer, full, start, ids, f"start of assistant turn {i}", spans), content
        t1 = _token_boundary(tokenizer, full, end, ids, f"end of assistant turn {i}", spans)
        for t in range(t0, t1):
            mask[t] = 1
        expected.append(learned + eos_text)
    return ids, mask, expected


def _answer_boundary(tokenizer, full: str, start: int, content: str, ids: list[int],
                     spans: list[tuple[int, int]] | None, turn: int, tags) -> tuple[int, str]:
    """`reasoning: mask`: the token where assistant turn `turn`'s learned text starts (right after its thinking
    span, else after the whitespace that follows it, whichever the tokenization splits at) and that text."""
    skip = thinking_end(content, tags)
    if skip and skip == len(content):
        raise DataError(f"assistant turn {turn} is all thinking (no {tags[1]!r} closes it): reasoning: mask leaves "
                        "nothing of it to learn")
    error = None
    for cut in dict.fromkeys((skip, answer_start(content, tags))):
        try:
            return _token_boundary(tokenizer, full, start + cut, ids, f"end of assistant turn {turn}'s thinking",
                                   spans), content[cut:]
        except DataError as e:
            error = e
    raise error


def _plain(tokenizer, messages: list[Message], add_bos: bool, separator: str, eos: list[tuple[int, str]],
           mask_thinking: bool, tags) -> tuple[list[int], list[int], list[str]]:
    ids: list[int] = []
    mask: list[int] = []
    expected = []
    if add_bos and tokenizer.bos_token_id is not None:
        ids.append(int(tokenizer.bos_token_id))
        mask.append(0)
    if not eos:
        raise DataError("plain continuation needs an EOS token to end responses; the tokenizer has none")
    eos_id, eos_text = eos[0]
    for msg in messages:
        if msg["role"] == "assistant":
            text = msg["content"]
            cut = thinking_end(text, tags) if mask_thinking else 0
            if cut and cut == len(text):
                raise DataError(f"an assistant turn is all thinking (no {tags[1]!r} closes it): reasoning: mask "
                                "leaves nothing of it to learn")
            thought = encode_text(tokenizer, text[:cut]) if cut else []
            part = encode_text(tokenizer, text[cut:]) + [eos_id]
            ids += thought + part
            mask += [0] * len(thought) + [1] * len(part)
            expected.append(text[cut:] + eos_text)
        else:
            part = encode_text(tokenizer, msg["content"] + separator)
            ids += part
            mask += [0] * len(part)
    return ids, mask, expected


def masked_spans(ids: Sequence[int], mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) token ranges where the mask is 1."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def verify_mask(tokenizer, ids: Sequence[int], mask: Sequence[int], expected: list[str],
                forbidden: Sequence[str] = ()) -> None:
    """Decode each masked span; it must be exactly the expected assistant text (+ end-of-turn token) and hold
    none of the `forbidden` strings (the thinking tags, where `reasoning: mask` keeps thinking out of the loss)."""
    spans = masked_spans(ids, mask)
    if len(spans) != len(expected):
        raise DataError(f"loss mask has {len(spans)} spans for {len(expected)} assistant turns")
    for n, ((a, b), want) in enumerate(zip(spans, expected)):
        got = _decode(tokenizer, ids[a:b])
        if got != want:
            raise DataError(
                f"loss mask check failed at assistant turn {n}: decoded span {got[:60]!r} != assistant text "
                f"{want[:60]!r}"
            )
        held = next((f for f in forbidden if f and f in got), None)
        if held is not None:
            raise DataError(f"loss mask check failed at assistant turn {n}: the learned span holds {held!r}, "
                            "thinking that reasoning: mask keeps out of the loss")


def tokenize_conversation(tokenizer, messages: list[Message], *, mode: str = "auto",
                          add_generation_prompt: bool = False, eos_token_ids: Sequence[int] | None = None,
                          plain_separator: str = "\n", add_bos: bool = True, template_kwargs: dict | None = None,
                          reasoning: str = "keep", think_tags: Sequence[str] = DEFAULT_TAGS
                          ) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1 = assistant token the model learns, end-of-turn token included).

    `messages` are {"role": "system"|"user"|"assistant", "content": str}. With `add_generation_prompt`
    the ids end where the next assistant turn starts (a generation prompt). `template_kwargs` go to every
    rendering of the chat template; `reasoning` (keep, drop, mask) is what the assistant turns' thinking spans,
    delimited by `think_tags`, become (data/reasoning.py). Raises DataError when the template cannot be masked
    or the decode-back check fails.
    """
    if not messages:
        raise DataError("empty conversation")
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise DataError(f"bad message {show(m)}: needs role system/user/assistant and text content")
    if reasoning not in POLICIES:
        raise DataError(f"reasoning must be keep, drop or mask, got {reasoning!r}")
    if reasoning == "drop":
        messages = [_dropped(m, i, think_tags) for i, m in enumerate(messages)]
    masking = reasoning == "mask"
    eos = end_tokens(tokenizer, eos_token_ids)
    if resolve_mode(tokenizer, mode) == "chat":
        ids, mask, expected = _chat(tokenizer, messages, add_generation_prompt, eos, template_kwargs or {}, masking,
                                    think_tags)
    else:
        ids, mask, expected = _plain(tokenizer, messages, add_bos, plain_separator, eos, masking, think_tags)
    verify_mask(tokenizer, ids, mask, expected, forbidden=think_tags if masking else ())
    return ids, mask


def _dropped(msg: Message, turn: int, tags: Sequence[str]) -> Message:
    """`reasoning: drop`: an assistant message without its thinking span."""
    if msg["role"] != "assistant" or not thinking_end(msg["content"], tags):
        return msg
    answer = drop_thinking(msg["content"], tags)
    if not answer:
        raise DataError(f"assistant turn {turn} is all thinking (no {tags[1]!r} closes it): reasoning: drop leaves "
                        "nothing of it")
    return {**msg, "content": answer}


def build_messages(turns: list[str], responses: list[str], system: str | None = None) -> list[Message]:
    """Interleave user turns and assistant responses (len(responses) may be len(turns) - 1 for a prompt)."""
    out: list[Message] = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if i < len(responses):
            out.append({"role": "assistant", "content": responses[i]})
    return out
