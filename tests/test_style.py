"""The style rules ruff does not check (scripts/check_style.py, also run by `make lint`): no backslash line
continuation anywhere in the repository's Python."""

from __future__ import annotations

from repo_scripts import load_script


def test_no_backslash_line_continuation():
    check = load_script("check_style")
    found = [f"{p}:{n}" for p in check.files() for n in check.continuations(p.read_text(encoding="utf-8"))]
    assert found == [], found


def test_the_rule_finds_a_continuation_and_not_a_backslash_in_a_string():
    check = load_script("check_style")
    source = ('x = 1 + \\\n    2\n'                      # a continuation: line 1
              'y = """text \\\nmore"""\n'                # a backslash ending a line inside a string
              '# a comment ending in \\\n'
              'z = (1 +\n     2)\n')
    assert check.continuations(source) == [1]
