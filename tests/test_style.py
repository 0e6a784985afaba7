"""The style rules (also run by `make lint`): no backslash line continuation anywhere in the repository's Python
(scripts/check_style.py, a rule ruff does not check), and ruff's line length on at 120 columns with no line past it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from repo_scripts import ROOT, load_script


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


def test_the_line_length_rule_is_on_at_120_columns():
    """pyproject.toml keeps ruff's E501 on at 120 columns, the length the code keeps (B905 stays ignored)."""
    tomllib = pytest.importorskip("tomllib")
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert "E501" not in ruff["lint"].get("ignore", []) and "B905" in ruff["lint"]["ignore"]


def test_no_line_runs_past_the_line_length():
    """Every Python line of the repository fits pyproject.toml's line-length (ruff's E501, as `make lint` runs it)."""
    pytest.importorskip("ruff")
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E501",
                            "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout[-2000:] + found.stderr[-2000:]
