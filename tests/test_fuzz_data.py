"""Fuzzing the data boundary's readers (tests/fuzzing.py): prompt files (evaluation's and a training source's),
row packs, and what a generation server answers. Each reads its input or refuses it in one line naming it."""

from __future__ import annotations

import pytest
from fuzzing import FUZZ, FUZZ_LONG, PLACES, mutated_jsonl, place, refuses_cleanly
from hypothesis import given

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
