"""Reduced draft vocabularies (EAGLE-3 §3.2; vLLM's Medusa `token_map`): a head predicts over the N tokens the
target writes most often instead of its whole vocabulary, which makes the head's vocab projection V/N
times cheaper (SmolLM2: 49,152 -> 8,192 rows, ~28M -> ~4.7M multiply-adds per proposed token).

Convention (the serving stacks'): draft ids are the chosen target ids in ascending order;
d2t [N] int64 with target_id = draft_id + d2t[draft_id], and t2d [V] bool marks the chosen target ids.
Invariant: nonzero(t2d) == arange(N) + d2t.
"""

from __future__ import annotations

import logging

import torch

from draftsmith.errors import ConfigError

log = logging.getLogger(__name__)


def token_counts(rows, vocab_size: int) -> torch.Tensor:
    """[V] int64: how often each token is TARGET-WRITTEN (loss_mask = 1) in `rows` (dicts with
    input_ids, loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        ids = torch.as_tensor(list(r["input_ids"]), dtype=torch.long)
        mask = torch.as_tensor(list(r["loss_mask"]), dtype=torch.bool)[: ids.numel()]
        counts += torch.bincount(ids[: mask.numel()][mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`size` tokens by count (ties and unseen tokens: lowest id first), sorted by target id.

    Returns d2t [size] int64 (target_id = draft_id + d2t[draft_id]) and t2d [V] bool.
    """
    V = counts.numel()
    if not 1 <= size <= V:
        raise ConfigError(f"draft vocabulary size must be in 1..{V}, got {size}")
    # stable sort on -count keeps ascending ids among equal counts (in float64: a count may carry a prior's
    # fraction, eagle/job.py, and every integer count is exact there)
    order = torch.sort(-counts.double(), stable=True).indices[:size]
    chosen = torch.sort(order).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size)
    return d2t, t2d


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The invariant nonzero(t2d) == arange(N) + d2t (draft ids are target ids in ascending order)."""
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    nz = torch.nonzero(t2d).flatten().to(d2t.device)
    if d2t.dtype != torch.long or t2d.dtype != torch.bool or nz.numel() != d2t.numel() or not torch.equal(nz, ids):
        raise ConfigError("draft vocabulary is inconsistent: nonzero(t2d) must equal arange(N) + d2t")


def vocab_coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage) of the top-`size` tokens of `counts` (at most the whole vocabulary), logged."""
    n = min(size, counts.numel())
    d2t, t2d = build_draft_vocab(counts, n)
    coverage = vocab_coverage(counts, t2d)
    log.info("draft vocabulary: %d tokens cover %.2f%% of the learned training tokens", n, 100 * coverage)
    return d2t, t2d, coverage


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """[V] int64: the draft id of each target id, -1 for a target id outside the draft vocabulary."""
    index = torch.full(t2d.shape, -1, dtype=torch.long, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return index
