"""Multi-turn evaluation (evaluation/turns.py): every user turn of a conversation is one measured generation,
its context the earlier user turns and the target's own answers to them; a template that does not render
earlier answers as the target wrote them (Qwen3's) is refused for later turns; the context holds the whole
conversation."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build_qwen3_tokenizer, build_thinking_qwen3, plain_linears_one_thread

from draftsmith.errors import ConfigError
from draftsmith.evaluation.domains import format_prompt, load_prompts

TURNS = ["Name three colors.", "Now say them in French.", "Which one is your favourite?"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with plain_linears_one_thread():
        yield


@pytest.fixture
def chat_files(tmp_path):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"category": "chat", "turns": TURNS}) + "\n")
    (tmp_path / "code.jsonl").write_text(json.dumps({"category": "code", "turns": ["def add(a, b):"]}) + "\n")
    return [tmp_path / "chat.jsonl", tmp_path / "code.jsonl"]


def _evaluate(target, files, monkeypatch=None, **kw):
    from draftsmith.evaluation.evaluate import evaluate

    return evaluate(target, "ngram", prompts=files, max_new_tokens=10, k=2, cost_model=False, repeats=1,
                    remeasure=0, **kw)


def _hf_greedy(target, ids: list[int], n: int) -> list[int]:
    from draftsmith.decoding.hf import cut_at_eos

    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                eos_token_id=list(target.eos_token_ids), pad_token_id=target.tokenizer.pad_token_id)
    return cut_at_eos(out[0, len(ids):].tolist(), set(target.eos_token_ids))[0]


def test_every_turn_is_measured_losslessly_from_the_targets_own_answers(tiny_target, chat_files, monkeypatch):
    from draftsmith.evaluation import turns as turns_mod

    seen: dict[int, list[int]] = {}
    real = turns_mod.Conversation.prompt

    def spy(self, tokenizer, turn):
        ids = real(self, tokenizer, turn)
        if self.row.domain == "chat":
            seen[turn] = ids
        return ids

    monkeypatch.setattr(turns_mod.Conversation, "prompt", spy)
    report = _evaluate(tiny_target, chat_files)
    recs = report["prompts"]
    assert [(r["domain"], r["turn"]) for r in recs] == [("chat", 1), ("chat", 2), ("chat", 3), ("code", 1)]
    assert [r["source"] for r in recs][:3] == ["chat.jsonl:1", "chat.jsonl:1#turn2", "chat.jsonl:1#turn3"]
    assert all(r["lossless"] is True for r in recs)  # each turn equal to HF generate's greedy output
    assert report["settings"]["turns"] == "all" and report["settings"]["turns_cut"] == []

    # turn 2's prompt: turn 1's prompt, the answer the target itself gives it (HF generate, independent of the
    # run), then the second user turn; turn 3's holds both answers
    tok = tiny_target.tokenizer
    eos = set(tiny_target.eos_token_ids)
    first = format_prompt(tok, TURNS[0])
    assert seen[0] == first
    answer1 = _hf_greedy(tiny_target, first, 10)
    assert answer1 and answer1[-1] not in eos  # ten tokens of text: the check below is not about an empty answer
    text1 = tok.decode([t for t in answer1 if t not in eos], skip_special_tokens=False)
    turn2 = tok.decode(seen[1], skip_special_tokens=False)
    assert turn2.startswith(tok.decode(first, skip_special_tokens=False) + text1)
    assert turn2.endswith(TURNS[1] + "<|im_end|>\n<|im_start|>assistant\n")
    answer2 = _hf_greedy(tiny_target, seen[1], 10)
    turn3 = tok.decode(seen[2], skip_special_tokens=False)
    assert turn3.startswith(turn2 + tok.decode([t for t in answer2 if t not in eos], skip_special_tokens=False))
    assert [r["prompt_tokens"] for r in recs[:3]] == [len(seen[0]), len(seen[1]), len(seen[2])]

    # aggregation: a domain counts every turn; turn 1 and turns 2+ are split off for multi-turn domains
    chat, overall = report["domains"]["chat"], report["overall"]
    assert chat["n_prompts"] == 3 and overall["n_prompts"] == 4
    assert chat["turns"]["1"]["n_prompts"] == 1 and chat["turns"]["2+"]["n_prompts"] == 2
    assert chat["turns"]["2+"]["mean_prompt_tokens"] == (len(seen[1]) + len(seen[2])) / 2
    assert chat["new_tokens"] == sum(r["new_tokens"] for r in recs[:3])
    assert overall["new_tokens"] == sum(r["new_tokens"] for r in recs)
    if chat["proposed"]:
        assert chat["alpha"] == pytest.approx(chat["accepted"] / chat["proposed"])
    assert "turns" not in report["domains"]["code"] and "turns" in overall
    from draftsmith.evaluation.report import render_markdown

    assert "## Per turn (multi-turn prompts)" in render_markdown(report)


def test_turns_first_is_the_single_turn_evaluation(tiny_target, chat_files):
    every = _evaluate(tiny_target, chat_files)
    first = _evaluate(tiny_target, chat_files, turns="first")
    assert [(r["source"], r["turn"]) for r in first["prompts"]] == [("chat.jsonl:1", 1), ("code.jsonl:1", 1)]
    assert first["settings"]["turns"] == "first" and "turns" not in first["overall"]
    ones = [r for r in every["prompts"] if r["turn"] == 1]
    for a, b in zip(first["prompts"], ones):  # turn 1 is decoded exactly as a single-turn run decodes it
        assert ((a["prompt_tokens"], a["new_tokens"], a["alpha"], a["tau"]) ==
            (b["prompt_tokens"], b["new_tokens"], b["alpha"], b["tau"]))
    assert first["domains"]["code"]["tau"] == every["domains"]["code"]["tau"]
    with pytest.raises(ValueError, match="turns must be one of all, first"):
        _evaluate(tiny_target, chat_files, turns="last")


def test_the_context_holds_the_whole_conversation(tiny_target, chat_files):
    from draftsmith.evaluation.limits import fit_context

    rows = load_prompts(chat_files)
    assert fit_context(tiny_target, rows, 10)[0] == [3, 1]
    # 512 positions: turn 3 after two answers of up to 200 tokens each, and 200 more, cannot fit
    counts, cut = fit_context(tiny_target, rows, 200)
    assert counts == [2, 1] and len(cut) == 1
    assert cut[0]["prompt"] == "chat.jsonl:1" and cut[0]["measured"] == 2 and cut[0]["turns"] == 3
    assert "turn 3's prompt" in cut[0]["reason"] and "context of 512 positions" in cut[0]["reason"]
    assert fit_context(tiny_target, rows, 200, turns="first") == ([1, 1], [])
    with pytest.raises(ConfigError, match="chat.jsonl:1: a prompt of .* context of 512"):
        fit_context(tiny_target, rows, 510)  # the first turn itself is refused, as before


def test_a_template_that_drops_earlier_thinking_is_refused_for_later_turns(tmp_path):
    """Qwen3's real template (tests/fixtures/qwen3): the tiny Qwen3 thinks before it answers, and the template
    renders that answer without its thinking in turn 2's prompt: refused in one line; first turns still run."""
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.targets import load_target

    tok = build_qwen3_tokenizer()
    target = load_target(str(build_thinking_qwen3(tok, tmp_path / "q")))
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"category": "chat", "turns": TURNS[:2]}) + "\n")
    kw = dict(prompts=[f], max_new_tokens=12, k=2, cost_model=False, repeats=1, remeasure=0, hf_reference=False)
    with pytest.raises(ConfigError, match=r"chat.jsonl:1#turn2: the chat template does not render the target's "
                                          r"answer to turn 1 .*--turns first"):
        evaluate(target, "ngram", **kw)
    assert evaluate(target, "ngram", **kw, turns="first")["overall"]["n_prompts"] == 1
    # thinking off: the generation prompt's empty thinking block is not in the history either
    from draftsmith.evaluation.turns import Conversation

    conv = Conversation(load_prompts([f])[0], {"enable_thinking": False})
    conv.prompt(tok, 0)
    conv.answered(tok, tok("Paris", add_special_tokens=False).input_ids, set())
    with pytest.raises(ConfigError, match="not prefix-stable over turns"):
        conv.prompt(tok, 1)


# Llama 3's template, in the tiny tokenizer's tokens: every message's content is trimmed (`| trim`)
TRIMMING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_later_turn_is_decoded_under_a_template_that_trims_the_answer(tiny_tokenizer):
    """The module's promise: a template that trims the ends of an earlier answer (Llama 3's) is prefix-stable
    up to that whitespace, so a later turn is measured. Its prompt ids came from the data pipeline's loss-mask
    builder, which looked for the untrimmed answer in the rendering and refused it ("does not write assistant
    turn 1 verbatim", a DataError); they now come from data/chat.py's render_chat, like every other prompt."""
    import copy

    from draftsmith.evaluation.domains import EvalPrompt
    from draftsmith.evaluation.turns import Conversation

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TRIMMING_TEMPLATE
    conv = Conversation(EvalPrompt("chat", TURNS[0], "chat.jsonl:1", TURNS[:2]))
    conv.prompt(tok, 0)
    conv.answered(tok, tok("Red, green and blue.\n", add_special_tokens=False).input_ids, set())
    ids = conv.prompt(tok, 1)
    want = tok.apply_chat_template([{"role": "user", "content": TURNS[0]},
                                    {"role": "assistant", "content": "Red, green and blue."},
                                    {"role": "user", "content": TURNS[1]}],
                                   tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False) == want
