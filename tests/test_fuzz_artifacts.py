"""Fuzzing the readers of the files a drafter is made of (tests/fuzzing.py): each reader, given a mutated copy
of a valid file, reads it — and what trusts the reader (the module built from a config, the spec a verifier
derives, serve-check's summary of a result) then runs — or refuses it in one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_boundary_artifacts import dflash_artifact, eagle3_artifact, medusa_artifact
from tiny_models import make_target

from draftsmith import artifact
from tests.fuzzing import FUZZ, FUZZ_LONG, PLACES, mutated_json, place, refuses_cleanly


@pytest.fixture(scope="module")
def valid(tiny_target, tiny_tokenizer, tmp_path_factory) -> dict[str, dict]:
    """A valid document of every format, as draftsmith writes it (artifacts and exports of tiny heads)."""
    from draftsmith.export import export_artifact

    root = tmp_path_factory.mktemp("fuzz_artifacts")
    target4 = make_target(tiny_tokenizer, seed=5, layers=4, folder=root / "target4")
    medusa = medusa_artifact(tiny_target, root / "m")
    dflash = dflash_artifact(tiny_target, root / "d")
    eagle = eagle3_artifact(target4, root / "e")
    exports = {kind: export_artifact(art, "vllm", root / f"x-{kind}", t).out
               for kind, art, t in [("medusa", medusa, tiny_target), ("dflash", dflash, tiny_target),
                                    ("eagle", eagle, target4)]}
    read = lambda p: json.loads(Path(p).read_text())  # noqa: E731
    result = {"vllm_version": "0.32.0", "loaded": True, "error": None, "outputs": [[5, 6, 7], [8]],
              "counters": {"spec_decode_num_drafts": 3, "spec_decode_num_accepted_tokens_per_pos": [2, 1]},
              "batch1": {"tokens": 4, "seconds": 0.5, "tokens_per_s": 8.0},
              "batched": {"batch": 2, "tokens": 4, "seconds": 0.25, "tokens_per_s": 16.0, "outputs": [[5, 6, 7], [8]]}}
    return {"manifest": read(medusa / "manifest.json"), "medusa_config": read(medusa / "config.json"),
            "tree": read(medusa / "tree.json"), "dflash_config": read(dflash / "config.json"),
            "eagle_config": read(eagle / "config.json"), "guard": read(exports["dflash"] / "draftsmith.json"),
            "medusa_export": read(exports["medusa"] / "config.json"),
            "dflash_export": read(exports["dflash"] / "config.json"),
            "eagle_export": read(exports["eagle"] / "config.json"), "vllm_result": result}


MANIFEST = {"kind": "dflash", "target": {"vocab_size": 320, "architecture": {"num_hidden_layers": 2}}}


def _medusa_config(folder: Path) -> None:
    from draftsmith.medusa.model import MedusaHeads, read_heads_config

    with torch.device("meta"):
        MedusaHeads(read_heads_config(folder, 320))


def _dflash_config(folder: Path) -> None:
    from draftsmith.dflash.model import DFlashDraft, read_config

    with torch.device("meta"):
        DFlashDraft(read_config(folder, MANIFEST))


def _eagle_config(folder: Path) -> None:
    from draftsmith.eagle.model import EagleHead, read_config

    with torch.device("meta"):
        EagleHead(read_config(folder, {"target": {"vocab_size": 320, "architecture": {"num_hidden_layers": 4}}}))


def _medusa_export(folder: Path) -> None:
    from draftsmith.medusa.export import MEDUSA_FORMAT, VLLM_FORMAT, expected_tensors, read_layout_config

    config = read_layout_config(folder)
    expected_tensors(VLLM_FORMAT if config.get("model_type") == "medusa" else MEDUSA_FORMAT, config)


def _dflash_export(folder: Path) -> None:
    from draftsmith.dflash.export import read_layout_config
    from draftsmith.dflash.model import DFlashDraft

    with torch.device("meta"):
        DFlashDraft(read_layout_config(folder)[1])


def _eagle_export(folder: Path) -> None:
    from draftsmith.eagle.export import EAGLE1, MIDLAYER, SPECULATORS, expected_tensors, read_layout_config

    config = read_layout_config(folder)
    fmt = (SPECULATORS if config.get("speculators_model_type") == "eagle3" else
           MIDLAYER if "eagle_config" in config else EAGLE1)
    expected_tensors(fmt, config)


def _vllm_result(folder: Path) -> None:
    from draftsmith.export.serve_check import _speed, read_result, vllm_acceptance

    result = read_result(folder / "vllm-spec.result.json", folder / "vllm-spec.log")
    if result["loaded"]:
        _speed(result)
        vllm_acceptance(result["counters"], 2)


def _tree(folder: Path) -> None:
    from draftsmith.medusa.model import read_tree

    tree = read_tree(folder, 2, 320)
    if tree is not None:
        tree.parents()


def _guard(folder: Path) -> None:
    from draftsmith.layouts.common import read_guard

    read_guard(folder)


# format -> (file name, the reader and what trusts it, given the folder)
READERS = {
    "manifest": ("manifest.json", artifact.load_manifest),
    "medusa_config": ("config.json", _medusa_config),
    "tree": ("tree.json", _tree),
    "dflash_config": ("config.json", _dflash_config),
    "eagle_config": ("config.json", _eagle_config),
    "guard": ("draftsmith.json", _guard),
    "medusa_export": ("config.json", _medusa_export),
    "dflash_export": ("config.json", _dflash_export),
    "eagle_export": ("config.json", _eagle_export),
    "vllm_result": ("vllm-spec.result.json", _vllm_result),
}


def _reads_or_refuses(name: str, valid: dict, folder: Path, data, how: str) -> None:
    filename, read = READERS[name]
    path = place(folder / filename, data.draw(mutated_json(valid[name])), how)
    refuses_cleanly(lambda: read(folder), path.name)


@pytest.mark.parametrize("name", READERS)
@FUZZ
@given(data=st.data(), how=PLACES)
def test_every_artifact_reader_reads_or_refuses_in_one_line(valid, tmp_path, name, data, how):
    _reads_or_refuses(name, valid, tmp_path, data, how)


@pytest.mark.slow
@pytest.mark.parametrize("name", READERS)
@FUZZ_LONG
@given(data=st.data(), how=PLACES)
def test_every_artifact_reader_reads_or_refuses_in_one_line_long(valid, tmp_path, name, data, how):
    _reads_or_refuses(name, valid, tmp_path, data, how)


@FUZZ
@given(d2t=st.lists(st.integers(-(2**62), 2**62), max_size=40), dtype=st.sampled_from(
    [torch.int64, torch.int32, torch.float32, torch.bool, torch.uint8]), t2d=st.one_of(st.none(), st.lists(
        st.booleans(), min_size=0, max_size=80)))
def test_the_vocabulary_maps_reader_names_a_problem_or_none(d2t, dtype, t2d):
    """d2t / t2d of any content and dtype: a list of one-line problems, never an exception."""
    from draftsmith.schema import vocab_map_problems

    d = torch.tensor(d2t, dtype=torch.int64).to(dtype)
    t = torch.tensor(t2d, dtype=torch.bool) if t2d is not None else None
    problems = vocab_map_problems(d, t, 64)
    assert all(isinstance(p, str) and "\n" not in p for p in problems)
