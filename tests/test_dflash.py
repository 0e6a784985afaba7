"""DFlash: the block mask, training's all-blocks forward against the proposer's one-block inference, training
through the one loop, artifact round trip, lossless speculative decoding (greedy against the target's own
HF generate, trees, sampling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import distilled_rows, make_target  # noqa: E402

from draftsmith.dflash.job import DFlashJob, DFlashJobConfig, pick_mask_token
from draftsmith.dflash.model import (
    DFlashDraft,
    block_mask,
    block_targets,
    load_dflash,
    position_weights,
    reference_layers,
    sample_anchors,
)
from draftsmith.errors import ConfigError
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.training import TrainConfig, train

BS = 4


@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("dflash-target"))


def job_config(tmp: Path, steps: int = 40, **kw) -> DFlashJobConfig:
    kw.setdefault("target_layers", [0, 1, 2])
    return DFlashJobConfig(
        target="tiny", data="in-memory", output=str(tmp / "dflash-artifact"), num_layers=2, block_size=BS,
        anchors_per_row=8, max_length=64,
        train=TrainConfig(lr=3e-3, max_steps=steps, batch_size=8, warmup_steps=2, output_dir=str(tmp / "dflash-run"),
                          resume="never", progress=False, log_every=5, eval_every=0),
        evaluate=EvalAfterTraining(enabled=False), **kw)


def test_reference_taps_and_slot_weights():
    assert reference_layers(30, 3) == [1, 14, 27]
    assert reference_layers(36, 5) == [1, 9, 17, 25, 33]  # the reference's Qwen3-8B taps
    assert reference_layers(30, 1) == [15]
    w = position_weights(4, 4.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[2:], torch.exp(-torch.tensor([1.0, 2.0]) / 4))


def test_block_mask_sees_earlier_context_and_its_own_block_only():
    m = block_mask(torch.tensor([[2, 5, -1]]), T=8, block_size=2)[0]
    assert m.shape == (6, 8 + 6)
    assert m[0, :8].tolist() == [True, True] + [False] * 6  # block at 2: context 0, 1 (strictly before)
    assert m[2, :8].tolist() == [True] * 5 + [False] * 3
    assert not m[4, :8].any()  # no anchor: no context
    assert m[0, 8:].tolist() == [True, True, False, False, False, False]  # its own block, both ways
    assert m[3, 8:].tolist() == [False, False, True, True, False, False]


def test_anchors_and_targets_follow_the_loss_mask():
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0]])
    anchors = sample_anchors(lm, torch.tensor([7]), per_row=10, generators=torch.Generator().manual_seed(0))
    live = anchors[anchors >= 0].tolist()
    assert live == [2, 3, 4, 5]  # a >= 1 with x_{a+1} learned, inside the row
    ids = torch.arange(8)[None]
    labels, valid = block_targets(ids, lm, torch.tensor([[2, 5]]), 3)
    assert labels[0, 0].tolist() == [2, 3, 4] and valid[0, 0].tolist() == [False, True, True]
    assert labels[0, 1].tolist() == [5, 6, 7] and valid[0, 1].tolist() == [False, True, False]


def test_training_forward_equals_the_proposers_one_block(target4):
    """Every block of the all-blocks training forward equals the block inference runs over the cached
    context of the positions before its anchor."""
    torch.manual_seed(0)
    draft = DFlashDraft.from_target(target4.model, [0, 1, 2], num_layers=2, block_size=BS, mask_token_id=7)
    ids = torch.randint(3, target4.vocab_size, (2, 12))
    feats = torch.randn(2, 12, 3 * target4.hidden_size)
    anchors = torch.tensor([[3, 6, 9], [1, 8, -1]])
    z = draft(ids, feats, anchors)
    for r in range(2):
        for i, a in enumerate(anchors[r].tolist()):
            if a < 0:
                continue
            cache = draft.context_kv(draft.context(feats[r: r + 1, :a]), torch.arange(a)[None])
            block = torch.tensor([[int(ids[r, a])] + [7] * (BS - 1)])
            one = draft.run_blocks(block, torch.arange(a, a + BS)[None], cache, None)
            torch.testing.assert_close(z[r, i], one[0], atol=1e-5, rtol=1e-4)


def test_mask_token_is_a_row_the_data_does_not_use(target4):
    tok = target4.tokenizer
    counts = torch.ones(target4.vocab_size)
    counts[11] = 0
    mask = pick_mask_token(target4, counts)
    assert mask == 11 or (mask not in (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) and counts[mask] == 0)


def test_layers_the_stacks_cannot_capture_are_refused(target4, tmp_path):
    rows = distilled_rows(target4, n=8)
    with pytest.raises(ConfigError, match="target_layers"):
        DFlashJob(job_config(tmp_path, target_layers=[1, 3]), target4, rows)


@pytest.fixture(scope="module")
def trained(target4, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash-train")
    rows = distilled_rows(target4)
    cfg = job_config(tmp, steps=60)
    job = DFlashJob(cfg, target4, rows)
    return job, train(job, cfg.train), rows


def test_training_lowers_the_loss_and_logs_slot_accuracy(trained):
    _, result, _ = trained
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    assert logs[-1]["slot1/acc"] > logs[0]["slot1/acc"]
    assert all(f"slot{j}/acc" in logs[-1] for j in range(1, BS))
    assert 1.0 <= logs[0]["tau"] < logs[-1]["tau"] <= BS  # the chain's accepted length, rising
    assert "tau" in [r for r in result.history if r["type"] == "eval"][-1]  # and held out


def test_artifact_round_trip(trained, target4):
    job, result, _ = trained
    path = Path(result.artifact)
    weights = load_file(str(path / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights)  # the target's, shared
    assert weights["fc.weight"].shape == (target4.hidden_size, 3 * target4.hidden_size)
    assert "layers.1.self_attn.k_norm.weight" in weights and "hidden_norm.weight" in weights
    draft, manifest = load_dflash(path, target4)
    assert manifest["kind"] == "dflash" and draft.config.mask_token_id == job.mask_id
    for k, v in job.build_module().state_dict().items():
        assert draft.state_dict()[k].shape == v.shape


def hf_greedy(target, prompts, n):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)
        out.append(g[0, len(p):].tolist())
    return out


def decode_rows(target, artifact, rows, tree: bool):
    """Greedy speculative decoding of the first rows' 4-token prompts (and a 1-token one), 16 new tokens, with the
    DFlash draft at `artifact` as a chain of the block or a tree; checked equal to transformers' generate."""
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    proposer = build_proposer(f"dflash:{artifact}", target, tree=tree, topk=2, max_nodes=8)
    prompts = [r["input_ids"][:4] for r in rows[:3]] + [[5]]
    spec = proposer.default_tree_spec()
    fast = speculative_generate(target, proposer, prompts, 16, k=None if tree else BS - 1,
                                tree=spec if tree else None, eos_ids=[])
    assert fast.tokens == hf_greedy(target, prompts, 16)
    return fast, prompts


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_equals_hf_generate(trained, target4, tree):
    _, result, rows = trained
    fast, prompts = decode_rows(target4, result.artifact, rows, tree)
    assert fast.stats.tau > 1.5  # trained on these very continuations: whole blocks are accepted
    assert fast.stats.target_forwards < 16 * len(prompts)


def test_sampling_with_the_draft_runs_and_a_bf16_draft_stays_lossless(trained, target4):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    _, result, rows = trained
    proposer = build_proposer(f"dflash:{result.artifact}", target4)
    assert proposer.use_dtype(torch.bfloat16)
    prompts = [r["input_ids"][:4] for r in rows[:2]]
    fast = speculative_generate(target4, proposer, prompts, 12, k=BS - 1, eos_ids=[])
    assert fast.tokens == hf_greedy(target4, prompts, 12)
    sampled = speculative_generate(target4, proposer, prompts, 12, k=BS - 1, temperature=1.0, seed=3, eos_ids=[])
    assert all(len(t) == 12 for t in sampled.tokens)


def test_export_for_vllm_and_sglang_verifies_and_reads_back(trained, target4, tmp_path):
    from draftsmith.export.api import export_artifact, import_export, verify_export

    _, result, _ = trained
    res = export_artifact(result.artifact, "vllm", tmp_path / "vllm", target4)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1, 2],
                                    "mask_token_id": cfg["dflash_config"]["mask_token_id"]}
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == BS and cfg["num_target_layers"] == 4
    assert f'"num_speculative_tokens": {BS - 1}' in (res.out / "serve.md").read_text()
    assert any("reloads strictly" in c for c in res.checks)
    names = load_file(str(res.out / "model.safetensors"))
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in names)
    assert verify_export(res.out, target4)
    sg = export_artifact(result.artifact, "sglang", tmp_path / "sglang", target4)
    assert "--speculative-algorithm DFLASH" in (sg.out / "serve.md").read_text()
    with pytest.raises(ConfigError, match="trtllm|TensorRT"):
        export_artifact(result.artifact, "trtllm", tmp_path / "trt", target4)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        export_artifact(result.artifact, "vllm", tmp_path / "k2", target4, num_speculative_tokens=2)
    back = import_export(res.out, tmp_path / "back")
    a, _ = load_dflash(result.artifact, target4)
    b, _ = load_dflash(back, target4)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    # corrupt one tensor's shape: verification names it
    bad = dict(names)
    bad["fc.weight"] = bad["fc.weight"][:, :8].contiguous()
    from safetensors.torch import save_file

    save_file(bad, str(res.out / "model.safetensors"))
    with pytest.raises(Exception, match="fc.weight"):
        verify_export(res.out, target4)


def test_memory_plan_counts_the_draft(trained, tmp_path):
    """`draftsmith plan`: a trained draft's parameters and the KV cache of its layers; a job preset's training
    memory on a GPU (the SmolLM2 preset against its embedded target's config)."""
    from draftsmith.memory.serving import artifact_shape
    from draftsmith.memory.training import plan_config

    job, result, _ = trained
    shape = artifact_shape(result.artifact, job.target.config)
    assert shape.kind == "dflash" and shape.kv_layers == 2
    assert shape.params == sum(v.numel() for v in job.build_module().state_dict().values())
    p = plan_config("configs/smollm2-135m/dflash.yaml", gpu="H100-80GB")
    assert p["kind"] == "dflash" and p["fits"] and p["trained_params"] > 0
    # an own lm_head over 8,192 of the 49,152 tokens: 8,192 x 576 more parameters to train
    v8k = plan_config("configs/smollm2-135m/dflash-v8k.yaml", gpu="H100-80GB")
    assert v8k["trained_params"] - p["trained_params"] == 8192 * 576


def test_evaluation_puts_the_gpu_sized_tree_beside_the_blocks_chain(trained, target4, tmp_path):
    """`--tree auto`: the proposer's own shape (the block's chain, what vLLM serves) and, beside it, the tree of
    each slot's top 10 cut to EAGLE-2's GPU budget of 60 nodes; both lossless."""
    from draftsmith.evaluation.evaluate import evaluate

    _, result, _ = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "qa", "turns": [t]}) + "\n"
                               for t in ["What is a fox?", "Name three colors."]))
    report = evaluate(target4, f"dflash:{result.artifact}", prompts=[str(prompts)], max_new_tokens=12,
                      tree_from_proposer=True, cost_context=16, cost_k_max=4, cost_repeats=1, limit_per_domain=2)
    assert report["settings"]["tree"] == [1] * (BS - 1)
    assert report["settings"]["gpu_tree"] == {"tree": [10] * (BS - 1), "tree_max_nodes": 60}
    gpu = report["overall"]["gpu_tree"]
    assert report["overall"]["lossless"] is True and gpu["lossless"] is True
    assert gpu["verified_nodes_per_step"] > report["overall"]["verified_nodes_per_step"]


def test_the_end_of_training_evaluation_decodes_the_blocks_chain_not_a_chain_of_k(trained, target4, tmp_path):
    """What `train` and `scripts/zoo_add.py --evaluate` write into the artifact: the block's chain of
    block_size - 1 (the shape vLLM and SGLang serve) and the GPU-sized tree beside it, not evaluate.k."""
    import shutil

    from draftsmith.artifact import load_manifest
    from draftsmith.evaluation.after_training import evaluate_into_artifact

    _, result, _ = trained
    art = shutil.copytree(result.artifact, tmp_path / "dflash")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": ["What is a fox?"]}) + "\n")
    opts = EvalAfterTraining(prompts=[str(prompts)], limit_per_domain=1, max_new_tokens=8)
    report = evaluate_into_artifact(art, target4, "dflash", opts)
    assert report["settings"]["tree"] == [1] * (BS - 1) and report["settings"]["k"] is None
    assert report["overall"]["gpu_tree"]["lossless"] is True
    assert load_manifest(art)["eval"]["settings"]["tree"] == [1] * (BS - 1)


@pytest.mark.parametrize("loss", ["ce", "kd"])
def test_offline_features_from_the_capture_cache_give_the_online_loss(trained, target4, tmp_path, loss):
    """Trained from the same capture cache as EAGLE-3 (`capture_cache`, capture/cache.py): the target never runs
    in the step, and the loss (the KD teacher read from the cached last hidden state too) is the online one."""
    from draftsmith.capture.cache import capture_dataset

    _, result, rows = trained
    capture_dataset(target4, rows, tmp_path / "cache", layers=[0, 1, 2], topk=1, last_hidden=True,
                    hidden_dtype=torch.float32, progress=False)
    online = DFlashJob(job_config(tmp_path, loss=loss), target4, rows)
    offline = DFlashJob(job_config(tmp_path, loss=loss, capture_cache=str(tmp_path / "cache")), target4, rows)
    batch = online.collate(rows[:8])
    module = result.module.eval()
    with torch.no_grad():
        on, m_on = online.loss(module, batch)
        off, m_off = offline.loss(module, batch)
    assert float(off) == pytest.approx(float(on), rel=1e-5)
    assert m_on == pytest.approx(m_off, rel=1e-5)


# --- a reduced draft vocabulary (`draft_vocab_size`, EAGLE-3's: heads/vocab.py) ---------------------------------
NV = 40  # of the tiny target's 320 tokens: fewer than its rows write, so some labels fall outside


@pytest.fixture(scope="module")
def trained_vocab(target4, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash-vocab")
    rows = distilled_rows(target4)
    cfg = job_config(tmp, steps=60, draft_vocab_size=NV)
    job = DFlashJob(cfg, target4, rows)
    return job, train(job, cfg.train), rows


def test_a_reduced_vocabulary_is_the_most_written_tokens_with_the_targets_rows_as_its_start(target4, tmp_path):
    from draftsmith.heads.vocab import token_counts

    rows = distilled_rows(target4)
    job = DFlashJob(job_config(tmp_path, draft_vocab_size=NV), target4, rows)
    draft = job.build_module()
    counts = token_counts(job.train_set, target4.vocab_size)
    chosen = torch.nonzero(draft.t2d).flatten()
    assert chosen.numel() == NV and torch.equal(torch.arange(NV) + draft.d2t, chosen)
    assert counts[chosen].min() >= counts[~draft.t2d].max()  # the most frequent target-written tokens
    torch.testing.assert_close(draft.lm_head.weight, target4.model.lm_head.weight[chosen])
    z = torch.randn(3, target4.hidden_size)
    assert draft.logits(z).shape == (3, NV)
    # the KD teacher is the target's logits over the same tokens
    h = torch.randn(3, target4.hidden_size)
    torch.testing.assert_close(draft.target_logits(h), target4.model.lm_head(h)[:, chosen])
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DFlashJob(job_config(tmp_path, draft_vocab_size=target4.vocab_size), target4, rows)


def test_labels_outside_the_draft_vocabulary_leave_the_ce_loss_and_are_counted():
    from draftsmith.dflash.model import dflash_loss
    from draftsmith.heads.vocab import build_draft_vocab, draft_index

    counts = torch.zeros(10)
    counts[[2, 5, 7]] = 1
    d2t, t2d = build_draft_vocab(counts, 3)  # draft ids 0, 1, 2 = target ids 2, 5, 7
    vocab = (d2t, draft_index(t2d))
    logits = torch.tensor([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]], requires_grad=True)
    labels = torch.tensor([5, 2, 9])  # the last is outside
    w = position_weights(3, None)
    loss, m = dflash_loss(logits, labels, torch.tensor([1, 2, 1]), w, vocab=vocab)
    inside, _ = dflash_loss(logits[:2], labels[:2], torch.tensor([1, 2]), w, vocab=vocab)
    assert float(loss.detach()) == pytest.approx(float(inside.detach()))
    assert m["outside"] == pytest.approx(1 / 3)
    assert m["acc"] == pytest.approx(2 / 3)  # the argmax mapped through d2t: 5, 2 right; 7 != 9 a miss
    loss.backward()
    assert not logits.grad[2].any()
    kd, _ = dflash_loss(logits, labels, torch.tensor([1, 2, 1]), w, teacher=torch.zeros(3, 3), vocab=vocab)
    assert float(kd) > 0  # the teacher, on the draft vocabulary, teaches every slot


def test_held_out_tau_is_the_run_of_correct_slots_of_whole_blocks():
    """`tau`: a chain is accepted up to its first miss, so a block right at slots 1, 2 and 4 accepts 2 drafted
    tokens (τ 3), however right its later slots are; a block cut by the row's end is left out."""
    from draftsmith.dflash.model import chain_tau

    blocks = torch.tensor([[[False, True, True, True, True],     # whole: right, right, miss, right -> run 2
                            [False, True, True, True, True],     # whole: miss first -> run 0
                            [False, True, True, False, False]]])  # cut by the row's end: left out
    right = torch.tensor([True, True, False, True, False, True, True, True, True, True])
    assert chain_tau(blocks, right) == pytest.approx(1 + (2 + 0) / 2)
    assert chain_tau(blocks[:, 2:], right[8:]) is None


def test_a_reduced_vocabulary_draft_trains_and_saves_its_own_head(trained_vocab, target4):
    job, result, _ = trained_vocab
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    assert 0 < logs[-1]["outside"] < 0.5
    path = Path(result.artifact)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (NV, target4.hidden_size)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].shape == (target4.vocab_size,)
    config = json.loads((path / "config.json").read_text())
    assert config["draft_vocab_size"] == NV and config["lm_head"] == "draft"
    assert 0.5 < config["draft_vocab_coverage"] < 1
    draft, _ = load_dflash(path, target4)
    assert draft.config.draft_vocab_size == NV and torch.equal(draft.d2t, job.build_module().d2t)


@pytest.mark.parametrize("tree", [False, True])
def test_a_reduced_vocabulary_draft_decodes_losslessly(trained_vocab, target4, tree):
    _, result, rows = trained_vocab
    fast, _ = decode_rows(target4, result.artifact, rows, tree)
    assert fast.stats.tau > 1.3  # ids mapped back through d2t: whole blocks still accepted


def test_a_reduced_vocabulary_draft_exports_for_vllm_and_is_refused_for_sglang(trained_vocab, target4, tmp_path):
    from safetensors.torch import save_file

    from draftsmith.export.api import export_artifact, import_export, verify_export

    _, result, _ = trained_vocab
    res = export_artifact(result.artifact, "vllm", tmp_path / "vllm", target4)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == NV and cfg["vocab_size"] == target4.vocab_size
    names = load_file(str(res.out / "model.safetensors"))
    assert names["lm_head.weight"].shape == (NV, target4.hidden_size) and names["d2t"].shape == (NV,)
    assert not any("embed" in k for k in names)
    assert any("d2t/t2d consistent" in c for c in res.checks) and any("reloads strictly" in c for c in res.checks)
    assert verify_export(res.out, target4)
    back = import_export(res.out, tmp_path / "back")
    a, _ = load_dflash(result.artifact, target4)
    b, _ = load_dflash(back, target4)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    with pytest.raises(ConfigError, match=r"config.json: draft_vocab_size 40: SGLang"):
        export_artifact(result.artifact, "sglang", tmp_path / "sglang", target4)
    assert not (tmp_path / "sglang").exists()
    bad = dict(names)
    bad["d2t"] = bad["d2t"].flip(0).contiguous()
    save_file(bad, str(res.out / "model.safetensors"))
    with pytest.raises(Exception, match="d2t"):
        verify_export(res.out, target4)


def test_each_vllm_patch_lives_in_its_method_folder_and_the_runner_names_none():
    """A fix of vLLM's own code for one method's drafter is that method's: its serving entry names the patch
    and the file that holds it (a module of its folder the runner loads by path in vLLM's environment, held
    by scripts/check_imports.py to no draftsmith import); export/vllm_run.py holds no patch and names no
    method."""
    import ast

    from repo_scripts import ROOT, load_script

    from draftsmith import methods
    from draftsmith.layouts.serving import VllmPatch

    checker = load_script("check_imports")
    named = []
    for method in methods.all_methods():
        if method.serving is None:
            continue
        for fmt, entry in method.get("serving").vllm.items():
            for patch in entry.patches:
                assert isinstance(patch, VllmPatch), (method.name, fmt, patch)
                rel = patch.file.resolve().relative_to(ROOT)
                assert rel.parts[0] in checker.METHODS and len(rel.parts) == 2, rel
                assert checker.engine_side(checker.module_name(ROOT / rel)), rel
                tree = ast.parse(patch.file.read_text(encoding="utf-8"))
                table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                             and any(getattr(t, "id", None) == "PATCHES" for t in n.targets))
                assert patch.name in [ast.literal_eval(k) for k in table.keys], (rel, patch.name)
                named.append((method.name, patch.name))
    assert ("dflash", "dflash-context-knorm") in named and ("dspark", "dflash-context-knorm") in named
    runner = ast.parse((ROOT / "export" / "vllm_run.py").read_text(encoding="utf-8"))
    code = ast.unparse(runner.body[1:])  # less its docstring, whose job example names vLLM's method "eagle3"
    assert "PATCHES =" not in code and not any(m in code for m in checker.METHODS), "export/ names a method"


def test_the_vllm_runner_applies_the_patches_it_is_given_by_file(tmp_path):
    """The runner loads each patch file by path (it cannot import draftsmith) and calls the named entry of its
    PATCHES; a name the file does not hold is one line naming the file and the names it has."""
    import importlib.util

    from repo_scripts import ROOT

    spec = importlib.util.spec_from_file_location("vllm_run_under_test", ROOT / "export" / "vllm_run.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    fix = tmp_path / "vllm_patches.py"
    fix.write_text('PATCHES = {"fix-a": lambda: "patched a", "not-here": lambda: None}\n')
    given = [{"name": "fix-a", "file": str(fix)}, {"name": "not-here", "file": str(fix)}]
    assert runner.apply_patches(given) == ["patched a"]
    with pytest.raises(ValueError) as e:
        runner.apply_patches([{"name": "fix-b", "file": str(fix)}])
    assert str(e.value) == f"{fix}: no patch 'fix-b' in its PATCHES (it has: fix-a, not-here)"
