"""Hostile inputs at the data boundary (issue #58): prompt files, row packs and datasets read from outside, what
a generation server answers, and the folders generation, growing and merging write. Each test names the finding
it pins; each failed before its fix."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import ConfigError


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert message and "\n" not in message
    return message


# ---- finding 6: evaluation's cost model measures no position past the target's context --------------------

def test_cost_context_past_the_targets_context_is_refused_at_the_start(tiny_target, tmp_path):
    from draftsmith.evaluation.evaluate import evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Say hi."]}) + "\n")
    with pytest.raises(ConfigError) as e:
        evaluate(tiny_target, "ngram", prompts=[prompts], max_new_tokens=4, cost_context=2000, cost_k_max=2,
                 cost_repeats=1, repeats=1, remeasure=0)
    message = _one_line(e)
    assert "cost_context" in message and "2000" in message and "512" in message
