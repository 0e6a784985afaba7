"""The function-length rule (scripts/check_functions.py, also run by `make lint`): 60 lines for a function of
the package, 100 for one in tests/ or scripts/."""

from __future__ import annotations

from repo_scripts import load_script


def _checker():
    return load_script("check_functions")


def _function(name: str, lines: int) -> str:
    """A function of exactly `lines` lines, `def` line included."""
    return f"def {name}():\n" + "    x = 1\n" * (lines - 1)


def test_no_function_runs_over_its_limit():
    assert _checker().problems() == []


def test_the_rule_finds_a_long_function_by_where_it_lives(tmp_path):
    checker = _checker()
    for folder in ("decoding", "tests", "scripts", "build"):
        (tmp_path / folder).mkdir()
    (tmp_path / "decoding" / "verify.py").write_text(_function("fits", 60) + "\n\n" + _function("too_long", 61))
    (tmp_path / "tests" / "test_x.py").write_text(_function("scenario", 100) + "\n\n" + _function("runs_on", 101))
    (tmp_path / "scripts" / "measure.py").write_text(_function("recipe", 90))
    (tmp_path / "build" / "copy.py").write_text(_function("not_read", 500))  # not package code
    (tmp_path / "top.py").write_text("class A:\n    " + _function("method", 62).replace("\n    ", "\n        "))
    assert checker.problems(tmp_path) == [
        "decoding/verify.py:63: too_long is 61 lines, over the 60-line limit (split it into named pieces)",
        "tests/test_x.py:103: runs_on is 101 lines, over the 100-line limit (split it into named pieces)",
        "top.py:2: method is 62 lines, over the 60-line limit (split it into named pieces)",
    ]
