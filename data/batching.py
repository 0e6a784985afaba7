"""Batches for the jobs that learn from self-distilled rows (draft, Medusa, EAGLE): which slice of a long
row is trained on, right padding, and an epoch order that puts rows of similar length together. It is part
of data/ (rows -> batches), below training/: `draftsmith data stats` reports how a dataset's rows batch, and
the loop and every method's job read the same rules.

Rows are dicts with `input_ids` and `loss_mask` (1 = a target-written token that is learned) and, for the
offline capture cache, `row_id`.

Windows. A row longer than `max_length` is trained on one window of `max_length` tokens. Cutting its tail
(the old rule) keeps the prompt and drops the answer, the only part with loss: a 512-token T0 document
under max_length 384 kept no learned token at all. `window` keeps the answer instead and cuts the
prompt's head, leaving `context` prompt tokens before the first learned one when the answer itself is
longer than the window. The batch carries each row's `offset` (its window's first token), so the offline
capture cache hands out the features of the same positions (`CaptureSource`); online, the target reads
the window only, i.e. without the prompt's cut head.

Prompt context (`prompt_context`). From the offline cache, every feature was computed by the target over
the WHOLE row, so a head (whose own attention is one layer deep) loses little when its window keeps only
the last `prompt_context` prompt tokens before the answer. A T0 row of a 480-token document and a
20-token answer then costs 84 positions instead of 500. Online, the target would read the cut prompt
too: leave it unset there.

Length grouping (`group_by_length`). With rows drawn in random order a batch is padded to its longest
row; on the self-distilled SmolLM2 set (rows of up to 768 tokens, max_length 384, batches of 8) padding was
30% of the positions computed (BENCHMARKS.md).
`length_grouped` reorders an epoch's permutation in the way of HF Trainer's `group_by_length`: cut it into
megabatches of `megabatch` steps, sort each by length, cut those into steps and shuffle the steps (the
longest first, so a batch that does not fit in memory fails at once and not hours in). The order is a
function of (seed, epoch), so a resumed run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.checksums import sha256_text


def _row_ids(rows) -> list | None:
    if hasattr(rows, "column_names"):
        return list(rows["row_id"]) if "row_id" in rows.column_names else None
    if rows and all(isinstance(r, dict) and "row_id" in r for r in rows):
        return [r["row_id"] for r in rows]
    return None


CONTEXT = 32  # prompt tokens kept before the first learned token when a row's window cannot hold it all


def split_rows(rows, eval_fraction: float, seed: int, train_rows: int | None = None):
    """Deterministic (train, held-out) split of a datasets.Dataset or a list.

    Rows with a `row_id` (every self-distilled dataset) are ranked by a seeded hash of it and the lowest
    ranks are held out: a row's side depends on its id, not on its position, so a dataset that grows
    (new sources, retraining on recent traffic) keeps its held-out rows held out, except the few near
    the cut. Rows without ids fall back to a seeded permutation.
    At least one row is held out, except from a one-row set, which is all training.
    `train_rows` keeps the first N training rows in that ranked order (train.train_rows): the held-out rows
    do not depend on N and the rows kept for a smaller N are among those kept for a larger one."""
    n = len(rows)
    n_eval = max(1, round(n * eval_fraction)) if n > 1 else 0
    ids = _row_ids(rows)
    if ids is not None:
        order = sorted(range(n), key=lambda i: sha256_text(f"{seed}:{ids[i]}"))
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if train_rows is not None and train_rows > n - n_eval:
        raise ValueError(f"train.train_rows={train_rows} but the data has {n - n_eval} training rows "
                         f"({n} rows, {n_eval} held out)")
    keep = n if train_rows is None else n_eval + train_rows
    held, train = sorted(order[:n_eval]), sorted(order[n_eval:keep])
    if hasattr(rows, "select"):
        return rows.select(train), rows.select(held)
    return [rows[i] for i in train], [rows[i] for i in held]


def window(loss_mask: Sequence[int], max_length: int, context: int = CONTEXT,
           prompt_context: int | None = None) -> tuple[int, int]:
    """[start, end) of the tokens of a row to train on (module docstring). A row that fits is taken whole;
    a longer one ends at its last token if that leaves `context` tokens before the first learned one, else
    it starts `context` tokens before that token (and the end of a very long answer is cut).
    `prompt_context`: keep at most this many tokens before the first learned one even where more fit."""
    n = len(loss_mask)
    first = next((i for i, m in enumerate(loss_mask) if m), n)
    lo = max(0, first - prompt_context) if prompt_context is not None else 0
    if n - lo <= max_length:
        return lo, n
    start = max(lo, min(n - max_length, first - context))
    return start, min(n, start + max_length)


def pad_rows(rows: list[dict], pad_id: int, max_length: int, context: int = CONTEXT,
             prompt_context: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] `input_ids`, `loss_mask` (0 on padding), `attention_mask` and `offset` [B] (each
    row's window start), plus `row_id` [B] when the rows have one and `replay` [B, T] when they carry
    rollout marks (data/engines/rollout.py). T = the longest window."""
    spans = [window(list(r["loss_mask"]), max_length, context, prompt_context) for r in rows]
    ids = [list(r["input_ids"])[s:e] for r, (s, e) in zip(rows, spans)]
    masks = [list(r["loss_mask"])[s:e] for r, (s, e) in zip(rows, spans)]
    T = max(len(x) for x in ids)
    out = {"input_ids": torch.full((len(rows), T), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros((len(rows), T), dtype=torch.long),
           "attention_mask": torch.zeros((len(rows), T), dtype=torch.long),
           "offset": torch.tensor([s for s, _ in spans], dtype=torch.long)}
    for b, (x, m) in enumerate(zip(ids, masks)):
        out["input_ids"][b, : len(x)] = torch.tensor(x, dtype=torch.long)
        out["loss_mask"][b, : len(m)] = torch.tensor(m, dtype=torch.long)
        out["attention_mask"][b, : len(x)] = 1
    out["loss_mask"] *= out["attention_mask"]
    if "row_id" in rows[0]:
        out["row_id"] = torch.tensor([int(r["row_id"]) for r in rows], dtype=torch.long)
    # on-policy rollouts' rejection marks (data/engines/rollout.py), windowed alike
    if rows[0].get("replay") is not None:
        out["replay"] = torch.zeros((len(rows), T), dtype=torch.long)
        for b, (r, (s, e)) in enumerate(zip(rows, spans)):
            x = list(r["replay"])[s:e]
            out["replay"][b, : len(x)] = torch.tensor(x, dtype=torch.long)
    return out


def next_token_learned(loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool [B, T] of the positions t whose next token x_{t+1} is learned (loss_mask [B, T]): where a model's
    next-token logits are compared with a teacher's or a label."""
    sel = torch.zeros_like(loss_mask, dtype=torch.bool)
    sel[:, :-1] = loss_mask[:, 1:].bool()
    return sel


def row_lengths(rows, max_length: int | None = None, prompt_context: int | None = None) -> list[int]:
    """Tokens of every row's window (`window`; whole rows without max_length), read as columns where the
    rows are a dataset."""
    if not max_length:
        column = rows["input_ids"] if hasattr(rows, "column_names") else [r["input_ids"] for r in rows]
        return [len(x) for x in column]
    masks = rows["loss_mask"] if hasattr(rows, "column_names") else [r["loss_mask"] for r in rows]
    spans = (window(list(m), max_length, prompt_context=prompt_context) for m in masks)
    return [e - s for s, e in spans]


def length_grouped(perm: list[int], lengths: Sequence[int], group: int, seed: int, epoch: int,
                   megabatch: int = 50) -> list[int]:
    """`perm` reordered so that each run of `group` rows (one step's batches over all ranks) holds rows of
    similar length; the rows past the last full group stay at the end (the loop drops them, as before)."""
    n_full = len(perm) // group * group
    used, tail = perm[:n_full], perm[n_full:]
    span = megabatch * group
    groups: list[list[int]] = []
    for s in range(0, n_full, span):
        chunk = sorted(used[s : s + span], key=lambda i: -lengths[i])
        groups += [chunk[k : k + group] for k in range(0, len(chunk), group)]
    if not groups:
        return list(perm)
    g = torch.Generator().manual_seed(seed * 1000003 + epoch + 0x5EED)
    order = torch.randperm(len(groups), generator=g).tolist()
    longest = max(range(len(groups)), key=lambda k: lengths[groups[k][0]])
    order.remove(longest)
    return [i for k in [longest, *order] for i in groups[k]] + tail


def batching_report(loss_masks: Sequence[Sequence[int]], max_length: int, batch_size: int,
                    prompt_context: int | None = None, seed: int = 0) -> dict[str, float]:
    """What a job's max_length / prompt_context / group_by_length do to one epoch of these rows.

    learned_kept_window / learned_kept_head: fraction of learned tokens inside `window` vs inside the first
    max_length tokens (the old rule); positions: tokens of the windows; padded_random / padded_grouped:
    positions computed when batches of `batch_size` are padded to their longest row, in random order and
    length-grouped (one epoch of `epoch_permutation` order, one rank)."""
    spans = [window(list(m), max_length, prompt_context=prompt_context) for m in loss_masks]
    learned = sum(sum(m) for m in loss_masks) or 1
    kept = sum(sum(list(m)[s:e]) for m, (s, e) in zip(loss_masks, spans))
    head = sum(sum(list(m)[:max_length]) for m in loss_masks)
    lengths = [e - s for s, e in spans]
    perm = epoch_permutation(len(lengths), seed, 0)

    def padded(order: list[int]) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for b in rank_batches(order, batch_size, 1, 0, 0))

    grouped = length_grouped(perm, lengths, batch_size, seed, 0)
    return {"rows": len(lengths), "learned_kept_window": kept / learned, "learned_kept_head": head / learned,
            "positions": sum(lengths), "padded_random": padded(perm), "padded_grouped": padded(grouped)}


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_batches(perm: list[int], batch_size: int, world: int, rank: int, start: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch from batch index `start` on (incomplete tail dropped)."""
    per_epoch = len(perm) // (batch_size * world)
    out = []
    for b in range(start, per_epoch):
        lo = (b * world + rank) * batch_size
        out.append(perm[lo:lo + batch_size])
    return out
