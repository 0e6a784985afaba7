"""What the house writes once (issue 67, "once each"): one number formatter for every table, one dash for "no
value", one namer of a JSON value's type and one shortener of a value for an error line, one home for the rows
every method's job trains on, and one for the state of the proposers that draft from the target's features.

Each test here failed while the same thing was written several times: a model card wrote "—" where every
other table wrote "–", a count came out "12.000" from the table formatter, a list was "list" in one error and
"a list" in another, a value was cut at 80 characters by one reader, 40 by another and 120 by the config."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHES = ("–", "—")


def test_fmt_num_writes_counts_whole_lists_cut_and_text_escaped():
    from draftsmith.formatting import fmt_num

    assert fmt_num(None) == "–" and fmt_num(True) == "yes" and fmt_num(False) == "NO"
    assert fmt_num(0.5) == "0.500" and fmt_num(0.5, ".2f") == "0.50"
    assert fmt_num(12) == "12" and fmt_num(12, ".2f") == "12"  # a count is whole, whatever the spec
    assert fmt_num([0.5, None, 3]) == "[0.500, –, 3]"
    assert fmt_num([0.25] * 9, ".2f") == "[" + ", ".join(["0.25"] * 8) + ", …]"
    assert fmt_num("a|b") == "a\\|b"  # text in a cell comes from outside: escaped (formatting.md_cell)


def _card(alpha, lossless) -> str:
    from draftsmith.layouts.card import card_text

    ev = {"domains": {"math": {"n_prompts": 3, "alpha": alpha, "tau": 1.5, "lossless": lossless}}}
    return card_text({"eval": ev}, "a head", "medusa", "vllm", "medusa", "t", "serve it")


def _alpha_table(alpha) -> str:
    from draftsmith.planning.production import render

    row = {"n_prompts": 3, "drafts": 4, "proposed": 8, "accepted": 4, "alpha": alpha, "tau": 2.0,
           "per_position_acceptance": [0.5] * 9}
    return render({"source": "s", "domains": {"math": row}, "overall": row})


def _summary(alpha) -> str:
    from draftsmith.evaluation.commands import summary_line

    o = {"alpha": alpha, "tau": 2.0, "tokens_per_s": 10.0, "baseline_tokens_per_s": 5.0, "speedup": 2.0,
         "lossless": True, "n_prompts": 3}
    return summary_line({"overall": o})


def test_every_table_writes_a_value_and_no_value_alike():
    """The model card, alpha's table and evaluate's printed line write 0.5 and a missing α as fmt_num does
    ("0.500", "–"), a failed check as "NO", and a list cut at 8 with "…"."""
    from draftsmith.formatting import fmt_num

    for write in (_card, _alpha_table, _summary):
        assert fmt_num(0.5) in (write(0.5) if write is not _card else _card(0.5, True))
        text = write(None) if write is not _card else _card(None, None)
        assert "—" not in text and " – " in text.replace("|", " ").replace(",", " ")
    assert "| math | 3 | 0.500 | 1.50 | NO |" in _card(0.5, False)
    assert "| math | 3 | – | 1.50 | – |" in _card(None, None)
    assert fmt_num([0.5] * 9, ".2f") in _alpha_table(0.5)


def _writes_a_dash(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value in DASHES for n in ast.walk(node))


def test_no_module_but_formatting_defines_a_value_formatter():
    """A function (or lambda) that returns the no-value dash is a number formatter of its own: only
    formatting.py has one. (A dash inside a longer string, or a whole cell of a missing row, is not one.)"""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "scripts", "results", "build", "runs") or rel.parts[0].startswith("."):
            continue
        if rel == Path("formatting.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Lambda) and _writes_a_dash(node.body):
                found.append(f"{rel}:{node.lineno} (lambda)")
            elif isinstance(node, ast.FunctionDef) and any(
                    isinstance(r, ast.Return) and r.value is not None and _writes_a_dash(r.value)
                    for r in ast.walk(node)):
                found.append(f"{rel}:{node.lineno} {node.name}")
    assert not found, f"value formatters besides formatting.fmt_num: {found}"


@pytest.mark.parametrize("value,named", [
    (None, "null"), (True, "a boolean"), (3, "a number (3)"), ("x", "text"), ([1], "a list"), ({}, "an object"),
])
def test_one_namer_of_a_json_value_type(tmp_path, value, named):
    """An artifact's JSON (schema.read_doc), a dataset row (data/rows.check_row) and a model folder's
    config.json (targets/loading) name a value of the wrong type with the same words: errors.json_kind's."""
    from draftsmith.data.rows import RowLimits, check_row
    from draftsmith.errors import DataError, DraftsmithError, json_kind
    from draftsmith.schema import read_doc
    from draftsmith.targets.loading import check_model_config

    assert json_kind(value) == named
    if isinstance(value, dict):
        return
    with pytest.raises(DataError) as e:
        check_row(value, "rows.jsonl:1", RowLimits())
    assert f"rows.jsonl:1: a row is not a JSON object (got {named})" in str(e.value)
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps(value))
    with pytest.raises(DraftsmithError) as e:
        read_doc(doc)
    assert f"{doc}: {named} at the top, expected a JSON object" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(value))
    with pytest.raises(DraftsmithError) as e:
        check_model_config(tmp_path)
    assert f"expected a JSON object, got {named}" in str(e.value)


LONG = ["x" * 50] * 20  # a value whose repr is ~1,100 characters


def test_one_shortener_of_a_value_for_an_error_line(tmp_path):
    """A config field, a model folder's config.json and a training log's record show a bad value the same way,
    errors.show's: its repr, cut to one length with one ellipsis."""
    from draftsmith.config import from_dict
    from draftsmith.errors import DraftsmithError, show
    from draftsmith.targets.loading import check_model_config
    from draftsmith.training.config import TrainConfig
    from draftsmith.training.run_files import log_records

    shown = show(LONG)
    assert shown.endswith("...") and len(shown) < 200
    with pytest.raises(DraftsmithError) as e:
        from_dict(TrainConfig, {"output_dir": LONG}, "train")
    assert f"train.output_dir: expected a string, got {shown}" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": LONG}))
    with pytest.raises(DraftsmithError) as e:
        check_model_config(tmp_path)
    assert f"model_type is {shown}, expected" in str(e.value)
    with pytest.raises(DraftsmithError) as e:
        log_records(json.dumps({"type": LONG, "step": 0}) + "\n", "train_log.jsonl")
    assert f"field 'type' must be a string, got {shown}" in str(e.value)


def test_every_method_job_takes_its_rows_from_the_one_rows_job():
    """The rows, the batches and the rows' lengths of every built-in method's job come from training/job.py's
    RowsJob: no job writes train_rows / eval_rows / collate / row_lengths again."""
    from draftsmith.dflash.job import DFlashJob
    from draftsmith.distill.job import DistillJob
    from draftsmith.dspark.job import DSparkJob
    from draftsmith.eagle.job import EagleJob
    from draftsmith.medusa.job import MedusaJob
    from draftsmith.training.job import RowsJob

    for job in (MedusaJob, EagleJob, DistillJob, DFlashJob, DSparkJob):
        assert issubclass(job, RowsJob), job
        for name in ("train_rows", "eval_rows", "collate", "row_lengths"):
            assert getattr(job, name) is getattr(RowsJob, name), f"{job.__name__}.{name}"


def test_the_feature_drafters_share_one_feature_proposer():
    """EAGLE's heads and DFlash's (and DSpark's) block drafters keep the target's features the same way:
    decoding/proposer.py's FeatureProposer holds begin, the pending features and the default tree."""
    from draftsmith.decoding.proposer import FeatureProposer
    from draftsmith.dflash.proposer import DFlashProposer
    from draftsmith.dspark.proposer import DSparkProposer
    from draftsmith.eagle.proposer import EagleProposer

    for proposer in (EagleProposer, DFlashProposer, DSparkProposer):
        assert issubclass(proposer, FeatureProposer), proposer
        for name in ("begin", "default_tree_spec", "take_pending"):
            assert getattr(proposer, name) is getattr(FeatureProposer, name), f"{proposer.__name__}.{name}"


def test_values_cut_inline_are_shown_by_the_one_shortener(tmp_path):
    """A value once cut in place (`str(x)[:60]`, `repr(x)[:40]`: walked whole first, cut at 20, 40, 60 or 80)
    is shown by errors.show too: a tensor's shape in a safetensors header, a Medusa tree's path, a Prometheus
    line, a traffic record's timestamp."""
    from draftsmith.errors import DraftsmithError, show
    from draftsmith.fleet.traffic_record import _show
    from draftsmith.layouts.verify import check_layout
    from draftsmith.medusa.model import tree_problem
    from draftsmith.planning.production import parse_prometheus

    shown = show(LONG)
    with pytest.raises(DraftsmithError) as e:
        check_layout(tmp_path / "m.safetensors", {"w": {"dtype": "F32", "shape": LONG, "data_offsets": [0, 4]}})
    assert f"shape {shown} is not a list of sizes" in str(e.value)
    assert f"path 0 ({shown}) is not" in tree_problem([LONG], 2, 10, "tree.json")
    line = "x" * 300
    with pytest.raises(DraftsmithError) as e:
        parse_prometheus(line + "\n", "metrics.prom")
    assert f"not a Prometheus sample: {show(line)}" in str(e.value)
    assert _show(LONG) == shown  # fleet/ keeps its own copy of the rule (it imports no draftsmith module)
