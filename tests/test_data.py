"""Data pipeline: sources, loss masks, malformed rows, overlap, batched == single decoding, resume, capture."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_models import cache_hub_dataset

from draftsmith.capture.config import CaptureConfig
from draftsmith.config import load_config
from draftsmith.data import generate_dataset, load_distilled, load_prompts, tokenize_conversation
from draftsmith.data.config import (
    ChatConfig,
    DataConfig,
    DomainRule,
    EvalSetConfig,
    GenerationConfig,
    SourceConfig,
)
from draftsmith.data.engines.base import Request
from draftsmith.data.engines.continuous import CaptureSpec, ContinuousBatcher
from draftsmith.data.engines.hf import HFEngine
from draftsmith.data.masks import masked_spans
from draftsmith.data.overlap import find_overlap, load_eval_texts
from draftsmith.data.sources import stdlib_code_rows
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import ConfigError, DataError, FingerprintMismatch
from draftsmith.paths import data_path, shared_data_dir

SHARED = shared_data_dir()
TRAIN = SHARED / "train"

CONVO = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "The answer is 4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": " It is  12.\n"},
]


def _spans_text(tok, ids, mask):
    return [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in masked_spans(ids, mask)]


# ----------------------------------------------------------------------------------- masks


def test_mask_multi_turn_decodes_back(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVO)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    assert _spans_text(tiny_tokenizer, ids, mask) == ["The answer is 4.<|im_end|>", " It is  12.\n<|im_end|>"]
    # the ids are the template's own tokenization
    assert ids == tiny_tokenizer.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]


def test_generation_prompt_has_no_mask(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVO[:1], add_generation_prompt=True)
    assert sum(mask) == 0
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_plain_mode(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVO[:2], mode="plain")
    assert "<|im_start|>user" not in tiny_tokenizer.decode(ids)
    assert _spans_text(tiny_tokenizer, ids, mask) == ["The answer is 4.<|im_end|>"]


def test_auto_mode_without_template_is_plain(tiny_tokenizer):
    import copy

    base = copy.deepcopy(tiny_tokenizer)
    base.chat_template = None
    ids, mask = tokenize_conversation(base, CONVO[:2])
    assert _spans_text(base, ids, mask) == ["The answer is 4.<|im_end|>"]
    with pytest.raises(DataError, match="no chat template"):
        tokenize_conversation(base, CONVO[:2], mode="chat")


@pytest.mark.parametrize("template, match", [
    # rewrites the assistant text: the decode-back check can never hold
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "verbatim"),
    # writes a running message count first: no rendering is a prefix of a longer one
    ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "prefix-stable"),
    # no end-of-turn token after the assistant turn: the model could never learn to stop
    ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
     "{% if add_generation_prompt %}[assistant] {% endif %}", "end-of-turn"),
])
def test_unmaskable_template_raises(tiny_tokenizer, template, match):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    with pytest.raises(DataError, match=match):
        tokenize_conversation(tok, CONVO)


def test_mask_boundary_inside_token_raises(tiny_tokenizer):
    import copy

    # "assistant " then the content: byte-level BPE merges the space into the content's first word
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"}]
    with pytest.raises(DataError, match="token boundary"):
        tokenize_conversation(tok, convo)


# ----------------------------------------------------------------------------------- sources


def _cfg(tmp_path, sources, **kw):
    kw.setdefault("generation", GenerationConfig(max_new_tokens=12, batch_size=4, flush_every=2))
    return DataConfig(sources=sources, output_dir=str(tmp_path / "out"), **kw)


def test_every_shared_train_file_loads(tmp_path):
    sources = [
        SourceConfig(name="gsm8k", path=str(TRAIN / "gsm8k_train.jsonl.gz"), prompt="question", domain="math",
                     limit=30),
        SourceConfig(name="t0", path=str(TRAIN / "t0_prompts.jsonl.gz"), prompt="prompt", limit=200, domain="nlp",
                     domain_rules=[{"field": "source", "pattern": "xsum|cnn_dailymail|gigaword|samsum|multi_news",
                                    "domain": "summarization"},
                                   {"field": "source", "pattern": "qa|quoref|ropes|duorc", "domain": "qa"}]),
        SourceConfig(name="seed", path=str(TRAIN / "self_instruct_seed_tasks.jsonl.gz"),
                     prompt_template="{instruction}\n\n{instances[0][input]}", domain="general"),
    ]
    cfg = _cfg(tmp_path, sources)
    ps = load_prompts(cfg)
    counts = ps.domain_counts()
    assert counts["math"] == 30 and counts["general"] == 175
    assert {"summarization", "qa", "nlp"} <= set(counts)
    assert sum(counts.values()) == 30 + 200 + 175 - ps.duplicates
    seed = [r for r in ps.rows if r.source == "seed"]
    assert all(r.prompt.strip() == r.prompt and r.prompt for r in seed)
    # row ids are stable across loads
    assert [r.row_id for r in load_prompts(cfg).rows] == [r.row_id for r in ps.rows]


def test_eval_set_schemas_load_as_multi_turn():
    sets = [EvalSetConfig(path=str(SHARED / f"eval/{split}/alpaca.jsonl"), turns="turns") for split in ("dev", "test")]
    sets += [EvalSetConfig(path=str(SHARED / f"eval/{split}/user_oriented_instructions.jsonl"),
                           prompt_template="{instruction}\n\n{instances[0][input]}") for split in ("dev", "test")]
    assert len(load_eval_texts(sets, 8)) == 80 + 252


def test_eval_data_cannot_be_a_source(tmp_path):
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "x.jsonl").write_text('{"q": "hi"}\n')
    with pytest.raises(ValueError, match="held-out"):
        DataConfig(sources=[SourceConfig(name="x", path=str(ev / "x.jsonl"), prompt="q", domain="d")],
                   output_dir=str(tmp_path / "o"), eval_dirs=[str(ev)])


def test_stdlib_code_source_is_deterministic():
    src = SourceConfig(name="code", type="stdlib", domain="code", limit=12, seed=3)
    a, b = stdlib_code_rows(src), stdlib_code_rows(src)
    assert [r.row_id for r in a] == [r.row_id for r in b] and len(a) == 12
    assert all(r.domain == "code" and "```python" in r.prompt for r in a)
    fn = [r for r in a if r.prompt.startswith("Complete")]
    assert fn and all("def " in r.prompt for r in fn)
    other = stdlib_code_rows(SourceConfig(name="code", type="stdlib", domain="code", limit=12, seed=4))
    assert [r.row_id for r in other] != [r.row_id for r in a]


def test_stdlib_rows_keep_the_code_that_follows_each_prompt():
    """responses: keep on the standard library: a function's response is the whole function as written, a
    chunk's is the module's next lines: existing code to capture teacher-forced."""
    src = SourceConfig(name="code", type="stdlib", domain="code", limit=12, seed=3)
    rows = stdlib_code_rows(src, keep=True)
    assert len(rows) == 12 and all(r.responses and r.responses[0].startswith("```python\n") for r in rows)
    for r in rows:
        path, line = r.origin.rsplit(":", 1)
        file_lines = Path(path).read_text(encoding="utf-8").splitlines()
        code = r.responses[0].removeprefix("```python\n").removesuffix("\n```")
        if r.prompt.startswith("Complete"):
            assert code.lstrip().startswith(("def ", "async def ")) and code.splitlines()[0].strip() in r.prompt
        else:
            shown = r.prompt.split("```python\n", 1)[1].removesuffix("\n```").splitlines()
            start = int(line) - 1 + src.chunk_lines
            assert shown and code.splitlines()[0] == next(x for x in file_lines[start:] if x.strip())
    assert DataConfig(sources=[src], output_dir="o", responses="keep").responses == "keep"


def _bad_file(tmp_path) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join([
        json.dumps({"q": "What is the capital of France?"}),  # 1 ok
        '{"q": "broken',  # 2 bad JSON
        json.dumps({"question": "wrong field"}),  # 3 missing field
        json.dumps({"q": "   "}),  # 4 empty prompt
        json.dumps({"q": "word " * 400}),  # 5 too long
        json.dumps({"q": "How many legs does a spider have?"}),  # 6 ok
    ]) + "\n")
    return p


def test_malformed_rows_skip_with_line_numbers(tmp_path, tiny_target):
    p = _bad_file(tmp_path)
    cfg = _cfg(tmp_path, [SourceConfig(name="x", path=str(p), prompt="q", domain="d")],
               generation=GenerationConfig(max_prompt_tokens=64))
    ps = load_prompts(cfg, prompt_length=lambda r: len(tiny_target.tokenizer(r.prompt)["input_ids"]))
    assert len(ps.rows) == 2
    where = {o.rsplit(":", 1)[1]: r for o, r in ps.malformed.items}
    assert set(where) == {"2", "3", "4", "5"}
    assert where["2"].startswith("bad JSON") and "missing field 'q'" in where["3"]
    assert where["4"] == "empty prompt" and where["5"].startswith("prompt too long")
    assert "4 malformed rows skipped" in ps.malformed.summary()


def test_malformed_rows_fail_policy_names_file_and_line(tmp_path):
    p = _bad_file(tmp_path)
    cfg = _cfg(tmp_path, [SourceConfig(name="x", path=str(p), prompt="q", domain="d")], malformed="fail")
    with pytest.raises(DataError, match=rf"{p.name}:2: bad JSON"):
        load_prompts(cfg)


def test_empty_after_filtering_raises(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"q": ""}\n{"z": 1}\n')
    with pytest.raises(DataError, match="no prompts left"):
        load_prompts(_cfg(tmp_path, [SourceConfig(name="x", path=str(p), prompt="q", domain="d")]))


def test_hf_dataset_source(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["one prompt", "two prompt", ""]}).save_to_disk(str(tmp_path / "ds"))
    cfg = _cfg(tmp_path, [SourceConfig(name="hf", type="hf", path=str(tmp_path / "ds"), prompt="text", domain="d")])
    ps = load_prompts(cfg)
    assert [r.prompt for r in ps.rows] == ["one prompt", "two prompt"]
    assert ps.malformed.items[0] == (f"{tmp_path / 'ds'}[2]", "empty prompt")


def test_hf_hub_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network wait in the test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = _cfg(tmp_path, [SourceConfig(name="hub", type="hf", path="no-such-org/no-such-set", prompt="t", domain="d")])
    with pytest.raises(DataError, match="from the Hugging Face hub"):
        load_prompts(cfg)


def test_overlap_detects_exact_substring_and_near(tmp_path):
    ev = tmp_path / "eval.jsonl"
    q1 = "Darrell and Allen's ages are in the ratio of 7:11. If their total age now is 162, calculate Allen's age."
    q2 = "Write a short poem about the sea at night with the moon shining over the quiet waves and sand."
    ev.write_text(json.dumps({"turns": [q1]}) + "\n" + json.dumps({"turns": [q2]}) + "\n")
    tr = tmp_path / "train.jsonl"
    tr.write_text("\n".join(json.dumps({"q": q}) for q in [
        q1.upper(),  # exact after normalisation
        "Read the story about the family first and think about every number in it carefully before you "
        "answer, then solve the following problem step by step and explain each step to a young student: "
        + q1 + " Show your work.",  # eval question pasted inside a longer prompt
        q2.replace("quiet", "calm"),  # near-duplicate
        "Completely unrelated question about cooking pasta for dinner tonight with friends.",
    ]) + "\n")
    cfg = _cfg(tmp_path, [SourceConfig(name="t", path=str(tr), prompt="q", domain="d")])
    rows = load_prompts(cfg).rows
    rep = find_overlap(rows, load_eval_texts([EvalSetConfig(path=str(ev), turns="turns")], 8), 8, 0.5)
    assert rep.rows == {0, 1, 2}
    assert set(rep.counts()) == {"exact", "substring", "near-duplicate"}


# ----------------------------------------------------------------------------------- engine


def _random_requests(vocab: int, n: int = 13, seed: int = 0, prefix: int = 0) -> list[Request]:
    """Random prompts; with `prefix`, all start with the same `prefix` tokens (a chat preamble)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [Request(i, shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 25))], rng.randrange(1, 30))
            for i in range(n)]


def _run(target, reqs, bs, **kw):
    out = {}
    ContinuousBatcher(target.model, [target.tokenizer.eos_token_id, 5], target.tokenizer.pad_token_id,
                      batch_size=bs, **kw).run(reqs, lambda c: out.__setitem__(c.key, c))
    return out


def test_batched_greedy_equals_one_at_a_time(tiny_target):
    reqs = _random_requests(tiny_target.vocab_size)
    single = _run(tiny_target, reqs, 1)
    # prefill groups: by length, one per length, one, and bounded to 40 tokens
    for bs, pad, budget in ((4, 0.15, 8192), (13, 0.15, 8192), (13, 0.0, 8192), (13, 100.0, 8192), (13, 100.0, 40)):
        batched = _run(tiny_target, reqs, bs, max_padding=pad, prefill_tokens=budget)
        assert {k: c.tokens for k, c in batched.items()} == {k: c.tokens for k, c in single.items()}
    # and equals transformers' own greedy generate, one prompt at a time
    ref = {}
    HFEngine(tiny_target.model, [tiny_target.tokenizer.eos_token_id, 5], tiny_target.tokenizer.pad_token_id,
             1).run(reqs, lambda c: ref.__setitem__(c.key, c))
    assert {k: c.tokens for k, c in ref.items()} == {k: c.tokens for k, c in single.items()}
    assert all(single[r.key].stopped or len(single[r.key].tokens) == r.max_new_tokens for r in reqs)


def test_prefill_groups_bound_padding():
    from draftsmith.data.engines.continuous import length_groups

    lengths = [36, 38, 41, 45, 50, 90, 95, 101, 1350, 40]
    reqs = [Request(i, [7] * n, 4) for i, n in enumerate(lengths)]
    groups = length_groups(reqs, 0.15)
    assert sorted(r.key for g in groups for r in g) == list(range(len(lengths)))  # every request once
    for g in groups:
        tokens = sum(len(r.prompt_ids) for r in g)
        assert len(g) * max(len(r.prompt_ids) for r in g) <= 1.15 * tokens
    assert [len(r.prompt_ids) for r in groups[-1]] == [1350]  # the long prompt does not pad the short ones
    assert len(length_groups(reqs, 100.0)) == 1
    bounded = length_groups(reqs, 100.0, max_tokens=200)  # at most 200 padded tokens, a longer prompt alone
    assert all(len(g) * max(len(r.prompt_ids) for r in g) <= 200 or len(g) == 1 for g in bounded)
    assert sum(len(g) for g in bounded) == len(lengths)


@pytest.mark.parametrize("src,dst,length", [(5, 0, 40), (0, 5, 40), (30, 0, 20), (0, 1, 30), (12, 3, 9)])
def test_cache_columns_move_like_a_copy(src, dst, length):
    from draftsmith.data.engines.continuous import _move_columns

    buf = torch.randn(3, 2, 64, 4)
    want = buf.clone()
    want[:2, :, dst : dst + length] = buf[:2, :, src : src + length].clone()
    _move_columns(buf, 2, src, dst, length)
    assert torch.equal(buf, want)


@pytest.mark.parametrize("additive", [False, True])
def test_decode_attention_groups_query_heads_like_repeated_kv(additive):
    from draftsmith.data.engines.continuous import _decode_gqa

    torch.manual_seed(0)
    B, H, KV, T, D = 5, 6, 2, 17, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    for b in range(B):
        keep[b, ..., : 3 * b] = False  # left padding of a different width per row
    mask = torch.zeros(B, 1, 1, T).masked_fill(~keep, float("-inf")) if additive else keep
    # reference: every query head against its own copy of its KV head (head h reads KV head h // (H/KV))
    rk, rv = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ rk.transpose(-1, -2)) * 0.3
    ref = (scores.masked_fill(~keep, float("-inf")).softmax(-1) @ rv).transpose(1, 2)
    got = _decode_gqa(q, k, v, mask, 0.3)
    assert got.shape == (B, 1, H, D)
    torch.testing.assert_close(got, ref)
    assert not torch.allclose(got, _decode_gqa(q, k, v, None, 0.3))  # the mask is applied


def test_decode_spans_skip_only_masked_columns(tiny_target, monkeypatch):
    from draftsmith.data.engines import continuous as engine

    torch.manual_seed(1)
    B, H, KV, T, D = 6, 4, 2, 20, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    starts = [0, 2, 5, 9, 9, 14]
    for b, s in enumerate(starts):
        keep[b, ..., :s] = False
    spans = [(0, 2, 0), (2, 3, 5), (3, 6, 9)]
    torch.testing.assert_close(engine._decode_spans(q, k, v, keep, 0.3, spans), engine._decode_gqa(q, k, v, keep, 0.3))

    # in the engine: refills make rows of different first columns share a step; the ranges skip columns,
    # and every position's state is the full forward's, the tokens those of a single SDPA call per step
    from draftsmith.capture.forward import capture_forward

    seen = []
    real = engine._decode_spans
    monkeypatch.setattr(engine, "_decode_spans", lambda *a: seen.append(a[-1]) or real(*a))
    reqs = _random_requests(tiny_target.vocab_size, n=17, seed=3)
    spec = CaptureSpec(layers=[-1], last_hidden=True, dtype=torch.float32)
    spans4, plain = _run(tiny_target, reqs, 6, capture=spec), _run(tiny_target, reqs, 6, decode_spans=0)
    assert {k: c.tokens for k, c in spans4.items()} == {k: c.tokens for k, c in plain.items()}
    assert any(len(s) > 1 and s[-1][2] > s[0][2] for s in seen)  # later ranges start further right
    for c in spans4.values():
        ref = capture_forward(tiny_target.model, torch.tensor([c.prompt_ids + c.tokens]), layers=[-1])
        torch.testing.assert_close(c.capture["last_hidden"], ref.last_hidden[0], atol=2e-4, rtol=1e-4)


def test_sampling_is_seeded_per_row(tiny_target):
    reqs = _random_requests(tiny_target.vocab_size, n=9)
    s = SamplingConfig(temperature=4.0, top_p=0.95)
    a, b = _run(tiny_target, reqs, 1, sampling=s), _run(tiny_target, reqs, 5, sampling=s)
    assert {k: c.tokens for k, c in a.items()} == {k: c.tokens for k, c in b.items()}
    greedy = _run(tiny_target, reqs, 5)
    assert {k: c.tokens for k, c in a.items()} != {k: c.tokens for k, c in greedy.items()}


def test_shared_prefix_is_prefilled_once_and_changes_nothing(tiny_target):
    reqs = _random_requests(tiny_target.vocab_size, prefix=12)
    single = _run(tiny_target, reqs, 1, shared_prefix=False)
    engine = ContinuousBatcher(tiny_target.model, [tiny_target.tokenizer.eos_token_id, 5],
                               tiny_target.tokenizer.pad_token_id, batch_size=5)
    out = {}
    stats = engine.run(reqs, lambda c: out.__setitem__(c.key, c))
    assert engine._prefix is not None and engine._prefix.length == 12
    assert stats["prompt_tokens"] == sum(len(r.prompt_ids) for r in reqs)  # the rows still hold every token
    assert {k: c.tokens for k, c in out.items()} == {k: c.tokens for k, c in single.items()}


@pytest.mark.parametrize("prefix", [0, 12])
def test_capture_matches_a_full_forward(tiny_target, prefix):
    from draftsmith.capture.forward import capture_forward

    reqs = _random_requests(tiny_target.vocab_size, n=6, prefix=prefix)
    got = _run(tiny_target, reqs, 3, capture=CaptureSpec(layers=[0, -1], topk=4, last_hidden=True,
                                                          dtype=torch.float32))
    for c in got.values():
        ids = torch.tensor([c.prompt_ids + c.tokens])
        ref = capture_forward(tiny_target.model, ids, layers=[0, -1])
        T = ids.shape[1]  # every position, the final token included (one extra step fed it)
        assert c.capture["layers"][0].shape == (T, tiny_target.hidden_size)
        torch.testing.assert_close(c.capture["layers"][-1], ref.layers[-1][0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(c.capture["last_hidden"], ref.last_hidden[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(c.capture["topk_values"], ref.logits[0].topk(4).values, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prefix", [0, 12])
def test_capture_skips_prompt_logits_no_row_wants(tiny_target, prefix):
    """With `logits_from`, top-k of earlier prompt positions are zeros and everything else is unchanged,
    also when the logits budget splits a prefill group row by row."""
    from draftsmith.capture.forward import capture_forward

    reqs = _random_requests(tiny_target.vocab_size, n=6, prefix=prefix)
    for i, r in enumerate(reqs):  # mostly the last prompt position; a multi-turn-like row wants more
        r.logits_from = len(r.prompt_ids) - 1 - (5 if i == 2 else 0)
    spec = CaptureSpec(layers=[0], topk=4, last_hidden=True, dtype=torch.float32)
    full = _run(tiny_target, copy.deepcopy(reqs), 3, capture=spec)
    for budget in (None, 1):
        engine = ContinuousBatcher(tiny_target.model, [tiny_target.tokenizer.eos_token_id, 5],
                                   tiny_target.tokenizer.pad_token_id, batch_size=3, capture=spec)
        if budget:
            engine.logit_tokens = budget  # rows x logit columns per prefill: one row per prefill
        got, skipped = {}, 0
        engine.run(reqs, lambda c, got=got: got.__setitem__(c.key, c))
        for r in reqs:
            c, ref = got[r.key], capture_forward(tiny_target.model, torch.tensor([r.prompt_ids + got[r.key].tokens]))
            assert c.tokens == full[r.key].tokens
            lf = max(r.logits_from, 0)
            vals = c.capture["topk_values"]
            assert vals.shape[0] == len(r.prompt_ids) + len(c.tokens)
            torch.testing.assert_close(vals[lf:], ref.logits[0, lf:].topk(4).values, atol=2e-4, rtol=1e-4)
            zero = (vals[:lf] == 0).all(-1) & (c.capture["topk_indices"][:lf] == 0).all(-1)
            if budget:  # alone in its prefill, a row gets no logits left of `logits_from` (the shared
                assert zero[: max(prefix - 1, 0)].all() and zero[prefix:].all()  # prefix's last one aside)
            else:  # a wider row in the same prefill may give it real ones
                skipped += int(zero.sum())
                torch.testing.assert_close(vals[:lf][~zero], ref.logits[0, :lf][~zero].topk(4).values,
                                           atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(c.capture["last_hidden"], full[r.key].capture["last_hidden"],
                                       atol=2e-4, rtol=1e-4)
        assert budget or skipped > 0


# ----------------------------------------------------------------------------------- end to end


def _gen_cfg(tmp_path, prompts: list[str], name="out", **kw) -> DataConfig:
    p = tmp_path / "prompts.jsonl"
    if not p.exists():
        p.write_text("".join(json.dumps({"q": q, "t": ["Hello there", "Say more"]}) + "\n" for q in prompts))
    kw.setdefault("generation", GenerationConfig(max_new_tokens=10, batch_size=3, flush_every=2))
    return DataConfig(sources=[SourceConfig(name="p", path=str(p), prompt="q", domain="general")],
                      output_dir=str(tmp_path / name), **kw)


PROMPTS = [f"Question number {i}: what is {i} plus {i * 3}?" for i in range(9)]


def _killed_after(n: int):
    """An `on_row` callback that kills the run (KeyboardInterrupt) when its n-th row is finished."""
    seen = []

    def crash(rec):
        seen.append(rec["row_id"])
        if len(seen) == n:
            raise KeyboardInterrupt("simulated kill")

    return crash


def test_generate_resume_after_crash_equals_uninterrupted(tmp_path, tiny_target):
    clean = load_distilled(generate_dataset(_gen_cfg(tmp_path, PROMPTS, "clean"), tiny_target, progress=False))

    cfg = _gen_cfg(tmp_path, PROMPTS, "crashy")
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(cfg, tiny_target, progress=False, on_row=_killed_after(5))
    assert not (Path(cfg.output_dir) / "dataset").exists()
    chunks = list((Path(cfg.output_dir) / "chunks").glob("chunk-*.jsonl"))
    assert chunks  # finished rows survived the crash
    again = []
    out = generate_dataset(cfg, tiny_target, progress=False, on_row=lambda r: again.append(r["row_id"]))
    resumed = load_distilled(out, tiny_target)
    assert len(again) < len(PROMPTS)  # the rerun skipped rows already generated
    assert len(set(resumed["row_id"])) == len(resumed) == len(PROMPTS)  # no duplicates, no gaps
    assert resumed["row_id"] == clean["row_id"]
    assert resumed["input_ids"] == clean["input_ids"] and resumed["response"] == clean["response"]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["timing"]["resumed_rows"] == len(PROMPTS) - len(again)


def test_dataset_rows_are_masked_and_decode_back(tmp_path, tiny_target):
    out = generate_dataset(_gen_cfg(tmp_path, PROMPTS[:4]), tiny_target, progress=False)
    ds = load_distilled(out)
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "domain", "row_id", "source", "prompt", "response"}
    tok = tiny_target.tokenizer
    for row in ds:
        spans = masked_spans(row["input_ids"], row["loss_mask"])
        assert len(spans) == 1
        text = tok.decode(row["input_ids"][spans[0][0]:spans[0][1]], skip_special_tokens=False)
        assert text == row["response"] + ("<|im_end|>" if row["stopped"] else "")
        assert tok.decode(row["input_ids"][: spans[0][0]]).endswith("<|im_start|>assistant\n")
    with pytest.raises(DataError, match="already holds"):
        generate_dataset(_gen_cfg(tmp_path, PROMPTS[:4]), tiny_target, progress=False)


def test_multi_turn_rows_mask_every_assistant_turn(tmp_path, tiny_target):
    p = tmp_path / "mt.jsonl"
    p.write_text(json.dumps({"turns": ["Hello there", "Say more"]}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(name="mt", path=str(p), turns="turns", domain="chat")],
                     output_dir=str(tmp_path / "mt"), generation=GenerationConfig(max_new_tokens=8, batch_size=2))
    row = load_distilled(generate_dataset(cfg, tiny_target, progress=False))[0]
    assert row["n_turns"] == 2
    assert len(masked_spans(row["input_ids"], row["loss_mask"])) == 2


def test_plain_continuation_dataset(tmp_path, tiny_target):
    cfg = _gen_cfg(tmp_path, PROMPTS[:3], chat=ChatConfig(mode="plain"))
    ds = load_distilled(generate_dataset(cfg, tiny_target, progress=False))
    assert all("<|im_start|>user" not in tiny_target.tokenizer.decode(ids) for ids in ds["input_ids"])
    assert all(sum(m) == len(m) - m.index(1) for m in ds["loss_mask"])  # the mask is the generated tail


def test_fingerprint_mismatch_on_load(tmp_path, tiny_target, other_target):
    out = generate_dataset(_gen_cfg(tmp_path, PROMPTS[:2]), tiny_target, progress=False)
    with pytest.raises(FingerprintMismatch, match="tokenizer_hash|vocab_size"):
        load_distilled(out, other_target)


def test_overlapping_prompts_are_dropped(tmp_path, tiny_target):
    ev = tmp_path / "heldout.jsonl"
    ev.write_text(json.dumps({"turns": [PROMPTS[1]]}) + "\n")
    cfg = _gen_cfg(tmp_path, PROMPTS[:4], eval_sets=[EvalSetConfig(path=str(ev), turns="turns")])
    out = generate_dataset(cfg, tiny_target, progress=False)
    ds = load_distilled(out)
    assert PROMPTS[1] not in ds["prompt"] and len(ds) == 3
    assert json.loads((out / "provenance.json").read_text())["counts"]["overlap"]["overlapping"] == 1
    cfg2 = _gen_cfg(tmp_path, PROMPTS[:4], name="o2", overlap="fail",
                    eval_sets=[EvalSetConfig(path=str(ev), turns="turns")])
    with pytest.raises(DataError, match="overlap the eval sets"):
        generate_dataset(cfg2, tiny_target, progress=False)


def test_capture_during_generation_writes_shards(tmp_path, tiny_target):
    from draftsmith.capture.cache import ShardReader

    cfg = _gen_cfg(tmp_path, PROMPTS[:5], capture=CaptureConfig(enabled=True, layers=[-1], topk=3))
    out = generate_dataset(cfg, tiny_target, progress=False)
    ds = load_distilled(out)
    reader = ShardReader(out / "capture")
    for row in ds:
        got = reader.get(row["row_id"])
        assert got["layer.-1"].shape[0] == len(row["input_ids"])
        assert got["topk_indices"].shape == (len(row["input_ids"]), 3)
        # from the position that predicts the first learned token on: the full logits' logsumexp
        first = row["loss_mask"].index(1) - 1
        with torch.no_grad():
            full = tiny_target.model(torch.tensor([row["input_ids"]])).logits[0, first:].float()
        torch.testing.assert_close(got["topk_logsumexp"][first:], torch.logsumexp(full, -1), rtol=1e-3, atol=1e-3)


def test_a_set_grows_keeping_every_row_and_its_capture(tmp_path, tiny_target):
    """A preset that adds a source and raises a limit, run with grow on the finished set: every earlier row is kept
    as it was (ids, text, captured states byte for byte), only the new prompts are generated, and provenance counts
    rows and learned tokens per domain and source; without grow a finished set is refused."""
    from draftsmith.capture.cache import ShardReader

    capture = CaptureConfig(enabled=True, layers=[-1], topk=2, last_hidden=True)
    first = _gen_cfg(tmp_path, PROMPTS, "grow", capture=capture)
    first.sources[0].limit = 4  # a seeded sample of 4; growing raises the limit, which samples other rows too
    out = generate_dataset(first, tiny_target, progress=False)
    before = load_distilled(out).to_list()
    reader = ShardReader(out / "capture")
    states = {r["row_id"]: reader.get(r["row_id"])["layer.-1"].clone() for r in before}
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"turns": [f"Translate {w} into French.", "And back?"]})
                                                 + "\n" for w in ("cat", "dog", "tree")))
    grown = _gen_cfg(tmp_path, PROMPTS, "grow", capture=capture)
    grown.sources += [SourceConfig(name="more", path=str(tmp_path / "more.jsonl"), turns="turns", domain="multiturn")]
    with pytest.raises(DataError, match="already holds a finished dataset .*grow"):
        generate_dataset(grown, tiny_target, progress=False)
    written = []
    generate_dataset(grown, tiny_target, progress=False, grow=True, on_row=lambda r: written.append(r["row_id"]))
    after = load_distilled(out, tiny_target).to_list()
    assert after[: len(before)] == before  # every earlier row, first and unchanged
    new = after[len(before):]
    assert sorted(written) == sorted(r["row_id"] for r in new)  # only the new prompts were generated
    assert len(new) == len(PROMPTS) - 4 + 3 and {r["domain"] for r in new} == {"general", "multiturn"}
    reader = ShardReader(out / "capture")
    for r in before:
        assert torch.equal(reader.get(r["row_id"])["layer.-1"], states[r["row_id"]])
    for r in new:
        assert reader.get(r["row_id"])["layer.-1"].shape[0] == len(r["input_ids"])
    counts = json.loads((out / "provenance.json").read_text())["counts"]
    assert counts["rows"] == len(after) and counts["per_source"] == {"more": 3, "p": len(PROMPTS)}
    assert counts["grown"]["kept_rows"] == len(before) and counts["grown"]["new_rows"] == len(new)
    assert (sum(counts["loss_tokens_per_domain"].values()) == counts["loss_tokens"] ==
        sum(counts["loss_tokens_per_source"].values()) == sum(sum(r["loss_mask"]) for r in after))


def test_grow_from_copies_the_base_set_and_leaves_it_as_it_was(tmp_path, tiny_target):
    """`grow_from`: the base set is copied into a new output_dir and the copy grows; the base set's files stay byte
    for byte (heads and benchmarks name it), a rerun resumes in the copy, and an existing folder that holds no
    dataset is refused."""
    capture = CaptureConfig(enabled=True, layers=[-1], topk=2, last_hidden=True)
    base_cfg = _gen_cfg(tmp_path, PROMPTS, "base", capture=capture)
    base_cfg.sources[0].limit = 4
    base = generate_dataset(base_cfg, tiny_target, progress=False)
    files = {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    grown = _gen_cfg(tmp_path, PROMPTS, "broad", capture=capture)
    out = generate_dataset(grown, tiny_target, progress=False, grow_from=base)
    assert {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()} == files
    before, after = load_distilled(base).to_list(), load_distilled(out, tiny_target).to_list()
    assert after[: len(before)] == before and len(after) == len(PROMPTS)
    written = []
    generate_dataset(grown, tiny_target, progress=False, grow_from=base, on_row=lambda r: written.append(r))
    assert written == [] and load_distilled(out, tiny_target).to_list() == after  # the rerun resumes in the copy
    (tmp_path / "stray").mkdir()
    stray = _gen_cfg(tmp_path, PROMPTS, "stray", capture=capture)
    with pytest.raises(DataError, match="stray: grow_from copies into a new output_dir"):
        generate_dataset(stray, tiny_target, progress=False, grow_from=base)


# ----------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", ["configs/smollm2-135m/data.yaml", "configs/smollm2-135m/data-broad.yaml",
                                    "configs/gemma3-270m/data.yaml"])
def test_presets_load(preset):
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / preset)
    assert isinstance(cfg, DataConfig) and cfg.eval_sets


def test_preset_data_paths_follow_draftsmith_data(tmp_path, monkeypatch):
    """`prompts/...` in a preset means the shipped sets, or $DRAFTSMITH_DATA, whatever the working directory."""
    data = tmp_path / "elsewhere" / "prompts"
    (data / "train").mkdir(parents=True)
    (data / "eval").mkdir()
    (data / "train" / "q.jsonl").write_text('{"q": "What is the capital of France?"}\n{"q": "Name a prime."}\n')
    (data / "eval" / "e.jsonl").write_text('{"q": "What is the capital of France?"}\n')
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)  # no prompts/ folder here
    monkeypatch.delenv("DRAFTSMITH_DATA", raising=False)
    shipped = data_path("prompts/train/gsm8k_train.jsonl.gz")
    assert shipped.is_file() and shipped.parent.parent.parent.name != "shared"  # inside the package itself
    monkeypatch.setenv("DRAFTSMITH_DATA", str(data))
    assert data_path("prompts/train/q.jsonl") == data / "train" / "q.jsonl"
    assert data_path("prompts_old/q.jsonl") == Path("prompts_old/q.jsonl")  # only the whole first part
    assert data_path("rel/q.jsonl") == Path("rel/q.jsonl")
    src = SourceConfig(name="q", path="prompts/train/q.jsonl", prompt="q", domain="general")
    cfg = _cfg(tmp_path, [src], eval_sets=[EvalSetConfig(path="prompts/eval/e.jsonl", prompt="q")])
    assert len(load_prompts(cfg).rows) == 2
    assert len(load_eval_texts(cfg.eval_sets, 8)) == 1
    # the train/eval guard resolves the same way: a source inside the mapped eval folder is refused
    with pytest.raises(ValueError, match="held-out"):
        _cfg(tmp_path, [SourceConfig(name="e", path="prompts/eval/e.jsonl", prompt="q", domain="d")],
             eval_dirs=["prompts/eval"])


def test_bad_config_values_fail_at_load(tmp_path):
    with pytest.raises(ConfigError, match="top_p"):
        load_config(None, ["sources=[{name: a, path: x, prompt: q, domain: d}]", "output_dir=o",
                           "generation.top_p=1.5"], cls=DataConfig)
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(None, ["sources=[{name: a, path: x, domain: d}]", "output_dir=o"], cls=DataConfig)


def test_subset_by_domain(tmp_path, tiny_target):
    from draftsmith.data.commands import subset_dataset

    cfg = _gen_cfg(tmp_path, PROMPTS[:4])
    cfg.sources[0].domain_rules = [DomainRule("q", "number [02]", "even")]
    out = generate_dataset(cfg, tiny_target, progress=False)
    sub = subset_dataset(out, tmp_path / "even", domains=["even"])
    ds = load_distilled(sub, tiny_target)  # still the target's dataset: fingerprint checked
    assert sorted(ds["domain"]) == ["even", "even"]
    prov = json.loads((sub / "provenance.json").read_text())
    assert prov["subset"] == {"parent": str(out), "domains": ["even"], "rows": 2, "parent_rows": 4}
    rest = load_distilled(subset_dataset(out, tmp_path / "rest", exclude=["even"]))
    assert set(rest["domain"]) == {"general"} and len(rest) == 2
    with pytest.raises(DataError, match="no rows of domain"):
        subset_dataset(out, tmp_path / "x", domains=["code"])
    # a stable fraction: the rows whose id falls in the first half of the id space, the same on every run
    full = load_distilled(out)
    half = subset_dataset(out, tmp_path / "half", fraction=0.5)
    kept = sorted(load_distilled(half)["row_id"])
    assert kept == sorted(r for r in full["row_id"] if r % 1000 < 500)
    assert json.loads((half / "provenance.json").read_text())["subset"]["rule"] == "row_id % 1000 < 500"


def test_the_kv_store_is_freed_when_the_run_returns(tiny_target):
    import gc
    import weakref

    from draftsmith.data.engines import continuous as engine

    stores = []
    real = engine._SlotStore

    def tracked(*args):
        store = real(*args)
        stores.append(weakref.ref(store))
        return store

    engine._SlotStore = tracked
    gc.disable()  # freed by reference counting alone, not by a later collection of a cycle
    try:
        _run(tiny_target, _random_requests(tiny_target.vocab_size, n=5), 3)
        assert len(stores) == 1 and stores[0]() is None
    finally:
        gc.enable()
        engine._SlotStore = real


# ----------------------------------------------------------------------------------- magpie

def _magpie(name="self", limit=24, **kw) -> SourceConfig:
    # the tiny random target ends a turn by chance; a high temperature makes that happen within 48 tokens
    kw = {"temperature": 10.0, "max_request_tokens": 48, "min_request_chars": 1, **kw}
    return SourceConfig(name=name, type="magpie", limit=limit, domain="general", **kw)


def _magpie_cfg(out, *sources, **kw) -> DataConfig:
    kw.setdefault("generation", GenerationConfig(max_new_tokens=8, batch_size=8, flush_every=4))
    return DataConfig(sources=list(sources), output_dir=str(out), **kw)


def test_magpie_prefix_is_the_template_up_to_the_user_text(tiny_tokenizer):
    from draftsmith.data.magpie import user_turn_prefix

    for system in (None, "Be brief."):
        prefix, stop = user_turn_prefix(tiny_tokenizer, system)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "XYZ"}]
        full = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tiny_tokenizer.decode(prefix, skip_special_tokens=False) == full.split("XYZ")[0]
        assert stop == [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        user_turn_prefix(plain, None)


def test_magpie_requests_resume_and_extend_deterministically(tmp_path, tiny_target):
    from draftsmith.data.magpie import write_requests

    src = _magpie()
    cfg = _magpie_cfg(tmp_path / "a", src)
    path, full = write_requests(src, cfg, tiny_target, 24)
    lines = path.read_text().splitlines()
    assert len(lines) == 25 and {r["index"] for r in full} == set(range(24))
    kept = [r for r in full if r["stopped"] and not r["special_inside"]]
    assert 0 < len(kept) < 24  # both branches of the filter are exercised
    # a killed run: only 10 requests reached the file; the rerun writes the rest, identical to the first run
    path.write_text("\n".join(lines[:11]) + "\n")
    _, again = write_requests(src, cfg, tiny_target, 24)
    assert again == full
    # request i depends on i alone: a smaller run elsewhere gives the first requests of the larger one
    _, first = write_requests(src, _magpie_cfg(tmp_path / "b", src), tiny_target, 9)
    assert first == full[:9]
    # other sampling settings do not silently mix with the file's requests
    hotter = _magpie(temperature=20.0)
    with pytest.raises(DataError, match="other settings"):
        write_requests(hotter, _magpie_cfg(tmp_path / "a", hotter), tiny_target, 24)
    # nor do requests a bf16 copy of the target wrote: the key names a precision other than float32 (and only then,
    # so files written before precision could change still resume)
    from draftsmith.data.magpie import _key

    header = json.loads(lines[0])["key"]
    assert "dtype" not in header and header == _key(src, None, tiny_target.fingerprint(), {}, "float32")
    assert _key(src, None, tiny_target.fingerprint(), {}, "bfloat16") == {"dtype": "bfloat16", **header}

    ps = load_prompts(cfg, target=tiny_target)
    assert [r.prompt for r in ps.rows] == [r["text"] for r in kept]
    assert sum(ps.rejected["self"].values()) == 24 - len(kept)
    assert all(r.domain == "general" and r.origin.startswith(str(path)) for r in ps.rows)
    # max_rows caps how many requests are written: no more could be kept
    capped = _magpie_cfg(tmp_path / "c", src, max_rows=5)
    load_prompts(capped, target=tiny_target)
    assert len((tmp_path / "c" / "requests" / "self.jsonl").read_text().splitlines()) == 1 + 5


def test_magpie_rows_are_answered_like_any_other(tmp_path, tiny_target):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"q": q}) + "\n" for q in PROMPTS[:3]))
    cfg = _magpie_cfg(tmp_path / "d", _magpie(), SourceConfig(name="p", path=str(jsonl), prompt="q", domain="math"))
    out = generate_dataset(cfg, tiny_target, progress=False)
    ds = load_distilled(out, tiny_target)
    requests = [json.loads(line) for line in (out / "requests" / "self.jsonl").read_text().splitlines()[1:]]
    kept = {r["text"] for r in requests if r["stopped"] and not r["special_inside"]}
    mine = [row for row in ds if row["source"] == "self"]
    assert {row["prompt"] for row in mine} == kept and len(ds) == len(kept) + 3
    tok = tiny_target.tokenizer
    for row in mine:  # the request sits in a user turn; only the answer is learned
        start = row["loss_mask"].index(1)
        assert row["prompt"] in tok.decode(row["input_ids"][:start], skip_special_tokens=False)
    prov = json.loads((out / "provenance.json").read_text())
    assert sum(prov["counts"]["magpie_rejected"]["self"].values()) == 24 - len(kept)


def test_magpie_writes_only_its_share_of_a_max_rows_sample(tmp_path, tiny_target):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"q": f"question number {i}"}) + "\n" for i in range(72)))
    cfg = _magpie_cfg(tmp_path / "g", _magpie(limit=24),
                      SourceConfig(name="p", path=str(jsonl), prompt="q", domain="math"), max_rows=12)
    ps = load_prompts(cfg, target=tiny_target)
    # 12 of 72 + 24 candidates: the magpie source's share is 24 * 12 / 96 = 3 requests, not 12 or 24
    lines = (tmp_path / "g" / "requests" / "self.jsonl").read_text().splitlines()[1:]
    requests = [json.loads(line) for line in lines]
    assert len(requests) == 3
    kept = [r for r in requests if r["stopped"] and not r["special_inside"]]
    mine = [r for r in ps.rows if r.source == "self"]
    # every kept request is in the sample; the file rows fill the rest
    assert len(ps.rows) == 12 and [r.prompt for r in mine] == [r["text"] for r in kept]
    assert list(ps.per_source) == ["self", "p"]  # config order


def test_magpie_needs_a_target_a_limit_and_chat_formatting(tmp_path, tiny_target):
    with pytest.raises(ValueError, match="needs limit"):
        SourceConfig(name="m", type="magpie", domain="general")
    with pytest.raises(ValueError, match="temperature"):
        SourceConfig(name="m", type="magpie", domain="general", limit=3, temperature=0.0)
    with pytest.raises(DataError, match="needs the target"):
        load_prompts(_magpie_cfg(tmp_path / "e", _magpie()))
    with pytest.raises(DataError, match="chat formatting"):
        load_prompts(_magpie_cfg(tmp_path / "f", _magpie(), chat=ChatConfig(mode="plain")), target=tiny_target)


def test_a_hub_source_reads_its_dataset_offline_from_the_local_cache(tmp_path, monkeypatch):
    """`type: hub` with id, config, split and revision: on a machine without the network, the rows come from the
    datasets cache a download left; a dataset the cache lacks is one line naming it."""
    import datasets

    cache = tmp_path / "hf-datasets"
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for i, (q, a) in enumerate([("What is 2+2?", "4."), ("Name a colour.", "Red."), ("Say hi.", "Hi!")])]
    cache_hub_dataset(cache, "someorg/chat", rows)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    src = SourceConfig(name="chat", type="hub", id="someorg/chat", split="train", revision="main",
                       messages="messages", id_field="id", domain="chat")
    got = load_prompts(_cfg(tmp_path, [src], responses="keep")).rows
    assert [r.turns for r in got] == [["What is 2+2?"], ["Name a colour."], ["Say hi."]]
    assert [r.responses for r in got] == [["4."], ["Red."], ["Hi!"]] and got[0].origin == "someorg/chat[0]"
    missing = SourceConfig(name="gone", type="hub", id="someorg/absent", messages="messages", domain="chat")
    with pytest.raises(DataError, match=r"source 'gone': cannot load hub dataset someorg/absent, split train: "):
        load_prompts(_cfg(tmp_path, [missing]))
    with pytest.raises(ValueError, match="type hub needs an id"):
        SourceConfig(name="x", type="hub", messages="messages", domain="chat")
    with pytest.raises(ValueError, match="go with type hub"):
        SourceConfig(name="x", type="jsonl", path="a.jsonl", prompt="q", revision="main", domain="d")


def test_a_pack_carries_an_interrupted_set_to_a_new_folder_that_finishes_it(tmp_path, tiny_target):
    """`data pack` keeps what generation wrote (rows of an interrupted run, magpie requests, the generation key)
    in one xz file with a sha256 manifest; `generate --resume-from` in a new folder generates only what the pack
    does not answer and ends with the set an uninterrupted run writes. A damaged pack and a pack generated under
    another key are refused in one line."""
    from draftsmith.data.generate import pack_rows, unpack_rows
    from draftsmith.data.pack import manifest_path, read_pack

    jsonl = tmp_path / "p.jsonl"
    # a prompt holding characters str.splitlines() breaks at (a shipped GSM8K question holds U+2028), written raw
    # into the chunks and the pack by ensure_ascii=False
    odd = ["Two lines\u2028in one question\x85and a third: what is 2 + 2?"]
    jsonl.write_text("".join(json.dumps({"q": q}, ensure_ascii=False) + "\n" for q in odd + PROMPTS))

    def cfg(name, **kw):
        return _magpie_cfg(tmp_path / name, _magpie(limit=12),
                           SourceConfig(name="p", path=str(jsonl), prompt="q", domain="math"), **kw)

    clean = load_distilled(generate_dataset(cfg("clean"), tiny_target, progress=False)).to_list()
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(cfg("first"), tiny_target, progress=False, on_row=_killed_after(6))
    from draftsmith.cli import main

    pack = tmp_path / "keep" / "rows.jsonl.xz"
    assert main(["data", "pack", str(tmp_path / "first"), "--out", str(pack)]) == 0
    man = json.loads(manifest_path(pack).read_text())
    assert manifest_path(pack) == tmp_path / "keep" / "rows.json"
    assert pack_rows(tmp_path / "first", tmp_path / "again.jsonl.xz")["sha256"] == man["sha256"]  # reproducible
    assert man["rows"] >= 4 and man["requests"] == {"self": 12}  # flushed rows (every 4) and every request
    assert sum(man["rows_per_domain"].values()) == man["rows"] - man["skipped_rows"]

    written = []
    out = generate_dataset(cfg("second"), tiny_target, progress=False, resume_from=pack,
                           on_row=lambda r: written.append(r["row_id"]))
    again = load_distilled(out, tiny_target).to_list()
    assert len(written) == len(clean) - man["rows"]  # only the prompts the pack does not answer
    strip = [{k: v for k, v in r.items() if k != "origin"} for r in again]  # magpie origins name their folder
    assert strip == [{k: v for k, v in r.items() if k != "origin"} for r in clean]
    assert odd[0] in {r["prompt"] for r in again}
    whole = pack_rows(out, tmp_path / "whole.jsonl.xz")  # the finished set packs whole, the odd row read back
    assert whole["rows"] == len(clean) and odd[0] in {r["prompt"] for r in read_pack(tmp_path / "whole.jsonl.xz")[1]}
    assert unpack_rows(pack, out)["rows_added"] == 0  # unpacking again adds nothing

    damaged = tmp_path / "damaged" / "rows.jsonl.xz"
    damaged.parent.mkdir()
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    manifest_path(damaged).write_text(manifest_path(pack).read_text())
    with pytest.raises(DataError, match=r"rows.jsonl.xz: its sha256 does not match .*rows.json"):
        unpack_rows(damaged, tmp_path / "third")
    manifest_path(damaged).unlink()  # without its manifest, xz's own check still catches it
    with pytest.raises(DataError, match="not a readable xz pack"):
        unpack_rows(damaged, tmp_path / "third")
    longer = cfg("fourth", generation=GenerationConfig(max_new_tokens=9, batch_size=8, flush_every=4), max_rows=3)
    generate_dataset(longer, tiny_target, progress=False)
    with pytest.raises(DataError, match="rows.jsonl.xz: its rows were generated with another sampling .*fourth"):
        unpack_rows(pack, tmp_path / "fourth")
