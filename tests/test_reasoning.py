"""Reasoning targets: Qwen3's real chat template (tests/fixtures/qwen3), `chat_template_kwargs` per source
(`enable_thinking` on and off), and the `reasoning` policy (keep, drop, mask) on kept and regenerated answers.

Every mask is checked by decoding its learned spans back: with keep they hold the thinking, with mask and
drop they do not. The regenerated rows come from a tiny Qwen3 that really writes `<think>...</think>` before
its answer (tiny_models.build_thinking_qwen3), and an EAGLE-3 head trains a few steps on the masked rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    QWEN3_TEMPLATE,
    THINK_TAGS,
    build_qwen3_tokenizer,
    build_thinking_qwen3,
    build_tiny_family,
)

from draftsmith.data import generate_dataset, load_distilled, tokenize_conversation
from draftsmith.data.config import ChatConfig, DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import read_provenance
from draftsmith.data.masks import masked_spans, verify_mask
from draftsmith.data.reasoning import drop_thinking, thinking_end, thinking_tokens
from draftsmith.errors import DataError

THOUGHT = "<think>\nThe sum of two and two.\n</think>\n\n"
ANSWER = "The answer is 4."
CONVO = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": THOUGHT + ANSWER}]
PROMPT_ON = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_OFF = PROMPT_ON + "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module", autouse=True)
def _plain_linears():
    """F.linear everywhere: the CPU kernel plan (targets/gemm.py) would measure these shapes afresh, seconds of
    work that has nothing to do with reasoning data."""
    from draftsmith.targets import gemm

    with gemm.disabled():
        yield


@pytest.fixture(scope="module")
def qwen3_tok():
    return build_qwen3_tokenizer()


def _learned(tok, ids, mask) -> list[str]:
    return [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in masked_spans(ids, mask)]


def test_the_fixture_is_qwen3s_template_as_its_readme_names_it():
    readme = (QWEN3_TEMPLATE.parent / "README.md").read_text()
    digest = hashlib.sha256(QWEN3_TEMPLATE.read_bytes()).hexdigest()
    assert digest in readme and "Apache" in readme and "Qwen/Qwen3-0.6B" in readme
    assert "enable_thinking is defined and enable_thinking is false" in QWEN3_TEMPLATE.read_text()


def test_thinking_on_and_off_render_as_qwen3_does(qwen3_tok):
    user = CONVO[:1]
    render = lambda **kw: qwen3_tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kw)  # noqa: E731
    assert render() == render(enable_thinking=True) == PROMPT_ON  # on by default: the model opens <think> itself
    assert render(enable_thinking=False) == PROMPT_OFF  # off: the template closes an empty block
    for kwargs, text in (({"enable_thinking": True}, PROMPT_ON), ({"enable_thinking": False}, PROMPT_OFF)):
        ids, mask = tokenize_conversation(qwen3_tok, user, add_generation_prompt=True, template_kwargs=kwargs)
        assert qwen3_tok.decode(ids, skip_special_tokens=False) == text and not any(mask)
    # an answer without thinking gets Qwen3's empty block before it, outside the learned span
    ids, mask = tokenize_conversation(qwen3_tok, [*user, {"role": "assistant", "content": ANSWER}],
                                      template_kwargs={"enable_thinking": False})
    assert qwen3_tok.decode(ids, skip_special_tokens=False) == PROMPT_OFF + ANSWER + "<|im_end|>\n"
    assert _learned(qwen3_tok, ids, mask) == [ANSWER + "<|im_end|>"]


@pytest.mark.parametrize("enable_thinking", [True, None])
def test_each_policy_gives_its_rows_and_masks(qwen3_tok, enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    rows = {p: tokenize_conversation(qwen3_tok, CONVO, reasoning=p, template_kwargs=kwargs)
            for p in ("keep", "mask", "drop")}
    text = {p: qwen3_tok.decode(ids, skip_special_tokens=False) for p, (ids, _) in rows.items()}
    learned = {p: _learned(qwen3_tok, *rows[p]) for p in rows}
    # keep: the thinking is in the row and learned
    assert text["keep"] == PROMPT_ON + THOUGHT + ANSWER + "<|im_end|>\n"
    assert learned["keep"] == [THOUGHT + ANSWER + "<|im_end|>"]
    # mask: the same tokens, the thinking out of the loss (the learned span starts right after </think>)
    assert rows["mask"][0] == rows["keep"][0]
    assert learned["mask"] == ["\n\n" + ANSWER + "<|im_end|>"]
    assert not any(t in learned["mask"][0] for t in (*THINK_TAGS, "sum of two"))
    # drop: the thinking is gone from the row's text (Qwen3's template writes its empty block instead)
    assert text["drop"] == PROMPT_OFF + ANSWER + "<|im_end|>\n" and "sum of two" not in text["drop"]
    assert learned["drop"] == [ANSWER + "<|im_end|>"]


def test_drop_with_thinking_off_is_the_conversation_qwen3_serves(qwen3_tok):
    """Thinking off: the generation prompt holds the empty block, and a dropped answer follows it."""
    prompt, _ = tokenize_conversation(qwen3_tok, CONVO[:1], add_generation_prompt=True,
                                      template_kwargs={"enable_thinking": False})
    ids, mask = tokenize_conversation(qwen3_tok, CONVO, reasoning="drop", template_kwargs={"enable_thinking": False})
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert _learned(qwen3_tok, ids, mask) == [ANSWER + "<|im_end|>"]
    # keeping the thinking while the template is told there is none is a conversation the template cannot mask
    with pytest.raises(DataError, match="prefix-stable"):
        tokenize_conversation(qwen3_tok, CONVO, reasoning="keep", template_kwargs={"enable_thinking": False})


def test_the_mask_check_refuses_thinking_in_a_learned_span(qwen3_tok):
    ids, mask = tokenize_conversation(qwen3_tok, CONVO, reasoning="keep")
    (a, b), = masked_spans(ids, mask)
    whole = qwen3_tok.decode(ids[a:b], skip_special_tokens=False)
    verify_mask(qwen3_tok, ids, mask, [whole])  # keep: the thinking is meant to be learned
    with pytest.raises(DataError, match="holds '<think>'"):
        verify_mask(qwen3_tok, ids, mask, [whole], forbidden=THINK_TAGS)


@pytest.mark.parametrize("policy", ["mask", "drop"])
def test_an_answer_that_is_all_thinking_is_refused_in_one_line(qwen3_tok, policy):
    convo = [CONVO[0], {"role": "assistant", "content": "<think>\nstill thinking when it was cut"}]
    with pytest.raises(DataError, match="all thinking") as e:
        tokenize_conversation(qwen3_tok, convo, reasoning=policy)
    assert "\n" not in str(e.value)


def test_plain_mode_masks_thinking_too(qwen3_tok):
    ids, mask = tokenize_conversation(qwen3_tok, CONVO, mode="plain", reasoning="mask")
    assert _learned(qwen3_tok, ids, mask) == ["\n\n" + ANSWER + "<|im_end|>"]
    assert "sum of two" in qwen3_tok.decode(ids, skip_special_tokens=False)


def test_thinking_spans_are_read_as_qwen3s_template_reads_them(qwen3_tok):
    assert thinking_end(THOUGHT + ANSWER) == len(THOUGHT) - 2  # up to the closing tag
    assert drop_thinking(THOUGHT + ANSWER) == ANSWER
    assert drop_thinking("reasoned in the prompt's block</think>\n" + ANSWER) == ANSWER  # DeepSeek-R1: no opening tag
    assert drop_thinking(ANSWER) == ANSWER and thinking_end(ANSWER) == 0
    assert thinking_end("  <think>\nnever closed") == len("  <think>\nnever closed")
    ids = qwen3_tok(THOUGHT + ANSWER, add_special_tokens=False)["input_ids"]
    n = thinking_tokens(qwen3_tok, ids)
    assert qwen3_tok.decode(ids[:n]).endswith("</think>") and "</think>" not in qwen3_tok.decode(ids[: n - 1])
    assert thinking_tokens(qwen3_tok, ids[:3]) == 3 and thinking_tokens(qwen3_tok, ids[n + 2:]) == 0


def test_config_per_source_over_the_defaults(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("{}\n")
    cfg = DataConfig(sources=[SourceConfig(name="a", path=str(src), prompt="q", domain="chat"),
                              SourceConfig(name="b", path=str(src), prompt="q", domain="chat", reasoning="drop",
                                           chat_template_kwargs={"enable_thinking": True})],
                     output_dir=str(tmp_path / "out"), reasoning="mask",
                     chat=ChatConfig(template_kwargs={"enable_thinking": False, "x": 1}))
    a, b = cfg.source_chat("a"), cfg.source_chat("b")
    assert (a.reasoning, a.template_kwargs, a.think_tags) == ("mask", {"enable_thinking": False, "x": 1}, THINK_TAGS)
    assert (b.reasoning, b.template_kwargs) == ("drop", {"enable_thinking": True, "x": 1})
    with pytest.raises(ValueError, match="sources.c.reasoning"):
        SourceConfig(name="c", path=str(src), prompt="q", domain="chat", reasoning="hide")
    with pytest.raises(ValueError, match="add_generation_prompt is set by draftsmith"):
        SourceConfig(name="c", path=str(src), prompt="q", domain="chat",
                     chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat.think_tags"):
        ChatConfig(think_tags=["<think>"])


def _sources(tmp: Path, rows: dict[str, list], **fields) -> list[SourceConfig]:
    out = []
    for name, lines in rows.items():
        path = tmp / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        reasoning = name.split("-")[-1]
        out.append(SourceConfig(name=name, path=str(path), domain="chat", reasoning=reasoning,
                                chat_template_kwargs={"enable_thinking": True}, **fields))
    return out


def test_kept_answers_follow_each_sources_policy(qwen3_tok, tmp_path):
    """responses: keep on a tiny Qwen3 target with the real template: one source per policy."""
    from draftsmith.targets import load_target

    target = load_target(str(build_tiny_family("qwen3", qwen3_tok, tmp_path / "qwen3")))
    convos = {f"think-{p}": [{"messages": [{"role": "user", "content": f"Question {i} for {p}?"},
                                          {"role": "assistant", "content": THOUGHT + f"Answer {i}."}]}
                             for i in range(3)] for p in ("keep", "mask", "drop")}
    cfg = DataConfig(sources=_sources(tmp_path, convos, messages="messages"), output_dir=str(tmp_path / "data"),
                     responses="keep")
    generate_dataset(cfg, target, progress=False)
    ds = load_distilled(tmp_path / "data", target)
    assert len(ds) == 9
    for row in ds:
        policy = row["source"].split("-")[-1]
        learned = _learned(qwen3_tok, row["input_ids"], row["loss_mask"])
        text = qwen3_tok.decode(row["input_ids"], skip_special_tokens=False)
        assert len(learned) == 1 and learned[0].endswith(".<|im_end|>")
        assert ("sum of two" in learned[0]) == (policy == "keep")
        assert ("sum of two" in text) == (policy != "drop") == ("sum of two" in row["response"])
    used = read_provenance(tmp_path / "data")["sources_chat"]
    assert used["think-mask"] == {"chat_template_kwargs": {"enable_thinking": True}, "reasoning": "mask",
                                  "think_tags": list(THINK_TAGS)}


@pytest.fixture(scope="module")
def thinking_target(qwen3_tok, tmp_path_factory):
    from draftsmith.targets import load_target

    return load_target(str(build_thinking_qwen3(qwen3_tok, tmp_path_factory.mktemp("thinking") / "q")))


def test_regenerated_answers_follow_each_sources_policy_and_train(qwen3_tok, thinking_target, tmp_path):
    """The target writes `<think>The quick</think>Paris`; keep learns all of it, mask only `Paris`, drop
    rebuilds the row without the thinking; then an EAGLE-3 head trains on the masked rows."""
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import TrainConfig, train

    prompts = {f"think-{p}": [{"q": f"Question {i} for {p}?"} for i in range(6)] for p in ("keep", "mask", "drop")}
    cfg = DataConfig(sources=_sources(tmp_path, prompts, prompt="q"), output_dir=str(tmp_path / "data"),
                     generation=GenerationConfig(max_new_tokens=24, batch_size=4, threads=1))
    generate_dataset(cfg, thinking_target, progress=False)
    ds = load_distilled(tmp_path / "data", thinking_target)
    assert len(ds) == 18
    want = {"keep": "<think>The quick</think>Paris<|im_end|>", "mask": "Paris<|im_end|>", "drop": "Paris<|im_end|>"}
    for row in ds:
        policy = row["source"].split("-")[-1]
        assert row["stopped"]
        assert _learned(qwen3_tok, row["input_ids"], row["loss_mask"]) == [want[policy]]
        text = qwen3_tok.decode(row["input_ids"], skip_special_tokens=False)
        assert ("The quick" in text) == (policy != "drop") == ("The quick" in row["response"])
        if policy == "drop":  # Qwen3's own rendering of the answer without thinking
            assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nParis<|im_end|>\n")

    masked = ds.filter(lambda r: r["source"] == "think-mask")
    train_cfg = TrainConfig(lr=3e-3, max_steps=3, batch_size=2, warmup_steps=0, output_dir=str(tmp_path / "run"),
                            resume="never", progress=False, log_every=1, eval_every=0, eval_batches=1)
    ecfg = EagleJobConfig(target=str(thinking_target.folder), data="in-memory", output=str(tmp_path / "eagle3"),
                          version="eagle3", ttt_steps=2, draft_vocab_size=64, max_length=64, train=train_cfg,
                          evaluate=EvalAfterTraining(enabled=False))
    torch.manual_seed(0)
    result = train(EagleJob(ecfg, thinking_target, masked), ecfg.train)
    assert (Path(result.artifact) / "model.safetensors").is_file()


def test_a_multi_turn_conversation_on_qwen3s_template_is_refused_in_one_line(qwen3_tok):
    """Qwen3's template drops earlier turns' thinking and writes an empty block before the last answer only, so
    rendering more of a conversation rewrites what came before: no loss mask can be built (docs/data.md)."""
    convo = [*CONVO, {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
    with pytest.raises(DataError, match="not prefix-stable at assistant turn 1") as e:
        tokenize_conversation(qwen3_tok, convo, reasoning="mask")
    assert "\n" not in str(e.value)


def test_rows_written_under_another_policy_are_not_resumed(thinking_target, tmp_path):
    prompts = {"think-mask": [{"q": "Question one?"}, {"q": "Question two?"}]}
    cfg = DataConfig(sources=_sources(tmp_path, prompts, prompt="q"), output_dir=str(tmp_path / "data"),
                     generation=GenerationConfig(max_new_tokens=24, batch_size=2, threads=1))
    generate_dataset(cfg, thinking_target, progress=False)
    cfg.sources[0].reasoning = "keep"
    with pytest.raises(DataError, match="different sources_chat"):
        generate_dataset(cfg, thinking_target, progress=False, overwrite=True)


def test_evaluation_prompts_render_with_the_datas_template_arguments(qwen3_tok, thinking_target, tmp_path):
    """`evaluate` reads prompts through the same template arguments as the rows the head learned from: with
    thinking off, Qwen3's generation prompt carries the empty thinking block; the report records them."""
    from draftsmith.evaluation.domains import format_prompt
    from draftsmith.evaluation.evaluate import evaluate

    on, off = (qwen3_tok.decode(format_prompt(qwen3_tok, "Capital of France?", kw))
               for kw in (None, {"enable_thinking": False}))
    assert off == on + "<think>\n\n</think>\n\n"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": ["Capital of France?"]}) + "\n")
    report = evaluate(thinking_target, "ngram", prompts=[str(prompts)], max_new_tokens=6,
                      k=2, cost_model=False, repeats=1, chat_template_kwargs={"enable_thinking": False})
    assert report["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert report["overall"]["lossless"] is True
