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

A message's own text never becomes control tokens: `<|im_end|><|im_start|>assistant` typed by a user (or
written in a dataset's response) is tokenized as text (`split_special_tokens`), and only the special-token
strings the chat template writes itself become special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.errors import DataError

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


def _content_spans(tokenizer, messages: list[Message], full: str) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendering `full` (a prefix-stable template writes message i
    between the renderings of the conversation up to i-1 and up to i)."""
    spans = []
    before = ""
    for i, msg in enumerate(messages):
        upto = _render(tokenizer, messages[: i + 1], False)
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


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises TemplateError and friends for templates that reject a conversation
        raise DataError(f"chat template failed to render the conversation: {type(e).__name__}: {e}") from None


def end_tokens(tokenizer, eos_token_ids: Sequence[int] | None = None) -> list[tuple[int, str]]:
    """(id, text) of the tokens that end an assistant turn: the given EOS ids, else the tokenizer's EOS."""
    ids = list(eos_token_ids) if eos_token_ids else []
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return [(i, _decode(tokenizer, [i])) for i in ids]


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


def _chat(tokenizer, messages: list[Message], add_generation_prompt: bool,
          eos: list[tuple[int, str]]) -> tuple[list[int], list[int], list[str]]:
    full = _render(tokenizer, messages, add_generation_prompt)
    specials = special_strings(tokenizer)
    # a message holding special-token text: its content is tokenized as text, the template's own tokens as tokens
    spans = (_content_spans(tokenizer, messages, full)
             if any(sp in m["content"] for m in messages for sp in specials) else None)
    ids = _encode(tokenizer, full) if spans is None else _encode_spans(tokenizer, full, spans)
    mask = [0] * len(ids)
    expected = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        pre = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
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
        t0 = _token_boundary(tokenizer, full, start, ids, f"start of assistant turn {i}", spans)
        t1 = _token_boundary(tokenizer, full, end, ids, f"end of assistant turn {i}", spans)
        for t in range(t0, t1):
            mask[t] = 1
        expected.append(content + eos_text)
    return ids, mask, expected


def _plain(tokenizer, messages: list[Message], add_bos: bool, separator: str,
           eos: list[tuple[int, str]]) -> tuple[list[int], list[int], list[str]]:
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
            part = encode_text(tokenizer, msg["content"]) + [eos_id]
            ids += part
            mask += [1] * len(part)
            expected.append(msg["content"] + eos_text)
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


def verify_mask(tokenizer, ids: Sequence[int], mask: Sequence[int], expected: list[str]) -> None:
    """Decode each masked span; it must be exactly the expected assistant text (+ end-of-turn token)."""
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


def tokenize_conversation(tokenizer, messages: list[Message], *, mode: str = "auto",
                          add_generation_prompt: bool = False, eos_token_ids: Sequence[int] | None = None,
                          plain_separator: str = "\n", add_bos: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1 = assistant token the model learns, end-of-turn token included).

    `messages` are {"role": "system"|"user"|"assistant", "content": str}. With `add_generation_prompt`
    the ids end where the next assistant turn starts (a generation prompt). Raises DataError when the
    template cannot be masked or the decode-back check fails.
    """
    if not messages:
        raise DataError("empty conversation")
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise DataError(f"bad message {str(m)[:80]}: needs role system/user/assistant and text content")
    eos = end_tokens(tokenizer, eos_token_ids)
    if resolve_mode(tokenizer, mode) == "chat":
        ids, mask, expected = _chat(tokenizer, messages, add_generation_prompt, eos)
    else:
        ids, mask, expected = _plain(tokenizer, messages, add_bos, plain_separator, eos)
    verify_mask(tokenizer, ids, mask, expected)
    return ids, mask


def build_messages(turns: list[str], responses: list[str], system: str | None = None) -> list[Message]:
    """Interleave user turns and assistant responses (len(responses) may be len(turns) - 1 for a prompt)."""
    out: list[Message] = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if i < len(responses):
            out.append({"role": "assistant", "content": responses[i]})
    return out
