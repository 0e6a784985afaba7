"""Teacher-forced capture: one prefill pass of the frozen target over finished rows (`draftsmith data capture`).

Head training reads, per token, the target's hidden states of chosen layers and its top-k logits (with the
full logits' logsumexp, so top-k KD knows the tail mass). Generation can keep them while it writes
(`capture.enabled` during `data generate`), but rows the target did not write — a dataset's own responses
kept with `responses: keep`, or responses a server fleet wrote — need the target to read them once. That is
a prefill, with no decode loop: every position of a batch in one forward. Where decoding is memory-bound (a
GPU) that is many times faster than generating the same tokens; on a CPU, where a large-batch decode is
compute-bound too, capture is still faster on the same rows (benchmark/capture.py; BENCHMARKS.md has the
measurement).

Rows are sorted by length and packed into batches of at most `capture.batch_tokens` padded tokens (little
padding, full matrices). The body runs in `capture.dtype` (auto = bf16 on a GPU or a CPU with native bf16;
the lm_head stays float32). The lm_head runs only on positions a loss reads — from the one that predicts
the first learned token on — the same rows `data generate` keeps; earlier top-k rows are zeros.

Shards go to `output_dir/capture/` (cache.py): a shard is written whole or not at all, and a
rerun skips the rows already stored, so a killed capture resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.capture.cache import ShardWriter, estimate_disk_bytes
from draftsmith.capture.config import CaptureConfig
from draftsmith.capture.forward import capture_forward, topk_with_logsumexp
from draftsmith.errors import DataError

log = logging.getLogger(__name__)


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length (longest first) so that rows x longest row <= batch_tokens per batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def capture_target(target, dtype: str = "auto", fp32_logits: bool = True):
    """The target as capture runs it (a bf16 copy where bf16 is native) and the dtype's name."""
    from draftsmith.targets.device import dtype_name
    from draftsmith.targets.precision import inference_copy, inference_dtype

    want = inference_dtype(target.device, dtype)
    model = inference_copy(target.model, want, fp32_logits)
    if model is not target.model:
        target.fingerprint()  # of the weights as loaded, before the copy's float32 head joins them
        target = dataclasses.replace(target, model=model)
    return target, dtype_name(want)


@torch.inference_mode()
def capture_rows(target, records: Sequence[dict], out_dir: str | Path, cc: CaptureConfig, *,
                 progress: bool = True, on_batch=None) -> dict:
    """Capture `records` (dicts with row_id, input_ids, loss_mask) into the shard cache at `out_dir`.

    Resumable: rows already in the cache are skipped. Returns stats (rows, tokens, seconds, tokens_per_s,
    dtype). `on_batch(n_rows_done)` is called after each batch (tests use it to simulate a kill).
    """
    from tqdm.auto import tqdm

    if not (cc.layers or cc.topk or cc.last_hidden):
        raise DataError("capture: nothing to capture (set capture.layers, capture.topk or capture.last_hidden)")
    fp = target.fingerprint()
    target, dtype = capture_target(target, cc.dtype)
    writer = ShardWriter(out_dir, list(cc.layers), cc.topk, fingerprint=fp)
    _refuse_other_data(writer, records, out_dir)
    todo = [r for r in records if int(r["row_id"]) not in writer]
    lengths = [len(r["input_ids"]) for r in todo]
    n_tokens = sum(lengths)
    need = estimate_disk_bytes(n_tokens, target.hidden_size, len(cc.layers), cc.topk, last_hidden=cc.last_hidden)
    log.info("capture: %d of %d rows to do (%d already stored), %d tokens, ~%.1f MB -> %s",
             len(todo), len(records), len(records) - len(todo), n_tokens, need / 2**20, out_dir)
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else target.eos_token_ids[0]
    bar = tqdm(total=n_tokens, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
               desc="capture")
    t0, done_rows = time.perf_counter(), 0
    try:
        for batch in length_batches(lengths, max(cc.batch_tokens, max(lengths, default=1))):
            rows = [todo[i] for i in batch]
            _capture_batch(target, rows, pad, cc, writer)
            done_rows += len(rows)
            bar.update(sum(lengths[i] for i in batch))
            bar.set_postfix_str(f"{done_rows}/{len(todo)} rows", refresh=False)
            if on_batch is not None:
                on_batch(done_rows)
        seconds = time.perf_counter() - t0
    finally:
        bar.close()
        writer.flush()  # what was captured stays: a rerun resumes from it
    writer.close()
    elapsed = max(seconds, 1e-9)
    return {"rows": len(todo), "cached_rows": len(records) - len(todo), "tokens": n_tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(n_tokens / elapsed, 1) if todo else None,
            "dtype": dtype, "dir": str(out_dir)}


def _refuse_other_data(writer: ShardWriter, records: Sequence[dict], out_dir: str | Path) -> None:
    """A stored row of another length was captured from other data under the same key."""
    for r in records:
        stored = writer.rows.get(int(r["row_id"]))
        if stored is not None and stored[2] != len(r["input_ids"]):
            raise DataError(f"capture cache {out_dir} holds row {r['row_id']} with {stored[2]} tokens, the dataset's "
                            f"row has {len(r['input_ids'])}: it was captured from other data; use another folder")


def _right_padded(rows: Sequence[dict], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of `rows`, padded on the right: a causal position never sees the pads
    after it."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
        mask[b, : len(r["input_ids"])] = 1
    return ids, mask


def _loss_spans(rows: Sequence[dict]) -> list[tuple[int, int]]:
    """Per row, (a, n): the positions the lm_head runs on, from the one that predicts the first learned token
    to the row's end."""
    spans = []
    for r in rows:
        learned = next((i for i, m in enumerate(r["loss_mask"]) if m), len(r["input_ids"]))
        spans.append((max(learned - 1, 0), len(r["input_ids"])))
    return spans


def _topk_per_row(head, last_hidden: torch.Tensor, spans: list[tuple[int, int]], k: int):
    """Per row, (values [n, k], indices [n, k], logsumexp [n]) of the head on its span, zeros before it: the
    head runs once, on the spans of the whole batch."""
    picked = torch.cat([last_hidden[b, a:n] for b, (a, n) in enumerate(spans)])
    topv, topi, lse = topk_with_logsumexp(head(picked), k)
    out, at = [], 0
    for a, n in spans:
        v = torch.zeros((n, k), dtype=torch.float32)
        i = torch.zeros((n, k), dtype=torch.long)
        s = torch.zeros(n, dtype=torch.float32)
        v[a:], i[a:], s[a:] = topv[at:at + n - a], topi[at:at + n - a], lse[at:at + n - a]
        at += n - a
        out.append((v, i, s))
    return out


def _capture_batch(target, rows: Sequence[dict], pad: int, cc: CaptureConfig, writer: ShardWriter) -> None:
    """One prefill of `rows` and their layers, last hidden state and top-k logits into `writer`."""
    ids, mask = _right_padded(rows, pad)
    # logits_to_keep=1: the full [B, T, V] logits are never built; the head runs on the positions a loss reads
    cap = capture_forward(target.model, ids.to(target.device), mask.to(target.device), layers=list(cc.layers),
                          want_logits=False, logits_to_keep=1)
    spans = _loss_spans(rows)
    topk = (_topk_per_row(target.model.get_output_embeddings(), cap.last_hidden, spans, cc.topk) if cc.topk
            else [(None, None, None)] * len(rows))
    for b, (r, (_, n), (v, i, s)) in enumerate(zip(rows, spans, topk)):
        writer.add(int(r["row_id"]), {layer: cap.layers[layer][b, :n] for layer in cc.layers}, v, i,
                   cap.last_hidden[b, :n] if cc.last_hidden else None, s)
