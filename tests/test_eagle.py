"""EAGLE heads: draft vocabulary, TTT masks, TTT forward vs a step-by-step reference, architectures,
training through the one loop (online and offline features), artifact round trip, lossless proposing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import distilled_rows, make_target  # noqa: E402

from draftsmith.eagle.job import EagleJob, EagleJobConfig
from draftsmith.eagle.model import (
    DraftKV,
    EagleHead,
    eagle3_loss,
    load_eagle,
    shift_left,
    ttt_mask,
)
from draftsmith.errors import ConfigError
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.heads.vocab import build_draft_vocab, check_draft_vocab, token_counts, vocab_coverage
from draftsmith.training import TrainConfig, train


# --- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    """A 4-layer tiny Llama target (so the three EAGLE-3 layers are distinct)."""
    return make_target(tiny_tokenizer, seed=3, layers=4, folder=tmp_path_factory.mktemp("target4"))


def vocab_for(target, n: int = 96):
    counts = torch.arange(target.vocab_size).flip(0)  # any deterministic counts
    return build_draft_vocab(counts, n)


def job_config(tmp: Path, version: str, steps: int = 30, **kw) -> EagleJobConfig:
    kw.setdefault("target_layers", [0, 1, 2] if version == "eagle3" else None)
    return EagleJobConfig(
        target="tiny", data="in-memory", output=str(tmp / f"{version}-artifact"), version=version,
        ttt_steps=3, draft_vocab_size=128,
        train=TrainConfig(lr=3e-3, max_steps=steps, batch_size=8, warmup_steps=2,
                          output_dir=str(tmp / f"{version}-run"), resume="never", progress=False, log_every=5,
                          eval_every=0),
        evaluate=EvalAfterTraining(enabled=False), **kw)


def test_uncapturable_layer_refused_when_training_is_configured(target4, tmp_path):
    """The last layer's output enters no decoder layer, so vLLM and SGLang never capture it: an exportable
    EAGLE-3 job that would read it is refused before its first step (not at export), naming the field; a head
    meant only for draftsmith's decoder may still read it. The default layers are the ecosystem's."""
    rows = distilled_rows(target4, n=8)
    for layers in ([0, 1, 3], [0, 1, -1]):
        with pytest.raises(ConfigError, match=r"target_layers: layer\(s\) \[3\] .*captured by no serving stack"):
            EagleJob(job_config(tmp_path, "eagle3", target_layers=layers), target4, rows)
    assert EagleJob(job_config(tmp_path, "eagle3", target_layers=[0, 1, 3], exportable=False), target4,
                    rows).layers == [0, 1, 3]
    assert EagleJob(job_config(tmp_path, "eagle3", target_layers=None), target4, rows).layers == [0, 1, 2]


# --- draft vocabulary ------------------------------------------------------------------------------------------
def test_draft_vocab_invariants():
    counts = torch.tensor([0, 5, 3, 9, 3, 0, 7, 1])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (8,)
    # top-4 by count: 3 (9), 6 (7), 1 (5), then the tie 2/4 (3) goes to the lower id 2; sorted by id
    assert torch.nonzero(t2d).flatten().tolist() == [1, 2, 3, 6]
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(4) + d2t)
    check_draft_vocab(d2t, t2d)
    assert vocab_coverage(counts, t2d) == pytest.approx((5 + 3 + 9 + 7) / 28)
    with pytest.raises(ConfigError):
        check_draft_vocab(d2t.flip(0), t2d)
    with pytest.raises(ConfigError):
        build_draft_vocab(counts, 9)


def test_token_counts_only_target_written():
    rows = [{"input_ids": [5, 6, 7, 7], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [5, 8], "loss_mask": [1, 0]}]
    counts = token_counts(rows, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 0, 2, 0, 0]


# --- TTT masks and the unrolled forward ------------------------------------------------------------------------
def test_ttt_mask_shape_and_pattern():
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)


def reference_unroll(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Slow reference: for every base t, recompute from scratch what inference does when the committed context
    ends at t — step-0 entries of positions 0..t in a fresh cache, then a chain of steps, each entry attending
    the committed entries and its own chain. Returns per step [B, T, H]."""
    B, T = ids.shape
    out = [torch.zeros(B, T, head.config.hidden_size) for _ in range(steps)]
    g = head.fuse(feats)
    for b in range(B):
        for t in range(T):
            kv = DraftKV()
            pos = torch.arange(t + 1)[None]
            tok0 = shift_left(ids[b:b + 1], 1)[0, : t + 1]
            a = head.layer_step(g[b:b + 1, : t + 1], head.embed(tok0)[None], pos, kv,
                                torch.ones(t + 1, t + 1, dtype=torch.bool).tril())[0, -1]
            out[0][b, t] = a
            for j in range(1, steps):
                if head.config.ttt_tokens == "target":
                    tok = ids[b, t + 1 + j] if t + 1 + j < T else torch.tensor(0)
                else:
                    tok = head.to_target_ids(head.logits(a).argmax())
                a = head.layer_step(head.next_feature(a)[None, None], head.embed(tok.view(1))[None],
                                    torch.tensor([[t + j]]), kv,
                                    torch.ones(1, len(kv) + 1, dtype=torch.bool))[0, 0]
                out[j][b, t] = a
    return out


def gemma3_target(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from draftsmith.targets import Target, freeze

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           sliding_window=8, query_pre_attn_scalar=16)
    return Target("tiny-gemma3", freeze(Gemma3ForCausalLM(cfg).eval()), tokenizer, "tiny-gemma3")


@pytest.mark.parametrize("arch,version,ttt_tokens", [
    ("llama", "eagle3", "target"), ("llama", "eagle3", "draft"), ("llama", "eagle1", "target"),
    ("gemma3", "eagle3", "target"), ("gemma3+llama-layer", "eagle3", "target"),
])
def test_ttt_forward_equals_step_by_step_reference(target4, tiny_tokenizer, arch, version, ttt_tokens):
    target = target4 if arch == "llama" else gemma3_target(tiny_tokenizer)
    torch.manual_seed(1)
    head = EagleHead.from_target(target.model, version, [0, 1, 2] if version == "eagle3" else None,
                                 draft_vocab=vocab_for(target), ttt_steps=4, ttt_tokens=ttt_tokens,
                                 draft_layer="llama" if arch.endswith("llama-layer") else "target").eval()
    want = "LlamaDecoderLayer" if arch.startswith("llama") or arch.endswith("llama-layer") else "Gemma3DecoderLayer"
    assert type(head.layer).__name__ == want
    ids = torch.randint(3, target.vocab_size, (2, 7))
    F = 3 * 64 if version == "eagle3" else 64
    feats = torch.randn(2, 7, F)
    with torch.no_grad():
        fast = head(ids, feats).hidden
        slow = reference_unroll(head, ids, feats, 4)
    for j in range(4):
        torch.testing.assert_close(fast[j], slow[j], atol=2e-5, rtol=1e-4, msg=f"step {j}")


def test_ttt_mask_from_a_start_base_is_the_full_mask_cut():
    full = ttt_mask(6, 2)
    cut = ttt_mask(6, 2, start=4)
    # rows of bases 4, 5; K^0 over all 6 bases, K^1 and K^2 over bases 4, 5 only
    assert cut.shape == (2, 6 + 2 * 2)
    assert torch.equal(cut[:, :6], full[4:, :6])
    assert torch.equal(cut[:, 6:8], full[4:, 6 + 4:12]) and torch.equal(cut[:, 8:], full[4:, 12 + 4:])
    with pytest.raises(ValueError):
        ttt_mask(6, 1, start=6)


@pytest.mark.parametrize("version,ttt_tokens", [("eagle3", "target"), ("eagle3", "draft"), ("eagle1", "target")])
def test_ttt_skipping_unselected_bases_changes_no_logit_or_gradient(target4, version, ttt_tokens):
    """With `select`, steps >= 1 skip the bases left of every selected one: the selected logits, the kept
    outputs and the gradients must equal those of the forward over every base."""
    torch.manual_seed(3)
    head = EagleHead.from_target(target4.model, version, [0, 1, 2] if version == "eagle3" else None,
                                 draft_vocab=vocab_for(target4), ttt_steps=3, ttt_tokens=ttt_tokens)
    B, T, S = 2, 12, 3
    ids = torch.randint(3, target4.vocab_size, (B, T))
    feats = torch.randn(B, T, 3 * 64 if version == "eagle3" else 64)
    lmask = torch.zeros(B, T, dtype=torch.long)
    lmask[0, 7:] = 1  # learned tokens from 7 on (row 0) and 8 on (row 1): steps >= 1 need bases >= 7 - 2 - 2
    lmask[1, 8:] = 1
    select = [shift_left(lmask, 2 + j).bool() for j in range(S)]

    def run(skip: bool):
        head.zero_grad()
        out = head(ids, feats, steps=S, select=select, skip=skip)
        logits = out.logits
        sum((lg.float() ** 2).mean() * (j + 1) for j, lg in enumerate(logits)).backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        return out, [lg.detach() for lg in logits], grads

    full, full_logits, full_grads = run(False)
    cut, cut_logits, cut_grads = run(True)
    assert full.start == 0 and cut.start == 3
    for j in range(S):
        torch.testing.assert_close(cut_logits[j], full_logits[j], atol=1e-5, rtol=1e-4)
        c = cut.start if j else 0
        torch.testing.assert_close(cut.hidden[j][:, c:], full.hidden[j][:, c:], atol=1e-5, rtol=1e-4)
        assert torch.equal(cut.tokens[j][:, c:], full.tokens[j][:, c:])
    assert set(cut_grads) == set(full_grads)
    for n in full_grads:
        torch.testing.assert_close(cut_grads[n], full_grads[n], atol=1e-5, rtol=1e-3, msg=n)


def test_ttt_step_sees_only_its_context_and_chain(target4):
    """Changing the input at base t' changes no output at bases t < t' (any step) but every step at t'; a
    token changes step j at base t only if t's own context or chain reads it."""
    torch.manual_seed(2)
    head = EagleHead.from_target(target4.model, "eagle3", [0, 1, 2], draft_vocab=vocab_for(target4), ttt_steps=3)
    ids = torch.randint(3, target4.vocab_size, (1, 8))
    feats = torch.randn(1, 8, 192)
    with torch.no_grad():
        base = head(ids, feats).hidden
        feats2 = feats.clone()
        feats2[0, 5] += 1.0
        moved = head(ids, feats2).hidden
    for j in range(3):
        torch.testing.assert_close(moved[j][0, :5], base[j][0, :5])
        assert not torch.allclose(moved[j][0, 5], base[j][0, 5])
    # x_5 is read by step 0 at base 4 (then by every later base through the step-0 keys), by step 1 at base 3
    # and by step 2 at base 2: step 2 at bases 0 and 1 must not move, at base 2 it must
    ids2 = ids.clone()
    ids2[0, 5] = (ids[0, 5] + 1) % target4.vocab_size
    with torch.no_grad():
        moved = head(ids2, feats).hidden
    torch.testing.assert_close(moved[2][0, :2], base[2][0, :2])
    torch.testing.assert_close(moved[1][0, :3], base[1][0, :3])
    assert not torch.allclose(moved[2][0, 2], base[2][0, 2])
    assert not torch.allclose(moved[1][0, 3], base[1][0, 3])


def test_eagle3_loss_soft_targets_and_accuracy():
    d2t = torch.tensor([1, 1, 2])  # draft ids 0,1,2 -> target ids 1,2,4
    logits = [torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 5.0]], requires_grad=True)]
    teacher = [logits[0].detach().clone()]
    loss, m = eagle3_loss(logits, teacher, [torch.tensor([1, 3])], d2t, [1.0])
    assert m["step0/acc"] == 0.5  # row 0: target 1 == 0 + d2t[0]; row 1: target 3 is outside the draft vocab
    p = torch.softmax(teacher[0], -1)
    assert float(loss.detach()) == pytest.approx(float(-(p * torch.log_softmax(teacher[0], -1)).sum(-1).mean()),
                                                 rel=1e-5)
    loss.backward()
    assert logits[0].grad.abs().max() < 1e-6  # the minimum of the soft CE is the teacher itself


def test_llama_draft_layer_for_gemma_has_the_targets_shapes(tiny_tokenizer):
    from draftsmith.eagle.model import layer_config_dict

    target = gemma3_target(tiny_tokenizer)
    d = layer_config_dict(target.model.config, "llama")
    assert d["model_type"] == "llama" and d["hidden_act"] == "silu"
    assert (d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (64, 4, 2, 16)
    assert layer_config_dict(target.model.config, "target")["model_type"] == "gemma3_text"
    assert layer_config_dict(target.model.config) == d  # the Llama layer is the default
    with pytest.raises(ConfigError, match="draft_layer"):
        layer_config_dict(target.model.config, "mamba")


def test_unsupported_architecture_is_a_clear_error(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer)))
    with pytest.raises(ConfigError, match="target family 'gpt2' is not in draftsmith's table"):
        EagleHead.from_target(gpt2, "eagle1")


# --- training through the one loop ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(target4, tmp_path_factory):
    """A short EAGLE-3 run on the tiny target's own greedy outputs: (job, result, rows)."""
    tmp = tmp_path_factory.mktemp("eagle3-train")
    rows = distilled_rows(target4)
    cfg = job_config(tmp, "eagle3", steps=30)
    job = EagleJob(cfg, target4, rows)
    return job, train(job, cfg.train), rows


def test_training_lowers_the_loss_and_logs_step_accuracy(trained):
    _, result, _ = trained
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < 0.5 * logs[0]["loss"]
    for j in range(3):
        assert f"step{j}/acc" in logs[-1]
    assert logs[-1]["step0/acc"] > logs[0]["step0/acc"]


def test_artifact_round_trip(trained, target4):
    job, result, _ = trained
    path = Path(result.artifact)
    assert path == Path(job.cfg.output)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.nonzero(weights["t2d"]).flatten(), torch.arange(128) + weights["d2t"])
    assert not any("embed" in k for k in weights)  # the target's embedding is shared, not saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["version"] == 3 and cfg["target_layers"] == [0, 1, 2] and cfg["ttt_steps"] == 3
    assert cfg["draft_vocab_size"] == 128 and cfg["embeddings"] == "target" and "norm_before_residual" in cfg
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "eagle" and manifest["target"] == target4.fingerprint()
    head, _ = load_eagle(path, target4)
    trained_state = result.module.state_dict()
    for k, v in head.state_dict().items():
        assert torch.equal(v, trained_state[k].to(v.dtype)), k


def test_offline_features_give_the_online_loss(trained, target4, tmp_path):
    from draftsmith.capture.cache import capture_dataset

    job, result, rows = trained
    capture_dataset(target4, rows, tmp_path / "cache", layers=[0, 1, 2], topk=1, last_hidden=True,
                    hidden_dtype=torch.float32, progress=False)
    offline = EagleJob(job_config(tmp_path, "eagle3", capture_cache=str(tmp_path / "cache")), target4, rows)
    batch = job.collate(rows[:8])
    module = result.module.eval()
    with torch.no_grad():
        on, m_on = job.loss(module, batch)
        off, m_off = offline.loss(module, batch)
    assert float(off) == pytest.approx(float(on), rel=1e-5)
    assert m_on == pytest.approx(m_off, rel=1e-5)


def _per_step_reference(job, module, batch, target):
    """Step j's draft logits, teacher logits and target ids at its selected bases, each step from features
    shifted on its own (the definition)."""
    feats = job.features(batch)
    S = job.cfg.ttt_steps
    select = [shift_left(batch["loss_mask"], 2 + j).bool() for j in range(S)]
    x = torch.cat([feats[f"layer.{i}"] for i in job.layers], dim=-1)
    out = module(batch["input_ids"], x, steps=S, select=select)
    w = target.model.get_output_embeddings().weight[module.t2d]
    teacher = [shift_left(feats["last_hidden"], 1 + j)[select[j]] @ w.T for j in range(S)]
    ids = [shift_left(feats["topk_indices"][..., 0], 1 + j)[select[j]] for j in range(S)]
    return out, teacher, ids


def test_eagle3_job_loss_equals_a_per_step_reference(trained, target4):
    """The job computes every step's teacher as rows of one product; the reference shifts the target's
    features per step and multiplies S times (the definition: step j at base t learns the target at t+1+j)."""
    job, result, rows = trained
    batch = job.collate(rows[:8])
    batch["loss_mask"][:, 10:13] = 0  # holes in the learned span: per-step selections differ
    module = result.module.eval()
    with torch.no_grad():
        got, m_got = job.loss(module, batch)
        out, teacher, ids = _per_step_reference(job, module, batch, target4)
        want, m_want = eagle3_loss(out.logits, teacher, ids, module.d2t, job.weights)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert m_got == pytest.approx(m_want, rel=1e-6)


def test_eagle1_trains(target4, tmp_path):
    rows = distilled_rows(target4, n=32)
    cfg = job_config(tmp_path, "eagle1", steps=16)
    result = train(EagleJob(cfg, target4, rows), cfg.train)
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < logs[0]["loss"] and "step0/reg" in logs[-1]
    head, _ = load_eagle(result.artifact, target4)
    assert head.config.version == 1 and not hasattr(head, "lm_head")


def test_eagle3_trains_under_bf16_autocast_on_the_cpu(target4, tmp_path):
    """train.mixed_precision bf16 on the CPU (what `auto` picks on AVX512-BF16): the draft layer's attention
    takes the bf16 q/k/v with its float mask, the loss falls, the saved head is float32."""
    rows = distilled_rows(target4, n=32)
    cfg = job_config(tmp_path, "eagle3", steps=16)
    cfg.train.mixed_precision = "bf16"
    result = train(EagleJob(cfg, target4, rows), cfg.train)
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < logs[0]["loss"]
    head, _ = load_eagle(result.artifact, target4)
    assert head.fc.weight.dtype == torch.float32 and target4.dtype == torch.float32


# --- proposing ------------------------------------------------------------------------------------------------
EAGLE31 = [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}]


@pytest.mark.parametrize("opts", EAGLE31[1:])
def test_eagle31_ttt_forward_equals_step_by_step_reference(target4, opts):
    """EAGLE-3.1: the fused layers normalised before fc (one norm, or one per layer), and (norm_output) every
    later step reading the normalised output: the unrolled forward is still what inference computes."""
    torch.manual_seed(2)
    head = EagleHead.from_target(target4.model, "eagle3", [0, 1, 2], draft_vocab=vocab_for(target4), ttt_steps=3,
                                 ttt_tokens="draft", **opts).eval()
    with torch.no_grad():  # norms away from 1, so that a norm applied twice or skipped shows
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    assert hasattr(head, "fc_norm") == bool(opts.get("fc_norm"))
    assert hasattr(head, "input_norm") == bool(opts.get("norm_before_fc"))
    ids = torch.randint(3, target4.vocab_size, (2, 6))
    feats = torch.randn(2, 6, 3 * 64)
    with torch.no_grad():
        fast = head(ids, feats).hidden
        slow = reference_unroll(head, ids, feats, 3)
    for j in range(3):
        torch.testing.assert_close(fast[j], slow[j], atol=2e-5, rtol=1e-4, msg=f"step {j}")


def test_eagle31_options_are_checked():
    from draftsmith.eagle.job import EagleJobConfig

    with pytest.raises(ValueError, match="choose one"):
        EagleJobConfig(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="fuses no target layers"):
        EagleJobConfig(version="eagle1", fc_norm=True, ttt_steps=1)


@pytest.mark.parametrize("opts", EAGLE31)
def test_proposer_chain_equals_the_ttt_draft_chain(target4, opts):
    """The proposer's chain from a context = the TTT forward's greedy chain at the last base (draft tokens)."""
    from draftsmith.capture.forward import capture_forward
    from draftsmith.decoding.proposer import AcceptResult, TargetFeatures, TreeSpec
    from draftsmith.eagle.proposer import EagleProposer

    torch.manual_seed(4)
    head = EagleHead.from_target(target4.model, "eagle3", [0, 1, 2], draft_vocab=vocab_for(target4), ttt_steps=4,
                                 ttt_tokens="draft", **opts).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ctx = torch.randint(3, target4.vocab_size, (10,))
    cap = capture_forward(target4.model, ctx[None], layers=[0, 1, 2], want_logits=False)
    feats = {i: cap.layers[i][0] for i in (0, 1, 2)}
    prop = EagleProposer(head, tree=False)
    # features arrive in two pieces, as from begin() and accept()
    prop.begin(ctx[:7], TargetFeatures(None, {i: f[:6] for i, f in feats.items()}))
    prop.accept(AcceptResult(None, [], [], ctx, TargetFeatures(None, {i: f[6:9] for i, f in feats.items()})))
    tokens = prop.propose(ctx, TreeSpec.chain(4), None, None).tokens.tolist()
    assert len(prop.kv) == 9  # only committed positions stay cached
    with torch.no_grad():
        out = head(ctx[None], torch.cat([feats[i] for i in (0, 1, 2)], -1)[None])
    t = 8  # the last committed position; ctx[9] is pending
    expected = [int(out.tokens[j][0, t]) for j in range(1, 4)] + [int(head.argmax_target_ids(out.hidden[3])[0, t])]
    assert tokens == expected


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_equals_target_greedy(trained, target4, tree):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    job, result, rows = trained
    proposer = build_proposer(f"eagle:{result.artifact}", target4, tree=tree, depth=4, topk=3, max_nodes=12)
    prompts = [r["input_ids"][:4] for r in rows[:2]] + [[5]]
    plain = speculative_generate(target4, None, prompts, 16, k=0)
    spec = proposer.default_tree_spec()
    fast = speculative_generate(target4, proposer, prompts, 16, k=None if tree else 4, tree=spec if tree else None)
    assert fast.tokens == plain.tokens
    # trained on these very continuations: drafts are accepted (α counts every tree node, so it is lower there)
    assert fast.stats.alpha > (0.05 if tree else 0.1)
    assert fast.stats.tau > 1.5
    assert fast.stats.target_forwards < plain.stats.target_forwards
    if tree:  # cut every step by the draft's path probabilities and a steep verify cost: still lossless
        from draftsmith.decoding.budget import VerifyCost

        cut = speculative_generate(target4, proposer, prompts, 16, k=None, tree=spec,
                                   cost=VerifyCost(tuple(1.0 + 0.1 * n for n in range(13)), 0.01))
        assert cut.tokens == plain.tokens
        assert cut.stats.pruned > 0 and cut.stats.proposed < fast.stats.proposed
        # EAGLE-2's GPU budget over the same head (what evaluation reports τ with): wider, and lossless
        gpu, gpu_spec = proposer.gpu_tree()
        assert gpu.head is proposer.head and (gpu.depth, gpu.topk, gpu.max_nodes) == (6, 10, 60)
        assert gpu_spec.depth == 6 and gpu_spec.capacity() == 60
        wide = speculative_generate(target4, gpu, prompts, 16, k=None, tree=gpu_spec)
        assert wide.tokens == plain.tokens
        assert wide.stats.proposed > fast.stats.proposed


@pytest.mark.parametrize("tree", [False, True])
def test_a_bf16_head_stays_lossless(trained, target4, tree):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    job, result, rows = trained
    fp32 = build_proposer(f"eagle:{result.artifact}", target4, tree=tree, depth=4, topk=3, max_nodes=12)
    proposer = build_proposer(f"eagle:{result.artifact}", target4, tree=tree, depth=4, topk=3, max_nodes=12)
    assert proposer.use_dtype(torch.bfloat16)
    head = proposer.head
    assert head.fc.weight.dtype == torch.bfloat16 and head.lm_head.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for n, b in head.named_buffers() if "inv_freq" in n)
    assert target4.model.get_input_embeddings().weight.dtype == torch.float32  # shared, not cast
    prompts = [r["input_ids"][:4] for r in rows[:2]] + [[5]]
    plain = speculative_generate(target4, None, prompts, 16, k=0)
    spec = proposer.default_tree_spec()
    kw = dict(k=None, tree=spec) if tree else dict(k=4)
    fast = speculative_generate(target4, proposer, prompts, 16, **kw)
    ref = speculative_generate(target4, fp32, prompts, 16, **kw)
    assert fast.tokens == plain.tokens
    assert fast.stats.tau > 1.5 and fast.stats.alpha > 0.8 * ref.stats.alpha  # it drafts about as well
    sampled = speculative_generate(target4, proposer, prompts, 12, temperature=1.0, seed=3, **kw)
    assert all(len(t) == 12 for t in sampled.tokens)


def test_confidence_calibration_follows_what_the_verifier_accepts(trained, target4, monkeypatch):
    from draftsmith.decoding.budget import VerifyCost
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.proposer import AcceptResult, Proposal

    job, result, rows = trained
    prop = build_proposer(f"eagle:{result.artifact}", target4)
    assert prop.calibrate and prop.calibration == 1.0  # no evidence yet: the draft's confidence as is
    prop.use_cost(VerifyCost((1.0, 1.1, 1.2), 0.01))
    tree = Proposal(torch.tensor([5, 6]), torch.tensor([-1, 0]), scores=torch.tensor([0.9, 0.8]))
    for _ in range(30):  # confident, never accepted: λ falls
        prop.accept(AcceptResult(tree, [], [7], torch.tensor([1, 7]), None))
    assert prop.calibration < 0.15
    prop.seen_accepted = prop.seen_expected = 0.0
    for _ in range(30):  # both nodes accepted every time, against 1.7 expected: λ rises
        prop.accept(AcceptResult(tree, [0, 1], [5, 6, 7], torch.tensor([1, 5, 6, 7]), None))
    assert 1.1 < prop.calibration < 2.0 / 1.7 + 0.01
    monkeypatch.setenv("DRAFTSMITH_EAGLE_CALIBRATE", "0")
    raw = build_proposer(f"eagle:{result.artifact}", target4)
    raw.use_cost(VerifyCost((1.0, 1.1, 1.2), 0.01))
    raw.accept(AcceptResult(tree, [], [7], torch.tensor([1, 7]), None))
    assert not raw.calibrate and raw.calibration == 1.0


def test_presets_load():
    from draftsmith.config import load_config

    root = Path(__file__).resolve().parent.parent / "configs"
    presets = sorted(root.glob("*/eagle*.yaml"))
    assert len(presets) >= 3
    for p in presets:
        cfg = load_config(p)
        assert isinstance(cfg, EagleJobConfig), p


def test_a_warm_start_keeps_the_draft_vocabulary_of_its_own_rows(target4, tmp_path):
    """Retraining after a domain shift warm-starts from the current head, whose draft vocabulary was counted on the
    old domain's rows: the new head keeps the vocabulary of its own rows (the new domain's tokens draftable), the
    lm_head row of a token in both moves to its new place, a new token starts from the target's lm_head row.
    (Before, the old d2t was loaded over the new one: the retrained head could never draft a new token.)"""
    from safetensors.torch import load_file

    from draftsmith.targets.families import lm_head

    def rows(lo: int, hi: int, seed: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"input_ids": torch.randint(lo, hi, (20,), generator=g).tolist(), "loss_mask": [0] * 4 + [1] * 16,
                 "row_id": seed * 100 + i} for i in range(16)]

    first = job_config(tmp_path / "v1", "eagle3", steps=4)
    first.draft_vocab_size = 40
    v1 = train(EagleJob(first, target4, rows(3, 60, 1)), first.train).artifact
    cfg = job_config(tmp_path / "v2", "eagle3", steps=1)
    cfg.draft_vocab_size = 40
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.warm_start = 1e-12, 0, str(v1)
    job = EagleJob(cfg, target4, rows(40, 120, 2))
    v2 = train(job, cfg.train).artifact
    old, new = load_file(str(Path(v1) / "model.safetensors")), load_file(str(Path(v2) / "model.safetensors"))
    assert torch.equal(new["d2t"], job.d2t) and not torch.equal(new["d2t"], old["d2t"])
    ids = lambda w: (torch.arange(w["d2t"].numel()) + w["d2t"]).tolist()  # noqa: E731
    old_at = {t: i for i, t in enumerate(ids(old))}
    target_rows = lm_head(target4.model).weight.detach()
    shared = 0
    for j, t in enumerate(ids(new)):
        if t in old_at:
            shared += 1
            torch.testing.assert_close(new["lm_head.weight"][j], old["lm_head.weight"][old_at[t]], atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(new["lm_head.weight"][j], target_rows[t], atol=1e-6, rtol=0)
    assert 0 < shared < len(ids(new))
    # few new tokens: the slots they leave go to the earlier head's vocabulary (its tokens as a prior)
    cfg3 = job_config(tmp_path / "v3", "eagle3", steps=1)
    cfg3.draft_vocab_size, cfg3.train.warm_start = 40, str(v1)
    few = EagleJob(cfg3, target4, rows(40, 50, 3))
    chosen = set((torch.arange(40) + few.d2t).tolist())
    assert set(range(40, 50)) <= chosen and chosen - set(range(40, 50)) <= set(ids(old))
