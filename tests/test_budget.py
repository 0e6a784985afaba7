"""Cost-aware tree size (decoding/budget.py): the cut is the best-paying prefix, stays a valid tree, and
decoding with it stays lossless."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from draftsmith.decoding.budget import VerifyCost, best_rate, best_size, isotonic, prune, worth_deeper
from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec
from draftsmith.errors import ConfigError


def test_isotonic_is_the_closest_non_decreasing_fit():
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 0.8, 1.2]) == pytest.approx([0.9, 0.9, 1.2])
    assert isotonic([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    v = VerifyCost.from_measurement({"v": {"0": 1.0, "1": 0.9, "2": 1.3}, "t_step_s": 0.05})
    assert list(v.v) == pytest.approx([0.95, 0.95, 1.3])
    assert v(4) == pytest.approx(1.3 + 2 * 0.35)  # past the measured range: the last slope goes on


def test_best_size_maximises_tokens_per_time_by_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        scores = sorted((rng.random() ** 2 for _ in range(rng.randint(0, 7))), reverse=True)
        v = VerifyCost(tuple(isotonic([1.0] + [1.0 + rng.random() * i / 3 for i in range(1, 8)])), 0.05)
        c = rng.random() * 0.3
        rate = [(1 + sum(scores[:n])) / (v(n) + c) for n in range(len(scores) + 1)]
        assert rate[best_size(scores, v, c)] == pytest.approx(max(rate))
    flat = VerifyCost((1.0,) * 10, 0.05)
    assert best_size([0.5, 0.1, 0.01], flat) == 3  # free nodes are all worth verifying
    steep = VerifyCost((1.0, 3.0, 5.0), 0.05)
    assert best_size([0.9, 0.9], steep) == 0  # a node must buy more than it costs


def test_worth_deeper_is_an_upper_bound():
    flat = VerifyCost((1.0,) * 40, 0.05)
    assert worth_deeper([0.5, 0.2], 0.2, [4], 24, flat, 0.1, 0.05)  # free rows, cheap levels: go on
    assert not worth_deeper([0.5, 0.2], 0.2, [4], 2, flat, 0.1, 0.05)  # the budget is full of better nodes
    steep = VerifyCost(tuple(1.0 + 0.5 * n for n in range(40)), 0.05)
    assert not worth_deeper([0.5, 0.01], 0.01, [4, 16], 24, steep, 0.1, 0.05)
    # whenever it says stop, no deeper tree with nodes at most `bound` beats cutting now
    rng = random.Random(3)
    for _ in range(300):
        have = [rng.random() ** 2 for _ in range(rng.randint(1, 8))]
        bound = min(have) * rng.random()
        per_level = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        v = VerifyCost(tuple(isotonic([1.0] + [1.0 + rng.random() * i / 6 for i in range(1, 40)])), 0.05)
        c_now, c_level = rng.random() * 0.2, rng.random() * 0.2
        if worth_deeper(have, bound, per_level, 12, v, c_now, c_level):
            continue
        now = best_rate(sorted(have, reverse=True)[:12], v, c_now)
        for j in range(1, len(per_level) + 1):
            extra = [bound * rng.random() for _ in range(sum(per_level[:j]))]
            assert best_rate(sorted(have + extra, reverse=True)[:12], v, c_now + j * c_level) <= now + 1e-12


def random_scored_tree(rng: random.Random, n: int) -> Proposal:
    parents, scores = [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        parents.append(p)
        scores.append((scores[p] if p >= 0 else 1.0) * rng.choice([1.0, rng.random()]))  # ties included
    q = torch.rand(n, 11)
    return Proposal(torch.randint(0, 100, (n,)), torch.tensor(parents), q, scores=torch.tensor(scores))


def test_prune_keeps_a_valid_tree_of_the_best_scored_nodes():
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(1, 12)
        prop = random_scored_tree(rng, n)
        v = VerifyCost(tuple(1.0 + 0.15 * i for i in range(13)), 0.05)
        cut = prune(prop, v, 0.02)
        m = len(cut)
        assert m == best_size(sorted(prop.scores.tolist(), reverse=True), v, 0.02)
        # the kept nodes: a parents-first tree whose tokens, q rows and scores are the originals'
        kept = [i for i in range(n) if any(
            int(cut.tokens[j]) == int(prop.tokens[i]) and torch.equal(cut.q[j], prop.q[i]) for j in range(m))]
        assert len(kept) >= m
        assert all(p < j for j, p in enumerate(cut.parent_list))
        _ = cut.depths  # validates the parent order
        # no unkept node outscores a kept one (ties aside)
        if 0 < m < n:
            assert float(cut.scores.min()) >= float(prop.scores.topk(m).values.min()) - 1e-9
    # every kept node's root path is kept: compare by original index through the q rows
    prop = random_scored_tree(random.Random(5), 12)
    cut = prune(prop, VerifyCost(tuple(1.0 + 0.2 * i for i in range(13)), 0.05))
    orig = [next(i for i in range(12) if torch.equal(cut.q[j], prop.q[i])) for j in range(len(cut))]
    for j, p in enumerate(cut.parent_list):
        assert (p == -1 and prop.parent_list[orig[j]] == -1) or orig[p] == prop.parent_list[orig[j]]


def test_prune_leaves_unscored_proposals_alone_and_refuses_scores_that_grow():
    plain = Proposal.chain([4, 5, 6])
    assert prune(plain, VerifyCost((1.0, 9.0, 9.0, 9.0), 0.05)) is plain
    bad = Proposal(torch.tensor([4, 5]), torch.tensor([-1, 0]), scores=torch.tensor([0.1, 0.9]))
    with pytest.raises(ConfigError, match="path probabilities"):
        prune(bad, VerifyCost((1.0, 1.1, 1.2), 0.05))


class ScoredTopK(Proposer):
    """A deterministic top-2-per-depth tree from a small draft model, scored with the draft's path
    probabilities; `with_q` attaches the draft's distributions (as a sampled proposer would)."""

    def __init__(self, draft, with_q: bool = False):
        self.draft, self.with_q = draft, with_q

    @torch.no_grad()
    def propose(self, context, spec, sampling, generator):
        toks, parents, scores, qs = [], [], [], []
        frontier = [(-1, [], 1.0)]
        for d in range(spec.depth):
            nxt = []
            for parent, path, s in frontier:
                probs = self.draft(torch.cat([context, torch.tensor(path, dtype=torch.long)])[None]).logits[0, -1]
                probs = probs.float().softmax(-1)
                for t in probs.topk(spec.branching[d]).indices.tolist():
                    toks.append(t)
                    parents.append(parent)
                    scores.append(s * float(probs[t]))
                    qs.append(probs)
                    nxt.append((len(toks) - 1, path + [t], scores[-1]))
            frontier = nxt
        return Proposal(torch.tensor(toks), torch.tensor(parents), torch.stack(qs) if self.with_q else None,
                        scores=torch.tensor(scores))


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    from test_decoding import varied_llama

    return varied_llama(len(tiny_tokenizer), seed=0), varied_llama(len(tiny_tokenizer), seed=0, layers=2)


# a cost curve that cuts these trees to a few nodes most steps, and sometimes to none
CUTTING = VerifyCost(tuple([1.0, 1.02, 1.05, 1.25, 1.5] + [1.5 + 0.3 * i for i in range(1, 12)]), 0.05)


def test_pruned_trees_stay_lossless_under_greedy_decoding(models, tiny_tokenizer):
    target, draft = models
    prompts = [tiny_tokenizer(t).input_ids for t in ["def add(a, b): return a + b", "The quick brown fox"]]
    plain = speculative_generate(target, None, prompts, 24, k=0, eos_ids=[])
    full = speculative_generate(target, ScoredTopK(draft), prompts, 24, k=None, tree=TreeSpec((2, 2, 2)), eos_ids=[])
    cut = speculative_generate(target, ScoredTopK(draft), prompts, 24, k=None, tree=TreeSpec((2, 2, 2)),
                               eos_ids=[], cost=CUTTING)
    assert full.tokens == plain.tokens and cut.tokens == plain.tokens
    assert cut.stats.pruned > 0 and full.stats.pruned == 0
    assert cut.stats.proposed + cut.stats.pruned == pytest.approx(14 * cut.stats.target_forwards, abs=14 * 2)
    assert cut.stats.proposed / cut.stats.target_forwards < full.stats.proposed / full.stats.target_forwards


def test_sampling_prunes_only_deterministic_candidates(models, tiny_tokenizer):
    target, draft = models
    prompt = [tiny_tokenizer("The quick brown fox").input_ids]
    kw = dict(k=None, tree=TreeSpec((2, 2)), eos_ids=[], temperature=1.0, seed=3, cost=CUTTING)
    det = speculative_generate(target, ScoredTopK(draft), prompt, 16, **kw)
    drawn = speculative_generate(target, ScoredTopK(draft, with_q=True), prompt, 16, **kw)
    assert det.stats.pruned > 0  # q = None: any candidate set is lossless, so it may be cut
    assert drawn.stats.pruned == 0  # q given: cutting draws by their identity would bias the rule
    greedy = speculative_generate(target, ScoredTopK(draft, with_q=True), prompt, 16, **{**kw, "temperature": 0.0})
    assert greedy.stats.pruned > 0


def test_sampling_distribution_with_pruned_topk_trees_matches_target():
    """The chi-square check of test_decoding, on deterministic top-2 trees that the cost model cuts by their
    scores before verification (which nodes survive depends on the candidates themselves)."""
    from test_decoding import SAMPLING, VOCAB, chi_square_ok, probs_from_logits, varied_llama

    from draftsmith.decoding.verify import accept_sampled

    tgt, drf = varied_llama(VOCAB, seed=5, scale=3.0), varied_llama(VOCAB, seed=6, layers=1, scale=3.0)
    ctx = [3, 7, 11, 4]
    one = torch.tensor([ctx + [x] for x in range(VOCAB)])
    with torch.no_grad():
        p0, p1 = (probs_from_logits(x, SAMPLING) for x in (tgt(torch.tensor([ctx])).logits[0, -1],
                                                           tgt(one).logits[:, -1]))
        q0, q1 = (probs_from_logits(x, SAMPLING) for x in (drf(torch.tensor([ctx])).logits[0, -1],
                                                           drf(one).logits[:, -1]))
    uniform_row = torch.full((VOCAB,), 1.0 / VOCAB)
    cost = VerifyCost((1.0, 1.0, 1.0, 1.035, 1.6), 0.05)  # a third node pays iff it scores above ~0.05
    gen = torch.Generator().manual_seed(99)
    n, first, pairs, sizes = 4000, {}, {}, set()
    for _ in range(n):
        a, b = q0.topk(2).indices.tolist()
        ca, cb = int(torch.multinomial(q1[a], 1, generator=gen)), int(torch.multinomial(q1[b], 1, generator=gen))
        prop = Proposal(torch.tensor([a, b, ca, cb]), torch.tensor([-1, -1, 0, 1]), None,
                        scores=torch.tensor([q0[a], q0[b], q0[a] * q1[a][ca], q0[b] * q1[b][cb]]))
        prop = prune(prop, cost)
        sizes.add(len(prop))
        rows = {-1: p0}
        for i, (t, par) in enumerate(zip(prop.tokens.tolist(), prop.parent_list)):
            rows[i] = p1[t] if par == -1 else uniform_row
        path, tok = accept_sampled(prop, torch.stack([rows[i] for i in range(-1, len(prop))]), gen)
        out = prop.tokens[path].tolist() + [tok]
        if len(out) == 1:
            out.append(int(torch.multinomial(p1[out[0]], 1, generator=gen)))
        first[out[0]] = first.get(out[0], 0) + 1
        pairs[tuple(out[:2])] = pairs.get(tuple(out[:2]), 0) + 1
    assert len(sizes) > 1  # the cut really depends on the candidates
    exp1 = {i: float(p0[i]) for i in range(VOCAB) if p0[i] > 0}
    exp2 = {(x, y): float(p0[x] * p1[x, y]) for x, y in itertools.product(exp1, range(VOCAB)) if p1[x, y] > 0}
    for counts, exp in ((first, exp1), (pairs, exp2)):
        ok, stat, crit = chi_square_ok(counts, exp, n)
        assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"
