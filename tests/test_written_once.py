"""What the house writes once (issue 67, "once each"): one number formatter for every table, one dash for "no
value", one namer of a JSON value's type and one shortener of a value for an error line, one home for the rows
every method's job trains on, and one for the state of the proposers that draft from the target's features.

Each test here failed while the same thing was written several times: a model card wrote "—" where every
other table wrote "–", a count came out "12.000" from the table formatter, a list was "list" in one error and
"a list" in another, a value was cut at 80 characters by one reader, 40 by another and 120 by the config."""

from __future__ import annotations

import ast
from pathlib import Path

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
