"""What draftsmith says vLLM serves is what was measured in the real vLLM.

scripts/vllm_families.py loads a tiny random target of every family with every kind of export in vLLM and keeps
its report (results/vllm-families/report.json). The family table of docs/your-model.md is rendered from it,
and the methods' measured vLLM refusals (`Method.serving`, read by export/vllm.py: the warning an export for vLLM
carries) are exactly the refusals it measured.
An export of a refused family and kind warns, in its checks and its log.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "results" / "vllm-families" / "report.json"


def _script():
    spec = importlib.util.spec_from_file_location("vllm_families", ROOT / "scripts" / "vllm_families.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


def test_every_family_and_kind_was_measured(report):
    """Every dense family of the table; the mixture-of-experts ones are served by tests/test_vllm_serving.py's
    MoE test (`make test-vllm`), not yet measured kind by kind in this report."""
    from tiny_models import DENSE_FAMILY_NAMES, FAMILY_NAMES

    assert set(DENSE_FAMILY_NAMES) <= set(report["families"]) <= set(FAMILY_NAMES)
    for fam, rows in report["families"].items():
        assert sorted(r["kind"] for r in rows) == sorted(report["kinds"]), fam
    assert report["vllm_version"] and report["command"] and report["date"] and report["machine"]


def test_the_docs_table_is_the_report(report):
    mod = _script()
    text = (ROOT / "docs" / "your-model.md").read_text()
    block = text.split(mod.BEGIN, 1)[1].split(mod.END, 1)[0]
    assert block.strip() == mod.docs_table(report).strip(), (
        "docs/your-model.md's vLLM table differs from the report: python scripts/vllm_families.py --write-docs")


def test_export_warns_exactly_where_the_measured_vllm_refuses(report):
    from draftsmith.export.vllm import VLLM_VERSION, refusal, refuses

    assert report["vllm_version"] == VLLM_VERSION
    refused = {}
    for fam, rows in report["families"].items():
        for r in rows:
            if r["kind"] != "ngram" and r.get("target_ran") and r.get("loaded") is False:
                refused[(fam, r["kind"])] = r["error"]
    assert set(refuses()) == set(refused)  # what every method declares (`Method.serving`), through the registry
    for key, error in refused.items():
        assert error[:80] in refuses()[key], key
        assert refusal(*key) and "refuses" in refusal(*key)
    served = [(f, r["kind"]) for f, rows in report["families"].items() for r in rows if r.get("loaded")]
    assert served and all(refusal(*key) is None for key in served)


def test_a_refusal_names_the_engine_cores_own_error(tmp_path):
    """vLLM's engine core fails in a process of its own, and the runner sees only vLLM's wrapper ("Engine core
    initialization failed"); the report takes the cause from the engine's log (lines as vLLM 0.32.0 writes them)."""
    from draftsmith.export.serve_check import root_cause

    log = tmp_path / "vllm-spec.log"
    log.write_text(
        "(EngineCore pid=1) INFO 11-26 02:57:40 [core.py:133] Initializing a V1 LLM engine (v0.32.0)\n"
        "(Worker pid=2) ERROR 11-26 02:57:50 [multiproc_executor.py:953]     raise RuntimeError(\n"
        "(Worker pid=2) ERROR 11-26 02:57:50 [multiproc_executor.py:953] RuntimeError: Model does not support "
        "EAGLE3 interface but aux_hidden_state_outputs was requested\n"
        "(EngineCore pid=1) ERROR 11-26 02:57:51 [core.py:1512] RuntimeError: Worker failed with error 'Model does "
        "not support EAGLE3 interface', please check the stack trace above for the root cause\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert root_cause(log) == ("RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs "
                               "was requested")
    # vLLM inspects a model class in a subprocess and reports only that the inspection failed: a module it could
    # not import is the cause (an image-text Gemma 3 without torchvision)
    log.write_text(
        "(MainProcess pid=3) ERROR [registry.py:1120] subprocess.CalledProcessError: Command '[...]' returned "
        "non-zero exit status 1.\n"
        "(MainProcess pid=3) ERROR [registry.py:1120] RuntimeError: Error raised in subprocess:\n"
        "(MainProcess pid=3) ERROR [registry.py:1120] ModuleNotFoundError: No module named 'torchvision'\n")
    assert root_cause(log) == "ModuleNotFoundError: No module named 'torchvision'"
    log.write_text("INFO nothing failed here\n")
    assert root_cause(log) is None


def test_serve_check_refuses_in_one_line_before_vllm_starts(tiny_target, tmp_path):
    """What serve-check checks before it starts an engine: k, an export or the n-gram control, a report folder
    outside the export, prompts that fit the target; and a target vLLM could not run alone stops the check
    (here the result of that plain run is given, as the tests share one per target)."""
    from draftsmith.errors import ConfigError
    from draftsmith.export.serve_check import ServeCheckError, serve_check

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Say hi."], "category": "chat"}) + "\n")
    export = tmp_path / "export"
    export.mkdir()
    kw = {"prompts": [str(prompts)], "limit_per_domain": None}
    with pytest.raises(ConfigError, match="k must be >= 1"):
        serve_check(export, tiny_target, out=tmp_path / "c", k=0, **kw)
    with pytest.raises(ConfigError, match="needs --export"):
        serve_check(None, tiny_target, out=tmp_path / "c", **kw)
    with pytest.raises(ConfigError, match="lies inside the export"):
        serve_check(export, tiny_target, out=export / "check", method="ngram", **kw)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        serve_check(None, tiny_target, out=tmp_path / "c", method="ngram", max_new_tokens=10_000, **kw)
    with pytest.raises(ServeCheckError, match="did not run the target .*: no engine here"):
        serve_check(None, tiny_target, out=tmp_path / "c", method="ngram",
                    plain={"loaded": False, "error": "no engine here"}, **kw)
