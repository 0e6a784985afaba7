# ruff: noqa: F811  (pytest fixtures imported from test_decoding are then named as test arguments)
"""Operator features: multi-proposer trees, per-domain routing, adaptive k, temperature sweeps, production α
from vLLM metrics, memory planning."""

from __future__ import annotations

import json

import pytest
import torch
from test_decoding import (  # noqa: F401  (the fixtures are shared with test_decoding by import)
    SAMPLING,
    VOCAB,
    _one_thread,
    draft,
    first_two_tokens_match,
    hf_greedy,
    prompts,
    small_tables,
    target,
    varied_llama,
)
from transformers import LlamaConfig

from draftsmith.decoding.adaptive import AdaptiveK
from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.multi import MultiProposer, merge_trees, union_spec
from draftsmith.decoding.ngram import NgramProposer
from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec
from draftsmith.decoding.routing import KeywordRouter, RoutedProposer
from draftsmith.distill.proposer import DraftProposer
from draftsmith.errors import ConfigError, DataError
from draftsmith.planning.policy import build_policy, compare_table, write_policy


class Fixed(Proposer):
    """Proposes a fixed tree (for merge / attribution tests)."""

    def __init__(self, tokens, parents, name):
        self.tokens, self.parents, self.name = tokens, parents, name
        self.accepted: list = []

    def propose(self, context, spec, sampling, generator):
        return Proposal(torch.tensor(self.tokens), torch.tensor(self.parents))

    def accept(self, result):
        self.accepted.append(list(result.accepted_nodes))


# ---- multi-proposer trees -------------------------------------------------------------------------------

def test_merge_trees_dedupes_shared_prefixes_and_respects_the_budget():
    a = Proposal.chain([5, 6, 7])
    b = Proposal(torch.tensor([5, 9, 8]), torch.tensor([-1, 0, -1]))  # 5 -> 9, and 8 at the root
    merged, maps = merge_trees([a, b], TreeSpec((2, 2, 1)))
    assert merged.tokens.tolist() == [5, 6, 7, 9, 8]
    assert merged.parent_list == [-1, 0, 1, 0, -1]
    assert maps == [[0, 1, 2], [0, 3, 4]]  # b's "5" is a's "5": one node
    assert merged.q is None  # candidates of several proposers: the verifier's deterministic rule
    # root branching 1: b's second root child is cut; depth 2: a's chain survives to depth 2 only
    merged, maps = merge_trees([a, b], TreeSpec((1, 2)))
    assert merged.tokens.tolist() == [5, 6, 9] and maps == [[0, 1, -1], [0, 2, -1]]
    # node capacity 2: the first two nodes in priority order
    merged, maps = merge_trees([a, b], TreeSpec((2, 2, 1), max_nodes=2))
    assert merged.tokens.tolist() == [5, 6] and maps[1] == [0, -1, -1]
    spec = union_spec([TreeSpec.chain(3), TreeSpec((2, 1), max_nodes=3)])
    assert spec.branching == (3, 2, 1) and spec.max_nodes == 6


def test_multi_tree_attributes_accepted_branches(target, prompts):
    """The draft is the target itself (always right); the fixed proposer is wrong: every accepted token is
    credited to the draft's branch, and each sub-proposer is told its own accepted nodes."""
    ctx = torch.tensor(prompts[0])
    greedy = hf_greedy(target, prompts[0], 6)
    wrong = [(greedy[1] + 1) % VOCAB, (greedy[2] + 1) % VOCAB]
    fixed = Fixed(wrong, [-1, 0], "fixed")
    # room for both branches whole (the default budget, the larger sub-tree's 3 nodes, is tested on its own)
    multi = MultiProposer([DraftProposer(target), fixed], specs=[TreeSpec.chain(3), TreeSpec.chain(2)], budget=5)
    res = speculative_generate(target, multi, [ctx], 5, k=None, tree=multi.default_tree_spec(), eos_ids=[])
    assert res.tokens[0] == greedy[:5]
    stats = multi.branch_stats()
    draft_name = [n for n in stats if n != "fixed"][0]
    assert stats[draft_name]["accepted"] == res.stats.accepted > 0
    assert stats["fixed"]["accepted"] == 0 and stats["fixed"]["wins"] == 0
    assert stats[draft_name]["wins"] == stats[draft_name]["steps"]
    assert all(a == [] for a in fixed.accepted)


@pytest.mark.parametrize("combo", ["draft+ngram", "ngram+draft"])
def test_multi_tree_greedy_equals_target(combo, target, draft, prompts):
    subs = {"draft": lambda: DraftProposer(draft), "ngram": lambda: NgramProposer(max_ngram=2)}
    multi = MultiProposer([subs[n]() for n in combo.split("+")], k=3)
    for p in prompts:
        want = hf_greedy(target, p, 24)
        res = speculative_generate(target, multi, [p], 24, k=None, tree=multi.default_tree_spec(), eos_ids=[])
        assert res.tokens[0] == want
    assert sum(s["proposed"] for s in multi.branch_stats().values()) >= res.stats.proposed


def test_multi_spec_string(tiny_target):
    prop = build_proposer("multi:ngram+ngram:2", tiny_target)
    assert isinstance(prop, MultiProposer) and prop.names == ["ngram", "ngram#2"]
    with pytest.raises(ConfigError, match="at least two"):
        build_proposer("multi:ngram", tiny_target)


# ---- sampling: every new decoder mode keeps the target's distribution -----------------------------------

@pytest.mark.parametrize("mode", ["multi", "routed", "adaptive"])
def test_new_modes_keep_the_target_distribution(small_tables, mode, tmp_path):
    t = small_tables
    n = 600
    kw = dict(temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p, seed=11, eos_ids=[])
    if mode == "multi":
        prop = MultiProposer([DraftProposer(t["drf"]), NgramProposer(max_ngram=1)], k=2)
        res = speculative_generate(t["tgt"], prop, [t["ctx"]] * n, 3, k=None, tree=prop.default_tree_spec(), **kw)
    elif mode == "routed":
        prop = RoutedProposer({"kind": "routing_policy", "domains": {"chat": {"proposer": "d", "k": 2}}},
                              {"d": DraftProposer(t["drf"])})
        prop.route(domain="chat")
        res = speculative_generate(t["tgt"], prop, [t["ctx"]] * n, 3, k=None, tree=prop.default_tree_spec(), **kw)
    else:
        ctl = AdaptiveK({"0": 1.0, "1": 1.0, "2": 1.0}, k_max=2, c=0.0)
        res = speculative_generate(t["tgt"], DraftProposer(t["drf"]), [t["ctx"]] * n, 3, k=2, adaptive=ctl, **kw)
    assert 0 < res.stats.accepted < res.stats.proposed
    ok, stat, crit = first_two_tokens_match(t, res.tokens)
    assert ok, f"{mode}: chi2 {stat:.1f} >= {crit:.1f}"


# ---- routing ----------------------------------------------------------------------------------------------

def _report(proposer, speedups, lossless=True, fp="A", k=4):
    return {"proposer": proposer, "target": {"fingerprint": {"tokenizer_hash": fp}},
            "settings": {"k": k, "tree": None, "tree_max_nodes": None},
            "domains": {d: {"speedup": s, "alpha": 0.5, "tau": 2.0, "lossless": lossless} for d, s in speedups.items()}}


def test_build_policy_picks_the_fastest_lossless_artifact_per_domain():
    reports = [_report("ngram", {"code": 1.3, "math": 0.9, "general": 0.8}),
               _report("medusa:m", {"code": 1.1, "math": 1.2, "general": 0.95}),
               _report("eagle:e", {"code": 2.0, "math": 3.0, "general": 2.5}, lossless=False)]
    policy = build_policy(reports, threshold=1.0)
    d = policy["domains"]
    assert d["code"]["proposer"] == "ngram" and d["math"]["proposer"] == "medusa:m" and d["general"] == "off"
    assert d["code"]["candidates"] == {"ngram": 1.3, "medusa:m": 1.1}  # the non-lossless run never competes
    with pytest.raises(ConfigError, match="different targets"):
        build_policy([_report("a", {"x": 1.0}), _report("b", {"x": 1.0}, fp="B")])


def test_keyword_router():
    r = KeywordRouter()
    assert r.classify("Write a python function that returns the sum of a list") == "code"
    assert r.classify("Natalia sold clips to 48 friends. How many clips did she sell in total?") == "math"
    assert r.classify("zzz") is None
    assert KeywordRouter({"a": ["x"], "b": ["x"]}).classify("x") is None  # a tie is no decision


def test_keyword_router_reads_the_instruction_not_the_passage():
    """A long passage full of one domain's words does not outvote the line that says what is asked, before or
    after it; "summary" is no math "sum"; a catch-all's "write a" loses a tie to the specific domain."""
    story = ("The club paid 40 dollars each, twice the total of last year; how much per ticket and how many "
             "seats were left? Half the budget went on food. ") * 12  # ~1,600 characters of math keywords
    r = KeywordRouter()
    assert r.classify(story) == "math"  # alone, the passage is math
    assert r.classify("Summarise the article:\n\n" + story) == "summarization"
    assert r.classify(story + "\n\nTL;DR:") == "summarization"
    assert r.classify("Write a summary of the following article:\n\n" + story) == "summarization"
    assert r.classify(story + "\n\nAccording to the passage above, who paid?") == "rag"
    # a request with no keyword in its instruction is still decided by its text
    assert r.classify("Go on:\n\n" + story) == "math"
    assert r.classify("Write a summary, please.") == "summarization"


def test_routed_decoding_follows_the_policy_and_stays_lossless(target, draft, prompts, tmp_path):
    prop = RoutedProposer({"kind": "routing_policy", "router": {"kind": "declared"}, "default": "off",
                           "domains": {"code": {"proposer": "d", "k": 3}, "general": "off"}},
                          {"d": DraftProposer(draft)})
    spec = prop.default_tree_spec()
    assert spec.branching == (1, 1, 1)
    for dom, expect_proposals in (("code", True), ("general", False), (None, False)):
        assert prop.route(domain=dom, text="nothing to match") == dom
        res = speculative_generate(target, prop, [prompts[0]], 16, k=None, tree=spec, eos_ids=[])
        assert res.tokens[0] == hf_greedy(target, prompts[0], 16)
        assert (res.stats.proposed > 0) == expect_proposals
    # keyword routing for a request without a declared domain
    assert prop.route(domain=None, text="def f(x): return x") == "code" and prop.active is not None


def test_evaluate_with_a_route_policy_and_compare(tiny_target, tiny_tokenizer, tmp_path, monkeypatch):
    import importlib

    from draftsmith.decoding import cost
    from draftsmith.evaluation.evaluate import evaluate

    ev = importlib.import_module("draftsmith.evaluation.timing")

    # routing mechanics, not timing: every measurement counts as valid here (a busy machine would leave a
    # domain without a measured speedup, and the policy would rightly turn it off)
    monkeypatch.setattr(cost, "BUSY_SHARE", 1.0)
    monkeypatch.setattr(ev, "IMPOSSIBLE_FACTOR", float("inf"))

    files = []
    for dom, text in (("code", "def add(a, b):"), ("math", "What is 7 times 6?")):
        f = tmp_path / f"{dom}.jsonl"
        f.write_text(json.dumps({"turns": [text], "category": dom}) + "\n")
        files.append(str(f))
    kw = dict(prompts=files, max_new_tokens=8, cost_model=False)
    single = evaluate(tiny_target, "ngram", **kw, k=2)
    policy = build_policy([single | {"_path": "x"}], threshold=0.0)
    path = write_policy(policy, tmp_path / "policy.json")
    routed = evaluate(tiny_target, f"route:{path}", **kw, tree_from_proposer=True, compare=["ngram", "none"])
    assert routed["overall"]["lossless"] is True
    assert {d["route"] for d in routed["domains"].values()} == {"ngram"}
    side = routed["domains"]["code"]["compare"]
    assert set(side) == {"ngram", "none"} and side["none"]["alpha"] is None and side["ngram"]["lossless"] is True
    md, verdict = compare_table(routed)  # against the side-by-side runs of the same evaluation
    assert set(verdict) == {"code", "math"} and "routed / best" in md and " none " in md.splitlines()[0]
    md2, _ = compare_table(routed, [single])  # or against separate reports
    assert "ngram" in md2
    # a report's side-by-side runs are routing candidates too (a calibration run with --compare)
    again = build_policy([routed], threshold=0.0)
    assert {r["proposer"] for r in again["domains"].values()} <= {"ngram", "none"}  # never the routed run itself
    assert any(c in again["domains"]["code"]["candidates"] for c in ("ngram", "none"))
    # a policy made for another target is refused
    other = dict(policy, target={"fingerprint": {**policy["target"]["fingerprint"], "tokenizer_hash": "x"}})
    write_policy(other, tmp_path / "other.json")
    with pytest.raises(Exception, match="tokenizer"):
        build_proposer(f"route:{tmp_path / 'other.json'}", tiny_target)


# ---- adaptive k -------------------------------------------------------------------------------------------

def test_adaptive_k_choices():
    flat = {str(k): 1.0 for k in range(9)}
    ctl = AdaptiveK(flat, k_max=8, c=0.0)
    for _ in range(20):
        k = ctl.next_k()
        ctl.update(k, k, k)  # everything accepted
    assert ctl.history[-1] == 8  # free verification, perfect drafts: the longest chain
    steep = {str(k): 1.0 + 0.5 * k for k in range(9)}
    ctl = AdaptiveK(steep, k_max=8, c=0.1, probe_every=4)
    for _ in range(12):
        k = ctl.next_k()
        ctl.update(k, k, 0)  # nothing accepted: speculation costs more than it gives
    assert ctl.history[-6:].count(0) >= 4 and ctl.best_k()[0] == 0
    assert ctl.probe_k in ctl.history[3:]  # it re-probes while off
    # hand check of S(k) with the prior only: a = 0.6, v(1) = 1.5, c = 0.1 -> (1 + 0.6) / (1.5 + 0.1)
    fresh = AdaptiveK(steep, k_max=8, c=0.1)
    assert fresh.speedup(1) == pytest.approx(1.6 / 1.6)


def test_adaptive_generation_is_lossless_and_adapts(target, draft, prompts):
    v = {str(k): 1.0 + 0.05 * k for k in range(7)}
    good = AdaptiveK(v, k_max=6, c=0.0)
    res = speculative_generate(target, DraftProposer(target), [prompts[0]], 30, k=6, adaptive=good, eos_ids=[])
    assert res.tokens[0] == hf_greedy(target, prompts[0], 30)
    assert max(res.k_history[0]) == 6  # a perfect draft earns long chains
    bad = AdaptiveK({str(k): 1.0 + 0.6 * k for k in range(7)}, k_max=6, c=0.5)
    res = speculative_generate(target, DraftProposer(draft), [prompts[1]], 30, k=6, adaptive=bad, eos_ids=[])
    assert res.tokens[0] == hf_greedy(target, prompts[1], 30)
    assert res.k_history[0].count(0) > len(res.k_history[0]) // 2  # falls back to plain decoding


def test_evaluate_reports_fixed_vs_adaptive(tiny_target, tmp_path):
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import render_markdown

    f = tmp_path / "code.jsonl"
    f.write_text(json.dumps({"turns": ["def add(a, b):"], "category": "code"}) + "\n")
    rep = evaluate(tiny_target, "ngram", prompts=[str(f)], max_new_tokens=8, k=3, adaptive=True,
                   cost_model=False, cost_context=16)
    a = rep["domains"]["code"]["adaptive"]
    assert a["lossless"] is True and a["mean_k"] is not None and 0 <= a["mean_k"] <= 3
    assert "adaptive k" in render_markdown(rep)


# ---- temperature sweep ------------------------------------------------------------------------------------

def test_temperature_sweep(tiny_target, tmp_path, monkeypatch):
    from draftsmith.evaluation import sweep
    from draftsmith.evaluation.config import EvalConfig

    monkeypatch.setattr("draftsmith.targets.load_target", lambda *a, **k: tiny_target)
    f = tmp_path / "code.jsonl"
    f.write_text(json.dumps({"turns": ["def add(a, b):"], "category": "code"}) + "\n")
    cfg = EvalConfig(proposer="ngram", prompts=[str(f)], max_new_tokens=8, k=2, temperatures=[0.0, 1.0],
                     cost_model=False, out=str(tmp_path / "sweep"))
    summary = sweep.sweep_temperatures(cfg, command="test")
    assert summary["temperatures"] == ["0", "1"]
    row = summary["domains"]["code"]
    assert row["0"]["lossless"] is True and row["1"]["lossless"] is None  # checked by the chi-square tests
    assert row["0"]["alpha_change"] == 0.0 and row["0"]["tau_change"] == 0.0
    for name in ("sweep.json", "sweep.md", "sweep.png", "T=0/report.json", "T=1/report.json"):
        assert (tmp_path / "sweep" / name).is_file(), name


def test_cli_temperature_list_becomes_a_sweep():
    from draftsmith.cli import build_parser
    from draftsmith.evaluation.commands import build_config

    args = build_parser().parse_args(["evaluate", "--temperature", "0", "0.7", "1.0", "--adaptive"])
    cfg = build_config(args)
    assert cfg.temperatures == [0.0, 0.7, 1.0] and cfg.adaptive
    cfg = build_config(build_parser().parse_args(["evaluate", "--temperature", "0.5"]))
    assert cfg.temperature == 0.5 and cfg.temperatures is None


# ---- production α from vLLM metrics -----------------------------------------------------------------------

# A /metrics excerpt in the shape vLLM's v1 engine exposes (prometheus_client counters: *_total plus
# *_created samples), two served models, num_speculative_tokens = 3.
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="chat-eagle"} 1000.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="code-eagle"} 400.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="chat-eagle"} 1.7636328e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="chat-eagle"} 3000.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="code-eagle"} 1200.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="chat-eagle"} 1500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="code-eagle"} 960.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="chat-eagle",position="0"} 700.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="chat-eagle",position="1"} 500.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="chat-eagle",position="2"} 300.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="code-eagle",position="0"} 360.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="code-eagle",position="1"} 320.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="code-eagle",position="2"} 280.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="chat-eagle"} 90.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="chat-eagle"} 10.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="code-eagle"} 40.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="chat-eagle"} 2500.0
"""


def test_vllm_metrics_to_per_domain_alpha(tmp_path):
    from draftsmith.planning.production import production_alpha, vllm_alpha

    t = vllm_alpha(VLLM_METRICS, model_domains={"chat-eagle": "general", "code-eagle": "code"})
    g, c, o = t["domains"]["general"], t["domains"]["code"], t["overall"]
    assert g["alpha"] == pytest.approx(1500 / 3000) and g["tau"] == pytest.approx(1 + 1500 / 1000)
    assert g["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.3]) and g["n_prompts"] == 100
    assert c["alpha"] == pytest.approx(0.8) and c["tau"] == pytest.approx(1 + 960 / 400) and c["n_prompts"] == 40
    assert o["alpha"] == pytest.approx(2460 / 4200) and o["tau"] == pytest.approx(1 + 2460 / 1400)
    # the window between two dumps
    earlier = VLLM_METRICS.replace("} 1500.0", "} 1000.0").replace("} 3000.0", "} 2000.0")
    w = vllm_alpha(VLLM_METRICS, since=earlier)
    assert w["domains"]["chat-eagle"]["alpha"] == pytest.approx(500 / 1000)
    with pytest.raises(DataError, match="restarted"):
        vllm_alpha(earlier, since=VLLM_METRICS)
    with pytest.raises(DataError, match="not a Prometheus sample"):
        vllm_alpha("vllm:spec_decode_num_drafts_total{broken 1\n")
    # the table is what retraining's staleness check reads
    from draftsmith.retrain.decide import Thresholds, staleness

    (tmp_path / "m.prom").write_text(VLLM_METRICS)
    table = production_alpha(tmp_path / "m.prom", model_domains={"chat-eagle": "general"})
    verdict = staleness(table, {"general": 0.75}, [], False, Thresholds(alpha_floor=0.3, max_drop=0.2))
    assert verdict.yes and any("general: alpha fell from 0.750 to 0.500" in r for r in verdict.reasons)


@pytest.fixture
def metrics_server():
    """A stdlib HTTP server answering /metrics with whatever `state["text"]` holds (a server whose counters
    move, or restart), on 127.0.0.1; stopped after the test. The real vLLM endpoint: tests/test_vllm_server.py."""
    import http.server
    import threading

    state = {"text": VLLM_METRICS}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = state["text"].encode() if self.path == "/metrics" else b"no"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{srv.server_address[1]}"
    yield state
    srv.shutdown()
    srv.server_close()


def test_production_alpha_reads_a_metrics_url_and_retraining_keeps_its_window(metrics_server, tmp_path):
    from draftsmith.planning.production import production_alpha
    from draftsmith.retrain.config import MeasureConfig
    from draftsmith.retrain.run import _production

    url = metrics_server["url"] + "/metrics"
    t = production_alpha(url, model_domains={"chat-eagle": "general"}, save=tmp_path / "kept.prom")
    assert t["source"] == url and t["domains"]["general"]["alpha"] == pytest.approx(0.5)
    assert (tmp_path / "kept.prom").read_text() == VLLM_METRICS
    with pytest.raises(DataError, match=r"/nothing: HTTP 404"):
        production_alpha(metrics_server["url"] + "/nothing")
    with pytest.raises(DataError, match=r"http://127.0.0.1:9/metrics: no metrics read") as e:
        production_alpha("http://127.0.0.1:9/metrics")
    assert "\n" not in str(e.value)

    # retraining with production_since: last judges the window since its previous check
    m = MeasureConfig(production=url, production_since="last", production_model_domains={"chat-eagle": "general"})
    kept = tmp_path / "registry" / "production-last.prom"
    kept.parent.mkdir()
    first = _production(m, kept)
    assert first["since"] == "server start" and first["domains"]["general"]["alpha"] == pytest.approx(0.5)
    metrics_server["text"] = VLLM_METRICS.replace("} 1500.0", "} 1600.0").replace("} 3000.0", "} 3400.0")
    second = _production(m, kept)
    assert second["since"] == str(kept) and second["domains"]["general"]["alpha"] == pytest.approx(100 / 400)
    # the server restarted: its counters went down; the check reads them since the (new) start, and says so
    metrics_server["text"] = VLLM_METRICS.replace("} 1500.0", "} 15.0").replace("} 3000.0", "} 30.0")
    third = _production(m, kept)
    assert third["since"].startswith("server start (restarted") and third["domains"]["general"]["alpha"] == 0.5


def test_request_logs_to_per_domain_alpha(tmp_path):
    from draftsmith.planning.production import production_alpha

    rows = [{"prompt": "p", "domain": "code", "draft_tokens": 40, "accepted_tokens": 30, "drafts": 10},
            {"prompt": "p", "domain": "code", "draft_tokens": 20, "accepted_tokens": 6, "drafts": 5},
            {"prompt": "p", "domain": "math", "meta_info": {"spec_verify_ct": 10, "completion_tokens": 25}},
            {"prompt": "no speculation here"}]
    (tmp_path / "a.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{bad json\n")
    t = production_alpha(tmp_path)
    assert t["domains"]["code"]["alpha"] == pytest.approx(36 / 60) and t["domains"]["code"]["n_prompts"] == 2
    assert t["domains"]["math"]["tau"] == pytest.approx(2.5) and t["domains"]["math"]["alpha"] is None
    assert t["malformed"] == 1


# ---- memory planning --------------------------------------------------------------------------------------

def _tiny_cfg(**kw):
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(**{**base, **kw})


def test_memory_arithmetic_by_hand():
    from draftsmith.memory.serving import ArtifactShape, count_params, kv_bytes_per_token, plan

    cfg = _tiny_cfg()
    h, i, L, V, hd = 64, 128, 3, 1000, 16
    per_layer = h * h + 2 * h * (2 * hd) + h * h + 3 * h * i + 2 * h  # q, k, v (2 kv heads), o, mlp, 2 norms
    assert count_params(cfg) == V * h + L * per_layer + h  # tied lm_head counted once, final norm
    assert kv_bytes_per_token(cfg, 2, 100) == 2 * L * 2 * hd * 2  # K+V x layers x kv heads x head_dim x bf16
    p = plan(cfg, ArtifactShape("none"), 10**9, batch=4, context=100, dtype="bf16", k=0, prefill_chunk=64,
             utilization=1.0, overhead_bytes=0)
    assert p["kv_bytes"]["target"] == 4 * 100 * 2 * L * 2 * hd * 2
    assert p["weights_bytes"]["target"] == count_params(cfg) * 2
    assert p["fits"] and p["max_batch"] > 4
    # the largest batch really is the largest: one more sequence does not fit
    tight = plan(cfg, ArtifactShape("none"), int(p["total_bytes"]), batch=4, context=100, dtype="bf16", k=0,
                 prefill_chunk=64, utilization=1.0, overhead_bytes=0)
    assert tight["max_batch"] == 4
    # sliding-window layers (Gemma 3 style) hold at most the window
    from transformers import Gemma3TextConfig

    g = Gemma3TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=32,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"])
    per = 2 * 1 * 16 * 2
    assert kv_bytes_per_token(g, 2, 1000) * 1000 == pytest.approx(5 * per * 32 + per * 1000)
    with pytest.raises(ConfigError, match="unknown --gpu"):
        plan(cfg, ArtifactShape("none"), "Z80", 1, 10)


def test_planned_kv_and_weights_match_the_bytes_counted_on_cpu(tiny_target, monkeypatch):
    """measure_cpu builds the real model, fills its KV cache and counts the bytes: they equal the plan's."""
    from draftsmith.memory import serving as memory

    monkeypatch.setattr("draftsmith.targets.load_target", lambda *a, **k: tiny_target)
    cfg = tiny_target.model.config
    m = memory.measure_cpu("tiny", None, batch=3, context=40, k=4)
    p = memory.plan(cfg, memory.ArtifactShape("none"), "cpu", 3, 40, "fp32", k=4, overhead_bytes=0)
    assert m["weights_bytes"] == p["weights_bytes"]["target"]
    # the plan holds context + nothing in flight for k (no artifact); the measured cache also has the k+1 step
    assert m["kv_bytes"] == memory.kv_bytes_per_token(cfg, 4, 45) * 45 * 3
