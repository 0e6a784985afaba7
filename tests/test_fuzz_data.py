"""Fuzzing the data boundary's readers (tests/fuzzing.py): prompt files (evaluation's and a training source's),
row packs, and what a generation server answers. Each reads its input or refuses it in one line naming it."""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.fuzzing import FUZZ, FUZZ_LONG, PLACES, mutated_doc, mutated_jsonl, place, refuses_cleanly

PROMPT_ROWS = [
    {"question_id": 1, "category": "math", "turns": ["What is 2 + 3?", "And then?"]},
    {"id": "t0", "motivation_app": "Gmail", "instruction": "Rewrite politely.", "instances": [{"input": "send it"}]},
    {"domain": "rag", "messages": [{"role": "user", "content": "Read this."}, {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "Now answer."}]},
    {"prompt": "Say hi."},
]


def _eval_prompts(tmp_path, data: bytes, how: str):
    from draftsmith.evaluation.domains import load_prompts

    path = place(tmp_path / "prompts.jsonl", data, how)
    prompts = refuses_cleanly(lambda: load_prompts([path]), path.name)
    for p in prompts or []:
        assert p.turns and all(isinstance(t, str) and t.strip() for t in p.turns) and p.text == p.turns[0]


def _training_prompts(tmp_path, data: bytes, how: str):
    from draftsmith.config import from_dict
    from draftsmith.data.config import DataConfig
    from draftsmith.data.sources import load_prompts

    path = place(tmp_path / "train.jsonl", data, how)
    cfg = from_dict(DataConfig, {"target": "x", "output_dir": str(tmp_path / "o"), "malformed": "skip", "sources": [
        {"name": "s", "type": "jsonl", "path": str(path), "turns": "turns", "domain_rules": [
            {"field": "category", "pattern": "math", "domain": "math"}], "domain": "general"}]})
    got = refuses_cleanly(lambda: load_prompts(cfg), path.name)
    for r in got.rows if got else []:
        assert r.turns and all(isinstance(t, str) and t.strip() for t in r.turns)


@FUZZ
@given(mutated_jsonl(PROMPT_ROWS), PLACES)
def test_fuzz_eval_prompt_file(tmp_path, data, how):
    _eval_prompts(tmp_path, data, how)


@FUZZ
@given(mutated_jsonl([{"turns": ["What is 2 + 3?", "And then?"], "category": "math"}, {"turns": "Say hi."}]), PLACES)
def test_fuzz_training_prompt_source(tmp_path, data, how):
    _training_prompts(tmp_path, data, how)


@pytest.mark.slow
@FUZZ_LONG
@given(mutated_jsonl(PROMPT_ROWS), mutated_jsonl([{"turns": ["a b", "c"], "category": "math"}]), PLACES)
def test_fuzz_prompt_files_long(tmp_path, eval_data, train_data, how):
    _eval_prompts(tmp_path, eval_data, how)
    _training_prompts(tmp_path, train_data, how)


# ---- row packs -------------------------------------------------------------------------------------------------

PACK_HEADER = {"kind": "draftsmith-rows", "version": 1, "rows": 2, "requests": {
    "self": {"key": {"seed": 0}, "records": [{"index": 0, "text": "Ask me.", "stopped": True, "special_inside": False,
                                              "tokens": 4}]}},
    "run": {"fingerprint": {"vocab_size": 320}, "sampling": {"max_new_tokens": 6}}}
PACK_ROWS = [
    {"row_id": 11, "source": "p", "domain": "math", "prompt": "2 + 3?", "response": "5", "input_ids": [5, 6, 7, 2],
     "loss_mask": [0, 0, 1, 1], "origin": "p.jsonl:1", "stopped": True, "n_turns": 1},
    {"row_id": 12, "origin": "p.jsonl:2", "skipped": "all thinking"},
]


def _read_pack(tmp_path, data: bytes, how: str):
    import lzma

    from draftsmith.data.pack import read_pack

    path = place(tmp_path / "rows.jsonl.xz", lzma.compress(data), how)
    got = refuses_cleanly(lambda: read_pack(path), path.name)
    if got is not None:
        header, rows = got
        assert all(0 <= t < 320 for r in rows if "skipped" not in r for t in r["input_ids"])


@FUZZ
@given(mutated_jsonl([PACK_HEADER, *PACK_ROWS]), PLACES)
def test_fuzz_row_pack(tmp_path, data, how):
    _read_pack(tmp_path, data, how)


# ---- what a generation server answers ------------------------------------------------------------------------

ANSWER = {"model": "m", "choices": [{"text": " five", "finish_reason": "stop", "token_ids": [5, 6, 2],
                                     "prompt_token_ids": [5, 6, 7]}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 3}}


@pytest.fixture(scope="module")
def server():
    """One scripted server for every example: it answers what `server["answer"]` holds."""
    from test_boundary_data import scripted_server

    state = {"answer": ANSWER}
    with scripted_server(lambda req: state["answer"]) as url:
        state["url"] = url
        yield state


def _served(tiny_target, server, answer):
    """What RemoteEngine makes of a server that answers `answer` to one request of 6 tokens: a Completion within the
    budget and the vocabulary, or a refusal in one line naming the server."""
    from draftsmith.data.config import GenerationConfig
    from draftsmith.data.engines.base import Request
    from draftsmith.data.engines.remote import RemoteEngine

    server["answer"] = answer
    gen = GenerationConfig(backend="openai", base_urls=[server["url"]], max_retries=0, retry_backoff=0.01,
                           request_timeout=5.0, concurrency=1, prompt_as="token_ids")
    engine = RemoteEngine(tiny_target.tokenizer, list(tiny_target.eos_token_ids), gen, "plain", tiny_target.vocab_size)
    got = []
    refuses_cleanly(lambda: engine.run([Request(1, [5, 6, 7], 6, seed=0)], got.append), "127.0.0.1")
    for c in got:
        assert len(c.tokens) <= 6 and all(0 <= t < tiny_target.vocab_size for t in c.tokens)


@FUZZ
@given(mutated_doc(ANSWER))
def test_fuzz_server_answer(tiny_target, server, answer):
    _served(tiny_target, server, answer)


@pytest.mark.slow
@FUZZ_LONG
@given(mutated_jsonl([PACK_HEADER, *PACK_ROWS]), PLACES, mutated_doc(ANSWER))
def test_fuzz_packs_and_server_answers_long(tmp_path, tiny_target, server, data, how, answer):
    _read_pack(tmp_path, data, how)
    _served(tiny_target, server, answer)
