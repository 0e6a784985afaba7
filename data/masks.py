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

Every rendering goes through data/chat.py's `render_chat`, so a message's own text never becomes control
tokens here either (a special-token string typed in a message stays text).
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.data.chat import (
    Message,
    content_spans,
    encode_spans,
    encode_template,
    encode_text,
    has_chat_template,
    holds_special_text,
    render_chat,
    with_reasoning,
)
from draftsmith.data.reasoning import DEFAULT_TAGS, answer_start, thinking_end
from draftsmith.errors import DataError, show


def resolve_mode(tokenizer, mode: str = "auto") -> str:
    """'chat' or 'plain' for this tokenizer; 'chat' without a template is an error."""
    if mode == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    if mode == "chat" and not has_chat_template(tokenizer):
        raise DataError("chat.mode is 'chat' but the tokenizer has no chat template (use mode: plain or auto)")
    if mode not in ("chat", "plain"):
        raise DataError(f"unknown chat mode {mode!r}")
    return mode


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def end_tokens(tokenizer, eos_token_ids: Sequence[int] | None = None) -> list[tuple[int, str]]:
    """(id, text) of the tokens that end an assistant turn: the given EOS ids, else the tokenizer's EOS."""
    ids = list(eos_token_ids) if eos_token_ids else []
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return [(i, _decode(tokenizer, [i])) for i in ids]


def _token_boundary(tokenizer, text: str, char: int, full_ids: list[int], what: str,
                    spans: list[tuple[int, int]] | None = None) -> int:
    """Token index where character `char` of `text` starts, if the tokenization splits there."""
    before = text[:char]
    prefix = encode_template(tokenizer, before) if spans is None else encode_spans(tokenizer, before, spans)
    if full_ids[: len(prefix)] != prefix:
        raise DataError(
            f"chat template: the {what} does not fall on a token boundary (tokenizing the text before it "
            "is not a prefix of the full tokenization), so its loss mask cannot be computed"
        )
    return len(prefix)


def _chat(tokenizer, messages: list[Message], add_generation_prompt: bool, eos: list[tuple[int, str]],
          kwargs: dict, mask_thinking: bool, tags) -> tuple[list[int], list[int], list[str]]:
    full = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       template_kwargs=kwargs)
    # a message holding special-token text: its content is tokenized as text, the template's own tokens as tokens
    spans = (content_spans(tokenizer, messages, full, kwargs)
             if holds_special_text(tokenizer, messages) else None)
    ids = encode_template(tokenizer, full) if spans is None else encode_spans(tokenizer, full, spans)
    mask = [0] * len(ids)
    expected = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        pre = render_chat(tokenizer, messages[:i], template_kwargs=kwargs) if i else ""
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=kwargs)
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
    messages = with_reasoning(messages, reasoning, think_tags)  # drop: thinking removed before rendering
    masking = reasoning == "mask"
    eos = end_tokens(tokenizer, eos_token_ids)
    if resolve_mode(tokenizer, mode) == "chat":
        ids, mask, expected = _chat(tokenizer, messages, add_generation_prompt, eos, template_kwargs or {}, masking,
                                    think_tags)
    else:
        ids, mask, expected = _plain(tokenizer, messages, add_bos, plain_separator, eos, masking, think_tags)
    verify_mask(tokenizer, ids, mask, expected, forbidden=think_tags if masking else ())
    return ids, mask
