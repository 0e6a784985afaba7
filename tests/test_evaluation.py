"""The evaluator: domains from prompt files, the cost model's arithmetic, a full report with plots from the
Python API and from the CLI on the tiny target saved as a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.decoding import cost
from draftsmith.errors import ConfigError
from draftsmith.evaluation.domains import canonical_domain, load_prompts

DOMAIN_FIELDS = ["n_prompts", "alpha", "tau", "per_position_acceptance", "tokens_per_s", "baseline_tokens_per_s",
                 "speedup", "lossless", "tau_predicted_from_alpha"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def prompt_files(tmp_path):
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "alpaca.jsonl").write_text("\n".join(json.dumps({"question_id": i, "category": "", "turns": [t]})
                                                  for i, t in enumerate(["Name three colors.", "What is a fox?",
                                                                         "Say hi."])) + "\n")
    (eagle / "gsm8k.jsonl").write_text("\n".join(json.dumps({"category": "math", "turns": [t, "And then?"]}) for t in
                                                 ["What is 2 + 3?", "Natalia sold 48 clips. How many?"]) + "\n")
    (tmp_path / "user_oriented_instructions.jsonl").write_text(json.dumps(
        {"id": "t0", "motivation_app": "Gmail", "instruction": "Rewrite politely.",
         "instances": [{"input": "send it now", "output": "x"}]}) + "\n")
    return [eagle / "alpaca.jsonl", eagle / "gsm8k.jsonl", tmp_path / "user_oriented_instructions.jsonl"]


def test_domains(prompt_files):
    rows = load_prompts(prompt_files)
    by = {}
    for r in rows:
        by.setdefault(r.domain, []).append(r)
    assert sorted(by) == ["general", "instructions", "math"]
    assert len(by["general"]) == 3 and len(by["math"]) == 2
    assert by["instructions"][0].text == "Rewrite politely.\n\nsend it now"
    assert by["math"][0].turns[1] == "And then?" and by["math"][0].text == "What is 2 + 3?"
    limited = load_prompts(prompt_files, limit_per_domain=2, seed=3)
    assert sum(r.domain == "general" for r in limited) == 2
    assert [r.text for r in limited] == [r.text for r in load_prompts(prompt_files, limit_per_domain=2, seed=3)]
    assert canonical_domain("humaneval") == "code" and canonical_domain("Poetry") == "poetry"


@pytest.mark.parametrize("line, why", [(b'{"turns": ["ok"', "bad JSON"), (b'["a list"]', "not a JSON object"),
                                       (b'{"turns": ["caf\xe9"]}', "not UTF-8"), (b'{"id": 3}', "no prompt field")])
def test_a_bad_eval_prompt_line_is_an_error_naming_file_and_line(tmp_path, line, why):
    """Eval prompts are read by the data pipeline's line reader, but a bad line stops the run (an eval set
    quietly one prompt smaller would move every number measured on it)."""
    from draftsmith.errors import DataError

    (tmp_path / "p.jsonl").write_bytes(b'{"turns": ["fine"]}\n\n' + line + b"\n")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'p.jsonl'}:3: {why}[^\n]*$"):
        load_prompts([tmp_path / "p.jsonl"])


def test_only_some_domains_are_the_same_prompts_as_in_a_run_over_all(prompt_files):
    """--domains keeps the prompts a run over every domain measures for those domains (the per-domain choice comes
    first), takes aliases, and refuses a domain the files do not hold in one line naming what they hold."""
    from draftsmith.cli import build_parser
    from draftsmith.errors import DataError
    from draftsmith.evaluation.commands import build_config
    from draftsmith.evaluation.domains import only_domains

    every = load_prompts(prompt_files, limit_per_domain=2, seed=3)
    some = only_domains(every, ["gsm8k", "general"], prompt_files)
    assert [r.text for r in some] == [r.text for r in every if r.domain in ("math", "general")]
    assert only_domains(every, [], prompt_files) == every
    with pytest.raises(DataError, match="domains: translation not in the prompt files .*general, instructions, math"):
        only_domains(every, ["translation"], prompt_files)
    cfg = build_config(build_parser().parse_args(["evaluate", "--domains", "math", "code"]))
    assert cfg.domains == ["math", "code"]


def test_shipped_prompts_longer_than_the_context_are_left_out_with_why(tiny_target):
    """A short-context target is measured on the shipped prompts it can read; each one left out keeps its reason
    (the report's settings.left_out). Prompt files a user names are refused instead (fit_context)."""
    from draftsmith.evaluation.domains import EvalPrompt
    from draftsmith.evaluation.limits import fit_context, leave_out_long

    ctx = tiny_target.model.config.max_position_embeddings
    rows = [EvalPrompt("rag", "word " * (2 * ctx), "rag.jsonl:1"), EvalPrompt("general", "Say hi.", "alpaca.jsonl:1")]
    kept, left = leave_out_long(tiny_target, rows, 8)
    assert [r.source for r in kept] == ["alpaca.jsonl:1"]
    assert left[0]["prompt"] == "rag.jsonl:1" and left[0]["domain"] == "rag"
    assert left[0]["reason"].endswith(f"+ max_new_tokens 8 > the target's context {ctx}")
    with pytest.raises(ConfigError, match="prompt rag.jsonl:1: a prompt of .* more than the target's context"):
        fit_context(tiny_target, rows, 8)


def test_cost_arithmetic():
    # 10 steps; 8 accepted >=1 draft, 5 accepted >=2, 2 accepted 3
    acc = [8, 5, 2]
    assert cost.expected_tokens(acc, 10, 0) == 1.0
    assert cost.expected_tokens(acc, 10, 3) == pytest.approx(1 + 0.8 + 0.5 + 0.2)
    # past the data: geometric with the last conditional rate 0.2/0.5
    assert cost.expected_tokens(acc, 10, 4) == pytest.approx(2.5 + 0.2 * 0.4)
    v = {"0": 1.0, "1": 1.1, "2": 1.3, "3": 2.5}
    full = [10, 10, 10]  # every step proposed 3 tokens: cost is v(k) + k·c
    assert cost.expected_cost(full, 10, 2, v, 0.05) == pytest.approx(1.3 + 0.1)
    # 10 steps: 4 empty proposals, 2 of length 1, 4 of length 3
    short = [6, 4, 4]
    assert cost.expected_cost(short, 10, 3, v, 0.0) == pytest.approx((4 * 1.0 + 2 * 1.1 + 4 * 2.5) / 10)
    assert cost.expected_cost(short, 10, 1, v, 0.0) == pytest.approx((4 * 1.0 + 6 * 1.1) / 10)
    rec = cost.recommend_k(acc, full, 10, v, c=0.05)
    table = {k: cost.expected_tokens(acc, 10, k) / (v[str(k)] + k * 0.05) for k in range(4)}
    assert rec["k"] == max(table, key=table.get)
    assert cost.recommend_k([0, 0], [10, 10], 10, v, c=0.0)["k"] == 0  # never accepted: do not speculate
    assert cost.recommend_k(acc, full[:2], 10, v, c=0.0)["k"] <= 2  # never beyond the measured depth
    assert cost.tau_from_alpha(0.5, 3) == pytest.approx(1.875) and cost.tau_from_alpha(1.0, 3) == 4.0


def test_verify_cost_measured(tiny_target):
    cm = cost.measure_verify_cost(tiny_target, context_length=16, k_max=4, repeats=2)
    assert set(cm["v"]) == {"0", "1", "2", "3", "4"} and cm["v"]["0"] == 1.0
    assert all(x > 0 for x in cm["v"].values()) and cm["t_step_s"] > 0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_cpu_share_sees_other_processes():
    import os
    import subprocess
    import sys
    import time

    n = min(os.cpu_count() or 1, 4)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)  # let them start
        assert all(sp.poll() is None for sp in spinners), "a spinner process died"
        with cost.CpuShare() as busy:
            time.sleep(1.0)
    finally:
        for sp in spinners:
            sp.kill()
            sp.wait(10)
    # n spinners on os.cpu_count() cores: at least half of what they should take, however loaded CI is
    assert busy.others is not None and busy.others >= 0.5 * n / os.cpu_count()
    assert busy.busy == (busy.others > cost.BUSY_SHARE)


def test_cpu_share_subtracts_our_own_cpu_time(monkeypatch):
    # machine counters (busy, total) before and after, and this process's CPU time: 2 s of wall on 2 cores,
    # the machine busy for 1.5 core-seconds of which 1.0 were ours -> others used 0.5 / 4 = 12.5%
    machine = iter([(100.0, 400.0), (101.5, 404.0)])
    own = iter([10.0, 11.0])
    monkeypatch.setattr(cost, "_machine_cpu_s", lambda: next(machine))
    monkeypatch.setattr(cost.time, "process_time", lambda: next(own))
    with cost.CpuShare() as share:
        pass
    assert share.others == pytest.approx(0.125) and not share.busy
    # a block of 2 clock ticks of all cores' time: one tick's rounding would read 0% or 50%, so no reading
    machine = iter([(100.0, 400.0), (100.01, 400.02)])
    own = iter([10.0, 10.0])
    monkeypatch.setattr(cost, "_machine_cpu_s", lambda: next(machine))
    with cost.CpuShare() as share:
        pass
    assert share.others is None and not share.busy
    monkeypatch.setattr(cost, "_machine_cpu_s", lambda: None)  # not Linux: unknown, never "busy"
    monkeypatch.setattr(cost.time, "process_time", lambda: 0.0)
    with cost.CpuShare() as share:
        pass
    assert share.others is None and not share.busy


def test_verify_cost_reports_contention(tiny_target):
    cm = cost.measure_verify_cost(tiny_target, context_length=16, k_max=2, repeats=2)
    assert "other_cpu_share" in cm and isinstance(cm["contended"], bool)
    # v is the median repeat per k; the fastest repeats are kept next to it
    assert all(cm["t_forward_min_s"][k] <= cm["t_forward_s"][k] for k in cm["v"])


def check_report(report, out_dir, lossless=True):
    for d in list(report["domains"].values()) + [report["overall"]]:
        for f in DOMAIN_FIELDS:
            assert f in d, f
        assert d["lossless"] is lossless
        assert d["tau"] >= 1.0
        # speeds come from the prompts timed validly; a prompt left out is named with its reason
        if d["n_timed"]:
            assert d["tokens_per_s"] > 0 and d["baseline_tokens_per_s"] > 0 and d["speedup"] > 0
        else:
            assert d["tokens_per_s"] is None and d["speedup"] is None
    invalid = report["contention"]["invalid"]
    assert report["overall"]["n_timed"] == report["overall"]["n_prompts"] - len({i["prompt"] for i in invalid
                                                                               if i["entry"] == "spec"})
    assert report["contention"]["speedups_valid"] is (not invalid)
    for key in ("cost_model", "recommended_k", "policy", "memory", "references", "machine", "command", "date"):
        assert key in report, key
    assert set(report["policy"]) == set(report["domains"])
    assert all({"enable", "threshold", "reason"} <= set(p) for p in report["policy"].values())
    assert report["memory"]["peak_rss_mb"] > 0
    assert "v" in report["cost_model"] and "c" in report["cost_model"]
    # how quiet the machine was while v(k) was timed, in the report itself; a tiny model's timing can be
    # shorter than /proc/stat's clock ticks, and then the report says that it could not be read
    share = report["cost_model"]["other_cpu_share"]
    md = (out_dir / "report.md").read_text()
    if share is None:
        assert "How busy the machine was while v(k) was timed could not be read" in md
    else:
        assert Path("/proc/stat").exists() and 0.0 <= share <= 1.0
        assert "v(k) was measured while other processes used" in md
    for name in ("report.json", "report.md", "acceptance_per_position.png", "domains.png", "verify_cost.png"):
        assert (out_dir / name).stat().st_size > 0, name
    assert json.loads((out_dir / "report.json").read_text())["overall"]["n_prompts"] == report["overall"]["n_prompts"]


def test_evaluate_api_draft_with_hf_references(tiny_target, prompt_files, tmp_path, monkeypatch):
    from draftsmith.distill.proposer import DraftProposer
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report
    from draftsmith.targets import gemm

    # HF generate, the outside reference, runs with the stock kernels; our plain decoding with the plan
    kernels_in_hf = []
    real_generate = type(tiny_target.model).generate

    def spy(self, *a, **kw):
        kernels_in_hf.append(gemm.ENABLED)
        return real_generate(self, *a, **kw)

    monkeypatch.setattr(type(tiny_target.model), "generate", spy)
    # references and kernels, not load: every measurement counts as valid here, so the speeds are there to check
    _scripted(monkeypatch, lambda n: 0.0)
    report = evaluate(tiny_target, DraftProposer(tiny_target), prompts=prompt_files, max_new_tokens=8, k=3,
                      cost_context=16, cost_k_max=4, cost_repeats=1, limit_per_domain=2)
    assert kernels_in_hf and not any(kernels_in_hf) and gemm.ENABLED
    assert report["machine"]["few_row_kernels"] == gemm.describe()
    o = report["overall"]
    assert o["speedup_vs_hf_generate"] == o["tokens_per_s"] / o["hf_generate_tokens_per_s"]
    out = write_report(report, tmp_path / "r")
    assert "few-row kernels (measured plan" in (out / "report.md").read_text()
    # a larger forward measured cheaper than the one-token step: the report says the baseline is off its kernel
    from draftsmith.evaluation.report import render_markdown

    report["cost_model"]["v"] = {"0": 1.0, "1": 0.6, "2": 1.2}
    assert "v(k) < 0.9 at k = 1:" in render_markdown(report)
    report["cost_model"]["v"] = {"0": 1.0, "1": 0.95, "2": 1.2}
    assert "v(k) <" not in render_markdown(report)
    check_report(report, out)
    assert report["overall"]["alpha"] == 1.0  # the target drafting for itself
    assert report["overall"]["n_prompts"] == 2 + 2 * 2 + 1  # the math rows have two turns: each is measured
    refs = report["references"]
    assert refs["hf_generate"]["matches_plain_decoding"] is True
    assert refs["hf_assisted_generate"]["matches_target_greedy"] is True
    assert refs["hf_assisted_generate"]["tokens_per_s"] > 0


def test_cli_end_to_end(tiny_target, prompt_files, tmp_path, capsys):
    from draftsmith.cli import main

    out = tmp_path / "cli"
    code = main(["evaluate", "--target", str(tiny_target.folder), "--proposer", "ngram", "--prompts",
                 *map(str, prompt_files), "--max-new-tokens", "8", "--k", "2", "--temperature", "0",
                 "--limit-per-domain", "1", "--out", str(out), "--cost-k-max", "3", "--cost-repeats", "1",
                 "--cost-context", "16", "--turns", "first"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    check_report(report, out)
    # --turns first: one generation per row, though the math row has two user turns
    assert report["settings"]["k"] == 2 and report["overall"]["n_prompts"] == 3
    assert report["settings"]["turns"] == "first" and "turns" not in report["overall"]
    assert "| alpha |" in (out / "report.md").read_text()
    assert "speedup" in capsys.readouterr().out


def test_cli_fingerprint_mismatch(tiny_target, other_target, prompt_files, tmp_path, capsys):
    from draftsmith.artifact import make_manifest, save_artifact
    from draftsmith.cli import main

    def writer(tmp):
        tiny_target.model.save_pretrained(tmp)
        tiny_target.tokenizer.save_pretrained(tmp)

    art = save_artifact(tmp_path / "d", make_manifest("draft", other_target.fingerprint(), {}), writer=writer)
    code = main(["evaluate", "--target", str(tiny_target.folder), "--proposer", f"draft:{art}", "--prompts",
                 str(prompt_files[0]), "--out", str(tmp_path / "x")])
    assert code == 2
    assert "different target" in capsys.readouterr().err


def test_evaluate_cuts_scored_trees_and_survives_a_cut_to_nothing(tiny_target, prompt_files, tmp_path):
    from test_budget import ScoredTopK

    from draftsmith.decoding.proposer import TreeSpec
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    class OwnTree(ScoredTopK):
        def default_tree_spec(self):
            return TreeSpec((2, 2))

    class GpuTree(OwnTree):
        def gpu_tree(self):
            return OwnTree(self.draft), TreeSpec((3, 3))

    class CutToNothing(OwnTree):
        def fit_tree(self, spec, cost):
            assert cost.v[0] > 0 and len(cost.v) == spec.capacity() + 1  # v(n) for every node count
            return TreeSpec(())

    kw = dict(prompts=prompt_files, max_new_tokens=8, tree_from_proposer=True, cost_context=16, cost_k_max=4,
              cost_repeats=1, limit_per_domain=1)
    report = evaluate(tiny_target, OwnTree(tiny_target.model), **kw)
    assert report["overall"]["lossless"] is True and report["settings"]["prune_tree"] is True
    assert len(report["cost_model"]["v_tree"]) == 6 + 1
    assert report["overall"]["proposed"] + report["overall"]["pruned"] > 0
    assert "trees cut to the nodes that pay" in (write_report(report, tmp_path / "a") / "report.md").read_text()
    nothing = evaluate(tiny_target, CutToNothing(tiny_target.model), **kw)
    assert nothing["settings"]["tree_verified"] == [] and nothing["overall"]["proposed"] == 0
    assert nothing["overall"]["tau"] == 1.0 and nothing["overall"]["lossless"] is True
    check_report(nothing, write_report(nothing, tmp_path / "b"))
    whole = evaluate(tiny_target, OwnTree(tiny_target.model), **{**kw, "prune_tree": False})
    assert whole["overall"]["pruned"] == 0 and "v_tree" not in whole["cost_model"]
    assert report["settings"]["gpu_tree"] is None and "gpu_tree" not in report["overall"]  # no GPU tree of its own
    # the uncut GPU-sized tree is decoded beside the cut one, for its τ; it is never cut
    gpu = evaluate(tiny_target, GpuTree(tiny_target.model), **kw)
    assert gpu["settings"]["gpu_tree"] == {"tree": [3, 3], "tree_max_nodes": None}
    for d in list(gpu["domains"].values()) + [gpu["overall"]]:
        assert d["gpu_tree"]["lossless"] is True and d["gpu_tree"]["tau"] >= 1.0
    assert gpu["overall"]["gpu_tree"]["verified_nodes_per_step"] > gpu["overall"]["verified_nodes_per_step"]
    assert "τ with the GPU-sized tree" in (write_report(gpu, tmp_path / "g") / "report.md").read_text()
    assert not evaluate(tiny_target, GpuTree(tiny_target.model), **kw, gpu_tree=False)["settings"]["gpu_tree"]


def test_compare_entries_pick_their_own_shape(tiny_target, prompt_files, tmp_path):
    from draftsmith.decoding.proposer import TreeSpec, side_by_side_entry
    from draftsmith.errors import ConfigError
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    assert side_by_side_entry("eagle:runs/x") == ("eagle:runs/x", None, None)
    assert side_by_side_entry("eagle:a@b/x") == ("eagle:a@b/x", None, None)  # an '@' in a path is part of the path
    assert side_by_side_entry("eagle:x@chain=4") == ("eagle:x", 4, None)
    assert side_by_side_entry("eagle:x@chain") == ("eagle:x", "chain", None)
    assert side_by_side_entry("medusa:x@tree@float32") == ("medusa:x", "tree", "float32")
    assert side_by_side_entry("eagle:x@bfloat16@chain=2") == ("eagle:x", 2, "bfloat16")
    assert side_by_side_entry("ngram@tree=3,2,1") == ("ngram", TreeSpec((3, 2, 1)), None)
    for bad in ("ngram@chain=0", "ngram@chain=2,2", "ngram@tree=", "ngram@tree=2,x", "ngram@chain@tree",
                "ngram@float32@float16"):
        with pytest.raises(ConfigError, match="after '@'"):
            side_by_side_entry(bad)
    kw = dict(prompts=prompt_files, max_new_tokens=8, k=3, cost_context=16, cost_k_max=3, cost_repeats=1,
              limit_per_domain=1)
    with pytest.raises(ConfigError, match="no tree of its own"):
        evaluate(tiny_target, "ngram", compare=["ngram@tree"], **kw)

    report = evaluate(tiny_target, "ngram", compare=["ngram@chain=1", "ngram@tree=2,1"], **kw)
    settings = report["settings"]["compare_settings"]
    assert (settings["ngram@chain=1"]["k"], settings["ngram@chain=1"]["tree"]) == (1, None)
    assert settings["ngram@tree=2,1"]["tree"] == [2, 1]
    for name, c in report["overall"]["compare"].items():
        assert c["lossless"] is True, name
        assert len(c["conditional_acceptance"]) <= (1 if name.endswith("=1") else 2)
    md = (write_report(report, tmp_path / "r") / "report.md").read_text()
    assert "n-α by position" in md and "| ngram@tree=2,1 |" in md


def test_draft_networks_run_in_the_draft_dtype(tiny_target, prompt_files, tmp_path):
    from draftsmith.distill.proposer import DraftProposer
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    kw = dict(prompts=prompt_files, max_new_tokens=6, k=2, limit_per_domain=1,
              cost_model=False)
    report = evaluate(tiny_target, DraftProposer(tiny_target), draft_dtype="bfloat16",
                      compare=["ngram", f"draft:{tiny_target.folder}@float32"], **kw)
    assert report["settings"]["draft_dtype"] == "bfloat16" and report["overall"]["lossless"] is True
    side = report["settings"]["compare_settings"]
    assert (side["ngram"]["draft_dtype"] is None
            and side[f"draft:{tiny_target.folder}@float32"]["draft_dtype"] == "float32")
    assert report["overall"]["compare"][f"draft:{tiny_target.folder}@float32"]["alpha"] == 1.0  # itself, in fp32
    assert next(tiny_target.model.parameters()).dtype == torch.float32  # the target drafting for itself: a copy
    assert "draft networks in bfloat16" in (write_report(report, tmp_path / "r") / "report.md").read_text()
    assert evaluate(tiny_target, "ngram", **kw)["settings"]["draft_dtype"] is None  # nothing to cast


def test_report_fields_are_pinned(tiny_target, prompt_files):
    """Every field of the report, for a run with each kind of decoding (plain, speculative, side by side,
    adaptive k, HF generate): the evaluator's internals may change, what readers of report.json see may not."""
    from draftsmith.evaluation.evaluate import evaluate

    report = evaluate(tiny_target, "ngram", prompts=prompt_files, max_new_tokens=6, k=2, cost_context=16,
                      cost_k_max=2, cost_repeats=1, limit_per_domain=1, adaptive=True, compare=["ngram@chain=1"])
    assert set(report) == {"command", "date", "machine", "target", "proposer", "shape", "settings", "domains",
                          "overall", "cost_model", "recommended_k", "policy", "memory", "references", "prompts",
                          "contention"}
    # no --as-served: draftsmith's own decoder, its chain of k
    assert report["shape"] == {"engine": "draftsmith", "method": "ngram", "form": "chain", "k": 2,
                               "label": "draftsmith's decoder chain k=2"}
    assert report["settings"]["compare_settings"]["ngram@chain=1"]["shape"]["k"] == 1
    assert set(report["contention"]) == {"other_cpu_share", "threshold", "speedups_valid", "note", "repeats",
                                         "remeasure", "prompts", "prompts_with_invalid_timing", "invalid",
                                         "busy_prompts"}
    assert set(report["settings"]) == {
        "max_new_tokens", "k", "tree", "tree_max_nodes", "prune_tree", "tree_verified", "temperature", "top_p",
        "top_k", "limit_per_domain", "seed", "prompt_files", "adaptive", "compare", "gpu_tree", "draft_dtype",
        "compare_settings", "split", "domains", "repeats", "remeasure", "chat_template_kwargs", "turns", "turns_cut",
        "left_out"}
    overall = {"n_prompts", "alpha", "tau", "tau_predicted_from_alpha", "per_position_acceptance",
               "conditional_acceptance", "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless",
               "hf_generate_tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_plain", "fastest_plain", "n_timed",
               "timing_valid", "self_consistent", "proposed", "pruned", "verified_nodes_per_step",
               "accepted", "proposed_per_position", "accepted_per_position", "target_forwards", "new_tokens",
               "baseline_new_tokens", "proposer_time_s", "target_time_s", "wall_time_s", "baseline_wall_time_s",
               "compare", "adaptive", "predicted_speedup"}
    # turn 1 against turns 2+ where a domain has multi-turn prompts (the math row has two turns)
    assert set(report["overall"]) == overall | {"turns"}
    assert all(set(d) == overall | ({"turns"} if name == "math" else set()) for name, d in report["domains"].items())
    assert set(report["overall"]["turns"]) == {"1", "2+"}
    assert set(report["overall"]["turns"]["2+"]) == {
        "n_prompts", "alpha", "tau", "per_position_acceptance", "tokens_per_s", "baseline_tokens_per_s", "speedup",
        "n_timed", "lossless", "verified_nodes_per_step", "mean_prompt_tokens"}
    assert set(report["overall"]["compare"]["ngram@chain=1"]) == {
        "alpha", "tau", "tokens_per_s", "speedup", "lossless", "per_position_acceptance", "conditional_acceptance",
        "verified_nodes_per_step", "speedup_vs_plain", "speedup_vs_hf_generate", "n_timed"}
    assert set(report["overall"]["adaptive"]) == {"alpha", "tau", "tokens_per_s", "speedup", "lossless", "proposed",
                                                 "accepted", "target_forwards", "mean_k", "plain_step_share", "n_timed"}
    assert set(report["references"]) == {"plain_decoding_tokens_per_s", "hf_generate", "plain_vs_hf_generate"}
    assert set(report["references"]["hf_generate"]) == {"tokens_per_s", "matches_plain_decoding", "n_mismatch", "role"}
    assert {"c", "t_step_decode_s", "v", "t_step_s", "t_forward_s", "context_length"} <= set(report["cost_model"])
    assert set(report["policy"]) == set(report["domains"])
    assert set(report["prompts"][0]) == {"domain", "source", "prompt_tokens", "new_tokens", "lossless", "hf_tokens",
                                        "hf_time", "hf_matches_baseline", "adaptive_lossless", "alpha", "tau",
                                        "tokens_per_s", "baseline_tokens_per_s", "self_consistent", "timing", "timed",
                                        "turn"}


class _ScriptedShare:
    """Stands in for cost.CpuShare inside the evaluator: the n-th timed block reads `shares(n)` (0 = the
    evaluator's own outer block), so a burst of load can be placed on exact runs."""

    count = 0
    shares = staticmethod(lambda n: 0.0)

    def __enter__(self):
        self.n = _ScriptedShare.count
        _ScriptedShare.count += 1
        return self

    def __exit__(self, *exc):
        self.others = _ScriptedShare.shares(self.n)

    @property
    def busy(self):
        from draftsmith.decoding.cost import contended

        return contended(self.others)


def _scripted(monkeypatch, shares):
    import importlib

    ev = importlib.import_module("draftsmith.evaluation.timing")
    _ScriptedShare.count = 0
    _ScriptedShare.shares = staticmethod(shares)
    monkeypatch.setattr(ev, "CpuShare", _ScriptedShare)
    monkeypatch.setattr(ev, "IMPOSSIBLE_FACTOR", float("inf"))  # this test is about load, not the bound


def test_a_burst_of_load_is_remeasured_and_a_prompt_that_stays_busy_is_left_out(tiny_target, prompt_files,
                                                                                  monkeypatch):
    from draftsmith.evaluation.evaluate import evaluate

    kw = dict(prompts=[prompt_files[0]], limit_per_domain=1, max_new_tokens=6, k=2, cost_model=False,
              repeats=3, remeasure=3)
    # block 1 is the load probe before the first prompt (quiet here); blocks 2-5 busy: round 1 (base, spec,
    # hf) and the first run of round 2; more rounds until each run has 3 quiet measurements, and then the
    # prompt's timing is valid
    _scripted(monkeypatch, lambda n: 0.9 if 2 <= n <= 5 else 0.0)
    report = evaluate(tiny_target, "ngram", **kw)
    timing = report["prompts"][0]["timing"]
    assert timing["rounds"] == 5 and all(timing["quiet"].values())
    assert [share for _, share in timing["measurements"]["base"]][:1] == [0.9]
    assert report["overall"]["n_timed"] == 1 and report["overall"]["speedup"] is not None
    assert report["contention"]["speedups_valid"] is True and report["contention"]["busy_prompts"] == 0
    # busy from the first prompt on, the probe quiet: two whole rounds busy are load, not a burst; the prompt is
    # left out of every speed
    _scripted(monkeypatch, lambda n: 0.9 if n >= 2 else 0.0)
    report = evaluate(tiny_target, "ngram", **kw)
    timing = report["prompts"][0]["timing"]
    assert timing["rounds"] == 2 and not any(timing["quiet"].values())
    o = report["overall"]
    assert o["n_timed"] == 0 and o["speedup"] is None and o["tokens_per_s"] is None and o["timing_valid"] is False
    assert o["lossless"] is True and o["tau"] >= 1.0  # acceptance and losslessness stand
    c = report["contention"]
    assert c["speedups_valid"] is False and c["invalid"][0]["entry"] == "spec" and "busy" in c["invalid"][0]["reason"]


def test_a_machine_busy_throughout_gets_one_round_per_prompt_and_no_speedup(tiny_target, prompt_files,
                                                                              monkeypatch, caplog):
    """Sustained load: rounds cannot become quiet, so re-measuring only makes the run longer. The probe before
    the first prompt (or two whole rounds of a prompt busy) says so at once; from then on each prompt is
    decoded in one round — acceptance and losslessness measured, speedups reported as not measured — until a
    round is quiet again."""
    from draftsmith.evaluation.evaluate import evaluate

    kw = dict(prompts=[prompt_files[0]], limit_per_domain=3, max_new_tokens=6, k=2, cost_model=False,
              repeats=3, remeasure=3)
    _scripted(monkeypatch, lambda n: 0.9 if n >= 1 else 0.0)  # busy before the first prompt and after
    with caplog.at_level("WARNING"):
        report = evaluate(tiny_target, "ngram", **kw)
    assert "speedups cannot be timed validly" in caplog.text
    assert [p["timing"]["rounds"] for p in report["prompts"]] == [1, 1, 1]
    c, o = report["contention"], report["overall"]
    assert c["busy_prompts"] == 3 and c["speedups_valid"] is False and "not measured" in c["note"]
    assert o["speedup"] is None and o["lossless"] is True and o["tau"] >= 1.0
    # the probe quiet, the first prompt busy through two whole rounds: it stops there, the next ones get one each
    _scripted(monkeypatch, lambda n: 0.9 if n >= 2 else 0.0)
    report = evaluate(tiny_target, "ngram", **kw)
    assert [p["timing"]["rounds"] for p in report["prompts"]] == [2, 1, 1]
    assert report["contention"]["busy_prompts"] == 3
    # busy at the start only: the first round is quiet, so timing resumes with that prompt
    _scripted(monkeypatch, lambda n: 0.9 if n == 1 else 0.0)
    report = evaluate(tiny_target, "ngram", **kw)
    assert [p["timing"]["rounds"] for p in report["prompts"]] == [3, 3, 3]
    assert report["contention"]["busy_prompts"] == 0 and report["contention"]["speedups_valid"] is True


def test_real_load_on_every_core_is_seen_before_the_first_prompt(tiny_target, prompt_files):
    """The same with real load: one spinning process per core beside the run (no scripted shares)."""
    import os
    import subprocess
    import sys

    from draftsmith.evaluation.evaluate import evaluate

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        report = evaluate(tiny_target, "ngram", prompts=[prompt_files[0]], limit_per_domain=2, max_new_tokens=24,
                          k=2, cost_model=False, repeats=3, remeasure=3)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert [p["timing"]["rounds"] for p in report["prompts"]] == [1, 1]
    assert report["contention"]["busy_prompts"] == 2 and report["overall"]["lossless"] is True


def test_an_impossible_speedup_is_flagged_and_left_out():
    """Burst-corrupted timing seen in a demo: Medusa at tau 1.34 read 2.82x because plain decoding ran during
    the burst. A speedup above max(1, tau / v(nodes)) by more than IMPOSSIBLE_FACTOR is not published."""
    from draftsmith.decoding.generate import GenerationStats
    from draftsmith.evaluation.aggregate import Speed
    from draftsmith.evaluation.timing import judge_timing, speedup_bound

    def rec(tau_steps, spec_s, base_s, nodes=4):
        # 100 tokens either way; tau = 100 / target_forwards
        spec = GenerationStats(proposed=nodes * tau_steps, accepted=100 - tau_steps, target_forwards=tau_steps,
                               new_tokens=100, wall_time=spec_s)
        base = GenerationStats(target_forwards=100, new_tokens=100, wall_time=base_s)
        return {"spec": spec, "base": base, "timing": {"quiet": {"base": True, "spec": True, "hf": True}}}

    v = lambda n: 1.0 + 0.1 * n  # noqa: E731  v(4) = 1.4
    burst = rec(75, spec_s=1.0, base_s=2.82)  # tau 1.33, speedup 2.82
    fine = rec(50, spec_s=1.0, base_s=1.3)  # tau 2.0, speedup 1.3 <= 2.0 / 1.4
    judge_timing([burst, fine], v, hf=False)
    assert burst["timed"] == {"spec": False} and "impossible speedup 2.82" in burst["timing"]["invalid"]["spec"]
    assert fine["timed"] == {"spec": True} and fine["timing"]["invalid"] == {}
    assert speedup_bound(2.0, 4, v) == pytest.approx(2.0 / 1.4) and speedup_bound(1.0, 0, None) == 1.0
    sp = Speed.of([burst, fine], "spec")
    assert sp.n == 1 and sp.fields()["speedup"] == pytest.approx(1.3)
    # a busy plain-decoding run invalidates every entry compared with it
    busy = rec(50, 1.0, 1.3)
    busy["timing"]["quiet"]["base"] = False
    busy["timing"]["rounds"] = 1
    judge_timing([busy], v, hf=False)
    assert busy["timed"] == {"spec": False}
    assert busy["timing"]["invalid"]["spec"] == "other processes kept the CPU busy during its measurements (1 round)"


def test_speedup_is_against_the_faster_plain_decoding():
    from draftsmith.evaluation.aggregate import Speed

    ours_faster = Speed(tokens=100, seconds=1.0, base_tokens=100, base_seconds=1.25, hf_tokens=100, hf_seconds=2.0, n=1)
    f = ours_faster.fields()
    assert f["fastest_plain"] == "draftsmith" and f["speedup"] == pytest.approx(1.25)
    assert f["speedup_vs_plain"] == pytest.approx(1.25) and f["speedup_vs_hf_generate"] == pytest.approx(2.0)
    hf_faster = Speed(tokens=100, seconds=1.0, base_tokens=100, base_seconds=1.25, hf_tokens=100, hf_seconds=1.1, n=1)
    f = hf_faster.fields()
    assert f["fastest_plain"] == "hf_generate" and f["speedup"] == pytest.approx(1.1)
    assert f["speedup_vs_plain"] == pytest.approx(1.25)


def test_lossless_is_judged_against_hf_generate_not_our_own_plain_decoding(tiny_target, prompt_files, monkeypatch):
    """A bug shared by our plain decoding and our speculative decoding (same verifier, KV cache, kernels) would
    pass a self-consistency check: `lossless` compares with HF generate, `self_consistent` with ourselves."""
    import importlib

    from draftsmith.evaluation.evaluate import evaluate

    ev = importlib.import_module("draftsmith.evaluation.decode")
    kw = dict(prompts=[prompt_files[0]], limit_per_domain=1, max_new_tokens=6, k=2, cost_model=False, repeats=1)
    report = evaluate(tiny_target, "ngram", **kw)
    assert report["overall"]["lossless"] is True and report["overall"]["self_consistent"] is True
    real = ev.speculative_generate

    def shared_bug(*args, **kwargs):  # every output of ours ends in a wrong token: ours agree, HF does not
        out = real(*args, **kwargs)
        out.tokens[0][-1] = (out.tokens[0][-1] + 1) % tiny_target.vocab_size
        return out

    monkeypatch.setattr(ev, "speculative_generate", shared_bug)
    report = evaluate(tiny_target, "ngram", **kw)
    assert report["overall"]["self_consistent"] is True and report["overall"]["lossless"] is False
    off = evaluate(tiny_target, "ngram", **kw, hf_reference=False)  # no reference: not judged, and it says so
    assert off["overall"]["lossless"] is None and "lossless_not_judged" in off["references"]
