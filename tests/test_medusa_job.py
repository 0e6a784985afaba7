"""Medusa end to end on the tiny target: train through the one loop, save, reload as a proposer,
and decode losslessly (chain and tree, greedy and sampled)."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.generate import speculative_generate
from draftsmith.errors import FingerprintMismatch
from draftsmith.heads.vocab import vocab_coverage
from draftsmith.medusa.job import MedusaJob, MedusaJobConfig
from draftsmith.medusa.model import load_medusa
from draftsmith.training import TrainConfig, train


def self_distilled_rows(target, n=32, prompt_len=6, new=24, seed=0):
    """Rows the target wrote itself (greedy), assistant tokens in the loss mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, target.vocab_size, (n, prompt_len), generator=g)
    out = target.model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    rows = []
    for i, seq in enumerate(out.tolist()):
        rows.append({"input_ids": seq, "loss_mask": [0] * prompt_len + [1] * new, "row_id": i})
    return rows


@pytest.fixture(scope="module")
def medusa_artifact(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("medusa")
    rows = self_distilled_rows(tiny_target)
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp / "artifact"), num_heads=3,
                          num_layers=1, eval_fraction=0.125, calibration_rows=8, tree_budget=10,
                          tree_max_rank=4,
                          train=TrainConfig(lr=3e-3, max_steps=40, batch_size=4, warmup_steps=5,
                                            output_dir=str(tmp / "run"), log_every=10, progress=False))
    cfg.evaluate.enabled = False
    job = MedusaJob(cfg, tiny_target, rows)
    result = train(job, cfg.train)
    return result, tmp / "artifact"


def test_training_learns_and_writes_a_complete_artifact(medusa_artifact, tiny_target):
    result, path = medusa_artifact
    assert result.artifact == path
    assert {p.name for p in path.iterdir()} >= {"model.safetensors", "config.json", "manifest.json", "tree.json"}
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "medusa" and manifest["target"] == tiny_target.fingerprint()
    train_log = [r for r in result.history if r["type"] == "train"]
    assert train_log[-1]["loss"] < 0.8 * train_log[0]["loss"]
    assert "head0/top1" in train_log[-1] and "eval/head2/top5" in result.metrics
    tree = json.loads((path / "tree.json").read_text())["paths"]
    assert 1 <= len(tree) <= 10 and all(p[:-1] in tree for p in tree if len(p) > 1)


def test_reload_refuses_another_target(medusa_artifact, other_target):
    with pytest.raises(FingerprintMismatch, match="vocab_size"):
        load_medusa(medusa_artifact[1], other_target)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_medusa_decoding_is_lossless(medusa_artifact, tiny_target, mode):
    proposer = build_proposer(f"medusa:{medusa_artifact[1]}", tiny_target)
    prompts = torch.randint(3, tiny_target.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)[:, 5:]
    kwargs = {"k": 3} if mode == "chain" else {"k": None, "tree": proposer.default_tree_spec()}
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=20, eos_ids=[], **kwargs)
    assert out.tokens == ref.tolist()
    assert out.stats.tau >= 1.0 and out.stats.proposed > 0
    # sampling goes through the same proposer without error and respects the budget
    sampled = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=12, temperature=1.0,
                                   eos_ids=[], seed=3, **kwargs)
    assert all(len(t) == 12 for t in sampled.tokens)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_bf16_heads_stay_lossless(medusa_artifact, tiny_target, mode):
    proposer = build_proposer(f"medusa:{medusa_artifact[1]}", tiny_target)
    assert proposer.use_dtype(torch.bfloat16)
    assert {p.dtype for p in proposer.heads.parameters()} == {torch.bfloat16}
    assert tiny_target.model.lm_head.weight.dtype == torch.float32
    prompts = torch.randint(3, tiny_target.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)[:, 5:]
    kwargs = {"k": 3} if mode == "chain" else {"k": None, "tree": proposer.default_tree_spec()}
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=20, eos_ids=[], **kwargs)
    assert out.tokens == ref.tolist() and out.stats.proposed > 0


def test_the_tree_is_cut_once_to_what_pays_and_stays_lossless(medusa_artifact, tiny_target):
    from draftsmith.decoding.budget import VerifyCost

    proposer = build_proposer(f"medusa:{medusa_artifact[1]}", tiny_target)
    tree = proposer.tree
    assert tree.probs is not None and len(tree.probs) == len(tree.paths)
    assert tree.probs == sorted(tree.probs, reverse=True)  # build order is most probable first
    full = proposer.default_tree_spec()
    free = [0.0] * (proposer.num_heads + 1)
    assert proposer.fit_tree(full, VerifyCost((1.0,) * 20, 0.01), free).capacity() == full.capacity()
    # each row costs `step`: above p1 / (1 + p0 - p1) the second node no longer pays, below p0 the first does
    p = sorted(tree.probs, reverse=True)
    assert p[0] > p[1]
    step = (p[1] / (1 + p[0] - p[1]) + p[0]) / 2
    cut = proposer.fit_tree(full, VerifyCost(tuple(1.0 + step * n for n in range(20)), 0.01), free)
    assert cut.capacity() == 1 and cut.depth == 1
    # heads that cost time count against the depth that needs them
    dear = [0.0] + [5.0 * d for d in range(1, proposer.num_heads + 1)]
    assert proposer.fit_tree(full, VerifyCost((1.0,) * 20, 0.01), dear).capacity() == 0
    measured = proposer.measure_head_cost(0.01)
    assert len(measured) == proposer.num_heads + 1 and measured[0] == 0 and all(x > 0 for x in measured[1:])
    prompts = torch.randint(3, tiny_target.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)[:, 5:]
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=20, eos_ids=[], k=None, tree=cut)
    assert out.tokens == ref.tolist()
    assert out.stats.proposed <= cut.capacity() * out.stats.target_forwards
    # an older artifact without node probabilities gets them from its manifest's calibration accuracies
    tree_json = json.loads((medusa_artifact[1] / "tree.json").read_text())
    assert "probs" in tree_json
    from draftsmith.medusa.model import MedusaTree

    acc = json.loads((medusa_artifact[1] / "manifest.json").read_text())["metrics"]["calibration_rank_accuracy"]
    old = MedusaTree.from_json({k: v for k, v in tree_json.items() if k != "probs"}).with_probs(acc)
    assert old.probs == pytest.approx(tree.probs)


def test_a_routed_medusa_tree_is_cut_by_the_verifiers_cost_model(medusa_artifact, tiny_target):
    from draftsmith.decoding.budget import VerifyCost
    from draftsmith.decoding.routing import RoutedProposer

    medusa = build_proposer(f"medusa:{medusa_artifact[1]}", tiny_target)
    routed = RoutedProposer({"kind": "routing_policy", "domains": {"chat": {"proposer": "m"}}}, {"m": medusa})
    routed.route(domain="chat")
    prompts = torch.randint(3, tiny_target.vocab_size, (2, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 5:]
    free = speculative_generate(tiny_target, routed, prompts, 12, eos_ids=[], k=None,
                                tree=routed.default_tree_spec(), cost=VerifyCost((1.0,) * 20, 0.01))
    assert free.tokens == ref.tolist() and free.stats.proposed > 0
    # every node costs ten target steps: the route's tree is cut to nothing, which is plain decoding
    dear = speculative_generate(tiny_target, routed, prompts, 12, eos_ids=[], k=None,
                                tree=routed.default_tree_spec(),
                                cost=VerifyCost(tuple(1.0 + 10 * n for n in range(20)), 0.01))
    assert dear.tokens == ref.tolist() and dear.stats.proposed == 0 and routed.active[1].capacity() == 0


def test_evaluation_report_is_written_into_the_artifact(medusa_artifact, tiny_target, tmp_path):
    import shutil

    from draftsmith.evaluation.after_training import EvalAfterTraining, evaluate_into_artifact

    art = tmp_path / "art"
    shutil.copytree(medusa_artifact[1], art)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": d, "turns": [f"add {i} and {i}"]})
                                 for d in ("math", "code") for i in range(2)) + "\n")
    report = evaluate_into_artifact(art, tiny_target, "medusa", EvalAfterTraining(
        prompts=[str(prompts)], limit_per_domain=2, max_new_tokens=8))
    assert set(report["domains"]) == {"math", "code"}
    assert (report["settings"]["tree"]
            == list(build_proposer(f"medusa:{art}", tiny_target).default_tree_spec().branching))
    assert all(row["lossless"] for row in report["domains"].values())
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["eval"]["report"] == "eval/report.json" and (art / "eval" / "report.md").is_file()
    # evaluate.domains: the same prompts of one domain, the other left out
    math_only = evaluate_into_artifact(art, tiny_target, "medusa", EvalAfterTraining(
        prompts=[str(prompts)], limit_per_domain=2, max_new_tokens=8, domains=["math"]))
    assert set(math_only["domains"]) == {"math"}
    assert [p["source"] for p in math_only["prompts"]] == [p["source"] for p in report["prompts"]
                                                         if p["domain"] == "math"]


def test_a_compared_tree_gets_its_gpu_sized_tree_beside_it(medusa_artifact, tiny_target, tmp_path):
    """One run puts several heads' τ at a GPU's budget side by side: every compared proposer that decodes a tree
    of its own is also decoded, untimed, with its uncut GPU-sized tree; a chain gets none."""
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    art = medusa_artifact[1]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": d, "turns": [f"add {i} and {i}"]})
                                 for d in ("math", "code") for i in range(2)) + "\n")
    report = evaluate(tiny_target, f"medusa:{art}", prompts=[str(prompts)], max_new_tokens=8, tree_from_proposer=True,
                      compare=[f"medusa:{art}@tree", f"medusa:{art}@chain=2", "ngram"], cost_context=16,
                      cost_k_max=3, cost_repeats=1, repeats=1, remeasure=0)
    tree, chain = f"medusa:{art}@tree", f"medusa:{art}@chain=2"
    whole = report["settings"]["compare_settings"][tree]["gpu_tree"]
    assert whole == report["settings"]["gpu_tree"] and report["settings"]["compare_settings"][chain]["gpu_tree"] is None
    for d in list(report["domains"].values()) + [report["overall"]]:
        beside = d["compare"][tree]["gpu_tree"]
        assert beside["lossless"] is True and "tokens_per_s" not in beside  # untimed: τ only
        assert beside["tau"] == d["gpu_tree"]["tau"]  # the same head at the same uncut tree, greedy
        assert "gpu_tree" not in d["compare"][chain] and "gpu_tree" not in d["compare"]["ngram"]
    assert all(set(m) == {"base", "spec", "hf", f"cmp:{tree}", f"cmp:{chain}", "cmp:ngram"}
               for m in (p["timing"]["measurements"] for p in report["prompts"]))
    md = (write_report(report, tmp_path / "r") / "report.md").read_text()
    assert "τ with each proposer's GPU-sized tree" in md and f"| domain | medusa:{art} | {tree} |" in md
    # the side-by-side entries are routing candidates under their proposer spec, scored by their own GPU τ
    from draftsmith.planning.policy import build_policy, write_policy

    policy = build_policy([report | {"_path": "r"}], threshold=0.0, criterion="tau")
    for d in policy["domains"].values():
        assert set(d["candidates"]) <= {f"medusa:{art}", "ngram"} and "@" not in d["proposer"]
        assert d["basis"]["gpu_tree"] is (d["proposer"] != "ngram")
    routed = build_proposer(f"route:{write_policy(policy, tmp_path / 'policy.json')}", tiny_target)
    assert routed.gpu_tree() is not None or all(d["proposer"] == "ngram" for d in policy["domains"].values())


# --- Medusa-2: heads + a LoRA adapter on the target -------------------------------------------------------

def test_medusa2_trains_adapter_and_heads_and_decodes_losslessly_with_the_adapted_target(tiny_target, tmp_path):
    from peft import PeftModel

    from draftsmith.medusa.medusa2 import Medusa2Config
    from draftsmith.training import TrainConfig, train

    rows = self_distilled_rows(tiny_target)
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "artifact"), num_heads=2,
                          num_layers=1, eval_fraction=0.125, calibration_rows=8, tree_budget=6, tree_max_rank=3,
                          medusa2=Medusa2Config(enabled=True, r=4, alpha=8, base_weight=1.0),
                          train=TrainConfig(lr=3e-3, max_steps=12, batch_size=4, warmup_steps=0,
                                            output_dir=str(tmp_path / "run"), log_every=1, progress=False))
    cfg.evaluate.enabled = False
    job = MedusaJob(cfg, tiny_target, rows)
    module = job.build_module()
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("heads.") or "lora_" in n for n in trainable)
    # at step 0 the adapter is the identity (LoRA B = 0): the KL to the original target is zero
    _, m0 = job.loss(module, job.collate(list(job.train_rows())[:4]))
    assert m0["base/kl"] == pytest.approx(0.0, abs=1e-6) and m0["base/agree"] == 1.0

    result = train(job, cfg.train)
    path = result.artifact
    train_log = [r for r in result.history if r["type"] == "train"]
    assert train_log[-1]["base/kl"] > 0.0  # the adapter moved the target, and the KL term measured it
    for k, v in tiny_target.model.state_dict().items():  # the shared original target is untouched
        assert torch.equal(v, before[k]), k
    assert (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file()
    drift = json.loads((path / "manifest.json").read_text())["metrics"]["target_drift"]
    assert drift["positions"] > 0 and 0.0 <= drift["agreement"] <= 1.0 and drift["kl"] >= 0.0
    # peft itself loads the adapter (a real consumer of the layout)
    import copy

    peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny_target.model), str(path))
    assert any("lora_A" in n for n, _ in peft_model.named_parameters())

    proposer = build_proposer(f"medusa:{path}", tiny_target)
    adapted = proposer.verifier_target
    assert adapted is not None
    prompts = torch.randint(3, tiny_target.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = adapted.model.generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0)[:, 5:]
    out = speculative_generate(adapted, proposer, prompts, max_new_tokens=16, eos_ids=[], k=None,
                               tree=proposer.default_tree_spec())
    assert out.tokens == ref.tolist()  # lossless with respect to the adapted target
    merged_diff = sum(float((adapted.model.state_dict()[k] - v).abs().sum()) for k, v in before.items()
                      if k in adapted.model.state_dict())
    assert merged_diff > 0  # the adapter really is merged into the verifier
    # how far the adapter moved the target: nowhere for the original itself, somewhere for the adapted one
    from draftsmith.medusa.medusa2 import target_drift

    same = target_drift(tiny_target.model, tiny_target.model, rows, 0, 64)
    assert same["agreement"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-6) and same["positions"] > 0
    moved = target_drift(tiny_target.model, adapted.model, rows, 0, 64)
    assert 0.0 <= moved["agreement"] <= 1.0 and moved["kl"] > 0.0


def test_medusa2_export_ships_the_adapted_target(tiny_target, tmp_path, capsys):
    """A Medusa-2 export carries the merged target next to the heads, and serve.md points at it."""
    from transformers import AutoModelForCausalLM

    from draftsmith.export.api import export_artifact
    from draftsmith.medusa.medusa2 import Medusa2Config
    from draftsmith.training import TrainConfig, train

    rows = self_distilled_rows(tiny_target, n=12)
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "artifact"), num_heads=2,
                          num_layers=1, eval_fraction=0.2, calibration_rows=4, tree_budget=4, tree_max_rank=2,
                          medusa2=Medusa2Config(enabled=True, r=2, alpha=4),
                          train=TrainConfig(lr=1e-2, max_steps=3, batch_size=4, warmup_steps=0,
                                            output_dir=str(tmp_path / "run"), progress=False))
    cfg.evaluate.enabled = False
    path = train(MedusaJob(cfg, tiny_target, rows), cfg.train).artifact
    res = export_artifact(path, "vllm", tmp_path / "export", tiny_target)
    merged = AutoModelForCausalLM.from_pretrained(res.out / "adapted_target")
    want = build_proposer(f"medusa:{path}", tiny_target).verifier_target.model.state_dict()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, want[k], msg=k)
    assert str(res.out / "adapted_target") in (res.out / "serve.md").read_text()
    # `draftsmith medusa2-drift` measures the adapter's drift again, on a dataset's held-out rows
    from draftsmith.cli import main
    from draftsmith.data import generate_dataset
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"q": f"Question {i}?"}) + "\n" for i in range(4)))
    data = generate_dataset(DataConfig(sources=[SourceConfig(name="q", path=str(questions), prompt="q", domain="chat")],
                                       output_dir=str(tmp_path / "data"),
                                       generation=GenerationConfig(max_new_tokens=6, batch_size=4)),
                            tiny_target, progress=False)
    assert main(["medusa2-drift", str(path), "--data", str(data), "--target", str(tiny_target.folder),
                 "--eval-fraction", "0.5", "--max-length", "64"]) == 0
    assert "held-out rows" in capsys.readouterr().out
    # side by side with another proposer, these heads would be verified by the un-adapted target
    from draftsmith.errors import ConfigError
    from draftsmith.evaluation.evaluate import evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Say hi."]}) + "\n")
    with pytest.raises(ConfigError, match="own adapted target"):
        evaluate(tiny_target, "ngram", prompts=[prompts], compare=[f"medusa:{path}"], max_new_tokens=4)


def test_medusa2_warm_starts_its_heads_and_trains_its_adapter_at_a_lower_lr(medusa_artifact, tiny_target, tmp_path):
    from draftsmith.artifact import load_artifact
    from draftsmith.medusa.medusa2 import Medusa2Config
    from draftsmith.training.loop import param_groups

    _, heads_path = medusa_artifact
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "artifact"), num_heads=3,
                          num_layers=1, eval_fraction=0.125, calibration_rows=4, tree_budget=4, tree_max_rank=2,
                          medusa2=Medusa2Config(enabled=True, r=4, alpha=8, adapter_lr_scale=0.25),
                          train=TrainConfig(lr=1e-5, max_steps=2, batch_size=4, warmup_steps=0,
                                            warm_start=str(heads_path), output_dir=str(tmp_path / "run"),
                                            progress=False))
    cfg.evaluate.enabled = False
    job = MedusaJob(cfg, tiny_target, self_distilled_rows(tiny_target, n=16))
    module = job.build_module()
    names = {id(p): n for n, p in module.named_parameters()}
    groups = param_groups(module, 0.0, job.lr_scale)
    assert {g["lr_scale"] for g in groups} == {1.0, 0.25}
    for g in groups:  # the adapter at a quarter of the heads' lr, every head parameter at the base lr
        assert all(("lora_" in names[id(p)]) == (g["lr_scale"] == 0.25) for p in g["params"])
    result = train(job, cfg.train)
    _, warm = load_artifact(heads_path, kind="medusa")
    for k, v in result.module.heads.state_dict().items():  # the Medusa-1 heads, moved by 2 steps of lr 1e-5
        assert (v - warm[k]).abs().max() < 1e-4, k


def test_medusa2_from_a_capture_cache_never_runs_the_original_and_its_kl_is_the_online_one(tiny_target, tmp_path,
                                                                                           monkeypatch):
    """Medusa-2 with a capture cache reads the original target's top-k logits instead of running it; with
    k = V the renormalised top-k KL is the full-vocabulary KL the online job computes."""
    from draftsmith.capture.cache import capture_dataset
    from draftsmith.capture.online import CaptureSource
    from draftsmith.medusa.medusa2 import Medusa2Config
    from draftsmith.training import TrainConfig, train

    rows = self_distilled_rows(tiny_target, n=16)
    V = tiny_target.vocab_size
    capture_dataset(tiny_target, rows, tmp_path / "cache", layers=[], topk=V, progress=False)

    def config(name, **kw):
        return MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / name), num_heads=2,
                               num_layers=1, eval_fraction=0.125, calibration_rows=4, tree_budget=4,
                               tree_max_rank=2, medusa2=Medusa2Config(enabled=True, r=4, alpha=8),
                               train=TrainConfig(lr=1e-2, max_steps=4, batch_size=4, warmup_steps=0,
                                                 output_dir=str(tmp_path / f"{name}.run"), progress=False), **kw)

    cached = config("cached", capture_cache=str(tmp_path / "cache"), kd_topk=V)
    cached.evaluate.enabled = False
    job = MedusaJob(cached, tiny_target, rows)
    assert job.features.offline
    batch = job.collate(list(job.train_rows())[:4])
    module = job.build_module()
    _, m0 = job.loss(module, batch)
    assert m0["base/kl"] == pytest.approx(0.0, abs=1e-5)  # LoRA B = 0: the adapted target is the original
    assert m0["base/agree"] == 1.0

    def no_online(self, batch):
        raise AssertionError("the original target ran although its logits are cached")

    with monkeypatch.context() as m:
        m.setattr(CaptureSource, "online_features", no_online)
        result = train(job, cached.train)
    assert (result.artifact / "adapter_model.safetensors").is_file()
    moved = result.module
    _, offline = job.loss(moved, batch)
    online_cfg = config("online")
    online_cfg.evaluate.enabled = False
    _, online = MedusaJob(online_cfg, tiny_target, rows).loss(moved, batch)
    assert offline["base/kl"] > 1e-6  # the adapter moved the target
    assert offline["base/kl"] == pytest.approx(online["base/kl"], rel=1e-3, abs=1e-6)
    assert offline["head0/top1"] == online["head0/top1"] and offline["base/agree"] == online["base/agree"]


# --- heads over a draft vocabulary -------------------------------------------------------------------------

def test_draft_vocabulary_heads_train_calibrate_and_decode_losslessly(tiny_target, tmp_path):
    # the tiny target loops over a few tokens per prompt: each row twice, so held-out rows share training tokens
    rows = self_distilled_rows(tiny_target)
    rows += [{**r, "row_id": r["row_id"] + len(rows)} for r in rows]
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "artifact"), num_heads=3,
                          num_layers=1, eval_fraction=0.125, calibration_rows=8, tree_budget=10, tree_max_rank=4,
                          draft_vocab_size=48,
                          train=TrainConfig(lr=3e-3, max_steps=30, batch_size=4, warmup_steps=5,
                                            output_dir=str(tmp_path / "run"), log_every=10, progress=False))
    cfg.evaluate.enabled = False
    job = MedusaJob(cfg, tiny_target, rows)
    coverage = vocab_coverage(job.counts, job.draft_vocab[1])
    assert 0.5 < coverage <= 1.0
    result = train(job, cfg.train)
    train_log = [r for r in result.history if r["type"] == "train"]
    assert train_log[-1]["loss"] < 0.8 * train_log[0]["loss"]
    heads, tree, manifest = load_medusa(result.artifact, tiny_target)
    assert heads.heads[0].lm_head.weight.shape[0] == 48 and int(heads.t2d.sum()) == 48
    assert manifest["metrics"]["draft_vocab_coverage"] == pytest.approx(coverage)
    # calibration compares TARGET ids: the tree's accuracies are those of target tokens
    acc = manifest["metrics"]["calibration_rank_accuracy"]
    assert acc[0][0] > 0 and tree is not None

    proposer = build_proposer(f"medusa:{result.artifact}", tiny_target)
    prompts = torch.tensor([r["input_ids"][:6] for r in rows[:3]])  # continuations inside the draft vocabulary
    ref = tiny_target.model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)[:, 6:]
    for kwargs in ({"k": 3}, {"k": None, "tree": proposer.default_tree_spec()}):
        out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=20, eos_ids=[], **kwargs)
        assert out.tokens == ref.tolist()
        assert out.stats.accepted > 0  # the draft ids were mapped back: some proposals were right


def test_a_warm_start_trains_against_the_vocabulary_the_heads_hold(tiny_target, tmp_path):
    """New data counts another draft vocabulary; the warm-started heads keep theirs, and so must the labels."""
    from draftsmith.artifact import load_artifact

    def job_on(rows, name, **train_kw):
        cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / name), num_heads=2,
                              num_layers=1, eval_fraction=0.125, calibration_rows=4, tree_budget=6, draft_vocab_size=24,
                              train=TrainConfig(lr=3e-3, max_steps=6, batch_size=4, warmup_steps=0, progress=False,
                                                output_dir=str(tmp_path / f"{name}.run"), **train_kw))
        cfg.evaluate.enabled = False
        return MedusaJob(cfg, tiny_target, rows)

    old_rows, new_rows = self_distilled_rows(tiny_target, seed=0), self_distilled_rows(tiny_target, seed=7)
    first = job_on(old_rows, "first")
    art = train(first, first.cfg.train).artifact
    second = job_on(new_rows, "second", warm_start=str(art))
    module = second.build_module()
    _, weights = load_artifact(art, kind="medusa")
    module.load_state_dict(weights, strict=False)
    assert not torch.equal(second.draft_vocab[1], module.t2d)  # the new data would pick other tokens
    batch = second.collate(new_rows[:4])
    with torch.no_grad():
        assert second.loss(module, batch)[0] == pytest.approx(float(first.loss(module, batch)[0]))
    result = train(second, second.cfg.train)
    _, _, manifest = load_medusa(result.artifact, tiny_target)
    _, saved = load_artifact(result.artifact, kind="medusa")
    assert torch.equal(saved["t2d"], weights["t2d"])
    assert manifest["metrics"]["draft_vocab_coverage"] == pytest.approx(vocab_coverage(second.counts, weights["t2d"]))


def test_medusa_trains_under_bf16_autocast_on_the_cpu(tiny_target, tmp_path):
    """What `make demo` runs on a CPU with AVX512-BF16 (train.mixed_precision auto = bf16): the heads learn,
    stay float32, calibrate their tree and decode losslessly with the float32 target."""
    rows = self_distilled_rows(tiny_target)
    cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "artifact"), num_heads=2,
                          num_layers=1, eval_fraction=0.125, calibration_rows=4, tree_budget=6, tree_max_rank=3,
                          train=TrainConfig(lr=3e-3, max_steps=12, batch_size=4, warmup_steps=2, mixed_precision="bf16",
                                            output_dir=str(tmp_path / "run"), log_every=4, progress=False))
    cfg.evaluate.enabled = False
    result = train(MedusaJob(cfg, tiny_target, rows), cfg.train)
    logs = [r for r in result.history if r["type"] == "train"]
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert all(p.dtype == torch.float32 for p in result.module.parameters()) and tiny_target.dtype == torch.float32
    proposer = build_proposer(f"medusa:{tmp_path / 'artifact'}", tiny_target)
    prompts = torch.randint(3, tiny_target.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = tiny_target.model.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 5:]
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=12, eos_ids=[], k=None,
                               tree=proposer.default_tree_spec())
    assert out.tokens == ref.tolist()


def test_train_rows_trains_on_fewer_rows_against_the_same_held_out_rows(tiny_target, tmp_path):
    """train.train_rows: a learning curve's point. The job keeps N training rows, the held-out split does not
    move, and the artifact's manifest records the N that was used."""
    rows = self_distilled_rows(tiny_target, n=24)

    def job(n):
        cfg = MedusaJobConfig(target="tiny", data="in-memory", output=str(tmp_path / f"a{n}"), num_heads=2,
                              num_layers=1, eval_fraction=0.125, calibration_rows=4, tree_budget=4, tree_max_rank=2,
                              train=TrainConfig(lr=3e-3, max_steps=2, batch_size=4, train_rows=n, progress=False,
                                                output_dir=str(tmp_path / f"run{n}")))
        cfg.evaluate.enabled = False
        return cfg, MedusaJob(cfg, tiny_target, rows)

    _, whole = job(None)
    cfg, part = job(8)
    assert len(whole.train_set) == 21 and len(part.train_set) == 8 and part.eval_set == whole.eval_set
    train(part, cfg.train)
    manifest = json.loads((tmp_path / "a8" / "manifest.json").read_text())
    assert manifest["config"]["train"]["train_rows"] == 8
    with pytest.raises(ValueError, match="train.train_rows=22 but the data has 21 training rows"):
        job(22)
