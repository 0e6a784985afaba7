"""A user's model folder is read from outside: its config.json goes through one reader (targets/loading.py
`check_model_config`) that refuses, in one line naming the file and field, what would otherwise reach
transformers as a shape ("lots" layers, a vocabulary of 10^9) or a raw exception; what transformers itself
refuses of a folder is one TargetError naming it. Fuzzed with mutations of a real tiny model's config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given

from draftsmith.errors import TargetError
from draftsmith.targets import load_target
from tests.fuzzing import PLACES, RUNS, mutated_json, place, refuses_cleanly


@pytest.fixture(scope="module")
def model_folder(tiny_target, tmp_path_factory) -> Path:
    """A copy of the tiny target's HF folder that a test may damage."""
    folder = tmp_path_factory.mktemp("model") / "m"
    shutil.copytree(tiny_target.folder, folder)
    return folder


def _with_config(folder: Path, tmp: Path, change) -> Path:
    copy = tmp / "m"
    shutil.copytree(folder, copy)
    doc = json.loads((copy / "config.json").read_text())
    change(doc)
    (copy / "config.json").write_text(json.dumps(doc))
    return copy


@pytest.mark.parametrize("field,value,says", [
    ("vocab_size", "lots", r"vocab_size is 'lots', expected an integer"),
    ("num_hidden_layers", 10**9, r"num_hidden_layers is 1000000000, expected an integer in 1\.\.4096"),
    ("hidden_size", 64.0, r"hidden_size is 64\.0, expected an integer"),
    ("max_position_embeddings", -1, r"max_position_embeddings is -1"),
    ("model_type", None, r"model_type is None, expected a model type name"),
])
def test_a_model_config_field_of_another_type_or_out_of_range_is_named(model_folder, tmp_path, field, value, says):
    folder = _with_config(model_folder, tmp_path, lambda d: d.__setitem__(field, value))
    with pytest.raises(TargetError, match=rf"config\.json: {says}"):
        load_target(str(folder))


def test_a_model_type_transformers_does_not_know_is_one_line_naming_the_folder(model_folder, tmp_path):
    folder = _with_config(model_folder, tmp_path, lambda d: d.__setitem__("model_type", "no-such-model"))
    with pytest.raises(TargetError, match=rf"{folder}: not a model folder transformers can load"):
        load_target(str(folder))


def test_a_config_json_that_is_not_json_or_nested_deep_is_named(model_folder, tmp_path):
    for text, says in (("{", "not valid JSON"), ("[" * 100_000 + "]" * 100_000, "JSON nested 100000 deep")):
        folder = tmp_path / says.split()[0]
        shutil.copytree(model_folder, folder)
        (folder / "config.json").write_text(text)
        with pytest.raises(TargetError, match=rf"config\.json: {says}"):
            load_target(str(folder))


def _fuzz_once(model_folder: Path, tmp: Path, data: bytes, how: str) -> None:
    folder = tmp / "fuzzed"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(model_folder, folder)
    place(folder / "config.json", data, how)
    refuses_cleanly(lambda: load_target(str(folder)), str(folder))


@pytest.mark.parametrize("runs", RUNS)
def test_fuzz_a_mutated_model_config_loads_or_is_refused_in_one_line(model_folder, tmp_path, runs):
    valid = json.loads((model_folder / "config.json").read_text())
    runs(given(data=mutated_json(valid), how=PLACES)(
        lambda data, how: _fuzz_once(model_folder, tmp_path, data, how)))()
