"""Every number a configuration or a flag gives is checked where it enters (config.py `Range`): a numeric
field without a bounded range fails here, and every bound is shown to be enforced, one line naming the key.
The findings of the hostile-input audit about unchecked numbers (#58: 18 and 22) each have a test below."""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import given

from draftsmith import config
from draftsmith.config import ConfigError, Range, load_config
from tests.fuzzing import RUNS, mutated_yaml, place, refuses_cleanly
from tests.test_cli_help import parsers

ROOT = Path(__file__).resolve().parents[1]


def _config_classes() -> list[type]:
    """Every dataclass a registered config kind holds, at any depth (sections, lists of sections)."""
    config._import_config_modules()
    seen: list[type] = []

    def walk(cls):
        if cls in seen:
            return
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            stack = [tp]
            while stack:
                t = stack.pop()
                if dataclasses.is_dataclass(t):
                    walk(t)
                stack.extend(typing.get_args(t))

    for cls in config.CONFIG_KINDS.values():
        walk(cls)
    return seen


def _is_numeric(tp) -> bool:
    if tp in (int, float):
        return True
    return any(_is_numeric(a) for a in typing.get_args(tp))


def _numeric_fields():
    for cls in _config_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init and _is_numeric(hints[f.name]):
                yield cls, f.name


def test_every_numeric_config_field_carries_a_bounded_range():
    fields = list(_numeric_fields())
    assert len(fields) > 100  # every section of every kind was walked
    bare = [f"{c.__module__}.{c.__name__}.{n}" for c, n in fields if n not in config.field_ranges(c)]
    assert not bare, f"numeric config fields without a Range in their annotation: {bare}"
    open_ended = [f"{c.__name__}.{n}: {r}" for c, n in fields for r in [config.field_ranges(c)[n]]
                  if (r.ge is None and r.gt is None) or (r.le is None and r.lt is None)]
    assert not open_ended, f"ranges must bound both sides: {open_ended}"


def test_every_config_class_checks_its_ranges_whenever_it_is_built():
    """YAML and overrides go through from_dict, Python callers (the `evaluate()` API, a job built in code) call
    the class: both are checked, by the one `validated` hook."""
    unchecked = [c.__name__ for c in _config_classes() if not getattr(c, "validated", False)]
    assert not unchecked, f"config dataclasses without @validated: {unchecked}"
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.training.config import TrainConfig

    with pytest.raises(ValueError, match=r"TrainConfig\.lr: nan is not a finite number"):
        TrainConfig(lr=math.nan)
    with pytest.raises(ConfigError, match=r"EvalConfig\.tree\[1\]: 100000 is out of range"):
        EvalConfig(tree=[2, 100000])
    with pytest.raises(ConfigError, match=r"TrainConfig\.batch_size: expected a number, got '8'"):
        TrainConfig(batch_size="8")


def _bad_values(bounds: Range, is_float: bool) -> list:
    low = bounds.ge - 1 if bounds.ge is not None else bounds.gt
    high = bounds.le + 1 if bounds.le is not None else bounds.lt
    bad = [low, high, "8", True]
    if is_float:
        bad += [math.nan, math.inf, -math.inf]
    return bad


def _wrapped(tp, value):
    """`value` where field type `tp` holds a number: as the number, a list's item, a dict's value or a pair."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, __import__("types").UnionType):
        return _wrapped(args[0], value)
    if origin is list:
        return [value]
    if origin is tuple:
        return [value] * len(args)
    if origin is dict:
        return {"x": value}
    return value


def _with(cls, name: str, value):
    """An instance of `cls` with its defaults (required fields left unset) and `value` in field `name`."""
    obj = cls.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            setattr(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(obj, f.name, f.default_factory())
    setattr(obj, name, value)
    return obj


def test_every_bound_is_enforced_in_one_line_naming_the_field():
    checked = 0
    for cls, name in _numeric_fields():
        tp = typing.get_type_hints(cls)[name]
        bounds = config.field_ranges(cls)[name]
        config.check_fields(_with(cls, name, _wrapped(tp, bounds.ge if bounds.ge is not None else
                                                        (bounds.gt + (bounds.le or bounds.lt)) / 2)))
        for bad in _bad_values(bounds, "float" in str(tp)):
            with pytest.raises(config.OutOfRange) as e:
                config.check_fields(_with(cls, name, _wrapped(tp, bad)))
            message = str(e.value)
            assert message.startswith(f"{cls.__name__}.{name}") and "\n" not in message, (cls, name, bad, message)
            checked += 1
    assert checked > 400


def test_a_bad_value_from_yaml_is_named_by_its_dotted_key_and_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("kind: medusa\ntrain:\n  betas: [0.9, 1.5]\nevaluate:\n  k: 0\n")
    with pytest.raises(ConfigError,
                       match=r"job\.yaml: train\.betas\[1\]: 1\.5 is out of range \(expected 0 <= x < 1\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"job\.yaml \+ overrides: evaluate\.k: 0 is out of range"):
        load_config(path, ["train.betas=[0.9, 0.99]"])


def test_a_range_is_shown_in_the_flag_help_and_refused_by_a_ranged_flag():
    from draftsmith.evaluation.config import EvalConfig

    assert "1 <= x <= 64" in config.field_help(EvalConfig, "tree")
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--n", type=config.ranged(int, Range(ge=1, le=8)))
    assert parser.parse_args(["--n", "8"]).n == 8
    for bad in ("0", "9", "x", "1.5"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(["--n", bad])
    parser.add_argument("--f", type=config.ranged(float, Range(gt=0, le=1)))
    for bad in ("nan", "inf", "0", "-1e400"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(["--f", bad])


def test_every_numeric_flag_is_ranged_or_sets_a_config_field():
    """A flag typed plain int or float takes 100000 workers or NaN seconds: each is `config.ranged`, or
    evaluate's flags, which set EvalConfig fields and are checked with them."""
    from draftsmith import cli
    from draftsmith.evaluation.commands import FLAGS

    config_flags = {flag for flag, (_, tp) in FLAGS.items() if tp in (int, float)} | {"--temperature"}
    bare = []
    for path, parser in parsers(cli.build_parser()):
        where = " ".join(path)
        for action in parser._actions:
            if action.type in (int, float) and not (where == "draftsmith evaluate" and
                                                     set(action.option_strings) & config_flags):
                bare.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    assert not bare, f"numeric flags without a range: {bare}"


# -- the audit's findings (#58) -------------------------------------------------------------------------------

@pytest.mark.parametrize("override", [
    "train.num_workers=100000", "train.lr=.nan", "train.eps=-1", "train.epochs=.inf", "train.max_grad_norm=.nan",
    "train.batch_size=0", "train.lr=1e999"])
def test_finding_22_unchecked_training_numbers_are_refused_at_load(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config("smollm2-135m/medusa", [override])


@pytest.mark.parametrize("override", [
    "generation.request_timeout=.nan", "generation.request_timeout=.inf", "generation.temperature=.nan",
    "generation.concurrency=100000", "generation.batch_size=0"])
def test_finding_22_unchecked_generation_numbers_are_refused_at_load(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config("smollm2-135m/data", [override])


@pytest.mark.parametrize("override", ["traffic.window_days=.nan", "traffic.window_days=-1", "traffic.window_days=1e9"])
def test_finding_18_a_traffic_window_that_is_not_a_finite_positive_number_is_refused(override):
    with pytest.raises(ConfigError, match=r"traffic\.window_days"):
        load_config("retrain", [override])


def test_finding_22_more_workers_than_the_machine_has_cpus_is_refused(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"train\.num_workers.*2 CPU"):
        load_config("smollm2-135m/medusa", ["train.num_workers=64"])
    assert load_config("smollm2-135m/medusa", ["train.num_workers=2"]).train.num_workers == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_finding_22_a_tree_of_100000_branches_is_refused_before_anything_is_loaded():
    """`evaluate --tree 100000` allocated 10 GB; a tree of many small depths is bounded by its node count."""
    for tree, field in (("100000", "tree[0]"), ("64,64,64,64", "tree")):
        r = _cli("evaluate", "--proposer", "ngram", "--tree", tree)
        assert r.returncode != 0 and field in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_finding_22_data_inspect_with_batch_size_0_is_a_usage_error():
    r = _cli("data", "inspect", "somewhere", "--batch-size", "0")
    assert r.returncode == 2 and "--batch-size" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- fuzz: every shipped preset, mutated ---------------------------------------------------------------------

PRESETS = {name: config.read_yaml(name) for name in ("smollm2-135m/medusa", "smollm2-135m/data", "retrain",
                                                     "smollm2-135m/eagle3", "smollm2-135m/dflash")}


def _load_mutated(tmp_path: Path, data: bytes):
    """A mutated preset loads, or is refused in one line naming the file."""
    path = place(tmp_path / "preset.yaml", data)
    refuses_cleanly(lambda: load_config(path), "preset.yaml")


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fuzz_a_mutated_preset_loads_or_is_refused_in_one_line(name, tmp_path, runs):
    runs(given(data=mutated_yaml(PRESETS[name]))(lambda data: _load_mutated(tmp_path, data)))()


@pytest.mark.parametrize("how", ["dangling_symlink", "directory"])
def test_a_preset_path_that_is_no_file_is_named(tmp_path, how):
    path = place(tmp_path / "preset.yaml", b"", how)
    refuses_cleanly(lambda: load_config(path), "preset.yaml")
    with pytest.raises(ConfigError):
        load_config(path)
