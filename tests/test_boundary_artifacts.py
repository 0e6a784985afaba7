"""The files a drafter is made of, read at the boundary (issue #58): each artifact and export file has one
validating reader, used by `draftsmith check` and at load (evaluate, export, import-export, serve-check), and
a bad value is one line naming the file and the field or tensor — never a raw exception at decode time.

One test per finding of the hostile-input audit; the artifacts are built here from tiny random heads on the
tiny targets of conftest.py (no training)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from tiny_models import make_target

from draftsmith import artifact
from draftsmith.cli import main
from draftsmith.errors import ArtifactError, DraftsmithError

VOCAB_N = 32  # draft vocabulary of the reduced-vocabulary heads


@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    """A 4-layer tiny target: EAGLE-3 reads three distinct feature layers."""
    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("boundary_target4"))


def draft_vocab(target, n: int = VOCAB_N):
    from draftsmith.heads.vocab import build_draft_vocab

    return build_draft_vocab(torch.arange(target.vocab_size) % 13, n)


def medusa_artifact(target, path: Path, tree: dict | None = None, heads: int = 2) -> Path:
    from draftsmith.medusa.model import MedusaHeads

    torch.manual_seed(0)
    m = MedusaHeads.from_target(target.config, heads, 1, lm_head=target.model.lm_head)
    cfg = {"hidden_size": target.config.hidden_size, "vocab_size": target.vocab_size, "num_heads": heads,
           "num_layers": 1, "share_lm_head": False, "draft_vocab_size": None}
    tree = tree if tree is not None else {"paths": [[0], [1], [0, 0]], "probs": [0.5, 0.2, 0.25],
                                          "expected_length": 0.95}

    def writer(tmp: Path) -> None:
        (tmp / "tree.json").write_text(json.dumps(tree))

    return artifact.save_artifact(path, artifact.make_manifest("medusa", target.fingerprint(), {}),
                                  m.state_dict(), cfg, writer=writer)


def dflash_artifact(target, path: Path, reduced: bool = True, edit=None) -> Path:
    """A DFlash draft (one layer, block 4, taps [0]); `edit(state)` changes its weights before they are written
    (the checksums are then those of the changed weights: a file written that way, not a torn one)."""
    from draftsmith.dflash.model import DFlashDraft

    torch.manual_seed(0)
    draft = DFlashDraft.from_target(target.model, [0], num_layers=1, block_size=4, mask_token_id=7,
                                    draft_vocab=draft_vocab(target) if reduced else None)
    state = dict(draft.state_dict())
    if edit is not None:
        edit(state)
    cfg = {**asdict(draft.config), "architecture": "dflash"}
    return artifact.save_artifact(path, artifact.make_manifest("dflash", target.fingerprint(), {}), state, cfg)


def eagle3_artifact(target, path: Path, edit=None) -> Path:
    from draftsmith.eagle.model import EagleHead

    torch.manual_seed(0)
    head = EagleHead.from_target(target.model, version=3, target_layers=[0, 1, 2], draft_vocab=draft_vocab(target))
    state = dict(head.state_dict())
    if edit is not None:
        edit(state)
    cfg = asdict(head.config)
    return artifact.save_artifact(path, artifact.make_manifest("eagle", target.fingerprint(), cfg), state, cfg)


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def check_says(capsys, art: Path, target, *needles: str) -> None:
    """`draftsmith check` exits 4 (damaged) and names each needle on one PROBLEM line."""
    capsys.readouterr()
    assert main(["check", "--artifact", str(art), "--target", str(target.folder)]) == 4
    problems = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("PROBLEM")]
    assert any(all(n in ln for n in needles) for ln in problems), problems


def one_line(e: BaseException, *needles: str) -> None:
    message = str(e)
    assert "\n" not in message, message
    for n in needles:
        assert n in message, message


# --- finding 5: tree.json -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("probs", ["high", 0.2, 0.25]), ("expected_length", "lots"),
                                          ("probs", [0.5, 0.2, 7.0]), ("expected_length", float("nan"))])
def test_a_tree_json_field_of_another_type_is_refused_by_check_and_load(tiny_target, tmp_path, capsys, field,
                                                                         value):
    from draftsmith.medusa.model import load_medusa

    tree = {"paths": [[0], [1], [0, 0]], "probs": [0.5, 0.2, 0.25], "expected_length": 0.95, field: value}
    art = medusa_artifact(tiny_target, tmp_path / "m", tree)
    check_says(capsys, art, tiny_target, "tree.json", f"field '{field}'")
    with pytest.raises(DraftsmithError) as e:
        load_medusa(art, tiny_target)
    one_line(e.value, "tree.json", field)


# --- finding 12: method configs and the vocabulary maps against the target -------------------------------
def test_a_dflash_config_sized_for_another_vocabulary_is_refused(tiny_target, tmp_path, capsys):
    from draftsmith.dflash.model import load_dflash

    art = dflash_artifact(tiny_target, tmp_path / "d", reduced=False)
    edit_json(art / "config.json", lambda c: c.update(vocab_size=100000, mask_token_id=50000))
    check_says(capsys, art, tiny_target, "config.json", "'vocab_size' is 100000", str(tiny_target.vocab_size))
    with pytest.raises(DraftsmithError) as e:
        load_dflash(art, tiny_target)
    one_line(e.value, "config.json", "vocab_size")


def test_a_d2t_beyond_the_target_vocabulary_is_refused(tiny_target, tmp_path, capsys):
    from draftsmith.dflash.model import load_dflash

    art = dflash_artifact(tiny_target, tmp_path / "d", edit=lambda s: s["d2t"].__setitem__(3, 2_000_000))
    check_says(capsys, art, tiny_target, "model.safetensors", "'d2t'", "draft id 3", "outside")
    with pytest.raises(ArtifactError) as e:
        load_dflash(art, tiny_target)
    one_line(e.value, "model.safetensors", "d2t")


def test_a_d2t_mapping_every_draft_id_to_one_target_is_refused(tiny_target, tmp_path, capsys):
    from draftsmith.dflash.model import load_dflash

    def collapse(state):
        state["d2t"] = 5 - torch.arange(VOCAB_N)  # target = draft + d2t[draft] = 5 for every draft id

    art = dflash_artifact(tiny_target, tmp_path / "d", edit=collapse)
    check_says(capsys, art, tiny_target, "model.safetensors", "'d2t'", "same target id 5")
    with pytest.raises(ArtifactError) as e:
        load_dflash(art, tiny_target)
    one_line(e.value, "model.safetensors", "same target id")


def test_an_eagle3_d2t_stored_as_float_is_refused(target4, tmp_path, capsys):
    from draftsmith.eagle.model import load_eagle

    art = eagle3_artifact(target4, tmp_path / "e", edit=lambda s: s.update(d2t=s["d2t"].float()))
    check_says(capsys, art, target4, "model.safetensors", "'d2t'", "float32")
    with pytest.raises(ArtifactError) as e:
        load_eagle(art, target4)
    one_line(e.value, "model.safetensors", "d2t", "int64")


# --- finding 14: import-export reads what it writes with check's reader -----------------------------------
def test_import_export_of_a_layout_check_would_call_damaged_writes_nothing(tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    from draftsmith.export import export_artifact, import_export

    exp = export_artifact(dflash_artifact(tiny_target, tmp_path / "d"), "vllm", tmp_path / "x", tiny_target).out
    edit_json(exp / "draftsmith.json", lambda g: [g.pop(k) for k in ("format", "checksums")])
    tensors = load_file(str(exp / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(7, 5)
    save_file(tensors, str(exp / "model.safetensors"))
    with pytest.raises(ArtifactError) as e:
        import_export(exp, tmp_path / "back")
    one_line(e.value, "fc.weight", "[7, 5]", "nothing written")
    assert not (tmp_path / "back").exists()


# --- finding 23: serve-check --------------------------------------------------------------------------
def fake_vllm(tmp_path: Path, monkeypatch, result: str, log: str = "") -> None:
    """A stand-in for the vLLM environment's python: a real executable that writes the given result file (the
    runner's job) and log lines, so serve-check's reading of a result runs for real without vLLM."""
    (tmp_path / "result.src").write_text(result)
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho '{log}'\ncp '{tmp_path / 'result.src'}' \"$3\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(script))


@pytest.mark.parametrize("result, field", [('{"loaded": true}', "outputs"), ("[1, 2]", "a list"),
                                           ('{"loaded": true, "outputs": [[1]], "counters": {}, '
                                            '"batch1": {"tokens": "9"}}', "batch1.tokens")])
def test_a_vllm_result_without_its_fields_is_named(tmp_path, monkeypatch, result, field):
    from draftsmith.export.serve_check import ServeCheckError, run_vllm

    fake_vllm(tmp_path, monkeypatch, result)
    with pytest.raises(ServeCheckError) as e:
        run_vllm({"prompts": []}, tmp_path, "vllm-spec", 60)
    one_line(e.value, "vllm-spec.result.json", field, "vllm-spec.log")


def test_a_vllm_error_pointing_at_a_stack_trace_names_the_log(tmp_path, monkeypatch):
    from draftsmith.export.serve_check import run_vllm

    error = "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."
    fake_vllm(tmp_path, monkeypatch, json.dumps({"loaded": False, "error": error}), log="INFO engine starting")
    result = run_vllm({"prompts": []}, tmp_path, "vllm-plain", 60)
    assert error in result["error"] and str(tmp_path / "vllm-plain.log") in result["error"]


def test_a_vllm_python_that_is_not_executable_is_named(tmp_path, monkeypatch):
    from draftsmith.data.engines.vllm_server import ServeCheckError, vllm_python

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(python))
    with pytest.raises(ServeCheckError) as e:
        vllm_python()
    one_line(e.value, str(python), "not executable")


def test_serve_check_of_a_folder_without_draftsmith_json_is_named(tmp_path):
    from draftsmith.export.serve_check import speculative_config

    (tmp_path / "exp").mkdir()
    with pytest.raises(ArtifactError) as e:
        speculative_config(tmp_path / "exp", 4)
    one_line(e.value, "exp", "draftsmith.json")


def test_a_medusa_export_without_num_heads_is_named_by_serve_check_and_check(tiny_target, tmp_path, capsys):
    from draftsmith.export import export_artifact
    from draftsmith.export.serve_check import speculative_config

    exp = export_artifact(medusa_artifact(tiny_target, tmp_path / "m"), "vllm", tmp_path / "x", tiny_target).out
    edit_json(exp / "config.json", lambda c: c.pop("num_heads"))
    with pytest.raises(DraftsmithError) as e:
        speculative_config(exp, 2)
    one_line(e.value, "config.json", "missing field 'num_heads'")
    check_says(capsys, exp, tiny_target, "config.json", "missing field 'num_heads'")


def test_a_dflash_block_size_spelled_as_a_string_is_named(tiny_target, tmp_path, capsys):
    from draftsmith.export import export_artifact
    from draftsmith.export.serve_check import speculative_config

    exp = export_artifact(dflash_artifact(tiny_target, tmp_path / "d"), "vllm", tmp_path / "x", tiny_target).out
    edit_json(exp / "config.json", lambda c: c.update(block_size="4"))
    with pytest.raises(DraftsmithError) as e:
        speculative_config(exp, 3)
    one_line(e.value, "config.json", "'block_size' is '4'")
    check_says(capsys, exp, tiny_target, "config.json", "block_size")


# --- finding 25 (part) -----------------------------------------------------------------------------------
def test_a_manifest_checksum_key_with_a_nul_byte_is_named(tiny_target, tmp_path, capsys):
    from draftsmith.medusa.model import load_medusa

    art = medusa_artifact(tiny_target, tmp_path / "m")
    edit_json(art / "manifest.json", lambda m: m.update(checksums={"model\x00.safetensors": "0" * 64}))
    with pytest.raises(ArtifactError) as e:
        load_medusa(art, tiny_target)
    one_line(e.value, "manifest.json", "checksums", "NUL")
    check_says(capsys, art, tiny_target, "manifest.json", "checksums")


def test_import_export_of_a_draftsmith_json_that_is_not_json_is_named(tiny_target, tmp_path):
    from draftsmith.export import export_artifact, import_export

    exp = export_artifact(medusa_artifact(tiny_target, tmp_path / "m"), "vllm", tmp_path / "x", tiny_target).out
    (exp / "draftsmith.json").write_text('{"target": {"vocab_size": 320}, "format": ')
    with pytest.raises(DraftsmithError) as e:
        import_export(exp, tmp_path / "back")
    one_line(e.value, "draftsmith.json", "not valid JSON")
    assert not (tmp_path / "back").exists()


def test_a_speculators_config_without_draft_vocab_size_is_named(target4, tmp_path):
    from draftsmith.export import export_artifact, import_export

    exp = export_artifact(eagle3_artifact(target4, tmp_path / "e"), "vllm", tmp_path / "x", target4).out
    edit_json(exp / "config.json", lambda c: c.pop("draft_vocab_size"))
    (exp / "draftsmith.json").unlink()  # another tool's export: the layout alone says what it is
    with pytest.raises(DraftsmithError) as e:
        import_export(exp, tmp_path / "back", fingerprint=target4.fingerprint())
    one_line(e.value, "config.json", "missing field 'draft_vocab_size'")
    assert not (tmp_path / "back").exists()
