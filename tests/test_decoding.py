"""Speculative decoding: greedy losslessness, exact α/τ on stub proposers, tree attention against a slow
reference, KV rollback, and the sampling rules' output distribution against the target's exact one."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.ngram import NgramProposer, find_continuation
from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec
from draftsmith.decoding.sampling import SamplingConfig, probs_from_logits
from draftsmith.decoding.verify import SequenceVerifier, accept_sampled, tree_attention
from draftsmith.distill.proposer import DraftProposer
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.targets import kvcache


def varied_llama(vocab: int, seed: int, layers: int = 2, scale: float = 16.0, attn: str = "sdpa"):
    """Untied tiny Llama whose greedy path is varied (the tied conftest model tends to repeat a token)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and the machine's 2 cores are shared; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    return varied_llama(len(tiny_tokenizer), seed=0)


@pytest.fixture(scope="module")
def draft(tiny_tokenizer):
    return varied_llama(len(tiny_tokenizer), seed=1, layers=1)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["def add(a, b): return a + b\nfor i in range(10): print(i)", "The quick brown fox jumps over"]
    return [tiny_tokenizer(t).input_ids for t in texts]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class TreeStub(Proposer):
    """Builds a tree from a model by slow full forwards: top-b children (deterministic) or b i.i.d. draws."""

    name = "tree-stub"

    def __init__(self, model, sampled: bool = False):
        self.model, self.sampled = model, sampled

    def propose(self, context, spec, sampling, generator):
        tokens, parents, qs = [], [], []
        frontier = [(-1, context.tolist())]
        for b in spec.branching:
            nxt = []
            for node, seq in frontier:
                logits = self.model(torch.tensor([seq])).logits[0, -1]
                q = probs_from_logits(logits, sampling)
                if self.sampled:
                    cands = torch.multinomial(q, b, replacement=True, generator=generator).tolist()
                else:
                    cands = logits.topk(b).indices.tolist()
                for c in cands:
                    tokens.append(c)
                    parents.append(node)
                    qs.append(q)
                    nxt.append((len(tokens) - 1, seq + [c]))
            frontier = nxt
        return Proposal(torch.tensor(tokens), torch.tensor(parents), torch.stack(qs) if self.sampled else None)


class ScriptedStub(Proposer):
    """Proposes the reference greedy continuation, corrupted at output positions in `bad` (a fixed script)."""

    name = "scripted"

    def __init__(self, prompt_len: int, reference: list[int], bad: set[int], vocab: int):
        self.prompt_len, self.ref, self.bad, self.vocab = prompt_len, reference, bad, vocab

    def propose(self, context, spec, sampling, generator):
        pos = context.numel() - self.prompt_len  # output position of the first proposed token
        toks = []
        for j in range(pos, min(pos + spec.depth, len(self.ref))):
            toks.append((self.ref[j] + 1) % self.vocab if j in self.bad else self.ref[j])
        return Proposal.chain(toks)


# ---------------------------------------------------------------------------------------------------------
# greedy: speculative output == the target's own greedy output


@pytest.mark.parametrize("which,k,tree", [
    ("plain", 0, None), ("ngram", 4, None), ("draft", 3, None), ("self", 5, None), ("tiny_draft", 4, None),
    ("tree_self", None, (2, 2, 1)), ("tree_draft", None, (3, 2)),
])
def test_greedy_equals_target_greedy(which, k, tree, target, draft, prompts, tiny_draft):
    n = 24
    proposer = {
        "plain": None, "ngram": NgramProposer(), "draft": DraftProposer(draft), "self": DraftProposer(target),
        "tiny_draft": DraftProposer(tiny_draft), "tree_self": TreeStub(target), "tree_draft": TreeStub(draft),
    }[which]
    res = speculative_generate(target, proposer, prompts, n, k=k, tree=tree, eos_ids=[])
    for row, prompt in zip(res.tokens, prompts):
        assert row == hf_greedy(target, prompt, n)
    assert res.stats.new_tokens == n * len(prompts)
    if which == "plain":
        assert res.stats.tau == 1.0 and res.stats.proposed == 0
    if which in ("self", "tree_self"):  # the target drafting for itself is always accepted
        assert res.stats.per_position_acceptance[0] == 1.0


def test_a_bf16_draft_stays_lossless_and_leaves_a_shared_model_alone(target, prompts, monkeypatch):
    from draftsmith.decoding.proposer import draft_dtype

    n = 16
    prop = DraftProposer(target)  # the target drafting for itself, cast: a copy, not the target
    assert prop.use_dtype(torch.bfloat16) and next(prop.model.parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32 and prop.model is not target
    res = speculative_generate(target, prop, prompts, n, k=4, eos_ids=[])
    assert res.tokens == [hf_greedy(target, p, n) for p in prompts]
    assert res.stats.alpha > 0.8  # bf16 rounding flips a near-tie now and then, not the whole draft
    sampled = speculative_generate(target, prop, prompts, 12, k=4, temperature=0.8, eos_ids=[], seed=2)
    assert all(len(t) == 12 for t in sampled.tokens)
    q = prop.propose(torch.tensor(prompts[0]), TreeSpec.chain(3), SamplingConfig(temperature=0.8), None).q
    assert q.dtype == torch.float32 and torch.allclose(q.sum(-1), torch.ones(3))  # sampled from, and reported
    assert not NgramProposer().use_dtype(torch.bfloat16)  # nothing to cast
    cpu = torch.device("cpu")
    assert draft_dtype("auto", torch.float32, cpu) == torch.float32  # the suite pins DRAFTSMITH_CPU_BF16=0
    assert draft_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert draft_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    monkeypatch.setenv("DRAFTSMITH_CPU_BF16", "1")
    assert draft_dtype("auto", torch.float32, cpu) == torch.bfloat16  # a CPU that multiplies bf16 natively


def test_padded_batch_rows_match(target, prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    res = speculative_generate(target, DraftProposer(target), ids, 10, k=3, attention_mask=mask, eos_ids=[])
    assert res.tokens == [hf_greedy(target, p, 10) for p in prompts]


@pytest.mark.parametrize("tree", [None, (2, 2, 2, 1, 1)])
def test_eos_and_budget_mid_block(target, prompts, tree):
    ref = hf_greedy(target, prompts[0], 30)
    eos = ref[7]
    cut = ref[: ref.index(eos) + 1]
    proposer = DraftProposer(target) if tree is None else TreeStub(target)
    k = None if tree else 5
    res = speculative_generate(target, proposer, [prompts[0]], 30, k=k, tree=tree, eos_ids=[eos])
    assert res.tokens[0] == cut  # stops right after EOS although the block accepted further tokens
    res = speculative_generate(target, proposer, [prompts[0]], 7, k=k, tree=tree, eos_ids=[])
    assert res.tokens[0] == ref[:7]  # never past the budget
    assert res.stats.proposed_per_position and res.stats.new_tokens == 7


# ---------------------------------------------------------------------------------------------------------
# stub proposers: α / τ counted exactly


def test_never_always_sometimes_accept(target, prompts):
    prompt, n, vocab = prompts[0], 20, target.config.vocab_size
    ref = hf_greedy(target, prompt, n)

    # The prefill forward produces output position 0; verification steps start at position 1.
    never = speculative_generate(target, ScriptedStub(len(prompt), ref, set(range(n)), vocab), [prompt], n, k=4,
                                 eos_ids=[])
    assert never.tokens[0] == ref
    s = never.stats
    assert (s.accepted, s.target_forwards, s.tau, s.alpha) == (0, n - 1, 1.0, 0.0)

    always = speculative_generate(target, ScriptedStub(len(prompt), ref, set(), vocab), [prompt], n, k=4, eos_ids=[])
    s = always.stats
    # steps at positions 1, 6, 11 emit 5 each; at 16 four remain, so k = 3 and it emits 4
    assert always.tokens[0] == ref and s.alpha == 1.0
    assert (s.proposed, s.target_forwards, s.tau) == (15, 4, 19 / 4)

    # Script: k=4, 20 tokens, output positions 2 and 9 corrupted.
    # step 1 at pos 1 proposes 1..4, rejects 2: accepts 1, emits 2 -> pos 3
    # step 2 at pos 3 proposes 3..6: accepts 4, emits 5 -> pos 8
    # step 3 at pos 8 proposes 8..11, rejects 9: accepts 1, emits 2 -> pos 10
    # step 4 at pos 10 proposes 10..13: accepts 4, emits 5 -> pos 15
    # step 5 at pos 15 (5 left, k = min(4, 5-1) = 4) proposes 15..18: accepts 4, emits 5 -> pos 20
    some = speculative_generate(target, ScriptedStub(len(prompt), ref, {2, 9}, vocab), [prompt], n, k=4, eos_ids=[])
    s = some.stats
    assert some.tokens[0] == ref
    assert (s.proposed, s.accepted, s.target_forwards) == (20, 14, 5)
    assert s.alpha == 0.7 and s.tau == 19 / 5
    assert s.proposed_per_position == [5, 5, 5, 5] and s.accepted_per_position == [5, 3, 3, 3]
    assert s.per_position_acceptance == [1.0, 0.6, 0.6, 0.6]
    # n-α: position 3 was tried only by the three steps that accepted 1 and 2, and all three accepted it
    assert s.tried_per_position == [5, 5, 3, 3] and s.conditional_acceptance == [1.0, 0.6, 1.0, 1.0]


def test_tried_positions_follow_the_accepted_branch_of_a_tree():
    from draftsmith.decoding.verify import StepStats

    # root -> {0, 1}; 0 -> {2, 3}; 2 -> {4}: a position is tried only where the accepted node has a child
    tree = Proposal(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]))
    cases = {(): 1, (1,): 1, (0, 3): 2, (0,): 2, (0, 2): 3, (0, 2, 4): 3}
    for path, tried in cases.items():
        st = StepStats()
        st.record(tree, len(path), list(path))
        assert sum(st.tried_at) == tried, path
        assert st.accepted_at == [1] * len(path) + [0] * (3 - len(path)) and st.proposed_at == [1, 1, 1]


def test_ngram_lookup():
    ctx = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6])
    assert find_continuation(ctx, 2, 3).tolist() == [7, 1, 5]  # most recent earlier "5 6"
    assert find_continuation(ctx, 3, 3) is None
    p = NgramProposer(max_ngram=3).propose(ctx, TreeSpec.chain(2), SamplingConfig(), None)
    assert p.tokens.tolist() == [7, 1] and p.is_chain and p.q is None


def test_registry_errors(tiny_target, other_target):
    assert build_proposer("ngram:2", tiny_target).max_ngram == 2
    with pytest.raises(ConfigError, match="unknown proposer 'magic'.*medusa:PATH"):
        build_proposer("magic", tiny_target)
    with pytest.raises(ConfigError, match="needs a path"):
        build_proposer("medusa", tiny_target)  # no path
    with pytest.raises(DraftsmithError, match="nowhere"):
        build_proposer("eagle:/nowhere", tiny_target)
    from draftsmith.errors import FingerprintMismatch

    with pytest.raises(FingerprintMismatch):  # a draft with another tokenizer
        build_proposer(f"draft:{other_target.folder}", tiny_target)
    ok = build_proposer(f"draft:{tiny_target.folder}", tiny_target)
    assert isinstance(ok, DraftProposer)


def test_draft_artifact_fingerprint_checked(tiny_target, other_target, tiny_tokenizer, tmp_path):
    from draftsmith.artifact import make_manifest, save_artifact
    from draftsmith.errors import FingerprintMismatch

    def writer(tmp):
        tiny_target.model.save_pretrained(tmp)
        tiny_tokenizer.save_pretrained(tmp)

    art = save_artifact(tmp_path / "d", make_manifest("draft", other_target.fingerprint(), {}), writer=writer)
    with pytest.raises(FingerprintMismatch):
        build_proposer(f"draft:{art}", tiny_target)
    art = save_artifact(tmp_path / "d2", make_manifest("draft", tiny_target.fingerprint(), {}), writer=writer)
    assert isinstance(build_proposer(f"draft:{art}", tiny_target), DraftProposer)


# ---------------------------------------------------------------------------------------------------------
# tree attention and KV rollback


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_matches_slow_reference(tiny_tokenizer, prompts, attn):
    model = varied_llama(len(tiny_tokenizer), seed=3, attn=attn)
    prompt = prompts[0]
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    parents = [-1, -1, 0, 0, 1, 2]
    tokens = [10, 11, 12, 13, 14, 15]
    mask, pos = tree_attention(parents, len(prompt) - 1, torch.float32, "cpu")
    out = model(input_ids=torch.tensor([[prompt[-1]] + tokens]), attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=True).logits[0]
    for r in range(len(tokens) + 1):
        path, u = [], r - 1
        while u >= 0:
            path.append(tokens[u])
            u = parents[u]
        seq = prompt + path[::-1]
        slow = model(input_ids=torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out[r], slow, atol=1e-4, rtol=1e-4)


def test_tree_forward_gemma3(tiny_tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           sliding_window=64, max_position_embeddings=256)
    model = Gemma3ForCausalLM(cfg).eval()
    prompt = list(range(5, 25))
    proposal_parents, tokens = [-1, -1, 0, 1], [30, 31, 32, 33]
    cache = kvcache.new_cache(model)
    model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    mask, pos = tree_attention(proposal_parents, len(prompt) - 1, torch.float32, "cpu")
    out = model(input_ids=torch.tensor([[prompt[-1]] + tokens]), attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=True).logits[0]
    slow = model(input_ids=torch.tensor([prompt + [31, 33]])).logits[0, -1]
    torch.testing.assert_close(out[4], slow, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("proposer_kind", ["chain", "tree"])
def test_kv_rollback_equals_fresh_prefill(target, draft, prompts, proposer_kind):
    proposer = DraftProposer(draft) if proposer_kind == "chain" else TreeStub(target)
    spec = TreeSpec.chain(4) if proposer_kind == "chain" else TreeSpec((3, 2, 1))
    seq = SequenceVerifier(target, proposer, SamplingConfig(), None)
    seq.begin(torch.tensor(prompts[1]))
    gathered = False
    for _ in range(4):
        seq.step(spec)
        fresh = DynamicCache(config=target.config)
        target(input_ids=seq.context[None, :-1], past_key_values=fresh, use_cache=True)
        assert kvcache.cache_length(seq.cache) == seq.context.numel() - 1
        for kept, prefilled in zip(seq.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(kept.keys, prefilled.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kept.values, prefilled.values, atol=1e-5, rtol=1e-5)
        gathered |= proposer_kind == "tree"
    if proposer_kind == "chain":
        assert seq.stats.accepted < seq.stats.proposed  # there were rejections to roll back
    assert gathered or proposer_kind == "chain"


# ---------------------------------------------------------------------------------------------------------
# sampling: the output distribution is the target's


VOCAB = 32
SAMPLING = SamplingConfig(temperature=0.9, top_k=6, top_p=0.9)


def reference_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Independent slow implementation of temperature -> top-k -> top-p for one 1-D logits row."""
    z = (logits.double() / cfg.temperature).tolist()
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[: cfg.top_k] if cfg.top_k else order
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    kept, mass = [], 0.0
    for i in keep:  # descending
        if mass >= cfg.top_p:
            break
        kept.append(i)
        mass += w[i] / total
    out = torch.zeros(len(z), dtype=torch.float64)
    for i in kept:
        out[i] = w[i]
    return out / out.sum()


@pytest.fixture(scope="module")
def small_tables():
    """Exact target p and draft q tables over 2 tokens after a fixed context, vocab 32."""
    tgt, drf = varied_llama(VOCAB, seed=5, scale=3.0), varied_llama(VOCAB, seed=6, layers=1, scale=3.0)
    ctx = [3, 7, 11, 4]
    one = torch.tensor([ctx + [x] for x in range(VOCAB)])
    with torch.no_grad():
        tl0, tl1 = tgt(torch.tensor([ctx])).logits[0, -1], tgt(one).logits[:, -1]
        dl0, dl1 = drf(torch.tensor([ctx])).logits[0, -1], drf(one).logits[:, -1]
    p0, p1 = probs_from_logits(tl0, SAMPLING), probs_from_logits(tl1, SAMPLING)
    q0, q1 = probs_from_logits(dl0, SAMPLING), probs_from_logits(dl1, SAMPLING)
    exact0 = reference_probs(tl0, SAMPLING)
    exact1 = torch.stack([reference_probs(tl1[x], SAMPLING) for x in range(VOCAB)])
    torch.testing.assert_close(p0.double(), exact0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(p1.double(), exact1, atol=1e-6, rtol=1e-5)
    return dict(tgt=tgt, drf=drf, ctx=ctx, p0=p0, p1=p1, q0=q0, q1=q1, exact0=exact0, exact1=exact1)


def chi_square_ok(counts: dict, expected: dict, n: int) -> tuple[bool, float, float]:
    """Pearson chi-square with cells of expected count < 5 pooled; critical value at p = 0.001
    (Wilson–Hilferty). Any draw outside the target's support fails outright."""
    if any(expected.get(c, 0.0) == 0.0 for c in counts):
        return False, float("inf"), 0.0
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for c, pr in expected.items():
        e, o = pr * n, counts.get(c, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = max(cells - 1, 1)
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def draw_two_tokens(t: dict, kind: str, gen: torch.Generator) -> tuple[int, int]:
    """One speculative step (+ a follow-up step if only one token came out), via the verifier's core."""
    uniform_row = torch.full((VOCAB,), 1.0 / VOCAB)
    if kind == "chain":  # x1 ~ q0, x2 ~ q1[x1]: Leviathan/Chen speculative sampling
        x1 = int(torch.multinomial(t["q0"], 1, generator=gen))
        x2 = int(torch.multinomial(t["q1"][x1], 1, generator=gen))
        prop = Proposal.chain([x1, x2], torch.stack([t["q0"], t["q1"][x1]]))
        p = torch.stack([t["p0"], t["p1"][x1], uniform_row])
    else:  # two i.i.d. root children from q0, each with one child from q1: SpecInfer MSS / deterministic
        if kind == "tree_sampled":
            a, b = torch.multinomial(t["q0"], 2, replacement=True, generator=gen).tolist()
        else:
            a, b = t["q0"].topk(2).indices.tolist()
        ca = int(torch.multinomial(t["q1"][a], 1, generator=gen))
        cb = int(torch.multinomial(t["q1"][b], 1, generator=gen))
        q = torch.stack([t["q0"], t["q0"], t["q1"][a], t["q1"][b]]) if kind == "tree_sampled" else None
        prop = Proposal(torch.tensor([a, b, ca, cb]), torch.tensor([-1, -1, 0, 1]), q)
        p = torch.stack([t["p0"], t["p1"][a], t["p1"][b], uniform_row, uniform_row])
    path, tok = accept_sampled(prop, p, gen)
    out = prop.tokens[path].tolist() + [tok]
    if len(out) == 1:  # second token from a follow-up one-token speculative step
        y = int(torch.multinomial(t["q1"][out[0]], 1, generator=gen))
        prop2 = Proposal.chain([y], t["q1"][out[0]][None])
        path2, tok2 = accept_sampled(prop2, torch.stack([t["p1"][out[0]], uniform_row]), gen)
        out += (prop2.tokens[path2].tolist() + [tok2])[:1]
    return out[0], out[1]


@pytest.mark.parametrize("kind", ["chain", "tree_sampled", "tree_topk"])
def test_sampling_distribution_matches_target(small_tables, kind):
    t = small_tables
    gen = torch.Generator().manual_seed(1234)
    n = 4000
    first, pairs = {}, {}
    for _ in range(n):
        a, b = draw_two_tokens(t, kind, gen)
        first[a] = first.get(a, 0) + 1
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    exp1 = {i: float(t["exact0"][i]) for i in range(VOCAB) if t["exact0"][i] > 0}
    exp2 = {(a, b): float(t["exact0"][a] * t["exact1"][a, b]) for a in exp1 for b in range(VOCAB)
            if t["exact1"][a, b] > 0}
    ok1, s1, c1 = chi_square_ok(first, exp1, n)
    ok2, s2, c2 = chi_square_ok(pairs, exp2, n)
    assert ok1, f"first token: chi2 {s1:.1f} >= {c1:.1f}"
    assert ok2, f"two tokens: chi2 {s2:.1f} >= {c2:.1f}"


def test_sampling_rejects_a_wrong_distribution(small_tables):
    """The chi-square check has power: draws from q (the draft) instead of p fail it."""
    t = small_tables
    gen = torch.Generator().manual_seed(7)
    n = 4000
    draws = torch.multinomial(t["q0"], n, replacement=True, generator=gen).tolist()
    counts = {i: draws.count(i) for i in set(draws)}
    exp1 = {i: float(t["exact0"][i]) for i in range(VOCAB) if t["exact0"][i] > 0}
    assert not chi_square_ok(counts, exp1, n)[0]


def test_sampling_end_to_end_two_tokens(small_tables):
    """speculative_generate itself (draft proposer, temperature/top-k/top-p): the first token comes from the
    prefill, the second from a speculative step (k = 1 within a budget of 3); their joint distribution is p."""
    t = small_tables
    n = 600
    res = speculative_generate(t["tgt"], DraftProposer(t["drf"]), [t["ctx"]] * n, 3, k=2,
                               temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p,
                               seed=11, eos_ids=[])
    assert 0 < res.stats.accepted < res.stats.proposed  # both branches of the rule were exercised
    ok, stat, crit = first_two_tokens_match(t, res.tokens)
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def first_two_tokens_match(t: dict, rows: list[list[int]]) -> tuple[bool, float, float]:
    """Chi-square of the rows' first two tokens against the exact target pair distribution of `small_tables`."""
    pairs: dict = {}
    for a, b, *_ in rows:
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    exp = {(a, b): float(t["exact0"][a] * t["exact1"][a, b]) for a in range(VOCAB) for b in range(VOCAB)
           if t["exact0"][a] * t["exact1"][a, b] > 0}
    return chi_square_ok(pairs, exp, len(rows))


class FeatureRecorder(TreeStub):
    """A tree proposer that declares target features (like Medusa + EAGLE-3) and records what it is given."""

    needs_last_hidden = True
    target_layers = [0, -1]

    def begin(self, prompt_ids, features):
        assert len(features) == prompt_ids.numel() - 1  # every prompt position; the last id is pending
        self.hidden, self.layers = [features.last_hidden], {i: [h] for i, h in features.layers.items()}

    def accept(self, result):
        assert len(result.features) == len(result.accepted_nodes) + 1  # root + accepted nodes
        self.hidden.append(result.features.last_hidden)
        for i, h in result.features.layers.items():
            self.layers[i].append(h)


def test_target_features_reach_the_proposer(target, prompts):
    """Features handed to begin/accept, concatenated, are the target's features of every cached position."""
    from draftsmith.capture.forward import capture_forward

    rec = FeatureRecorder(target)
    res = speculative_generate(target, rec, [prompts[1]], 12, k=None, tree=(2, 2), eos_ids=[])
    assert res.stats.accepted > 0
    cached = torch.tensor(prompts[1] + res.tokens[0])[:-1]
    ref = capture_forward(target, cached[None], layers=[0, -1])
    got = torch.cat(rec.hidden)
    n = got.shape[0]  # the last step's features cover up to its bonus position
    assert n >= len(prompts[1]) + 8
    torch.testing.assert_close(got, ref.last_hidden[0, :n], atol=1e-4, rtol=1e-4)
    for i in (0, -1):
        torch.testing.assert_close(torch.cat(rec.layers[i]), ref.layers[i][0, :n], atol=1e-4, rtol=1e-4)
