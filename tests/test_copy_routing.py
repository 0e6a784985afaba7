"""Copying where copying pays: the merged tree of a head and prompt lookup (decoding/multi.py) within one total
node budget, cut by the sub-proposers' calibrated confidence; routing policies chosen by a criterion
(measured speedup, τ at the GPU-sized budget, or the cost model's speedup for a verify-cost profile); and an
evaluation through such a policy (routing + merged trees + the cost model's cut) lossless per domain."""

from __future__ import annotations

import json

import pytest
import torch
from test_budget import ScoredTopK
from tiny_models import make_target, plain_linears_one_thread

from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.multi import MultiProposer, merge_trees
from draftsmith.decoding.ngram import NgramProposer
from draftsmith.decoding.proposer import Proposal, TreeSpec
from draftsmith.errors import ConfigError
from draftsmith.planning.policy import VerifyProfile, build_policy, write_policy


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with plain_linears_one_thread():
        yield


class Head(ScoredTopK):
    """A scored tree proposer with a CPU tree of its own and a larger GPU-sized one (as EAGLE-2's 60 nodes)."""

    GPU = TreeSpec((3, 3, 2), max_nodes=8)

    def default_tree_spec(self):
        return TreeSpec((2, 2), max_nodes=4)

    def gpu_tree(self):
        return Head(self.draft), self.GPU


def test_merging_by_score_keeps_the_best_nodes_as_a_tree():
    head = Proposal(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), scores=torch.tensor([0.9, 0.2, 0.1]))
    lookup = Proposal.chain([5, 8, 9])  # shares the head's first node, then goes its own way
    merged, maps = merge_trees([head, lookup], TreeSpec((3, 3, 3), max_nodes=4),
                               [[0.9, 0.2, 0.1], [0.6, 0.5, 0.4]])
    # five distinct nodes, four kept: the shared root node (max 0.9), lookup's 8 and 9 (0.5, 0.4), head's 6 (0.2)
    assert merged.tokens.tolist() == [5, 6, 8, 9] and merged.parent_list == [-1, 0, 0, 2]
    assert merged.scores.tolist() == pytest.approx([0.9, 0.2, 0.5, 0.4])
    assert maps == [[0, 1, -1], [0, 2, 3]]
    with pytest.raises(ConfigError, match="grow from a parent to a child"):
        merge_trees([lookup], TreeSpec((1, 1, 1), max_nodes=2), [[0.1, 0.5, 0.6]])


def test_the_merged_tree_keeps_its_total_budget_and_stays_lossless(tiny_target, tiny_draft):
    """The head's tree merged with lookup holds at most the head's own budget, at the CPU size and at the
    GPU size (8 nodes here, not 8 plus lookup's chain), every step; greedy output is the target's, also when
    the verifier's cost model cuts the merged tree further."""
    from draftsmith.decoding.budget import VerifyCost
    from draftsmith.decoding.hf import cut_at_eos

    tok = tiny_target.tokenizer
    prompts = [tok(t).input_ids for t in ["def add(a, b): return a + b. def add(a, b):", "The quick brown fox"]]
    multi = MultiProposer([Head(tiny_draft.model), NgramProposer()], k=3)
    assert multi.default_tree_spec().capacity() == 4
    gpu, spec = multi.gpu_tree()
    assert spec.capacity() == 8 and gpu.specs[1] == TreeSpec.chain(3)  # lookup's chain as deep as the GPU tree
    sizes = []
    real = MultiProposer.propose

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        sizes.append(len(out))
        return out

    MultiProposer.propose = spy
    try:
        for prop, tree, cost in ((multi, multi.default_tree_spec(), None), (gpu, spec, None),
                                 (multi, multi.default_tree_spec(), VerifyCost((1.0, 1.1, 1.3, 1.6, 2.0), 0.01))):
            for p in prompts:
                sizes.clear()
                eos = list(tiny_target.eos_token_ids)
                out = tiny_target.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
                want = cut_at_eos(out[0, len(p):].tolist(), set(eos))[0]
                res = speculative_generate(tiny_target, prop, [p], 16, k=None, tree=tree, cost=cost, eos_ids=eos)
                assert res.tokens[0] == want
                assert sizes and max(sizes) <= tree.capacity()
            stats = prop.branch_stats()
            assert stats["ngram"]["proposed"] > 0 and stats["ngram"]["steps"] == stats[prop.names[0]]["steps"]
    finally:
        MultiProposer.propose = real


def _report(proposer: str, domains: dict, nodes: float, settings: dict | None = None) -> dict:
    """A report of the shape `evaluate` writes, with what the policy reads per domain: measured speedup, τ at
    the run's own tree and at the GPU-sized one, verified nodes a step, the proposer's time."""
    return {"proposer": proposer, "target": {"fingerprint": {"tokenizer_hash": "A"}},
            "settings": settings or {"k": None, "tree": [4, 4], "tree_max_nodes": 24},
            "cost_model": {"t_step_decode_s": 0.01},
            "domains": {d: {"speedup": sp, "tau": tau, "alpha": 0.5, "lossless": True, "verified_nodes_per_step": nodes,
                            "target_forwards": 100, "proposer_time_s": 0.1 * (proposer != "ngram"),
                            **({"gpu_tree": {"tau": gpu, "verified_nodes_per_step": 2 * nodes}} if gpu else {})}
                        for d, (sp, tau, gpu) in domains.items()}}


def test_the_policy_picks_the_merged_tree_where_lookup_pays_by_the_chosen_criterion():
    # quote: the answer copies the prompt, lookup pays; math: it does not, and the merged tree only costs nodes
    head = _report("eagle:h", {"quote": (1.1, 1.8, 2.2), "math": (1.4, 2.2, 2.9)}, 6)
    merged = _report("multi:ngram+eagle:h", {"quote": (1.3, 2.4, 3.1), "math": (1.3, 2.2, 2.9)}, 8)
    lookup = _report("ngram", {"quote": (1.5, 2.0, None), "math": (1.05, 1.1, None)}, 3,
                     {"k": 4, "tree": None, "tree_max_nodes": None})
    by_tau = build_policy([head, merged, lookup], criterion="tau")
    assert by_tau["criterion"] == "tau"
    assert by_tau["domains"]["quote"]["proposer"] == "multi:ngram+eagle:h"
    assert by_tau["domains"]["math"]["proposer"] == "eagle:h"  # a tie in τ goes to fewer verified nodes
    assert by_tau["domains"]["quote"]["candidates"] == {"eagle:h": 2.2, "multi:ngram+eagle:h": 3.1, "ngram": 2.0}
    # this CPU's measured speedups choose lookup for quote: the criterion, not the machine, decides
    assert build_policy([head, merged, lookup])["domains"]["quote"]["proposer"] == "ngram"
    # the cost model's speedup for a GPU profile: τ / (v(n) + c), c by proposer kind
    pred = build_policy([head, merged, lookup], criterion="predicted",
                        profile={"name": "h100", "v": {"0": 1.0, "64": 1.0}, "c": {"eagle": 0.1, "ngram": 0.0}})
    q = pred["domains"]["quote"]
    assert q["proposer"] == "multi:ngram+eagle:h" and q["value"] == pytest.approx(3.1 / 1.1)
    assert q["basis"]["c_from"] == "profile h100" and pred["profile"]["name"] == "h100"
    assert pred["domains"]["math"]["proposer"] == "eagle:h"
    # a kind the profile does not price takes the time the report measured (0.1 s / 100 steps / 10 ms = 0.1)
    gpu = build_policy([head, merged, lookup], criterion="predicted", profile="gpu")
    assert gpu["domains"]["quote"]["basis"]["c"] == pytest.approx(0.1) and gpu["profile"]["name"] == "gpu"
    assert VerifyProfile.load("gpu").v(128) == 2.0 and VerifyProfile.load("gpu").v(60) == 1.0
    with pytest.raises(ConfigError, match="criterion must be one of speedup, tau, predicted"):
        build_policy([head], criterion="fastest")


def test_evaluation_through_a_copy_policy_is_lossless_per_domain(tiny_target, tmp_path):
    """route:policy.json sends quote to the draft merged with lookup and code to the draft alone; the routed
    run, its trees cut by the cost model measured here, is lossless per domain and says which route served it."""
    from draftsmith.evaluation.evaluate import evaluate

    tok = tiny_target.tokenizer
    draft = tmp_path / "draft"
    make_target(tok, seed=1, layers=1, folder=draft)
    files = []
    for dom, text in (("quote", "Repeat exactly: the quick brown fox. the quick brown fox."),
                      ("code", "def add(a, b):")):
        f = tmp_path / f"{dom}.jsonl"
        f.write_text(json.dumps({"turns": [text], "category": dom}) + "\n")
        files.append(str(f))
    policy = {"kind": "routing_policy", "criterion": "tau", "default": "off",
              "target": {"fingerprint": tiny_target.fingerprint()},
              "domains": {"quote": {"proposer": f"multi:ngram+draft:{draft}", "k": 3, "tree": [2, 1, 1],
                                    "tree_max_nodes": 3},
                          "code": {"proposer": f"draft:{draft}", "k": 3, "tree": None, "tree_max_nodes": None}}}
    path = write_policy(policy, tmp_path / "policy.json")
    report = evaluate(tiny_target, f"route:{path}", prompts=files, max_new_tokens=12, tree_from_proposer=True,
                      cost_context=16, cost_k_max=3, cost_repeats=1, repeats=1, remeasure=0)
    assert report["overall"]["lossless"] is True
    assert report["domains"]["quote"]["route"] == f"multi:ngram+draft:{draft}"
    assert report["domains"]["code"]["route"] == f"draft:{draft}"
    assert all(d["lossless"] is True for d in report["domains"].values())
    assert report["domains"]["quote"]["verified_nodes_per_step"] <= 3
