"""Training a DSpark drafter: DFlash's job (anchors, blocks, capture, reduced vocabulary, single- and multi-process
through the one loop) with DSpark's heads and loss.

    loss = λ_base · L_block(b) + L_block(l) + λ_conf · BCE(c, [argmax l_j = x_{a+j}])
    (confidence_target: overlap)           ... + λ_conf · BCE(c, Σ_v min(softmax(l_j)_v, p_v))

L_block is DFlash's position-weighted block objective (dflash_loss: CE against the target's token, or its
distribution with `loss: kd`), once on the backbone's base logits b (they keep their own meaning: vLLM's
top-k path picks its candidates by them, `dspark_draft_topk`) and once on the Markov-corrected logits l, which
are what the proposer drafts from. The Markov head is teacher-forced with the target's tokens (dspark/model.py
says why that is the case that counts). The confidence head learns, per learned slot, whether the corrected
argmax is the target's token there (or, with `confidence_target: overlap`, the probability that speculative
sampling accepts a token drawn from softmax(l_j) against the target's p there, 1 − TV); its BCE does not reach
the backbone or the Markov head (their outputs are detached for it), so asking for calibration never trades
away acceptance.

Logged: the corrected logits' `acc`, `slot{j}/acc` and `tau` (what the chain accepts), the base logits' as
`base/...`, and `conf/bce`, `conf/ece` (calibration of the confidence on the batch), `conf/overlap`.
`slot_weights: dpace` (DFlash's D-PACE) weighs both block objectives' slots by their own logits' confidence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from draftsmith.config import Range, register_config, validated
from draftsmith.decoding.calibration import expected_calibration_error
from draftsmith.dflash.job import DFlashJob, DFlashJobConfig
from draftsmith.dflash.model import dflash_loss
from draftsmith.dspark.model import DSparkDraft, confidence_loss, sampling_overlap
from draftsmith.errors import ConfigError
from draftsmith.training.job import unwrap

log = logging.getLogger(__name__)


@register_config("dspark")
@validated
@dataclass
class DSparkJobConfig(DFlashJobConfig):
    output: str = "runs/dspark/smollm2-135m"
    markov_rank: Annotated[int, Range(ge=1, le=4096)] = 64  # the transition bias's rank r (V·r + N·r parameters)
    confidence_head: bool = True  # train the acceptance estimate (vLLM's enable_confidence_head)
    confidence_with_markov: bool = True  # it reads [norm(z_j); e_j]; false: norm(z_j) alone
    base_loss_weight: Annotated[float, Range(ge=0, le=100)] = 1.0  # λ_base: the backbone's own block objective
    confidence_loss_weight: Annotated[float, Range(ge=0, le=100)] = 1.0  # λ_conf
    # the confidence head's learning rate / the run's: one linear unit from zero, whose logit must travel to
    # log(α/(1-α)) while Adam moves each weight about lr a step
    confidence_lr_scale: Annotated[float, Range(gt=0, le=1000)] = 10.0
    # what the confidence learns per slot: greedy, whether the corrected argmax is the target's token (1 or 0:
    # acceptance when both sides decode greedily); overlap, Σ_v min(q_v, p_v) = 1 − TV between the draft's and
    # the target's distributions there, the probability speculative sampling accepts a token drafted from q
    # (speculators' DSpark target; it reads the target's last hidden state, as loss: kd does)
    confidence_target: Literal["greedy", "overlap"] = "greedy"

    def __post_init__(self):
        super().__post_init__()
        if self.confidence_target == "overlap" and not self.confidence_head:
            raise ValueError("confidence_target: overlap trains the confidence head, and confidence_head is false")


def features(cfg: DSparkJobConfig, target) -> dict:
    """`Method.features`: what DFlash's job reads (the same backbone)."""
    from draftsmith.dflash.job import features as dflash_features

    needs = dflash_features(cfg, target)
    # the overlap's p is the target's distribution where each slot is verified: its post-norm last hidden state
    return {**needs, "last_hidden": needs["last_hidden"] or cfg.confidence_target == "overlap"}


class DSparkJob(DFlashJob):
    kind = "dspark"
    module_class = DSparkDraft

    def announce(self) -> None:
        super().announce()
        log.info("DSpark: Markov rank %d, confidence head %s", self.cfg.markov_rank,
                 f"on, learning the {self.cfg.confidence_target} acceptance" if self.cfg.confidence_head else "off")

    def capture_needs(self) -> dict:
        return features(self.cfg, self.target)

    def draft_fields(self) -> dict:
        return {"markov_rank": self.cfg.markov_rank, "confidence_head": self.cfg.confidence_head,
                "confidence_with_markov": self.cfg.confidence_with_markov}

    warm_start_kinds = ("dflash",)

    def warm_start_weights(self, weights: dict, module) -> dict:
        """A warm start from a DFlash drafter (`train.warm_start: DFLASH_ARTIFACT`) takes its backbone, block, taps
        and mask token as they are, and keeps this draft's fresh heads (a zero Markov bias and a confidence of 1/2:
        it starts drafting what the DFlash drafter drafts); anything else is refused in one line."""
        if any(k.startswith("markov_head.") for k in weights):
            return weights  # a DSpark artifact: every weight
        from draftsmith.dflash.model import read_config

        src = read_config(self.cfg.train.warm_start)
        mine = unwrap(module).config
        for name in ("block_size", "target_layers", "mask_token_id", "num_layers", "draft_vocab_size"):
            if getattr(src, name) != getattr(mine, name):
                raise ConfigError(f"train.warm_start {self.cfg.train.warm_start}: config.json field '{name}' is "
                                  f"{getattr(src, name)!r}, this DSpark job builds {getattr(mine, name)!r}")
        own = module.state_dict()
        return {**weights, **{k: v for k, v in own.items() if k.startswith(("markov_head.", "confidence_head."))}}

    def lr_scale(self, name: str) -> float:
        return self.cfg.confidence_lr_scale if "confidence_head." in name else 1.0

    def loss(self, module, batch):
        b = self.blocks(module, batch)
        base, logits, conf = b.out
        main, metrics = dflash_loss(logits, b.labels, b.slots, self.weights, b.teacher, b.vocab, blocks=b.valid,
                                    dpace_alpha=self.cfg.dpace)
        total = main
        if self.cfg.base_loss_weight > 0:
            base_loss, base_metrics = dflash_loss(base, b.labels, b.slots, self.weights, b.teacher, b.vocab,
                                                  blocks=b.valid, dpace_alpha=self.cfg.dpace)
            total = total + self.cfg.base_loss_weight * base_loss
            metrics.update({f"base/{k}": v for k, v in base_metrics.items() if k in ("ce", "acc", "tau")})
        if conf is not None:
            bce = self.confidence(module, b, logits, conf, metrics)
            if self.cfg.confidence_loss_weight > 0:
                total = total + self.cfg.confidence_loss_weight * bce
        return total, metrics

    def confidence(self, module, b, logits: torch.Tensor, conf: torch.Tensor, metrics: dict) -> torch.Tensor:
        """The confidence head's BCE against `confidence_target` (greedy acceptance, or the sampling overlap
        with the target's distribution); logs `conf/bce`, `conf/mean`, `conf/ece` (against greedy acceptance,
        what the evaluator's calibration counts at temperature 0) and, for overlap, `conf/overlap`."""
        draft = unwrap(module)
        with torch.no_grad():
            accepted = draft.to_target_ids(logits.argmax(-1)) == b.labels
            target = accepted
            if self.cfg.confidence_target == "overlap":
                target = sampling_overlap(logits, draft.target_logprobs(b.verify_hidden))
                metrics["conf/overlap"] = float(target.mean()) if target.numel() else 0.0
        # no learned slot in the batch: a zero with a graph, not the NaN an empty mean would be
        bce = confidence_loss(conf, target) if conf.numel() else conf.sum() * 0.0
        with torch.no_grad():
            p = torch.sigmoid(conf.float())
            ece = expected_calibration_error(p, accepted)
        metrics.update({"conf/bce": float(bce.detach()), "conf/mean": float(p.mean()) if p.numel() else 0.0})
        if ece is not None:
            metrics["conf/ece"] = ece
        return bce
