"""The boundary's remaining regressions (issue 64, "Safe inside the user's fleet"), each fixed where it is
born: /metrics read per process across a scale-out, per-position labels read by their integer value, YAML
nesting bounded before it is composed, serve-check's one output per prompt, `alpha --save` onto a folder, a
NUL byte in a config path, DSpark evaluated in every shape, one rule for preset names, and outside text
escaped in every Markdown table. Every test runs in seconds; none needs vLLM."""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from pathlib import Path

import pytest

from draftsmith.errors import ConfigError, DataError


def one_line(e: BaseException | str, *needles: str) -> str:
    message = str(e).strip()
    assert message and "\n" not in message and "Traceback" not in message, message
    for n in needles:
        assert n in message, message
    return message


# --- 1. a second API-server process between two /metrics dumps is a scale-out, not a restart ----------------
def _counters(drafts: int, drafted: int, accepted: int, labels: str = "") -> list[str]:
    """One process's (or the aggregate's) spec-decode counters for model m, positions 0..3 consistent with
    them."""
    per_pos = [min(drafts, accepted // 4 + i) for i in (3, 2, 1, 0)]
    sep = "," if labels else ""
    lines = [f'vllm:spec_decode_num_drafts_total{{model_name="m"{sep}{labels}}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"{sep}{labels}}} {drafted}',
             f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"{sep}{labels}}} {accepted}']
    per_pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f'{per_pos_name}{{model_name="m",position="{i}"{sep}{labels}}} {v}'
              for i, v in enumerate(per_pos)]
    return lines


def _start(pid: str, t: float) -> str:
    return f'process_start_time_seconds{{pid="{pid}"}} {t}'


def test_a_second_api_server_between_two_dumps_is_not_read_as_a_restart():
    """vLLM's multi-API-server mode sums the counters of its processes (Prometheus multiprocess mode) and
    shows each process's start time by its pid: process 101 runs through the window, 202 appears in it.
    Nothing restarted: the window is the difference of the sums (202's counts all fall inside it), α 3000/4000
    = 0.75 — not the after-dump alone (5000/8000), as a restart would be read."""
    from draftsmith.planning.production import vllm_alpha

    before = "\n".join([_start("101", 1.7e9), *_counters(1000, 4000, 2000)]) + "\n"
    after = "\n".join([_start("101", 1.7e9), _start("202", 1.70005e9), *_counters(2000, 8000, 5000)]) + "\n"
    t = vllm_alpha(after, since=before)
    assert t["overall"]["alpha"] == pytest.approx(0.75) and not t.get("restarted")
    assert t["overall"]["proposed"] == 4000


def test_per_process_counters_are_matched_process_by_process():
    """Counters labelled by process (pid): a process in both dumps with its start time is a difference, one
    that restarted counts since its restart, a new one counts all it has; the table says which restarted."""
    from draftsmith.planning.production import vllm_alpha

    before = "\n".join([_start("101", 1.7e9), *_counters(500, 2000, 1000, 'pid="101"'),
                        _start("303", 1.7e9), *_counters(500, 2000, 1000, 'pid="303"')]) + "\n"
    # 101 kept its start (+2000 drafted / +1500 accepted), 303 restarted (1000 / 750 since), 202 is new
    after = "\n".join([_start("101", 1.7e9), *_counters(1000, 4000, 2500, 'pid="101"'),
                       _start("303", 1.70009e9), *_counters(250, 1000, 750, 'pid="303"'),
                       _start("202", 1.70005e9), *_counters(250, 1000, 750, 'pid="202"')]) + "\n"
    t = vllm_alpha(after, since=before)
    assert t["overall"]["proposed"] == 2000 + 1000 + 1000
    assert t["overall"]["alpha"] == pytest.approx((1500 + 750 + 750) / 4000)
    assert 'pid="303"' in t["restarted"] and "101" not in t["restarted"]


def test_dumps_that_cannot_be_matched_per_process_fall_back_and_say_so():
    """Summed counters and a process that restarted: what the restarted one counted before cannot be taken out
    of the sum, so the after-dump alone is the window's count (as for a single server's restart), and the
    table says why."""
    from draftsmith.planning.production import render, vllm_alpha

    before = "\n".join([_start("101", 1.7e9), _start("202", 1.7e9), *_counters(1000, 4000, 2000)]) + "\n"
    after = "\n".join([_start("101", 1.7e9), _start("202", 1.70009e9), *_counters(1500, 6000, 3600)]) + "\n"
    t = vllm_alpha(after, since=before)
    assert t["overall"]["alpha"] == pytest.approx(0.6)
    assert "cannot be matched per process" in t["restarted"] and 'pid="202"' in t["restarted"]
    assert "cannot be matched per process" in render(t)


# --- 2. per-position labels are read by their integer value -------------------------------------------------
@pytest.mark.parametrize("dup", ["00", "01", "0"])
def test_two_samples_at_one_integer_position_are_refused_not_merged(dup):
    from draftsmith.planning.production import vllm_alpha

    text = "\n".join(_counters(100, 400, 200)) + "\n"
    text += f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{dup}"}} 5\n'
    with pytest.raises(DataError) as e:
        vllm_alpha(text, source="dump.prom")
    one_line(e.value, "dump.prom", f"position={dup!r}", "position", "refused")


def test_the_same_position_of_two_engines_is_two_series_summed():
    """Data-parallel engines count the same positions under their own `engine` label: two series, summed."""
    from draftsmith.planning.production import vllm_alpha

    text = "\n".join(_counters(100, 400, 200, 'engine="0"') + _counters(100, 400, 200, 'engine="1"')) + "\n"
    t = vllm_alpha(text)
    assert t["overall"]["proposed"] == 800
    assert t["overall"]["per_position_acceptance"][0] == pytest.approx(53 / 100)


# --- 3. YAML nesting is counted before the document is composed ---------------------------------------------
DEEP = 100_000


def _anchor_chain(n: int) -> str:
    """Each line one level deeper than the one before, through an alias: shallow text, a deep document."""
    return "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, n))


@pytest.mark.parametrize("text", ["x: " + "[" * DEEP + "]" * DEEP, "x: " + "{a: " * DEEP + "1" + "}" * DEEP,
                                  _anchor_chain(5000)], ids=["flow-sequences", "flow-mappings", "aliases"])
def test_deep_yaml_in_a_config_file_is_one_line(tmp_path, text):
    from draftsmith.config import load_config
    from draftsmith.training import TrainConfig

    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, cls=TrainConfig)
    one_line(e.value, str(path), "nest")


def test_deep_yaml_in_an_override_and_an_accelerate_file_is_one_line(tmp_path):
    from draftsmith.config import parse_override
    from draftsmith.memory.training import read_accelerate

    with pytest.raises(ConfigError) as e:
        parse_override("train.loggers=" + "[" * DEEP + "]" * DEEP)
    one_line(e.value, "train.loggers", "nest")
    accelerate = tmp_path / "accelerate.yaml"  # what `plan --config ... --accelerate FILE` reads
    accelerate.write_text("distributed_type: " + "[" * DEEP + "]" * DEEP + "\n")
    with pytest.raises(ConfigError) as e:
        read_accelerate(accelerate)
    one_line(e.value, str(accelerate), "nest")
    # a preset's own depth passes
    from draftsmith.config import safe_load

    assert safe_load("a: {b: [1, [2, {c: 3}]]}") == {"a": {"b": [1, [2, {"c": 3}]]}}


# --- 4. serve-check needs one output per prompt -------------------------------------------------------------
def _fake_vllm(tmp_path: Path, monkeypatch, result: dict) -> None:
    """The vLLM environment's python replaced by a script writing `result` as the runner's result file."""
    (tmp_path / "result.src").write_text(json.dumps(result))
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\ncp '{tmp_path / 'result.src'}' \"$3\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(script))


def _result(outputs: list) -> dict:
    run = {"tokens": 0, "seconds": 0.1, "tokens_per_s": None}
    return {"loaded": True, "outputs": outputs, "counters": {}, "batch1": run,
            "batched": {**run, "batch": 1, "outputs": outputs}}


@pytest.mark.parametrize("outputs", [[], [[5, 6], [7]]], ids=["none", "two-for-one"])
def test_serve_check_fails_when_vllm_did_not_decode_one_output_per_prompt(tiny_target, tmp_path, monkeypatch,
                                                                         outputs):
    from draftsmith.export.serve_check import ServeCheckError, serve_check

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Say hi."], "category": "chat"}) + "\n")
    _fake_vllm(tmp_path, monkeypatch, _result(outputs))
    with pytest.raises(ServeCheckError) as e:
        serve_check(None, tiny_target, [str(prompts)], tmp_path / "check", method="ngram",
                    limit_per_domain=None, evaluate=False, card=False)
    one_line(e.value, "vllm-plain.result.json", "outputs", f"{len(outputs)} ", "1 prompt")
    _fake_vllm(tmp_path, monkeypatch, _result([[5, 6]]))  # one output for the one prompt: the check runs
    report = serve_check(None, tiny_target, [str(prompts)], tmp_path / "check", method="ngram",
                         limit_per_domain=None, evaluate=False, card=False)
    assert report["lossless"] is True and report["n_prompts"] == 1


# --- 5. alpha --save onto a folder --------------------------------------------------------------------------
def test_alpha_save_onto_a_folder_is_one_line_and_a_link_there_is_not_followed(tmp_path, capsys):
    """`--save DIR`: a raw IsADirectoryError before; outputs' atomic writer refuses the folder (and a link)
    at the kept file's name in one line, nothing written into or through it."""
    from draftsmith.cli import main

    dump = tmp_path / "m.prom"
    dump.write_text("\n".join(_counters(100, 400, 200)) + "\n")
    folder = tmp_path / "kept"
    folder.mkdir()
    assert main(["alpha", str(dump), "--save", str(folder)]) != 0
    one_line(capsys.readouterr().err, str(folder), "a folder", "refused")
    assert list(folder.iterdir()) == []
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    link = tmp_path / "link.prom"
    link.symlink_to(outside)
    assert main(["alpha", str(dump), "--save", str(link)]) != 0
    one_line(capsys.readouterr().err, str(link), "a symlink", "refused")
    assert outside.read_text() == "not yours" and link.is_symlink()
    assert main(["alpha", str(dump), "--save", str(tmp_path / "kept.prom")]) == 0
    assert (tmp_path / "kept.prom").read_text() == dump.read_text()


# --- 6. a NUL byte in a path-valued config field ------------------------------------------------------------
def test_a_nul_byte_in_a_config_path_is_refused_naming_the_key(tmp_path):
    from draftsmith.config import load_config
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.training import TrainConfig

    path = tmp_path / "train.yaml"
    path.write_text('output_dir: "runs/a\\0b"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, cls=TrainConfig)
    one_line(e.value, str(path), "output_dir", "NUL")
    nested = tmp_path / "medusa.yaml"
    nested.write_text('kind: medusa\ntarget: tiny\ndata: d\ntrain: {output_dir: "x\\0"}\n')
    with pytest.raises(ConfigError) as e:
        load_config(nested)
    one_line(e.value, "train.output_dir", "NUL")
    listed = tmp_path / "eval.yaml"
    listed.write_text('prompts: [a.jsonl, "b\\0.jsonl"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(listed, cls=EvalConfig)
    one_line(e.value, "prompts[1]", "NUL")
    with pytest.raises(ConfigError, match="output_dir"):  # built by Python code: the same check
        TrainConfig(output_dir="runs/\0")


# --- 7. DSpark evaluated in every shape, with and without --tree --------------------------------------------
@pytest.fixture(scope="module")
def dspark(tiny_tokenizer, tmp_path_factory):
    """A tiny DSpark drafter (one training step: its shapes, not its quality, are under test) and its
    target."""
    from test_dspark import job_config
    from tiny_models import distilled_rows, make_target

    from draftsmith.dspark.job import DSparkJob
    from draftsmith.training import train

    target = make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("dspark-t"))
    cfg = job_config(tmp_path_factory.mktemp("dspark-a"), steps=1)
    return target, train(DSparkJob(cfg, target, distilled_rows(target)), cfg.train).artifact


@pytest.mark.parametrize("shape", [dict(), dict(confidence_cut=False), dict(tree=True),
                                   dict(evaluate=dict(tree=[2, 1])),
                                   dict(tree=True, evaluate=dict(tree=[2, 1])),
                                   dict(evaluate=dict(tree_from_proposer=True))],
                         ids=["chain", "chain-uncut", "tree-proposer-chain-run", "chain-proposer-tree-run",
                              "tree", "tree-auto"])
def test_dspark_is_evaluable_in_every_shape(dspark, tmp_path, shape):
    """Chain of --k (its confidence cut or not), a tree of --tree, the proposer's own tree (`--tree auto`):
    each decodes, losslessly against HF generate. The cost model is measured only where a tree is cut."""
    from draftsmith.dspark.proposer import DSparkProposer, build_proposer
    from draftsmith.evaluation.evaluate import evaluate

    target, artifact = dspark
    run = dict(shape.pop("evaluate", {}))
    proposer = build_proposer(target, str(artifact), **shape)
    assert isinstance(proposer, DSparkProposer)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": ["What is a fox?"]}) + "\n")
    report = evaluate(target, proposer, prompts=[str(prompts)], max_new_tokens=5, k=3, cost_context=16,
                      cost_k_max=3, cost_repeats=1, repeats=1, remeasure=0, limit_per_domain=1,
                      cost_model=bool(run), gpu_tree=False, **run)
    assert report["overall"]["lossless"] is True and report["overall"]["n_prompts"] == 1


def test_dspark_evaluates_without_tree_from_the_command_line(dspark, tmp_path, capsys):
    """`draftsmith evaluate --proposer dspark:ART` without --tree: `max() arg is an empty sequence` before."""
    from draftsmith.cli import main

    target, artifact = dspark
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": ["What is a fox?"]}) + "\n")
    code = main(["evaluate", "--target", str(target.folder), "--proposer", f"dspark:{artifact}", "--prompts",
                 str(prompts), "--max-new-tokens", "5", "--k", "3", "--out", str(tmp_path / "r"),
                 "--no-cost-model", "--repeats", "1", "--remeasure", "0"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "report.json").read_text())["overall"]["lossless"] is True


# --- 8. presets resolve one way for both spellings ----------------------------------------------------------
def test_a_local_preset_copy_is_read_by_both_spellings_and_named(tmp_path, monkeypatch, caplog):
    from draftsmith.config import PRESETS, preset_path

    monkeypatch.chdir(tmp_path)
    shipped = PRESETS / "smollm2-135m" / "medusa.yaml"
    assert preset_path("smollm2-135m/medusa") == preset_path("smollm2-135m/medusa.yaml") == shipped
    local = tmp_path / "smollm2-135m" / "medusa.yaml"
    local.parent.mkdir()
    local.write_text(shipped.read_text().replace("num_heads: 4", "num_heads: 3"))
    for ref in ("smollm2-135m/medusa", "smollm2-135m/medusa.yaml"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draftsmith.config"):
            assert preset_path(ref).resolve() == local.resolve(), ref
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1, warned
        assert "smollm2-135m/medusa.yaml" in warned[0] and str(shipped) in warned[0], warned
        one_line(warned[0])


# --- 9. outside text is escaped in every Markdown table -----------------------------------------------------
HOSTILE = ["a|b", "two\nlines", "cr\rhere", "nul\0byte", "bidi\u202eevil", "iso\u2067late", "back\\", "<!--",
           "sep\u2028line", "esc\x1b[31m"]
_PIPE = re.compile(r"(?<!\\)(?:\\\\)*\|")


def _raw_hostile(md: str) -> list[str]:
    """Characters that may not appear raw in Markdown: controls but the line break, format characters (bidi
    overrides), line/paragraph separators."""
    return [c for c in md if c != "\n" and unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def _tables_hold(md: str) -> None:
    """Every line of every table has its header's number of unescaped cell separators, no hostile character is
    raw, and no HTML comment hides what follows."""
    assert not _raw_hostile(md), _raw_hostile(md)
    assert "<!--" not in md
    block: list[str] = []
    for line in md.split("\n") + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            widths = {len(_PIPE.findall(x)) for x in block}
            assert len(widths) == 1, block
        block = []


def test_md_cell_escapes_every_forging_character():
    from draftsmith.formatting import md_cell

    for text in HOSTILE:
        cell = md_cell(text)
        assert len(_PIPE.findall(cell)) == 0 and "\n" not in cell and not _raw_hostile(cell), (text, cell)
    assert md_cell("plain text 0.75 (α) — τ") == "plain text 0.75 (α) — τ"
    assert md_cell(0.5) == "0.5" and md_cell(None) == "–"


def test_alpha_tables_escape_model_names_and_domains(tmp_path):
    from draftsmith.planning.production import log_alpha, render, vllm_alpha

    text = "".join("\n".join(_counters(100, 400, 200)).replace('model_name="m"', 'model_name="{}"'.format(
        name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))) + "\n" for name in HOSTILE)
    _tables_hold(render(vllm_alpha(text, source="dump|\nx.prom")))
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"prompt": "p", "domain": d, "draft_tokens": 40, "accepted_tokens": 30, "drafts": 10}
            for d in HOSTILE]
    (logs / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _tables_hold(render(log_alpha(logs)))


def test_evaluation_report_tables_escape_prompt_categories(tiny_target, tmp_path):
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import render_markdown

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": ["Say hi."]}) + "\n" for c in HOSTILE))
    report = evaluate(tiny_target, "ngram", prompts=[str(prompts)], max_new_tokens=3, k=2, cost_model=False,
                      repeats=1, remeasure=0, hf_reference=False)
    md = render_markdown(report)
    _tables_hold(md)
    assert "a\\|b" in md


def test_other_markdown_tables_escape_outside_names(tmp_path):
    """The model card's per-domain table, the temperature sweep's and routing's comparison take domain and
    proposer names from reports."""
    from draftsmith.layouts.card import card_text

    rows = {d: {"n_prompts": 1, "alpha": 0.5, "tau": 1.5, "lossless": True} for d in HOSTILE}
    manifest = {"eval": {"domains": rows, "overall": rows[HOSTILE[0]]}, "data": {"source": "x\n| forged |"}}
    _tables_hold(card_text(manifest, "a head", "medusa", "vllm", "medusa", "t", "serve it"))

    from draftsmith.evaluation.sweep import render

    cell = {"alpha": 0.5, "tau": 1.5, "speedup": 1.1, "alpha_change": 0.0, "tau_change": 0.0}
    _tables_hold(render({"temperatures": [0.0, 1.0], "proposer": "p|q", "target": "t", "date": "d",
                         "command": "c", "domains": {d: {0.0: cell, 1.0: cell} for d in HOSTILE}}))

    from draftsmith.planning.policy import compare_table

    routed = {"domains": {d: {"speedup": 1.2, "route": f"medusa:{d}",
                              "compare": {f"medusa:{d}": {"speedup": 1.1}}} for d in HOSTILE}}
    _tables_hold(compare_table(routed)[0])


def test_a_bad_table_fails_the_table_check():
    """The check can fail: a raw pipe in a cell is a forged column, a raw bidi override is refused."""
    with pytest.raises(AssertionError):
        _tables_hold("| a | b |\n|---|---|\n| x|y | 1 |")
    with pytest.raises(AssertionError):
        _tables_hold("| a |\n|---|\n| \u202ex |")
