"""Training recipes for the shape that is served: D-PACE slot weights for DFlash and DSpark, the LK losses for
EAGLE-3, DSpark's confidence trained against the sampling overlap (1 − TV), and EAGLE's test-time depth matched to
the served k. Each loss on toy tensors against values worked out by hand here (a vocabulary of 3, 2-3 positions),
masking and the gradient's direction included; each switch's config field checked; each switch through a few steps
of the one training loop on the tiny target, reading what it needs from the capture."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import distilled_rows, make_target  # noqa: E402

from draftsmith.config import OutOfRange, from_dict
from draftsmith.dflash.job import DFlashJob, DFlashJobConfig
from draftsmith.dflash.model import dflash_loss, dpace_weights
from draftsmith.dspark.job import DSparkJob, DSparkJobConfig
from draftsmith.dspark.model import DSparkDraft, confidence_loss, sampling_overlap
from draftsmith.eagle.job import EagleJob, EagleJobConfig
from draftsmith.eagle.model import eagle3_loss, lk_loss
from draftsmith.errors import ConfigError
from draftsmith.evaluation.after_training import EvalAfterTraining
from draftsmith.training import TrainConfig, train


def logits_of(*probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is each row of `probs` (the log of a distribution)."""
    return torch.tensor(probs, dtype=torch.float32).log()


# --- D-PACE -------------------------------------------------------------------------------------------------------
def one_block(*learned: bool) -> torch.Tensor:
    return torch.tensor([[list(learned)]])  # [B=1, n=1, bs]


def test_dpace_weights_are_the_suffix_sums_of_the_smoothed_prefix_products():
    """q = 0.8, 0.5, 0.2 at slots 1-3, α = 0.5: q̃ = 0.9, 0.75, 0.6; reach Π q̃ = 0.9, 0.675, 0.405; each slot
    weighs the reach summed from it to the block's end: 1.98, 1.08, 0.405. α = 1 counts the slots left."""
    q = torch.tensor([0.8, 0.5, 0.2])
    blocks = one_block(False, True, True, True)
    torch.testing.assert_close(dpace_weights(q, blocks, 0.5), torch.tensor([1.98, 1.08, 0.405]))
    torch.testing.assert_close(dpace_weights(q, blocks, 1.0), torch.tensor([3.0, 2.0, 1.0]))


def test_dpace_passes_over_a_slot_that_is_not_learned_and_keeps_blocks_apart():
    """Slot 2 not learned: it neither breaks the product nor adds a term (q̃ 0.9 then 0.6: weights 0.9 + 0.54 and
    0.54). A second block in the row starts its own product (q 0.0 -> q̃ 0.5, then 1.0 -> 1.0: 1.0 and 0.5)."""
    q = torch.tensor([0.8, 0.2, 0.0, 1.0])
    blocks = torch.tensor([[[False, True, False, True], [False, True, True, False]]])
    torch.testing.assert_close(dpace_weights(q, blocks, 0.5), torch.tensor([1.44, 0.54, 1.0, 0.5]))


def test_dpace_weights_take_no_gradient():
    q = torch.tensor([0.8, 0.5], requires_grad=True)
    assert not dpace_weights(q, one_block(False, True, True), 0.5).requires_grad


def test_dflash_loss_with_dpace_weighs_each_slots_cross_entropy_by_its_dpace_weight():
    """Labels of probability 0.8, 0.5, 0.2 at slots 1-3: loss = Σ w_j·(-ln q_j) / Σ w_j with the weights above;
    its gradient is that of the weighted sum with the weights held fixed (they are not differentiated)."""
    logits = logits_of([0.8, 0.1, 0.1], [0.25, 0.5, 0.25], [0.2, 0.2, 0.6]).requires_grad_(True)
    labels, slots = torch.tensor([0, 1, 0]), torch.tensor([1, 2, 3])
    decay = torch.tensor([0.0, 1.0, 1.0, 1.0])
    loss, m = dflash_loss(logits, labels, slots, decay, blocks=one_block(False, True, True, True), dpace_alpha=0.5)
    w = [1.98, 1.08, 0.405]
    ce = [-math.log(0.8), -math.log(0.5), -math.log(0.2)]
    assert float(loss.detach()) == pytest.approx(sum(a * b for a, b in zip(w, ce, strict=True)) / sum(w), rel=1e-5)
    assert m["slot1/acc"] == 1.0 and m["slot3/acc"] == 0.0
    loss.backward()
    fixed = logits.detach().clone().requires_grad_(True)
    ref = (torch.tensor(w) * torch.nn.functional.cross_entropy(fixed, labels, reduction="none")).sum() / sum(w)
    ref.backward()
    torch.testing.assert_close(logits.grad, fixed.grad)
    flat, _ = dflash_loss(logits.detach(), labels, slots, decay, blocks=one_block(False, True, True, True))
    assert float(flat) == pytest.approx(sum(ce) / 3, rel=1e-5)  # the decay path, unchanged
    with pytest.raises(ValueError, match="blocks"):
        dflash_loss(logits.detach(), labels, slots, decay, dpace_alpha=0.5)


def test_dpace_counts_a_label_outside_the_draft_vocabulary_as_a_certain_rejection():
    """Draft vocabulary {0, 1} of targets 0..2 (index 2 -> -1). Slot 1's label 2 is outside: q = 0, q̃ = 0.5, so
    slot 2 (q = 0.5, q̃ = 0.75) is reached with 0.375. With the KD teacher both slots learn: w = 0.875, 0.375."""
    index = torch.tensor([0, 1, -1])
    vocab = (torch.zeros(2, dtype=torch.long), index)
    logits = logits_of([0.5, 0.5], [0.5, 0.5])
    teacher = logits_of([0.9, 0.1], [0.2, 0.8])
    loss, m = dflash_loss(logits, torch.tensor([2, 1]), torch.tensor([1, 2]), torch.ones(3), teacher, vocab,
                          blocks=one_block(False, True, True), dpace_alpha=0.5)
    ln2 = math.log(2)  # the soft cross-entropy of any teacher against the uniform draft
    assert float(loss) == pytest.approx((0.875 * ln2 + 0.375 * ln2) / 1.25, rel=1e-5)
    assert m["outside"] == 0.5


# --- DSpark's confidence against the sampling overlap ---------------------------------------------------------------
def test_sampling_overlap_is_one_minus_the_total_variation():
    """q = 0.7, 0.2, 0.1 and p = 0.5, 0.3, 0.2: Σ min = 0.8 = 1 − TV (TV = (0.2 + 0.1 + 0.1) / 2). Over a reduced
    vocabulary p keeps its full-vocabulary values (0.5, 0.3: 0.2 is outside) and the overlap is 0.8, not the 0.975
    that p renormalised over the two tokens would give."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    assert float(sampling_overlap(logits_of([0.7, 0.2, 0.1]), p.log())[0]) == pytest.approx(0.8)
    reduced = sampling_overlap(logits_of([0.6, 0.4]), torch.tensor([[0.5, 0.3]]).log())
    assert float(reduced[0]) == pytest.approx(0.8)


def test_the_confidence_bce_against_an_overlap_is_least_at_it_and_pulls_towards_it():
    """BCE(σ(0) = 0.5, 0.8) = -(0.8·ln 0.5 + 0.2·ln 0.5) = ln 2; its gradient in the logit is σ(c) − t = -0.3 (the
    confidence rises towards 0.8), and at c = logit(0.8) it is 0."""
    c = torch.zeros(1, requires_grad=True)
    loss = confidence_loss(c, torch.tensor([0.8]))
    assert float(loss) == pytest.approx(math.log(2))
    loss.backward()
    assert float(c.grad[0]) == pytest.approx(-0.3)
    at = torch.tensor([math.log(0.8 / 0.2)], requires_grad=True)
    confidence_loss(at, torch.tensor([0.8])).backward()
    assert abs(float(at.grad[0])) < 1e-6


@pytest.fixture(scope="module")
def target4(tiny_tokenizer, tmp_path_factory):
    return make_target(tiny_tokenizer, seed=5, layers=4, folder=tmp_path_factory.mktemp("recipes-target"))


def test_dsparks_target_log_probabilities_are_normalised_over_the_whole_vocabulary(target4):
    """With a reduced vocabulary the target's p at the draft's tokens are its full-vocabulary probabilities (they sum
    below 1), not renormalised over the draft's tokens as the KD teacher is."""
    from draftsmith.heads.vocab import draft_vocabulary

    counts = torch.arange(target4.vocab_size, dtype=torch.float32)
    d2t, t2d, _ = draft_vocabulary(counts, 16)
    draft = DSparkDraft.from_target(target4.model, [0, 1, 2], num_layers=1, block_size=4, mask_token_id=7,
                                    markov_rank=8, draft_vocab=(d2t, t2d))
    h = torch.randn(3, target4.hidden_size)
    full = torch.log_softmax(h @ target4.model.lm_head.weight.T.float(), -1)
    torch.testing.assert_close(draft.target_logprobs(h), full[:, t2d])
    assert float(draft.target_logprobs(h).exp().sum(-1).max()) < 1.0


# --- LK losses ------------------------------------------------------------------------------------------------------
Q = [0.7, 0.2, 0.1]  # the draft's distribution
P = [0.5, 0.3, 0.2]  # the target's: overlap α = 0.5 + 0.2 + 0.1 = 0.8


def test_lk_alpha_is_minus_the_log_of_the_overlap_and_its_gradient_raises_it():
    """-ln 0.8. dα/dz_u = q_u·[q_u < p_u] − q_u·Q_S with S = {1, 2} (where q < p), Q_S = 0.3: (-0.21, 0.14, 0.07);
    the loss's gradient is -(1/α) of it: (0.2625, -0.175, -0.0875), lowering the token the draft over-proposes."""
    z = logits_of(Q).requires_grad_(True)
    target = torch.tensor([P]).log()
    loss, alpha = lk_loss(z, target, target, "lk_alpha")
    assert float(loss) == pytest.approx(-math.log(0.8)) and float(alpha[0]) == pytest.approx(0.8)
    loss.backward()
    torch.testing.assert_close(z.grad, torch.tensor([[0.2625, -0.175, -0.0875]]))


def test_lk_lambda_mixes_kl_and_the_rejection_rate_by_the_rows_acceptance():
    """λ = exp(-3·0.8); loss = λ·KL(p ‖ q) + (1 − λ)·(1 − 0.8), KL = Σ p·ln(p/q). At η = 0 it is KL alone."""
    z = logits_of(Q)
    target = torch.tensor([P]).log()
    kl = sum(p * math.log(p / q) for p, q in zip(P, Q, strict=True))
    lam = math.exp(-2.4)
    assert float(lk_loss(z, target, target, "lk_lambda")[0]) == pytest.approx(lam * kl + (1 - lam) * 0.2, rel=1e-5)
    assert float(lk_loss(z, target, target, "lk_lambda", eta=0.0)[0]) == pytest.approx(kl, rel=1e-5)


def test_lk_reads_acceptance_from_the_full_vocabulary_and_weighs_rows():
    """Draft vocabulary of 2: the target's full probabilities there are 0.5, 0.3 (renormalised 0.625, 0.375 for KL);
    q = 0.6, 0.4 overlaps 0.8 of them (0.975 of the renormalised). Row weights 1 and 3 multiply before the mean."""
    z = logits_of([0.6, 0.4], [0.6, 0.4])
    teacher = logits_of([0.5, 0.3], [0.5, 0.3])  # softmax renormalises it
    full = torch.tensor([[0.5, 0.3], [0.5, 0.3]]).log()
    loss, alpha = lk_loss(z, teacher, full, "lk_alpha", weights=torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(alpha, torch.tensor([0.8, 0.8]))
    assert float(loss) == pytest.approx(-math.log(0.8) * (1 + 3) / 2, rel=1e-5)


def test_eagle3_loss_takes_the_lk_objective_per_step_and_logs_the_expected_acceptance():
    """Two steps, decay weights 1 and 0.5: Σ_j w_j·(-ln α_j) with α = 0.8 and 0.5 (a half-half draft against
    p = (1, 0, 0) overlaps 0.5). `step{j}/alpha` is logged; the KL objective logs it too where it is given the
    target's log-probabilities, and the LK objectives refuse to run without them."""
    d2t = torch.zeros(3, dtype=torch.long)
    logits = [logits_of(Q), logits_of([0.5, 0.5, 1e-9])]
    targets = [torch.tensor([P]).log(), torch.tensor([[1.0, 1e-12, 1e-12]]).log()]
    ids = [torch.tensor([0]), torch.tensor([0])]
    loss, m = eagle3_loss(logits, targets, ids, d2t, [1.0, 0.5], target_logprobs=targets, objective="lk_alpha")
    assert float(loss) == pytest.approx(-math.log(0.8) - 0.5 * math.log(0.5), rel=1e-4)
    assert m["step0/alpha"] == pytest.approx(0.8) and m["step1/alpha"] == pytest.approx(0.5, rel=1e-4)
    _, kl_metrics = eagle3_loss(logits, targets, ids, d2t, [1.0, 0.5], target_logprobs=targets)
    assert kl_metrics["step0/alpha"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="target_logprobs"):
        eagle3_loss(logits, targets, ids, d2t, [1.0, 0.5], objective="lk_lambda")


# --- config fields --------------------------------------------------------------------------------------------------
def test_the_recipe_fields_are_checked_where_the_config_is_read():
    assert DFlashJobConfig().slot_weights == "decay" and DFlashJobConfig().dpace is None  # today's behaviour
    assert DFlashJobConfig(slot_weights="dpace").dpace == 0.5
    with pytest.raises(ValueError, match="gamma"):
        DFlashJobConfig(slot_weights="dpace", gamma=4.0)
    with pytest.raises(OutOfRange, match="dpace_alpha"):
        DFlashJobConfig(slot_weights="dpace", dpace_alpha=0.0)
    with pytest.raises(ConfigError, match="slot_weights"):
        from_dict(DFlashJobConfig, {"slot_weights": "linear"})
    assert DSparkJobConfig().confidence_target == "greedy"
    with pytest.raises(ValueError, match="confidence_head"):
        DSparkJobConfig(confidence_target="overlap", confidence_head=False)
    with pytest.raises(ConfigError, match="confidence_target"):
        from_dict(DSparkJobConfig, {"confidence_target": "tv"})
    assert EagleJobConfig().objective == "kl" and EagleJobConfig().steps == 7
    assert EagleJobConfig(ttt_depth="served", served_k=3).steps == 3
    with pytest.raises(ValueError, match="eagle1"):
        EagleJobConfig(version="eagle1", ttt_steps=1, objective="lk_alpha")
    with pytest.raises(OutOfRange, match="served_k"):
        EagleJobConfig(ttt_depth="served", served_k=0)
    with pytest.raises(OutOfRange, match="lk_eta"):
        EagleJobConfig(objective="lk_lambda", lk_eta=-1.0)
    with pytest.raises(ConfigError, match="objective"):
        from_dict(EagleJobConfig, {"objective": "tv"})


# --- through the training loop -----------------------------------------------------------------------------------
def run_config(tmp: Path, steps: int) -> TrainConfig:
    return TrainConfig(lr=3e-3, max_steps=steps, batch_size=8, warmup_steps=1, output_dir=str(tmp / "run"),
                       resume="never", progress=False, log_every=1, eval_every=0)


def test_dflash_and_dspark_train_with_dpace_and_the_overlap_confidence(target4, tmp_path):
    rows = distilled_rows(target4)
    common = {"target": "tiny", "data": "in-memory", "num_layers": 1, "block_size": 4, "anchors_per_row": 8,
              "max_length": 64, "target_layers": [0, 1, 2], "evaluate": EvalAfterTraining(enabled=False)}
    cfg = DFlashJobConfig(output=str(tmp_path / "dflash"), slot_weights="dpace", train=run_config(tmp_path, 6),
                          **common)
    logs = [r for r in train(DFlashJob(cfg, target4, rows), cfg.train).history if r["type"] == "train"]
    assert logs[-1]["loss"] < logs[0]["loss"]
    cfg = DSparkJobConfig(output=str(tmp_path / "dspark"), slot_weights="dpace", confidence_target="overlap",
                          markov_rank=8, train=run_config(tmp_path / "s", 6), **common)
    job = DSparkJob(cfg, target4, rows)
    assert job.features.last_hidden  # the overlap's p comes from the target's last hidden state
    logs = [r for r in train(job, cfg.train).history if r["type"] == "train"]
    assert all(0.0 < r["conf/overlap"] <= 1.0 for r in logs) and "conf/ece" in logs[-1]


def test_eagle3_trains_the_served_depth_with_an_lk_loss(target4, tmp_path):
    from draftsmith.eagle.model import read_config

    cfg = EagleJobConfig(target="tiny", data="in-memory", output=str(tmp_path / "eagle"), target_layers=[0, 1, 2],
                         ttt_steps=7, ttt_depth="served", served_k=2, draft_vocab_size=128, objective="lk_lambda",
                         train=run_config(tmp_path, 6), evaluate=EvalAfterTraining(enabled=False))
    job = EagleJob(cfg, target4, distilled_rows(target4))
    assert job.features.logsumexp and len(job.weights) == 2
    result = train(job, cfg.train)
    logs = [r for r in result.history if r["type"] == "train"]
    assert "step1/alpha" in logs[-1] and "step2/alpha" not in logs[-1]
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert read_config(result.artifact).ttt_steps == 2


def test_the_memory_plan_counts_what_each_switch_adds(target4):
    """The overlap keeps the target's last hidden state per token and its full-vocabulary log-probabilities per
    query; LK the target's probabilities per learned position; the served depth unrolls served_k steps, not
    ttt_steps."""
    from draftsmith.dspark.memory import job_memory as dspark_memory
    from draftsmith.eagle.memory import job_memory as eagle_memory

    tc, H, V = target4.model.config, target4.hidden_size, target4.vocab_size
    greedy = dspark_memory(DSparkJobConfig(), tc, 4)
    overlap = dspark_memory(DSparkJobConfig(confidence_target="overlap"), tc, 4)
    cfg = DSparkJobConfig()
    assert overlap.keep - greedy.keep == H * 4
    assert overlap.module_act - greedy.module_act == cfg.train.batch_size * cfg.anchors_per_row * cfg.block_size * V * 4
    kd, kd_overlap = DSparkJobConfig(loss="kd"), DSparkJobConfig(loss="kd", confidence_target="overlap")
    assert dspark_memory(kd_overlap, tc, 4).keep == dspark_memory(kd, tc, 4).keep  # kd keeps it already
    kl = eagle_memory(EagleJobConfig(draft_vocab_size=128), tc, 4)
    assert eagle_memory(EagleJobConfig(draft_vocab_size=128, objective="lk_alpha"), tc, 4).module_act > kl.module_act
    served = EagleJobConfig(draft_vocab_size=128, ttt_steps=7, ttt_depth="served", served_k=2)
    assert eagle_memory(served, tc, 4) == eagle_memory(EagleJobConfig(draft_vocab_size=128, ttt_steps=2), tc, 4)
