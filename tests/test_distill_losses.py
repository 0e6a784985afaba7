"""KD losses (heads/losses.py) against hand-computed values on small logits."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.heads import losses as L

P = [0.7, 0.2, 0.1]  # teacher
Q = [0.4, 0.4, 0.2]  # student


def _logits(probs):
    return torch.tensor([math.log(x) for x in probs]).view(1, 1, -1)


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def test_hand_values():
    s, t = _logits(Q), _logits(P)
    assert L.divergence(s, t, "forward_kl").item() == pytest.approx(_kl(P, Q), abs=1e-6)
    assert L.divergence(s, t, "reverse_kl").item() == pytest.approx(_kl(Q, P), abs=1e-6)
    assert L.divergence(s, t, "tvd").item() == pytest.approx(0.5 * (0.3 + 0.2 + 0.1), abs=1e-6)
    beta = 0.3
    m = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
    want = beta * _kl(P, m) + (1 - beta) * _kl(Q, m)
    assert L.divergence(s, t, "jsd", beta=beta).item() == pytest.approx(want, abs=1e-6)
    # the one-token acceptance of speculative sampling: α = Σ min(p, q) = 1 − TVD
    alpha = sum(min(p, q) for p, q in zip(P, Q))
    assert 1 - L.divergence(s, t, "tvd").item() == pytest.approx(alpha, abs=1e-6)


def test_zero_for_identical_inputs():
    z = torch.randn(2, 5, 11)
    for kind in L.DIVERGENCES:
        assert L.divergence(z, z.clone(), kind).item() == pytest.approx(0.0, abs=1e-6)


def test_jsd_symmetric_at_half_and_limits():
    a, b = torch.randn(3, 4, 9), torch.randn(3, 4, 9) * 2
    assert (L.divergence(a, b, "jsd", beta=0.5).item()
            == pytest.approx(L.divergence(b, a, "jsd", beta=0.5).item(), abs=1e-6))
    assert L.divergence(a, b, "jsd", beta=0.5).item() <= math.log(2) + 1e-6
    # not symmetric away from 0.5
    assert (L.divergence(a, b, "jsd", beta=0.2).item()
            != pytest.approx(L.divergence(b, a, "jsd", beta=0.2).item(), abs=1e-4))
    # GKD limits: JSD(β)/β -> KL(p‖q) as β -> 0, JSD(β)/(1-β) -> KL(q‖p) as β -> 1; endpoints are those KLs
    eps = 1e-4
    assert (L.divergence(a, b, "jsd", beta=eps).item() / eps
            == pytest.approx(L.divergence(a, b, "forward_kl").item(), rel=1e-2))
    assert (L.divergence(a, b, "jsd", beta=1 - eps).item() / eps
            == pytest.approx(L.divergence(a, b, "reverse_kl").item(), rel=1e-2))
    assert (L.divergence(a, b, "jsd", beta=0.0).item()
            == pytest.approx(L.divergence(a, b, "forward_kl").item(), abs=1e-6))
    assert (L.divergence(a, b, "jsd", beta=1.0).item()
            == pytest.approx(L.divergence(a, b, "reverse_kl").item(), abs=1e-6))


def test_tvd_bounds():
    a = torch.randn(4, 6, 13) * 5
    b = torch.randn(4, 6, 13) * 5
    v = L.divergence(a, b, "tvd").item()
    assert 0.0 < v < 1.0
    # disjoint supports: TVD = 1
    x = torch.tensor([[[50.0, -50.0]]])
    assert L.divergence(x, -x, "tvd").item() == pytest.approx(1.0, abs=1e-6)


def test_temperature():
    s, t = _logits(Q), _logits(P)
    # τ = 2: p ∝ p^(1/2); compute by hand
    pt = [math.sqrt(x) for x in P]
    pt = [x / sum(pt) for x in pt]
    qt = [math.sqrt(x) for x in Q]
    qt = [x / sum(qt) for x in qt]
    assert L.divergence(s, t, "forward_kl", temperature=2.0).item() == pytest.approx(_kl(pt, qt), abs=1e-6)
    # high temperature flattens both: the divergence shrinks
    assert L.divergence(s, t, "forward_kl", temperature=4.0) < L.divergence(s, t, "forward_kl", temperature=1.0)
    with pytest.raises(ValueError):
        L.divergence(s, t, "forward_kl", temperature=0.0)


def test_masking_is_mean_over_masked_positions():
    s = torch.randn(2, 3, 7)
    t = torch.randn(2, 3, 7)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    per = [L.divergence(s[b, i], t[b, i], "forward_kl").item() for b, i in [(0, 0), (0, 2), (1, 2)]]
    assert L.divergence(s, t, "forward_kl", mask).item() == pytest.approx(sum(per) / 3, abs=1e-6)
    # masked-out positions get no gradient
    s.requires_grad_(True)
    L.divergence(s, t, "reverse_kl", mask).backward()
    assert s.grad[0, 1].abs().sum() == 0 and s.grad[0, 0].abs().sum() > 0
    # empty mask: 0, not nan
    assert L.divergence(s, t, "tvd", torch.zeros(2, 3)).item() == 0.0


@pytest.mark.parametrize("kind", L.DIVERGENCES)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_topk_equals_full_when_k_is_vocab(kind, tail):
    torch.manual_seed(0)
    s, t = torch.randn(2, 4, 10), torch.randn(2, 4, 10) * 3
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]])
    values, indices = torch.topk(t, 10, dim=-1)
    full = L.divergence(s, t, kind, mask, temperature=1.5, beta=0.3).item()
    top = L.topk_divergence(s, values, indices, kind, mask, temperature=1.5, beta=0.3, tail=tail).item()
    assert top == pytest.approx(full, abs=1e-5)


def test_topk_tail_bucket_penalises_student_mass_outside_support():
    torch.manual_seed(1)
    t = torch.randn(1, 3, 20) * 4
    values, indices = torch.topk(t, 4, dim=-1)
    good = t.clone()  # student = teacher
    bad = t.clone().scatter(-1, indices, -30.0)  # student puts ~all mass outside the teacher's top-4
    for kind in L.DIVERGENCES:
        assert (L.topk_divergence(bad, values, indices, kind).item()
                > L.topk_divergence(good, values, indices, kind).item())
    # exact teacher normaliser (τ = 1): bucketed forward KL is <= the full KL (data-processing inequality)
    s = torch.randn(1, 3, 20)
    lse = torch.logsumexp(t, dim=-1)
    top = L.topk_divergence(s, values, indices, "forward_kl", teacher_logsumexp=lse).item()
    assert top <= L.divergence(s, t, "forward_kl").item() + 1e-6
    # renormalised mode ignores student mass outside the support: identical top-k logits -> 0
    assert (L.topk_divergence(bad.scatter(-1, indices, values), values, indices, "tvd", tail="renormalize").item()
        == pytest.approx(0.0, abs=1e-6))


def test_distill_loss_mixing_and_grad():
    torch.manual_seed(2)
    s = torch.randn(2, 5, 8, requires_grad=True)
    t = torch.randn(2, 5, 8)
    labels = torch.randint(0, 8, (2, 5))
    mask = torch.ones(2, 5)
    ce = L.hard_ce(s, labels, mask)
    kd = L.divergence(s, t, "forward_kl", mask)
    loss, m = L.distill_loss(s, labels, mask, teacher_logits=t, ce_weight=0.25, temperature=1.0)
    assert loss.item() == pytest.approx(0.75 * kd.item() + 0.25 * ce.item(), abs=1e-6)
    assert set(m) == {"kd", "ce", "tvd", "top1"}
    loss.backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    only_ce, _ = L.distill_loss(s, labels, mask, ce_weight=1.0)
    assert only_ce.item() == pytest.approx(ce.item(), abs=1e-6)
    with pytest.raises(ValueError):
        L.distill_loss(s, labels, mask, ce_weight=0.5)  # KD needs a teacher
    # top-k path gives the same metrics' names and a finite gradient
    v, i = torch.topk(t, 3, dim=-1)
    loss2, m2 = L.distill_loss(s, labels, mask, teacher_topk=(v, i), kind="reverse_kl")
    assert set(m2) == set(m) and torch.isfinite(loss2)
