"""The one check of generated rows that come back from outside: a row pack (`data generate --resume-from`), the
chunk files an earlier run left in output_dir, and the finished dataset a training job or a merge reads.

Generation writes a row as `{"row_id", "source", "domain", "prompt", "response", "input_ids", "loss_mask",
"origin", "stopped", "n_turns"}` (data/generate.py), or as `{"row_id", "origin", "skipped"}` when its source's
policy left nothing to learn in it. What is read back is checked against the target before anything trusts it:
every id a token of the target's vocabulary ([0, vocab_size)), the mask as long as the ids and of 0s and 1s, the
row no longer than the target's context, and no more learned tokens than `max_new_tokens` allows each answered
turn (the end-of-turn token included). A row that fails is one line naming where it was read and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.errors import DataError, json_kind
from draftsmith.reading import is_int

TEXT_FIELDS = ("source", "domain", "prompt", "response", "origin")
MAX_ROW_ID = 1 << 63  # row ids are 60-bit hashes; the dataset stores them as int64


@dataclass(frozen=True)
class RowLimits:
    """What a row of one target and one generation setting can hold; None: not known here, not checked."""

    vocab_size: int | None = None
    context: int | None = None
    max_new_tokens: int | None = None

    @classmethod
    def of(cls, target, max_new_tokens: int | None = None) -> RowLimits:
        from draftsmith.targets.context import context_window

        return cls(int(target.vocab_size), context_window(target), max_new_tokens)


def check_row(rec: Any, where: str, limits: RowLimits) -> dict:
    """`rec` as read from `where` (a file and line), checked (module docstring); a DataError in one line otherwise."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a row is not a JSON object (got {json_kind(rec)})")
    if not is_int(rec.get("row_id")) or not 0 <= rec["row_id"] < MAX_ROW_ID:
        raise DataError(f"{where}: field 'row_id' is {json_kind(rec.get('row_id'))}, expected a whole number in "
                        "[0, 2^63)")
    if "skipped" in rec:
        for name in ("origin", "skipped"):
            if not isinstance(rec.get(name), str):
                raise DataError(f"{where}: field '{name}' is {json_kind(rec.get(name))}, expected text")
        return rec
    for name in TEXT_FIELDS:
        if not isinstance(rec.get(name), str):
            raise DataError(f"{where}: field '{name}' is {json_kind(rec.get(name))}, expected text")
    if not isinstance(rec.get("stopped"), bool):
        raise DataError(f"{where}: field 'stopped' is {json_kind(rec.get('stopped'))}, expected true or "
                        "false")
    if not is_int(rec.get("n_turns")) or rec["n_turns"] < 1:
        raise DataError(f"{where}: field 'n_turns' is {json_kind(rec.get('n_turns'))}, expected a whole "
                        "number >= 1")
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    check_ids(ids, where, limits)
    if not isinstance(mask, list) or len(mask) != len(ids) or any(type(m) is not int or m not in (0, 1) for m in mask):
        raise DataError(f"{where}: field 'loss_mask' is not {len(ids)} 0s and 1s (one per input id)")
    replay = rec.get("replay")
    if replay is not None and (not isinstance(replay, list) or len(replay) != len(ids)
                               or any(not is_int(r) or not -128 <= r < 128 for r in replay)):
        raise DataError(f"{where}: field 'replay' is not {len(ids)} small whole numbers (one per input id)")
    check_learned(sum(mask), rec["n_turns"], where, limits)
    return rec


def check_ids(ids: Any, where: str, limits: RowLimits) -> None:
    """`input_ids`: a non-empty list of token ids of the target, no longer than its context."""
    if not isinstance(ids, list) or not ids:
        raise DataError(f"{where}: field 'input_ids' is {json_kind(ids)}, expected a non-empty list of token "
                        "ids")
    top = limits.vocab_size
    for i, t in enumerate(ids):
        if not is_int(t) or t < 0 or (top is not None and t >= top):
            raise DataError(f"{where}: field 'input_ids'[{i}] is {json_kind(t)}, not a token id of the "
                            f"target (whole numbers in [0, {top if top is not None else 'vocab_size'}))")
    if limits.context is not None and len(ids) > limits.context:
        raise DataError(f"{where}: field 'input_ids' holds {len(ids)} tokens, more than the target's context of "
                        f"{limits.context} positions")


def check_learned(learned: int, n_turns: int, where: str, limits: RowLimits) -> None:
    """At most max_new_tokens + 1 learned tokens (an answer and its end-of-turn token) for each answered turn."""
    if limits.max_new_tokens is not None and learned > n_turns * (limits.max_new_tokens + 1):
        raise DataError(f"{where}: field 'loss_mask' marks {learned} learned tokens, more than {n_turns} answer(s) "
                        f"of max_new_tokens {limits.max_new_tokens} can hold")


def pack_limits(header: dict, where: str, limits: RowLimits | None) -> RowLimits:
    """What a pack's rows may hold: the target's limits where known, else those its own generation key records
    (vocab_size, max_new_tokens; the key is compared with the target's before a row is used)."""
    run = header.get("run")
    fp = run.get("fingerprint") if isinstance(run, dict) else None
    sampling = run.get("sampling") if isinstance(run, dict) else None
    vocab = fp.get("vocab_size") if isinstance(fp, dict) else None
    most = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
    for name, value in (("run.fingerprint.vocab_size", vocab), ("run.sampling.max_new_tokens", most)):
        if not is_int(value) or value < 1:
            raise DataError(f"{where}: field '{name}' is {json_kind(value)}, expected a whole number >= 1")
    limits = limits or RowLimits()
    return RowLimits(limits.vocab_size or vocab, limits.context, limits.max_new_tokens or most)
