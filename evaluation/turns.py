"""Multi-turn evaluation: every user turn of a conversation is one measured generation (MT-bench, EAGLE).

Turn k's prompt is the target's chat template over user turns 1..k with the target's OWN answers to turns
1..k-1, taken from the plain decoding of the same evaluation (k = 0 through the verifier, the run every
speculative output is checked against): the context is what the target itself would have said, as MT-bench
and EAGLE's evaluation build it. Under sampling the earlier answers are plain decoding's seeded samples, and
every run of turn k (plain, speculative, HF generate, side by side) decodes from that same context, so the
runs of one turn stay comparable.

An answer is written back as text and the template renders it again. That is the conversation the target
saw only when the template is prefix-stable over turns: turn k's rendering must begin with turn k-1's prompt
followed by the answer as it was written (up to whitespace at its ends, which templates such as Llama 3's
trim). Qwen3's template is not: it drops an earlier answer's thinking, and with thinking off its generation
prompt holds an empty thinking block that the history does not. A later turn there would be decoded from a
context the target never produced, so it is refused in one line (`--turns first` measures first turns).

Without a chat template, turn k's prompt is turn k-1's prompt, the tokens the target wrote, a newline and the
next user turn: exactly what it saw.

The context window holds the whole conversation: a row is measured on as many turns as fit when each earlier
answer takes its full `max_new_tokens` (`evaluation.limits.fit_context`); a row cut short is named, with why,
in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.data.chat import build_messages, has_chat_template, render_chat
from draftsmith.errors import ConfigError
from draftsmith.evaluation.domains import EvalPrompt, format_prompt


def _render(tokenizer, turns: list[str], answers: list[str], kwargs: dict | None, what: str,
            tokenize: bool = False) -> str | list[int]:
    """The user `turns` answered by `answers`, to the next assistant turn (data/chat.py's render_chat); a
    template that rejects them is a ConfigError naming the prompt."""
    return render_chat(tokenizer, build_messages(turns, answers), template_kwargs=kwargs, tokenize=tokenize,
                       where=what, error=ConfigError)


def conversation_bound(tokenizer, turns: list[str], max_new_tokens: int, kwargs: dict | None, what: str) -> int:
    """The most tokens the prompt of the last of `turns` can take: the template over the user turns with empty
    answers, plus `max_new_tokens` for each earlier answer."""
    earlier = len(turns) - 1
    if has_chat_template(tokenizer):  # counted as the prompt is made: the turns' own text as text
        base = len(_render(tokenizer, turns, [""] * earlier, kwargs, what, tokenize=True))
    else:
        base = len(format_prompt(tokenizer, turns[0])) + sum(len(_plain_turn(tokenizer, t)) for t in turns[1:])
    return base + earlier * max_new_tokens


def _plain_turn(tokenizer, text: str) -> list[int]:
    """A later user turn without a template: a newline and its text, which stays text (no control tokens)."""
    return list(tokenizer("\n" + text, add_special_tokens=False, split_special_tokens=True).input_ids)


@dataclass
class Conversation:
    """One row decoded turn by turn: the prompt ids of each turn, built from the answers given so far."""

    row: EvalPrompt
    template_kwargs: dict | None = None
    answers: list[str] = field(default_factory=list)  # the target's answers as text (for the template)
    last_ids: list[int] = field(default_factory=list)  # the newest turn's prompt and, once answered, its answer

    def source(self, turn: int) -> str:
        """The row's file:line, and which turn after turn 1 (each turn is a prompt of the report)."""
        return self.row.source if turn == 0 else f"{self.row.source}#turn{turn + 1}"

    def prompt(self, tokenizer, turn: int) -> list[int]:
        """Turn `turn`'s (0-based) prompt ids; every earlier turn must have been answered (`answered`)."""
        if turn != len(self.answers):
            raise ConfigError(f"prompt {self.row.source}: turn {turn + 1} asked before turn {len(self.answers)} "
                              "was answered")
        if turn == 0:
            self.last_ids = format_prompt(tokenizer, self.row.text, self.template_kwargs)
        elif not has_chat_template(tokenizer):
            self.last_ids = self.last_ids + _plain_turn(tokenizer, self.row.turns[turn])
        else:
            self.last_ids = self._templated(tokenizer, turn)
        return list(self.last_ids)

    def _templated(self, tokenizer, turn: int) -> list[int]:
        what = f"prompt {self.source(turn)}"
        before = _render(tokenizer, self.row.turns[:turn], self.answers[:-1], self.template_kwargs, what)
        now = _render(tokenizer, self.row.turns[: turn + 1], self.answers, self.template_kwargs, what)
        said = self.answers[-1]
        if not (now.startswith(before + said) or now.startswith(before + said.strip())):
            raise ConfigError(f"{what}: the chat template does not render the target's answer to turn {turn} as "
                              "the target wrote it (not prefix-stable over turns: Qwen3's drops earlier thinking), "
                              "so a later turn would be decoded from a context the target never produced; "
                              "evaluate first turns only (--turns first)")
        return _render(tokenizer, self.row.turns[: turn + 1], self.answers, self.template_kwargs, what, tokenize=True)

    def answered(self, tokenizer, tokens: list[int], eos: set[int]) -> None:
        """Plain decoding's answer to the newest turn (its tokens, an end-of-sequence token last if it stopped)."""
        body = tokens[:-1] if tokens and tokens[-1] in eos else list(tokens)
        self.answers.append(tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        self.last_ids = self.last_ids + list(tokens)
