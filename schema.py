"""What every reader of an artifact or export file is built of: a JSON file read whole or refused in one line
(missing, not a file, too large, not UTF-8, nested too deep, not JSON, not an object), a field of it checked
for type and range, and a draft vocabulary's maps (d2t, t2d) checked against the target's vocabulary.

Each file format draftsmith reads from an artifact or export folder has ONE reader, built of these, in the
module that owns the format (the manifest in artifact.py, draftsmith.json in layouts/common.py, tree.json and
the Medusa configs in medusa/, ...). A reader checks every field the code behind it uses, so that code trusts
what it gets: a bad value is a `FieldError` naming the file and the field, at `draftsmith check` and at load,
never a KeyError or a ValueError at decode time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import ArtifactError, ConfigError, DraftsmithError, json_kind, show
from draftsmith.reading import MAX_JSON_BYTES, is_int, read_json

MAX_VOCAB = 1 << 24  # a vocabulary size beyond any tokenizer (Gemma 3: 262,144): a typo or a hostile file
MAX_HIDDEN = 1 << 16  # a hidden size beyond any model's


class FieldError(ArtifactError, ConfigError):
    """A file of an artifact or export is unreadable, or one of its fields is missing, of another type or out
    of range: one line naming the file and the field. It is both an ArtifactError (the folder is damaged)
    and a ConfigError (its config is wrong), so callers that catch either keep working."""


def read_doc(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from `path` (reading.read_json: missing, a folder, over `max_bytes`, not UTF-8, nested too
    deep, not JSON), or a FieldError naming it; also when it is not an object."""
    try:
        doc = read_json(path, max_bytes)
    except DraftsmithError as e:
        raise FieldError(str(e)) from None
    if not isinstance(doc, dict):
        raise FieldError(f"{path}: {json_kind(doc)} at the top, expected a JSON object")
    return doc


_MISSING = object()


def _is_number(v: Any) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")


def value_at(doc: dict, name: str) -> Any:
    """doc[a][b] for name "a.b"; _MISSING where a part is absent or not an object."""
    node: Any = doc
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def get(doc: dict, name: str, where: str | Path, kind: str, *, lo: float | None = None, hi: float | None = None,
        null: bool = False, default: Any = _MISSING, choices: tuple | None = None) -> Any:
    """The field `name` ("a.b" reaches into an object) of `doc`, read from the file `where`, checked:

    kind: "int", "number" (finite), "bool", "str", "dict", "list", "ints" (a list of ints), "numbers";
    lo / hi: the range of an int or number, or of each item of "ints" / "numbers";
    null: None is allowed; default: the value where the field is absent (without one, absence is an error);
    choices: the values allowed.
    """
    value = value_at(doc, name)
    if value is _MISSING:
        if default is not _MISSING:
            return default
        raise FieldError(f"{where}: missing field '{name}'")
    if value is None and null:
        return None
    ok = {"int": is_int, "number": _is_number, "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict),
          "list": lambda v: isinstance(v, list),
          "ints": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
          "numbers": lambda v: isinstance(v, list) and all(_is_number(x) for x in v)}[kind]
    items = kind in ("ints", "numbers")
    inside = ok(value) and all((lo is None or x >= lo) and (hi is None or x <= hi)
                               for x in (value if items else [value] if kind in ("int", "number") else []))
    if not inside or (choices is not None and value not in choices):
        noun = {"int": "an int", "number": "a finite number", "bool": "true or false", "str": "a string",
                "dict": "an object", "list": "a list", "ints": "a list of ints", "numbers": "a list of numbers"}[kind]
        want = f"one of {', '.join(map(str, choices))}" if choices is not None else noun + _range(lo, hi)
        raise FieldError(f"{where}: field '{name}' is {show(value)}, expected {want}" + (" or null" if null else ""))
    return value


def safe_relative(name: Any, where: str | Path, field: str) -> str:
    """A file name a manifest lists (a checksum's key): a non-empty string without NUL bytes (an OS call on one
    raises a raw ValueError); whether it stays inside its folder is the checksum reader's business."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FieldError(f"{where}: field '{field}' has the key {show(name)}, expected a file name (no NUL byte)")
    return name


def checksums(doc: dict, where: str | Path, field: str = "checksums") -> dict[str, str] | None:
    """`field` of a manifest or draftsmith.json: {relative weight file: sha256 hex}, or None where absent."""
    sums = get(doc, field, where, "dict", null=True, default=None)
    if sums is None:
        return None
    for name, digest in sums.items():
        safe_relative(name, where, field)
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise FieldError(f"{where}: field '{field}' gives {show(name)} the sha256 {show(digest)}, expected 64 "
                             "lowercase hex digits")
    return sums


def head_config(path: str | Path, manifest: dict | None) -> tuple[dict, Path, int, int]:
    """A head's config.json read from an artifact folder, with what it shares with its target checked: the
    document, its path, its `vocab_size` (the target's own, where the artifact's `manifest` records it) and the
    deepest target layer it may tap (`num_hidden_layers - 1`, 1023 where the target's depth is not recorded)."""
    where = Path(path) / "config.json"
    cfg = read_doc(where)
    target = (manifest or {}).get("target") or {}
    vocab, depth = target.get("vocab_size"), (target.get("architecture") or {}).get("num_hidden_layers")
    V = get(cfg, "vocab_size", where, "int", lo=1, hi=MAX_VOCAB)
    if vocab is not None and V != vocab:
        raise FieldError(f"{where}: field 'vocab_size' is {V}, but the target's vocabulary has {vocab} tokens")
    return cfg, where, V, depth - 1 if isinstance(depth, int) and depth >= 1 else 1023


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int,
                       draft_vocab: int | None = None) -> list[str]:
    """The problems of a draft vocabulary's maps (EAGLE-3 §3.2; heads/vocab.py), one line each naming the tensor.

    d2t [N] int64 is an offset table: target_id = draft_id + d2t[draft_id]; every target id lies in the
    target's vocabulary [0, V) and no two draft ids share one (a draft token that cannot be told from another
    would be verified as the wrong token). t2d [V] bool, where present, marks exactly those N target ids, in
    draft-id order: nonzero(t2d) == arange(N) + d2t.
    """
    problems = []
    if d2t.dtype != torch.int64:
        problems.append(f"tensor 'd2t' has dtype {d2t.dtype}, expected int64 (an offset table of token ids)")
    if t2d is not None and t2d.dtype != torch.bool:
        problems.append(f"tensor 't2d' has dtype {t2d.dtype}, expected bool")
    n = draft_vocab if draft_vocab is not None else d2t.numel()
    if d2t.dim() != 1 or d2t.numel() != n:
        problems.append(f"tensor 'd2t' has shape {list(d2t.shape)}, expected [{n}]")
    if t2d is not None and tuple(t2d.shape) != (vocab_size,):
        problems.append(f"tensor 't2d' has shape {list(t2d.shape)}, expected [{vocab_size}] (the target's vocabulary)")
    if problems or d2t.is_floating_point() or d2t.is_complex():
        return problems
    ids = torch.arange(n, dtype=torch.int64) + d2t.to(torch.int64)
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if outside.numel():
        d = int(outside[0])
        return [f"tensor 'd2t' maps draft id {d} to target id {int(ids[d])}, outside the target's vocabulary "
                f"[0, {vocab_size})"]
    if torch.unique(ids).numel() != n:
        sorted_ids, order = torch.sort(ids, stable=True)
        at = int((sorted_ids[1:] == sorted_ids[:-1]).nonzero()[0])
        problems.append(f"tensor 'd2t' maps draft ids {int(order[at])} and {int(order[at + 1])} to the same target "
                        f"id {int(sorted_ids[at])} (target = draft + d2t[draft] must keep ids distinct)")
    elif t2d is not None:
        marked = int(t2d.sum())
        nz = torch.nonzero(t2d).flatten()
        if marked != n:
            problems.append(f"tensor 't2d' marks {marked} target tokens, expected {n} (the draft vocabulary)")
        elif not torch.equal(nz, ids):
            bad = int((nz != ids).nonzero()[0])
            problems.append(f"tensors 'd2t' / 't2d': d2t is inconsistent with t2d: draft id {bad} maps to target "
                            f"{int(ids[bad])} "
                            f"but the {bad}-th marked target token is {int(nz[bad])} (target = draft + d2t[draft])")
    return problems


SPEC_DTYPES = {torch.long: "I64", torch.bool: "BOOL"}  # the vocabulary maps' dtypes, whatever the weights' are


def module_spec(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of a module built on the meta device: the vocabulary maps' dtypes are the
    format's (d2t int64, t2d bool), a weight's is left open ("": the artifact's own precision)."""
    return {k: (tuple(v.shape), SPEC_DTYPES.get(v.dtype, "")) for k, v in module.state_dict().items()}
