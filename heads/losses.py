"""Knowledge-distillation losses for draft models, as pure functions on logits.

Notation: p is the TARGET's (teacher's) next-token distribution, q the DRAFT's (student's), both over the
same vocabulary of V tokens, both at temperature τ: p = softmax(z_p / τ), q = softmax(z_q / τ).

    forward KL     KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)            mean-seeking (classic KD, Hinton 2015)
    reverse KL     KL(q ‖ p) = Σ_v q_v (log q_v − log p_v)            mode-seeking
    JSD(β)         β·KL(p ‖ m) + (1−β)·KL(q ‖ m),  m = β·p + (1−β)·q  (GKD, Agarwal et al. 2024, eq. 3)
    TVD            ½ Σ_v |p_v − q_v|                                  bounded in [0, 1]

JSD(β) limits (GKD): JSD(β)/β → KL(p ‖ q) as β → 0 and JSD(β)/(1−β) → KL(q ‖ p) as β → 1, so the two
endpoints β = 0 and β = 1 are DEFINED here as forward and reverse KL (JSD(β) itself goes to 0 there).
JSD(0.5) is the symmetric Jensen-Shannon divergence, bounded by log 2.

TVD is the divergence speculative decoding cares about: with the draft sampling x ~ q and the target
accepting with probability min(1, p_x / q_x) (Leviathan et al. 2023, §3.1), the acceptance probability of one
token is α = Σ_v min(p_v, q_v) = 1 − TVD(p, q). DistillSpec (Zhou et al. 2024) finds TVD and the JSD family
often best for acceptance; which one wins depends on task and decoding strategy.

Every loss is a per-position divergence averaged over the positions where `mask` is 1 (0 when the mask is
empty, keeping the autograd graph). Shapes: logits [..., V] (typically [B, T, V], already aligned so that
position t of the student and of the teacher predict the same next token), mask [...] (typically [B, T]).
Divergences are computed in float32 whatever the logits' dtype.

Top-k teacher (offline caches store only the target's k largest logits per position, see
`topk_divergence`): the teacher is renormalised over its top-k support S, and the rest of the vocabulary
is handled in one of two documented ways (`tail`):
    "bucket"       (default) a (k+1)-outcome distribution: the k tokens of S plus one "tail" outcome that
                   collects all other tokens. Student: q_v for v ∈ S from its FULL softmax, tail
                   1 − Σ_S q_v (so draft mass outside S is penalised). Teacher: p̂ = softmax over S
                   (tail 0), or, when its full log-normaliser `teacher_logsumexp` was stored (τ = 1
                   only), the exact p_v = exp(z_v − lse) with the exact tail mass 1 − Σ_S p_v. Tail
                   masses are floored at `TAIL_FLOOR` (so reverse KL stays finite when the teacher's tail
                   is 0 or unknown). By the data-processing inequality the bucketed divergence is ≤ the
                   full-vocabulary one between the same two distributions, with equality when k = V.
    "renormalize"  both distributions conditioned on S: p̂ = p|S, q̂ = q|S (draft mass outside S gets
                   no gradient; cheaper, and exact when k = V).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

Divergence = Literal["forward_kl", "reverse_kl", "jsd", "tvd"]
DIVERGENCES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd", "tvd")
TAIL_FLOOR = 1e-6
# log-probabilities are clamped here before multiplying by a probability that may be 0: 0 · (−inf) is nan,
# and torch.where does not stop that nan from reaching the gradient.
_LOG_FLOOR = -1e4


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of values [...] over positions where mask [...] is nonzero (0 if none; the graph is kept)."""
    if mask is None:
        return values.sum() / max(values.numel(), 1)
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)


def divergence_from_logprobs(log_p: torch.Tensor, log_q: torch.Tensor, kind: Divergence = "forward_kl",
                             beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence between two distributions given as log-probabilities.

    log_p: teacher log-probs [..., N]; log_q: student log-probs [..., N] (N outcomes: V tokens, or the
    k + 1 buckets of the top-k version). Returns [...] (float32). Probabilities may be exactly 0 (log −inf).
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r} (known: {', '.join(DIVERGENCES)})")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    log_p = log_p.float().clamp_min(_LOG_FLOOR)
    log_q = log_q.float().clamp_min(_LOG_FLOOR)
    p, q = log_p.exp(), log_q.exp()
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return (q * (log_q - log_p)).sum(-1)
    # log m = log(β p + (1−β) q), computed stably in log space
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    kl_pm = (p * (log_p - log_m)).sum(-1)
    kl_qm = (q * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1.0 - beta) * kl_qm


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: Divergence = "forward_kl",
               mask: torch.Tensor | None = None, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Masked mean of D(p_teacher, q_student) at temperature τ over the full vocabulary.

    student_logits, teacher_logits: [..., V]; mask: [...] or None. Returns a scalar.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float().detach() / temperature, dim=-1)
    return masked_mean(divergence_from_logprobs(log_p, log_q, kind, beta), mask)


def _log_tail(log_probs_on_support: torch.Tensor) -> torch.Tensor:
    """log(max(1 − Σ_S p, TAIL_FLOOR)) for log-probs [..., k] of the support S. Returns [..., 1]."""
    mass = torch.logsumexp(log_probs_on_support, dim=-1, keepdim=True).exp()
    return torch.log((1.0 - mass).clamp_min(TAIL_FLOOR))


def topk_logprobs(student_logits: torch.Tensor, teacher_values: torch.Tensor, teacher_indices: torch.Tensor,
                  temperature: float = 1.0, tail: Literal["bucket", "renormalize"] = "bucket",
                  teacher_logsumexp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student log-probs on the teacher's top-k support (plus the tail bucket).

    student_logits [..., V]; teacher_values, teacher_indices [..., k] (the target's k largest logits and
    their token ids); teacher_logsumexp [...] (optional, logsumexp of the target's full logits at τ = 1).
    Returns (log_p, log_q), each [..., k + 1] for tail="bucket" (last entry = tail) or [..., k] for
    tail="renormalize".
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher_values.shape != teacher_indices.shape:
        raise ValueError("teacher top-k values and indices differ in shape")
    if teacher_values.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"teacher top-k {tuple(teacher_values.shape)} does not match student logits "
                         f"{tuple(student_logits.shape)} in the leading dims")
    idx = teacher_indices.long()
    z_p = teacher_values.float().detach() / temperature
    z_q = student_logits.float() / temperature
    if tail == "renormalize":
        return F.log_softmax(z_p, dim=-1), F.log_softmax(z_q.gather(-1, idx), dim=-1)
    if tail != "bucket":
        raise ValueError(f"unknown tail mode {tail!r} (bucket or renormalize)")
    log_q_support = F.log_softmax(z_q, dim=-1).gather(-1, idx)
    if teacher_logsumexp is not None:
        if temperature != 1.0:
            raise ValueError("teacher_logsumexp gives the exact tail only at temperature 1")
        log_p_support = z_p - teacher_logsumexp.float().detach().unsqueeze(-1)
    else:
        log_p_support = F.log_softmax(z_p, dim=-1)
    log_p = torch.cat([log_p_support, _log_tail(log_p_support)], dim=-1)
    log_q = torch.cat([log_q_support, _log_tail(log_q_support)], dim=-1)
    return log_p, log_q


def topk_divergence(student_logits: torch.Tensor, teacher_values: torch.Tensor, teacher_indices: torch.Tensor,
                    kind: Divergence = "forward_kl", mask: torch.Tensor | None = None, temperature: float = 1.0,
                    beta: float = 0.5, tail: Literal["bucket", "renormalize"] = "bucket",
                    teacher_logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Masked mean divergence from the teacher's top-k logits only (module docstring: tail handling).

    student_logits [..., V]; teacher_values, teacher_indices [..., k]; mask [...]. Scalar. With k = V it
    equals `divergence` on the full logits (up to the TAIL_FLOOR, ~1e-6).
    """
    log_p, log_q = topk_logprobs(student_logits, teacher_values, teacher_indices, temperature, tail,
                                 teacher_logsumexp)
    return masked_mean(divergence_from_logprobs(log_p, log_q, kind, beta), mask)


def hard_ce(student_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy against hard next-token labels: logits [..., V], labels [...] (aligned), masked mean."""
    logp = F.log_softmax(student_logits.float(), dim=-1)
    nll = -logp.gather(-1, labels.long().clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return masked_mean(nll, mask)


def distill_loss(student_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None,
                 teacher_logits: torch.Tensor | None = None,
                 teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kind: Divergence = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                 ce_weight: float = 0.0, tail: Literal["bucket", "renormalize"] = "bucket",
                 teacher_logsumexp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(1 − w)·τ²·D(p, q) + w·CE(labels, q) with w = ce_weight; the teacher as full logits or top-k.

    The τ² factor keeps the KD gradient scale independent of τ (Hinton et al. 2015, §2). With w = 1 no
    teacher is needed (plain next-token training, the "no KD" baseline). student_logits [..., V],
    labels and mask [...], teacher_logits [..., V] or teacher_topk = (values, indices) [..., k].
    Returns the loss and metrics `kd`, `ce`, `tvd` (τ = 1 TVD on the teacher's support: 1 − TVD is the
    expected one-token acceptance α of the draft under speculative sampling), `top1` (student argmax ==
    teacher argmax).
    """
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    ce = hard_ce(student_logits, labels, mask)
    metrics = {"ce": float(ce.detach())}
    if teacher_logits is None and teacher_topk is None:
        if ce_weight != 1.0:
            raise ValueError("distill_loss needs teacher logits (or top-k) unless ce_weight is 1")
        top1 = masked_mean((student_logits.argmax(-1) == labels).float(), mask)
        metrics.update(kd=0.0, tvd=float("nan"), top1=float(top1))
        return ce, metrics
    if teacher_logits is not None:
        kd = divergence(student_logits, teacher_logits, kind, mask, temperature, beta)
        with torch.no_grad():
            tvd = divergence(student_logits, teacher_logits, "tvd", mask, 1.0)
            teacher_top1 = teacher_logits.argmax(-1)
    else:
        values, indices = teacher_topk
        kd = topk_divergence(student_logits, values, indices, kind, mask, temperature, beta, tail,
                             teacher_logsumexp if temperature == 1.0 else None)
        with torch.no_grad():
            tvd = topk_divergence(student_logits, values, indices, "tvd", mask, 1.0, tail=tail,
                                  teacher_logsumexp=teacher_logsumexp)
            teacher_top1 = indices.gather(-1, values.argmax(-1, keepdim=True)).squeeze(-1)
    with torch.no_grad():
        top1 = masked_mean((student_logits.argmax(-1) == teacher_top1).float(), mask)
    loss = (1.0 - ce_weight) * temperature**2 * kd + ce_weight * ce
    metrics.update(kd=float(kd.detach()), tvd=float(tvd), top1=float(top1))
    return loss, metrics
