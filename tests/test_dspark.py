"""DSpark: the Markov head's training forward against the proposer's left-to-right drafting, training through the
one loop (base, corrected and confidence objectives), lossless decoding against transformers' generate (chain,
tree, confidence-cut chain, sampling, a reduced vocabulary), the calibration pairs, export in vLLM's layout, and
the memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_dflash import hf_greedy
from tiny_models import distilled_rows, make_target  # noqa: E402

from draftsmith.decoding.calibration import expected_calibration_error, reliability, summary
from draftsmith.dspark.job import DSparkJob, DSparkJobConfig
from draftsmith.dspark.model import DSparkDraft, load_dspark
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.training import TrainConfig, train

BS = 4


@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("dspark-target"))


def job_config(tmp: Path, steps: int = 40, **kw) -> DSparkJobConfig:
    kw.setdefault("target_layers", [0, 1, 2])
    return DSparkJobConfig(
        target="tiny", data="in-memory", output=str(tmp / "dspark-artifact"), num_layers=1, block_size=BS,
        anchors_per_row=8, max_length=64, markov_rank=16,
        train=TrainConfig(lr=3e-3, max_steps=steps, batch_size=8, warmup_steps=2, output_dir=str(tmp / "dspark-run"),
                          resume="never", progress=False, log_every=5, eval_every=0),
        evaluate=EvalAfterTraining(enabled=False), **kw)


def test_a_fresh_markov_head_drafts_what_the_backbone_drafts(target4):
    torch.manual_seed(0)
    draft = DSparkDraft.from_target(target4.model, [0, 1, 2], num_layers=1, block_size=BS, mask_token_id=7,
                                    markov_rank=8)
    h = torch.randn(5, target4.hidden_size)
    base, corrected, conf = draft.corrected(h, torch.randint(0, target4.vocab_size, (5,)))
    torch.testing.assert_close(base, corrected)
    torch.testing.assert_close(torch.sigmoid(conf), torch.full((5,), 0.5))


def test_training_forward_teacher_forces_the_markov_head_with_the_rows_tokens(target4):
    """Slot j of block a reads x_{a+j-1}: the training forward's corrected logits equal the bias of that token
    added to the proposer's one-block base logits."""
    torch.manual_seed(0)
    draft = DSparkDraft.from_target(target4.model, [0, 1, 2], num_layers=1, block_size=BS, mask_token_id=7,
                                    markov_rank=8)
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight)
    torch.nn.init.normal_(draft.confidence_head.proj.weight)
    ids = torch.randint(3, target4.vocab_size, (1, 12))
    feats = torch.randn(1, 12, 3 * target4.hidden_size)
    anchors = torch.tensor([[5]])
    select = torch.zeros(1, 1, BS, dtype=torch.bool)
    select[..., 1:] = True
    base, corrected, conf = draft(ids, feats, anchors, select=select)
    cache = draft.context_kv(draft.context(feats[:, :5]), torch.arange(5)[None])
    z = draft.run_blocks(torch.tensor([[int(ids[0, 5])] + [7] * (BS - 1)]), torch.arange(5, 5 + BS)[None], cache, None)
    h = draft.norm(z[0, 1:])
    e = draft.markov_head.embed(ids[0, 5:5 + BS - 1])
    torch.testing.assert_close(base, draft.head_logits(h), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(corrected, draft.head_logits(h) + draft.markov_head.bias(e), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conf, draft.confidence_head(h, e), atol=1e-4, rtol=1e-4)


def test_calibration_error_of_known_pairs():
    p = torch.tensor([0.1, 0.1, 0.9, 0.9])
    assert expected_calibration_error(p, torch.tensor([0, 0, 1, 1])) == pytest.approx(0.1)
    assert expected_calibration_error(p, torch.tensor([1, 1, 0, 0])) == pytest.approx(0.9)
    table = reliability(p, torch.tensor([0, 1, 1, 1]))
    assert [(r["n"], r["accepted"]) for r in table] == [(2, 0.5), (2, 1.0)]
    assert summary([], [])["ece"] is None


@pytest.fixture(scope="module")
def trained(target4, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark-train")
    rows = distilled_rows(target4)
    cfg = job_config(tmp, steps=60)
    job = DSparkJob(cfg, target4, rows)
    return job, train(job, cfg.train), rows


def test_training_lowers_the_loss_and_logs_both_heads(trained):
    _, result, _ = trained
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    for key in ("acc", "tau", "base/acc", "base/tau", "conf/bce", "conf/mean"):
        assert key in logs[-1], key
    # the confidence follows the acceptance up as the draft learns (0 -> 0.99 here): estimate and rate meet
    assert logs[-1]["conf/mean"] > 0.6 and logs[-1]["conf/ece"] < 0.3
    assert all(f"slot{j}/acc" in logs[-1] for j in range(1, BS))


def test_artifact_holds_the_heads_under_vllms_names(trained, target4):
    job, result, _ = trained
    path = Path(result.artifact)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["markov_head.markov_w1.weight"].shape == (target4.vocab_size, 16)
    assert weights["markov_head.markov_w2.weight"].shape == (target4.vocab_size, 16)
    assert weights["confidence_head.proj.weight"].shape == (1, target4.hidden_size + 16)
    assert not any("embed" in k or "lm_head" in k for k in weights)
    draft, manifest = load_dspark(path, target4)
    assert manifest["kind"] == "dspark" and isinstance(draft, DSparkDraft) and draft.config.markov_rank == 16
    assert float(draft.markov_head.markov_w2.weight.abs().sum()) > 0  # it learned a bias


def decode(target, artifact, rows, tree: bool = False, cost=None, **opts):
    """Greedy speculative decoding of the first rows' 4-token prompts (and a 1-token one), 16 new tokens, checked
    equal to transformers' generate (an implementation independent of ours)."""
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    proposer = build_proposer(f"dspark:{artifact}", target, tree=tree, topk=2, max_nodes=8, **opts)
    prompts = [r["input_ids"][:4] for r in rows[:3]] + [[5]]
    fast = speculative_generate(target, proposer, prompts, 16, k=None if tree else BS - 1,
                                tree=proposer.default_tree_spec() if tree else None, eos_ids=[], cost=cost)
    assert fast.tokens == hf_greedy(target, prompts, 16)
    return fast, proposer


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_equals_hf_generate(trained, target4, tree):
    _, result, rows = trained
    fast, _ = decode(target4, result.artifact, rows, tree)
    assert fast.stats.tau > 1.5  # trained on these very continuations: whole blocks are accepted


def test_the_confidence_cut_chain_is_lossless_and_verifies_fewer_tokens(trained, target4):
    """With a verify cost that rises steeply with the tokens verified, the confidence product cuts chains short:
    fewer tokens verified, the same output."""
    from draftsmith.decoding.budget import VerifyCost

    _, result, rows = trained
    steep = VerifyCost(tuple(1.0 + 0.8 * n for n in range(BS + 1)), 1.0)
    cut, prop = decode(target4, result.artifact, rows, cost=steep)
    whole, _ = decode(target4, result.artifact, rows, confidence_cut=False, cost=steep)
    assert cut.stats.pruned > 0 and whole.stats.pruned == 0
    est, acc = prop.acceptance_estimates()
    assert est and len(est) == len(acc) and set(acc) <= {0, 1} and all(0 <= p <= 1 for p in est)


def test_calibration_pairs_are_the_accepted_tokens_and_the_first_rejected(trained, target4):
    _, result, rows = trained
    fast, prop = decode(target4, result.artifact, rows)
    est, acc = prop.acceptance_estimates()
    s = fast.stats
    assert sum(acc) == s.accepted  # every accepted token is a pair with 1
    assert len(acc) - sum(acc) <= s.target_forwards  # at most one rejected token a step
    prop.reset_stats()
    assert prop.acceptance_estimates() == ([], [])


def test_sampling_keeps_the_targets_distribution(trained, target4):
    """Temperature 1: the first token comes from the prefill, the second from a DSpark step (its chain drafted
    after the first); the pairs' joint distribution must be the target's own p(a) p(b | a), computed exactly
    from the target (chi-square, p = 0.001), with the draft's chain accepted on some draws."""
    from test_decoding import chi_square_ok

    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    _, result, rows = trained
    prompt = rows[0]["input_ids"][:4]
    n = 500
    # 3 new tokens: the prefill's, then a step that may draft 1 (the budget leaves room for one more)
    res = speculative_generate(target4, build_proposer(f"dspark:{result.artifact}", target4), [prompt] * n, 3,
                               k=BS - 1, temperature=1.0, seed=5, eos_ids=[])
    assert res.stats.accepted > 0
    with torch.no_grad():
        p0 = torch.softmax(target4.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        firsts = torch.arange(target4.vocab_size)
        ctx = torch.cat([torch.tensor(prompt).expand(len(firsts), -1), firsts[:, None]], 1)
        p1 = torch.softmax(target4.model(ctx).logits[:, -1].float(), -1)
    joint = p0[:, None] * p1
    counts: dict = {}
    for a, b, *_ in res.tokens:
        counts[(a, b)] = counts.get((a, b), 0) + 1
    expected = {(a, b): float(joint[a, b]) for a, b in (joint > 1e-9).nonzero().tolist()}
    ok, stat, crit = chi_square_ok(counts, expected, n)
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def test_a_bf16_draft_stays_lossless(trained, target4):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    _, result, rows = trained
    proposer = build_proposer(f"dspark:{result.artifact}", target4)
    assert proposer.use_dtype(torch.bfloat16)
    prompts = [r["input_ids"][:4] for r in rows[:2]]
    assert (speculative_generate(target4, proposer, prompts, 12, k=BS - 1, eos_ids=[]).tokens ==
        hf_greedy(target4, prompts, 12))


def test_export_for_vllm_verifies_reloads_and_is_refused_elsewhere(trained, target4, tmp_path):
    from draftsmith.errors import ConfigError
    from draftsmith.export.api import export_artifact, import_export

    _, result, _ = trained
    res = export_artifact(result.artifact, "vllm", tmp_path / "vllm", target4)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 16
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is False and cfg["target_layer_ids"] == [0, 1, 2]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2] and cfg["block_size"] == BS
    assert '"method": "dspark"' in (res.out / "serve.md").read_text()
    assert any("reloads strictly into draftsmith's DSpark draft" in c for c in res.checks)
    names = load_file(str(res.out / "model.safetensors"))
    assert "markov_head.markov_w2.weight" in names and "confidence_head.proj.bias" in names
    back = import_export(res.out, tmp_path / "back")
    draft, manifest = load_dspark(back, target4)
    assert manifest["kind"] == "dspark"
    for k, v in load_dspark(result.artifact, target4)[0].state_dict().items():
        torch.testing.assert_close(draft.state_dict()[k].float(), v.float())
    for stack in ("sglang", "hf"):
        with pytest.raises(ConfigError, match="DSpark"):
            export_artifact(result.artifact, stack, tmp_path / stack, target4)


def test_evaluation_reports_calibration_beside_the_gpu_sized_tree(trained, target4, tmp_path):
    """`--tree auto`: the block's chain cut by the confidence (the verifier's cost model), the GPU-sized tree
    beside it, both lossless against HF generate; the report holds the confidence's calibration per domain and
    overall, in report.md and as a reliability plot."""
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    _, result, _ = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "qa", "turns": [t]}) + "\n"
                               for t in ["What is a fox?", "Name three colors."]))
    report = evaluate(target4, f"dspark:{result.artifact}", prompts=[str(prompts)], max_new_tokens=12,
                      tree_from_proposer=True, cost_context=16, cost_k_max=4, cost_repeats=1, limit_per_domain=2)
    assert report["settings"]["tree"] == [1] * (BS - 1) and report["settings"]["prune_tree"] is True
    assert report["overall"]["lossless"] is True and report["overall"]["gpu_tree"]["lossless"] is True
    cal = report["overall"]["calibration"]
    assert cal["n"] > 0 and 0 <= cal["ece"] <= 1 and sum(b["n"] for b in cal["bins"]) == cal["n"]
    assert report["domains"]["qa"]["calibration"]["n"] == cal["n"]
    write_report(report, tmp_path / "out")
    assert "## Calibration of the acceptance estimates" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "calibration.png").stat().st_size > 0


def test_memory_plan_counts_the_heads(trained, tmp_path):
    """`draftsmith plan`: the draft's parameters (the heads' included) and its layers' KV cache; the preset's
    training memory is DFlash's plus the Markov head's V·r + N·r parameters and the confidence's H + r + 1."""
    from draftsmith.memory.serving import artifact_shape
    from draftsmith.memory.training import plan_config

    job, result, _ = trained
    shape = artifact_shape(result.artifact, job.target.config)
    assert shape.kind == "dspark" and shape.kv_layers == 1
    assert shape.params == sum(v.numel() for v in job.build_module().state_dict().values())
    d = plan_config("configs/smollm2-135m/dflash.yaml", gpu="H100-80GB")
    s = plan_config("configs/smollm2-135m/dspark.yaml", gpu="H100-80GB")
    assert s["kind"] == "dspark" and s["fits"]
    assert s["trained_params"] - d["trained_params"] == 2 * 49152 * 64 + 576 + 64 + 1


@pytest.fixture(scope="module")
def trained_vocab(target4, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark-vocab")
    rows = distilled_rows(target4)
    cfg = job_config(tmp, steps=40, draft_vocab_size=96)
    job = DSparkJob(cfg, target4, rows)
    return job, train(job, cfg.train), rows


@pytest.mark.parametrize("tree", [False, True])
def test_a_reduced_vocabulary_draft_decodes_losslessly_and_exports(trained_vocab, target4, tree, tmp_path):
    from draftsmith.export.api import export_artifact

    _, result, rows = trained_vocab
    weights = load_file(str(Path(result.artifact) / "model.safetensors"))
    assert weights["markov_head.markov_w2.weight"].shape == (96, 16)  # draft vocabulary out, target ids in
    assert weights["markov_head.markov_w1.weight"].shape == (target4.vocab_size, 16)
    decode(target4, result.artifact, rows, tree)
    if not tree:
        res = export_artifact(result.artifact, "vllm", tmp_path / "vllm", target4)
        assert json.loads((res.out / "config.json").read_text())["draft_vocab_size"] == 96


@pytest.mark.parametrize("field,value,says", [("markov_rank", 0, "markov_rank"), ("markov_rank", "64", "markov_rank"),
                                              ("confidence_head", "yes", "confidence_head")])
def test_a_bad_head_field_is_one_line_naming_the_file_and_field(trained, target4, tmp_path, field, value, says):
    """The boundary: DSpark's own config fields are read by the one reader like DFlash's (draftsmith check,
    load and export all go through it)."""
    import shutil

    from draftsmith.errors import DraftsmithError

    _, result, _ = trained
    art = shutil.copytree(result.artifact, tmp_path / "bad")
    cfg = json.loads((art / "config.json").read_text())
    cfg[field] = value
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError) as e:
        load_dspark(art, target4)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and says in msg, msg


def test_a_warm_start_from_a_dflash_drafter_drafts_what_it_drafts(target4, tmp_path):
    """`train.warm_start: DFLASH_ARTIFACT`: the backbone loads as it is and the heads start harmless, so the
    warm-started DSpark's first chain is the DFlash drafter's; a DFlash drafter of another block is refused."""
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.dflash.job import DFlashJob, DFlashJobConfig
    from draftsmith.errors import ConfigError

    rows = distilled_rows(target4)
    d = job_config(tmp_path / "d", steps=20)
    dcfg = DFlashJobConfig(**{k: getattr(d, k) for k in DFlashJobConfig.__dataclass_fields__})
    dflash = train(DFlashJob(dcfg, target4, rows), dcfg.train).artifact
    cfg = job_config(tmp_path / "s", steps=1)
    cfg.train.warm_start, cfg.train.lr = str(dflash), 1e-12  # one step that moves nothing measurable
    dspark = train(DSparkJob(cfg, target4, rows), cfg.train).artifact
    prompts = [r["input_ids"][:4] for r in rows[:3]]
    outs = [speculative_generate(target4, build_proposer(spec, target4), prompts, 12, k=BS - 1, eos_ids=[])
            for spec in (f"dflash:{dflash}", f"dspark:{dspark}")]
    assert outs[0].tokens == outs[1].tokens and outs[0].stats.accepted == outs[1].stats.accepted
    other = job_config(tmp_path / "o", steps=1)
    other.block_size = BS + 1
    other.train.warm_start = str(dflash)
    with pytest.raises(ConfigError, match="block_size"):
        train(DSparkJob(other, target4, rows), other.train)
