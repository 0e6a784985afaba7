"""scripts/speculators_compare.py on a tiny 3-layer Llama target: speculators' own EAGLE-3 trainer runs on CPU
on our rows and capture cache, its head imports into an EagleHead (the export mapping read backwards, pinned
by a round trip), its loss sees the positions and teachers ours does, and the imported head drafts losslessly
in draftsmith's decoder, side by side with one of ours."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import plain_linears_one_thread

pytest.importorskip("speculators")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "speculators_compare.py"
PROMPTS = ["What is the capital of France?", "Add 2 and 3.", "Write a loop in Python.", "Summarize the passage.",
           "How many clips did Natalia sell?", "Translate the sentence into French.", "def add(a, b):",
           "Name a fox."]
LAYERS = [0, 1, 2]  # default_eagle3_layers(4)


@pytest.fixture(autouse=True)
def _one_thread():
    with plain_linears_one_thread():
        yield


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("speculators_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(sc, tiny_tokenizer, tmp_path_factory):
    """A 3-layer target as an HF folder, self-distilled rows, their capture cache, a speculators-trained head."""
    from tiny_models import make_target, prompt_rows

    from draftsmith.capture.cache import capture_dataset

    tmp = tmp_path_factory.mktemp("peer")
    torch.set_num_threads(1)
    target = make_target(tiny_tokenizer, seed=0, layers=4, folder=tmp / "target")
    rows = prompt_rows(target, tmp, PROMPTS)
    capture_dataset(target, list(rows), tmp / "data" / "capture", layers=LAYERS, topk=1, last_hidden=True,
                    progress=False)
    cfg = sc.PeerConfig(target=str(tmp / "target"), data=str(tmp / "data"), out=str(tmp / "theirs"), seconds=60,
                        max_steps=3, draft_vocab_size=64, ttt_steps=3, warmup_steps=0, lr=3e-3, max_length=64,
                        eval_fraction=0.25, precision="no", progress=False)
    art = sc.train_peer(cfg, target, rows)
    return {"tmp": tmp, "target": target, "rows": rows, "cfg": cfg, "art": art}


def _speculators_model(export_dir: Path, target):
    """speculators' Eagle3DraftModel on an export of ours (the verifier's embedding read from the target)."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from draftsmith.eagle.export import load_speculators

    config = Eagle3SpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = str(target.folder)
    return load_speculators(export_dir, config)


def test_import_round_trips_through_the_speculators_layout(sc, setup, tmp_path):
    """our head -> speculators export -> speculators' model -> import: the same tensors, the same draft logits."""
    from draftsmith.eagle.model import load_eagle
    from draftsmith.export import export_artifact

    target = setup["target"]
    head, _ = load_eagle(setup["art"], target)
    res = export_artifact(setup["art"], "vllm", tmp_path / "export", target=target, verify=False)
    model = _speculators_model(res.out, target)
    back = sc.import_head(model, target, LAYERS, setup["cfg"])
    ours, theirs = head.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name

    ids = torch.tensor([setup["rows"][0]["input_ids"][:12]])
    feats = torch.randn(1, ids.shape[1], 3 * target.hidden_size)
    with torch.no_grad():
        a, b = head(ids, feats, steps=3), back(ids, feats, steps=3)
        for j in range(3):
            assert torch.equal(head.logits(a.hidden[j]), back.logits(b.hidden[j]))
    with pytest.raises(SystemExit, match="no place in an EagleHead"):
        sc.import_state({**model.state_dict(), "mask_hidden.weight": torch.ones(3)})
    # an EAGLE-3.1 draft (speculators' own defaults for eagle3: a norm before fc, post-norm feedback) is held too
    model.config.norm_output = True
    back31 = sc.import_head(model, target, LAYERS, setup["cfg"])
    assert back31.config.norm_output and not back31.config.norm_before_fc


def test_speculators_loss_sees_our_positions_and_teachers(sc, setup, tmp_path):
    """speculators' per-step KL on two rows we hand it (its dataset base, collate packing both rows into one
    sequence, shift_batch and forward) equals the KL of the imported head at draftsmith's positions (step j
    at base t: learned where x_{t+2+j} is target-written) against draftsmith's teacher (the target's lm_head
    rows of the draft vocabulary times its last hidden state at t+1+j). Random tokens and states, so that a
    teacher one position off gives another number (the tiny target itself writes one token over and over)."""
    from speculators.losses import resolve_loss_config

    from draftsmith.capture.cache import ShardReader, ShardWriter
    from draftsmith.eagle.model import shift_left
    from draftsmith.heads.vocab import draft_vocabulary, token_counts
    from draftsmith.targets.families import lm_head

    target, cfg, S, T, H = setup["target"], setup["cfg"], 3, 40, setup["target"].hidden_size
    g = torch.Generator().manual_seed(0)
    rows = [{"row_id": i, "input_ids": torch.randint(3, target.vocab_size, (T,), generator=g).tolist(),
             "loss_mask": [0] * (10 + i) + [1] * (T - 10 - i)} for i in range(2)]
    # the teacher's sharpness grows along the row, so a teacher one position off is off by a margin, whatever
    # the random head's logits
    sharpness = torch.linspace(1.0, 12.0, T)[:, None]
    with ShardWriter(tmp_path / "capture", LAYERS, topk=1, hidden_dtype=torch.float32,
                     fingerprint=target.fingerprint()) as writer:
        for r in rows:
            writer.add(r["row_id"], {i: torch.randn(T, H, generator=g) for i in LAYERS}, torch.zeros(T, 1),
                       torch.zeros(T, 1, dtype=torch.long), sharpness * torch.randn(T, H, generator=g))
    reader = ShardReader(tmp_path / "capture")
    d2t, t2d, _ = draft_vocabulary(token_counts(rows, target.vocab_size), 64)
    model = sc.build_speculators_model(target, LAYERS, d2t, t2d, cfg)
    head = sc.import_head(model, target, LAYERS, cfg)
    mods = sc.speculators_modules()
    data = sc.captured_rows_dataset(rows, reader, LAYERS, cfg, torch.float32)
    batch = mods["data"].CollateFn(2 * T, H, 3, torch.float32,
                                   preprocess=mods["eagle3"].shift_batch)([data[0], data[1]])
    with torch.no_grad():
        _, _, metrics = model(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, ttt_steps=S,
                              ttt_step_loss_decay=1.0, loss_config=resolve_loss_config("kl_div", "eager"))

    states = [reader.get(r["row_id"]) for r in rows]
    ids = torch.tensor([r["input_ids"] for r in rows])
    lmask = torch.tensor([r["loss_mask"] for r in rows])
    feats = torch.stack([torch.cat([s[f"layer.{i}"] for i in LAYERS], dim=-1) for s in states])
    last = torch.stack([s["last_hidden"] for s in states])
    select = [shift_left(lmask, 2 + j).bool() for j in range(S)]
    w = lm_head(target.model).weight[head.t2d]

    def kl(student, teacher):
        p = torch.softmax(teacher, -1)
        return (p * (torch.log_softmax(teacher, -1) - torch.log_softmax(student, -1))).sum(-1).mean()

    with torch.no_grad():
        out = head(ids, feats, steps=S, select=select)
        for j in range(S):
            ours = kl(out.logits[j], shift_left(last, 1 + j)[select[j]] @ w.T)
            torch.testing.assert_close(metrics[f"loss_{j}_sum"], ours, rtol=1e-4, atol=1e-5)
            off = kl(out.logits[j], shift_left(last, 2 + j)[select[j]] @ w.T)  # a teacher one position off
            assert abs(float(off) - float(ours)) > 1e-2, (float(off), float(ours))


def test_speculators_trainer_trains_within_a_budget_and_its_head_drafts_losslessly(sc, setup):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.eagle.model import load_eagle

    target, rows = setup["target"], setup["rows"]
    head, manifest = load_eagle(setup["art"], target)
    by = manifest["trained_by"]
    assert by["package"] == "speculators" and by["steps"] == 3 and not by["stopped_by_budget"]
    assert by["patches"] and by["differences"] and manifest["config"]["trainer"] == "speculators"
    assert torch.isfinite(torch.tensor(manifest["metrics"]["speculators/train/loss"]))
    assert head.config.ttt_steps == 3 and head.config.target_layers == LAYERS and head.config.draft_vocab_size == 64

    prompts = [rows[i]["input_ids"][: list(rows[i]["loss_mask"]).index(1)] for i in range(3)]
    plain = speculative_generate(target, None, prompts, 10, k=0).tokens
    fast = speculative_generate(target, build_proposer(f"eagle:{setup['art']}", target), prompts, 10, k=3)
    assert fast.tokens == plain and fast.stats.proposed > 0

    # the wall-clock budget ends the run after the step it runs out in, whatever the horizon
    quick = sc.PeerConfig(**{**vars(setup["cfg"]), "seconds": 1e-6, "max_steps": 50,
                             "out": str(setup["tmp"] / "quick")})
    _, m = load_eagle(sc.train_peer(quick, target, rows), target)
    assert m["trained_by"]["steps"] == 1 and m["trained_by"]["stopped_by_budget"]


def test_the_command_line_trains_from_flags(sc, setup, tmp_path, capsys):
    cfg = setup["cfg"]
    assert sc.main(["train", "--target", cfg.target, "--data", cfg.data, "--out", str(tmp_path / "cli"),
                    "--max-steps", "1", "--ttt-steps", "2", "--draft-vocab-size", "32", "--max-length", "64",
                    "--eval-fraction", "0.25", "--precision", "no", "--warmup-steps", "0", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert manifest["trained_by"]["steps"] == 1 and manifest["config"]["ttt_steps"] == 2


def test_like_reads_our_artifacts_settings(sc, tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"kind": "eagle", "config": {
        "version": "eagle3", "target": "smollm2-135m", "data": "runs/b31/data",
        "capture_cache": "runs/b31/data/capture",
        "ttt_steps": 6, "step_decay": 0.8, "prompt_context": 64, "draft_layer": "target",
        "train": {"lr": 5e-4, "batch_size": 8, "schedule": "constant", "mixed_precision": "auto", "max_steps": None}}}))
    cfg = sc.PeerConfig(**sc.like_artifact(tmp_path))
    assert (cfg.capture, cfg.prompt_context, cfg.scheduler, cfg.batch_rows, cfg.like) == (
        "runs/b31/data/capture", 64, "none", 8, str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"kind": "medusa", "config": {}}))
    with pytest.raises(SystemExit, match="EAGLE-3"):
        sc.like_artifact(tmp_path)


def test_compare_decodes_both_heads_side_by_side(sc, setup, tmp_path):
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import TrainConfig, train

    target, cfg = setup["target"], setup["cfg"]
    ecfg = EagleJobConfig(target=cfg.target, data="in-memory", output=str(tmp_path / "ours"), ttt_steps=3,
                          draft_vocab_size=64, max_length=64, capture_cache=str(Path(cfg.data) / "capture"),
                          train=TrainConfig(lr=3e-3, max_steps=3, batch_size=4, output_dir=str(tmp_path / "run"),
                                            resume="never", progress=False, eval_batches=1),
                          evaluate=EvalAfterTraining(enabled=False))
    ours = Path(train(EagleJob(ecfg, target, setup["rows"]), ecfg.train).artifact)
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": "chat"}) + "\n" for p in PROMPTS[:2]))
    table = sc.compare(ours, setup["art"], tmp_path / "cmp", target=target, limit_per_domain=2, max_new_tokens=8,
                       chain=3, prompts=[str(prompts)], cost_model=False)
    runs, theirs = table["overall"], f"theirs (speculators {importlib.metadata.version('speculators')})"
    assert ({"ours (draftsmith) / tree", f"{theirs} / tree", "ours (draftsmith) / chain 3", f"{theirs} / chain 3"}
            <= set(runs))
    assert all(r["lossless"] for r in runs.values()) and all(r["tau"] >= 1 for r in runs.values())
    # each head's own uncut GPU-sized tree, in the same run
    assert {"ours (draftsmith) / GPU tree, uncut", f"{theirs} / GPU tree, uncut"} <= set(runs)
    assert f"| {theirs} / chain 3 |" in (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"| {theirs} / GPU tree, uncut |" in (tmp_path / "cmp" / "comparison.md").read_text()
    # the report's command is the one that reproduces it, settings included
    command = json.loads((tmp_path / "cmp" / "report.json").read_text())["command"]
    assert "--split dev" in command and "--limit-per-domain 2 --max-new-tokens 8 --chain 3" in command
