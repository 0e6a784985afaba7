"""Medusa heads: identity init, distinct parameters, loss alignment, candidate tree."""

from __future__ import annotations

import itertools

import pytest
import torch

from draftsmith.medusa.model import (
    MedusaHeads,
    MedusaTree,
    build_tree,
    head_labels,
    head_positions,
    medusa_loss,
    rank_accuracies,
    tree_expected_length,
)


@pytest.mark.parametrize("share", [False, True])
def test_fresh_heads_predict_what_the_target_predicts(tiny_target, share):
    model = tiny_target.model
    heads = MedusaHeads.from_target(model.config, num_heads=3, num_layers=2, share_lm_head=share,
                                    lm_head=model.lm_head)
    ids = torch.randint(3, tiny_target.vocab_size, (2, 9))
    out = model(ids, output_hidden_states=True)
    logits = heads(out.hidden_states[-1])
    assert logits.shape == (3, 2, 9, tiny_target.vocab_size)
    for i in range(3):
        torch.testing.assert_close(logits[i], out.logits)


@pytest.mark.parametrize("share", [False, True])
def test_batched_forward_equals_head_by_head(tiny_target, share):
    """forward() projects every head at once (one product over K rows when the lm_head is shared)."""
    model = tiny_target.model
    heads = MedusaHeads.from_target(model.config, num_heads=3, num_layers=1, share_lm_head=share,
                                    lm_head=model.lm_head)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for shape in ((1, tiny_target.hidden_size), (2, 5, tiny_target.hidden_size)):
            h = torch.randn(*shape)
            got = heads(h)
            for i in range(3):
                torch.testing.assert_close(got[i], heads.head_logits(i, h), atol=1e-5, rtol=1e-5)


def test_every_block_has_its_own_parameters(tiny_target):
    H, V = tiny_target.hidden_size, tiny_target.vocab_size
    heads = MedusaHeads.from_target(tiny_target.model.config, num_heads=4, num_layers=3)
    n_params = sum(p.numel() for p in heads.parameters())
    assert n_params == 4 * (3 * (H * H + H) + V * H)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    shared = MedusaHeads.from_target(tiny_target.model.config, num_heads=4, num_layers=3, share_lm_head=True,
                                     lm_head=tiny_target.model.lm_head)
    assert sum(p.numel() for p in shared.parameters()) == 4 * 3 * (H * H + H)
    assert "lm_head" not in "".join(shared.state_dict())


def medusa_loss_dense(logits, input_ids, loss_mask, weights, teacher=None, kd_weight=0.0):
    """`medusa_loss` from dense logits [K, B, T, V] (and a dense teacher [B, T, k] pair), picking each head's
    positions and labels as the job does: the teacher for head i at t is the target at t+1+i."""
    sels = [head_positions(loss_mask, i) for i in range(logits.shape[0])]
    picked = [logits[i][sel] for i, sel in enumerate(sels)]
    labels = [head_labels(input_ids, sel, i) for i, sel in enumerate(sels)]
    t = None
    if teacher is not None:
        t = [tuple(torch.roll(x, shifts=-(i + 1), dims=1)[sel] for x in teacher) for i, sel in enumerate(sels)]
    return medusa_loss(picked, labels, weights, t, kd_weight)


def test_loss_targets_the_token_two_plus_i_ahead():
    # One-hot "logits" that put all mass on x_{t+2+i} give zero CE and top1 = 1; shifting by one breaks it.
    V, T = 11, 8
    ids = torch.arange(T).unsqueeze(0) % V
    mask = torch.ones_like(ids)
    K = 3
    logits = torch.full((K, 1, T, V), -30.0)
    for i in range(K):
        for t in range(T - 2 - i):
            logits[i, 0, t, ids[0, t + 2 + i]] = 30.0
    loss, m = medusa_loss_dense(logits, ids, mask, weights=[1.0] * K)
    assert loss.item() < 1e-6
    assert all(m[f"head{i}/top1"] == 1.0 for i in range(K))
    wrong = torch.roll(logits, shifts=1, dims=2)
    _, m2 = medusa_loss_dense(wrong, ids, mask, weights=[1.0] * K)
    assert all(m2[f"head{i}/top1"] == 0.0 for i in range(K))


def test_loss_mask_selects_label_positions():
    V, T = 7, 6
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 1]])  # only x_4, x_5 are assistant tokens
    logits = torch.zeros(1, 1, T, V)
    logits[0, 0, 2, 5] = 50.0  # t=2 predicts x_4 = 5: right
    logits[0, 0, 3, 0] = 50.0  # t=3 predicts x_5 = 6: wrong
    logits[0, 0, 0, 0] = 50.0  # t=0 -> x_2 is masked out, does not count
    _, m = medusa_loss_dense(logits, ids, mask, weights=[1.0])
    assert m["head0/top1"] == pytest.approx(0.5)


def test_head_positions_need_an_existing_assistant_label():
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert head_positions(mask, 0).tolist() == [[True, True, True, False, False]]
    assert head_positions(mask, 2).tolist() == [[True, False, False, False, False]]
    assert not head_positions(mask, 3).any()


def test_kd_term_is_zero_when_head_equals_teacher():
    torch.manual_seed(0)
    B, T, V = 2, 6, 9
    teacher = torch.randn(B, T, V)
    ids = teacher.argmax(-1)
    logits = teacher[:, 1:].unsqueeze(0)  # head 0 at t copies the teacher at t+1
    logits = torch.cat([logits, torch.zeros(1, B, 1, V)], dim=2)
    mask = torch.ones(B, T)
    full = (teacher, torch.arange(V).expand(B, T, V))
    loss_kd, _ = medusa_loss_dense(logits, ids, mask, [1.0], teacher=full, kd_weight=1.0)
    assert loss_kd.item() == pytest.approx(0.0, abs=1e-5)


def test_tree_is_prefix_closed_and_optimal_on_small_cases():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.1], [0.3, 0.1, 0.05]]
    for budget in (1, 3, 6, 10):
        tree = build_tree(acc, budget)
        assert len(tree.paths) == budget
        assert all(p[:-1] in tree.paths for p in tree.paths if len(p) > 1)
        # brute force over all prefix-closed trees of this size from the 39 possible nodes
        best = _best_tree_value(acc, budget)
        assert tree.expected_length == pytest.approx(best)
        assert tree_expected_length(acc, tree) == pytest.approx(tree.expected_length)
    parents = build_tree(acc, 6).parents()
    assert parents[0] == -1


def _best_tree_value(acc, budget):
    # All nodes sorted by probability; the top `budget` nodes are prefix-closed, so the optimum is their sum.
    probs = []
    for depth in range(1, len(acc) + 1):
        for path in itertools.product(range(len(acc[0])), repeat=depth):
            p = 1.0
            for d, r in enumerate(path):
                p *= acc[d][r]
            probs.append(p)
    return sum(sorted(probs, reverse=True)[:budget])


def test_rank_accuracies_and_chain():
    hits = torch.zeros(2, 4, 3, dtype=torch.bool)
    hits[0, :2, 0] = True
    hits[1, 0, 1] = True
    assert rank_accuracies(hits) == [[0.5, 0.0, 0.0], [0.0, 0.25, 0.0]]
    chain = MedusaTree.chain(3)
    assert chain.paths == [(0,), (0, 0), (0, 0, 0)] and chain.parents() == [-1, 0, 1]
    assert MedusaTree.from_json(chain.to_json()).paths == chain.paths


def _draft_vocab(vocab: int, n: int):
    from draftsmith.heads.vocab import build_draft_vocab

    counts = torch.arange(vocab).flip(0) % 17  # some tokens frequent, some never seen
    return build_draft_vocab(counts, n)


def test_draft_vocabulary_heads_start_as_the_target_restricted_to_their_tokens(tiny_target):
    model, V, H = tiny_target.model, tiny_target.vocab_size, tiny_target.hidden_size
    d2t, t2d = _draft_vocab(V, 40)
    heads = MedusaHeads.from_target(model.config, num_heads=2, num_layers=1, lm_head=model.lm_head,
                                    draft_vocab=(d2t, t2d))
    assert sum(p.numel() for p in heads.parameters()) == 2 * ((H * H + H) + 40 * H)  # 40 rows, not V
    out = model(torch.randint(3, V, (2, 7)), output_hidden_states=True)
    logits = heads(out.hidden_states[-1])
    assert logits.shape == (2, 2, 7, 40)
    torch.testing.assert_close(logits[1], out.logits[..., t2d])
    # draft ids map back to target ids: the argmax over the draft vocabulary is the target's best draft token
    best = heads.to_target(logits[0].argmax(-1))
    assert t2d[best].all()
    want = out.logits.masked_fill(~t2d, float("-inf")).argmax(-1)
    assert torch.equal(best, want)
    assert {"d2t", "t2d"} <= set(heads.state_dict())
    with pytest.raises(ValueError, match="share_lm_head"):
        MedusaHeads.from_target(model.config, share_lm_head=True, lm_head=model.lm_head, draft_vocab=(d2t, t2d))


def test_loss_skips_labels_outside_the_draft_vocabulary_and_counts_them_as_misses():
    from draftsmith.medusa.model import medusa_loss

    torch.manual_seed(0)
    pred = torch.randn(6, 5) * 0.1
    y = torch.tensor([0, 1, -1, 3, -1, 4])
    pred[torch.arange(6), y.clamp(min=0)] = 20.0  # right wherever the label is known
    loss, m = medusa_loss([pred], [y], [1.0])
    assert loss.item() < 1e-6 and m["head0/top1"] == pytest.approx(4 / 6)
    assert torch.isfinite(medusa_loss([pred], [torch.full((6,), -1)], [1.0])[0])  # nothing to learn: 0, no NaN
    # KD: teacher tokens outside the vocabulary (-1) leave its support; a teacher equal to the head gives 0
    t_idx = torch.tensor([[0, 1, -1]] * 6)
    t_val = pred.gather(-1, t_idx.clamp(min=0))
    kd_only, _ = medusa_loss([pred], [torch.full((6,), -1)], [1.0], teacher=[(t_val, t_idx)], kd_weight=1.0)
    assert torch.isfinite(kd_only) and kd_only.item() > 0  # the head spreads mass beyond {0, 1}
    ok = torch.full_like(pred, -30.0)
    ok[:, :2] = t_val[:, :2]
    assert medusa_loss([ok], [torch.full((6,), -1)], [1.0], teacher=[(t_val, t_idx)],
                       kd_weight=1.0)[0].item() == pytest.approx(0.0, abs=1e-5)
