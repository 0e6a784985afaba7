"""On-policy EAGLE-3 training: rollouts by our speculative decoder mark where the head's draft was rejected
(data/engines/rollout.py), and training weighs those (base, TTT step) pairs up (eagle/job.py `replay_weight`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_target

from draftsmith.data.engines.base import Request
from draftsmith.data.engines.rollout import SpeculativeEngine
from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.eagle.model import eagle3_loss, soft_ce
from draftsmith.errors import ConfigError

PROMPTS = ["What is the capital of France?", "Add 2 and 3.", "Write a loop in Python.", "Summarize the passage.",
           "How many clips did Natalia sell?", "Translate the sentence into French.", "def add(a, b):",
           "Name a fox.", "Count to ten.", "Why is the sky blue?", "List three colours.", "Sort these numbers."]


@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    """A 4-layer tiny Llama target (the three EAGLE-3 layers distinct) with its own lm_head: the tied one
    copies the last token over and over, which any draft predicts without a miss."""
    return make_target(tiny_tokenizer, seed=3, layers=4, folder=tmp_path_factory.mktemp("target4"),
                       tie_word_embeddings=False)


class WrongAt(Proposer):
    """Proposes the target's own greedy continuation (known in advance) with the token at depth `wrong`
    (0-based) replaced: every draft long enough is accepted for `wrong` tokens and rejected at step `wrong`."""

    def __init__(self, continuations: dict[int, list[int]], wrong: int, vocab: int):
        self.continuations, self.wrong, self.vocab = continuations, wrong, vocab

    def begin(self, prompt_ids, features):
        self.full = next(list(p) + c for p, c in self.continuations.items() if prompt_ids[:len(p)].tolist() == list(p))

    def propose(self, context, spec, sampling, generator):
        n = context.numel()
        chain = list(self.full[n:n + spec.depth])
        chain += [3] * (spec.depth - len(chain))
        if self.wrong < len(chain):
            chain[self.wrong] = (chain[self.wrong] + 1) % self.vocab
        return Proposal.chain(chain, device=context.device)


def test_rollout_rows_are_the_targets_and_mark_each_rejected_step(target4):
    new, k, wrong = 20, 4, 1
    prompts = [target4.tokenizer(p).input_ids for p in PROMPTS[:6]]
    plain = speculative_generate(target4, None, prompts, new, k=0).tokens
    keep = [i for i, t in enumerate(plain) if len(t) == new]  # no EOS: every cycle is a full one
    assert len(keep) >= 3
    conts = {tuple(prompts[i]): plain[i] for i in keep}
    engine = SpeculativeEngine(target4, WrongAt(conts, wrong, target4.vocab_size), TreeSpec.chain(k),
                               SamplingConfig(0.0, 0, 1.0))
    done = []
    engine.run([Request(i, prompts[i], new) for i in keep], done.append)
    for c in done:
        assert c.tokens == plain[c.key]  # the target's own rows, whatever the draft
        P = len(c.prompt_ids)
        assert len(c.replay) == P + new
        # expected: a cycle at base t proposes min(k, left - 1) tokens; when longer than `wrong` it is accepted
        # for `wrong` tokens, rejected at step `wrong` (mark wrong + 1) and emits wrong + 1 tokens
        want, emitted = [0] * (P + new), 1
        while emitted < new:
            depth = min(k, new - emitted - 1)
            base = P + emitted - 2
            if depth > wrong:
                want[base] = wrong + 1
                emitted += wrong + 1
            else:
                emitted += depth + 1
        assert c.replay == want
    assert engine.describe()["tau"] == pytest.approx(engine.stats.tau)


def test_soft_ce_weights_and_replay_weighting():
    torch.manual_seed(0)
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    w = torch.tensor([1.0, 3.0, 1.0, 1.0, 3.0])
    per_row = torch.stack([soft_ce(s[i:i + 1], t[i:i + 1]) for i in range(5)])
    assert soft_ce(s, t, w) == pytest.approx(float((per_row * w).mean()), rel=1e-6)
    d2t = torch.zeros(7, dtype=torch.long)
    ids = t.argmax(-1)
    rep = torch.tensor([False, True, False, False, True])
    plain, m0 = eagle3_loss([s], [t], [ids], d2t, [1.0])
    weighted, m = eagle3_loss([s], [t], [ids], d2t, [1.0], [rep], replay_weight=2.0)
    assert float(weighted) == pytest.approx(float(soft_ce(s, t, w)), rel=1e-6)
    assert float(weighted) > float(plain) * 0.99 and "replay/n" not in m0
    assert m["replay/n"] == 2 and m["replay/acc"] == float((s.argmax(-1) == ids)[rep].float().mean())


def _data_config(tmp: Path, out: str, **gen):
    from draftsmith.capture.config import CaptureConfig
    from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig

    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"q": p}) + "\n" for p in PROMPTS))
    return DataConfig(sources=[SourceConfig(name="mixed", path=str(src), prompt="q", domain="chat")],
                      output_dir=str(tmp / out),
                      generation=GenerationConfig(max_new_tokens=24, batch_size=8, threads=1, dtype="float32", **gen),
                      capture=CaptureConfig(enabled=True, layers=[0, 1, 2], topk=4, last_hidden=True,
                                            dtype="float32"))


def _eagle_cfg(tmp: Path, name: str, data: Path, steps: int, **kw):
    from draftsmith.eagle.job import EagleJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import TrainConfig

    return EagleJobConfig(
        target="tiny", data=str(data), output=str(tmp / name), version="eagle3", target_layers=[0, 1, 2], ttt_steps=3,
        draft_vocab_size=128, capture_cache=str(data / "capture"), eval_fraction=0.1,
        train=TrainConfig(lr=3e-3, max_steps=steps, batch_size=4, warmup_steps=0, output_dir=str(tmp / f"{name}.run"),
                          resume="never", progress=False, log_every=1, eval_every=0),
        evaluate=EvalAfterTraining(enabled=False), **kw)


@pytest.fixture(scope="module")
def round0(target4, tmp_path_factory):
    """Rows the batched engine wrote (captured) and a barely trained EAGLE-3 head on them."""
    from draftsmith.data import generate_dataset, load_distilled
    from draftsmith.eagle.job import EagleJob
    from draftsmith.targets import gemm
    from draftsmith.training import train

    tmp = tmp_path_factory.mktemp("round0")
    with gemm.disabled():
        base = generate_dataset(_data_config(tmp, "base"), target4, progress=False)
        cfg = _eagle_cfg(tmp, "head0", base, 1)
        head0 = train(EagleJob(cfg, target4, load_distilled(base, target4)), cfg.train).artifact
    return base, head0


def test_rollouts_with_the_cut_tree_decode_as_evaluate_does(target4, round0, tmp_path):
    from draftsmith.data import generate_dataset, load_distilled
    from draftsmith.data.generate import read_provenance
    from draftsmith.targets import gemm

    base, head0 = round0
    with gemm.disabled():
        roll = generate_dataset(_data_config(tmp_path, "roll", engine="speculative", proposer=f"eagle:{head0}",
                                             tree_auto=True), target4, progress=False)
    rows, ref = load_distilled(roll, target4), load_distilled(base, target4)
    assert rows["input_ids"] == ref["input_ids"]
    info = read_provenance(roll)["timing"]["rollout"]
    assert info["cut_by_cost"] is True and info["tree"]  # the head's own tree, cut by v(n) measured here
    assert all(0 <= v <= len(info["tree"]) for r in rows["replay"] for v in r)


def test_on_policy_round_rollouts_capture_and_replay_training(target4, round0, tmp_path):
    """Supervised head -> rollouts with it through `draftsmith data` (engine: speculative) -> the same rows the
    batched engine writes, plus replay marks -> a warm-started head trained with replay_weight, lossless."""
    from draftsmith.data import generate_dataset, load_distilled
    from draftsmith.data.generate import read_provenance
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.eagle.job import EagleJob
    from draftsmith.targets import gemm
    from draftsmith.training import train

    base, head0 = round0
    spec = f"eagle:{head0}"
    with gemm.disabled():
        roll = generate_dataset(_data_config(tmp_path, "roll", engine="speculative", proposer=spec, k=3),
                                target4, progress=False)
    rows, ref = load_distilled(roll, target4), load_distilled(base, target4)
    assert "replay" in rows.column_names and "replay" not in ref.column_names
    assert rows["input_ids"] == ref["input_ids"] and rows["loss_mask"] == ref["loss_mask"]
    marks = [v for r in rows["replay"] for v in r]
    assert all(0 <= v <= 3 for v in marks) and sum(v > 0 for v in marks) > 0
    for r in rows:
        assert len(r["replay"]) == len(r["input_ids"])
        # a draft starts at a base whose next token is pending, never inside the prompt's first tokens
        first = r["loss_mask"].index(1)
        assert all(v == 0 for v in r["replay"][: first - 1])
    timing = read_provenance(roll)["timing"]
    assert timing["rollout"]["proposer"] == spec and timing["rollout"]["tau"] >= 1.0
    assert "capture" in timing  # teacher-forced after the rollouts

    # another head may not resume these rows: their marks are head0's
    import dataclasses

    from draftsmith.errors import DataError
    cfg = _data_config(tmp_path, "roll", engine="speculative", proposer="ngram", k=3)
    (Path(roll) / "provenance.json").unlink()  # as if killed before the end: resume reads run.json
    with pytest.raises(DataError, match="rollout"):
        generate_dataset(dataclasses.replace(cfg), target4, progress=False)

    # the next round trains on the earlier rows and the rollouts together: `draftsmith data merge` + capture
    from draftsmith.data.batching import split_rows
    from draftsmith.data.commands import merge_datasets, merged_row_id
    from draftsmith.data.generate import capture_dataset_dir

    generate_dataset(_data_config(tmp_path, "roll", engine="speculative", proposer=spec, k=3), target4,
                     progress=False)  # the killed rollout finishes with its own head
    merged = merge_datasets([base, roll], tmp_path / "merged")
    both = load_distilled(merged, target4)
    assert len(both) == 2 * len(ref) and both["row_id"][: len(ref)] == ref["row_id"]
    assert both["row_id"][len(ref):] == [merged_row_id(read_provenance(roll), i) for i in rows["row_id"]]
    assert both["replay"][: len(ref)] == [[0] * len(x) for x in ref["input_ids"]]
    assert both["replay"][len(ref):] == rows["replay"]
    with pytest.raises(DataError, match="repeats"):  # the same rows twice
        merge_datasets([merged, roll], tmp_path / "again")
    # the first dataset's rows keep their rank after the merge (a hash of their unchanged ids): the ones the merge
    # holds out and the ones it held out alone are both its lowest-ranked rows, so one set holds the other. (A
    # strict "held stay held" failed whenever enough of the merged rows, whose ids hash the rollouts' creation
    # time, ranked below them: a test that depended on the second it ran.)
    held = set(split_rows(ref, 0.1, 0)[1]["row_id"])
    held_after = set(split_rows(both, 0.1, 0)[1]["row_id"]) & set(ref["row_id"])
    assert held <= held_after or held_after <= held
    with pytest.raises(DataError, match="replace"):
        merge_datasets([base, merged], merged, overwrite=True)
    with gemm.disabled():
        capture_dataset_dir(dataclasses.replace(_data_config(tmp_path, "merged")), target4, progress=False)
    cfg1 = _eagle_cfg(tmp_path, "head1", Path(merged), 6, replay_weight=3.0)
    cfg1.train.warm_start = str(head0)
    with gemm.disabled():
        result = train(EagleJob(cfg1, target4, both), cfg1.train)
    logged = [json.loads(x) for x in (tmp_path / "head1.run" / "log.jsonl").read_text().splitlines()]
    assert any(e.get("replay/n", 0) > 0 for e in logged)
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows.select(range(3))]
    plain = speculative_generate(target4, None, prompts, 12, k=0).tokens
    fast = speculative_generate(target4, build_proposer(f"eagle:{result.artifact}", target4), prompts, 12, k=3)
    assert fast.tokens == plain and fast.stats.proposed > 0


def test_replay_weight_needs_rollout_rows(target4, tmp_path):
    from draftsmith.eagle.job import EagleJob, EagleJobConfig

    rows = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1], "row_id": 0, "domain": "x"}] * 4
    cfg = _eagle_cfg(tmp_path, "h", tmp_path / "data", 1, replay_weight=1.0)
    cfg.capture_cache = None
    with pytest.raises(ConfigError, match="replay"):
        EagleJob(cfg, target4, rows)
    with pytest.raises(ValueError, match="eagle3"):
        EagleJobConfig(version="eagle1", replay_weight=1.0)
