"""Verification of what an exporter wrote, with a loader that knows nothing of draftsmith's classes.

A serving stack loads a checkpoint by tensor NAME: vLLM and SGLang skip names they do not know without a
word, and a missing name leaves a parameter at its random init. So every export is re-read here from
disk (the safetensors header and config.json, nothing else) and compared against a spec — a table
`name -> (shape, dtype)` that each format derives from the config it wrote:

    missing      a name the stack expects is absent
    unexpected   a name the stack would silently drop (so the trained weight would never be used)
    shape        a tensor has the wrong shape
    dtype        a tensor has the wrong dtype (e.g. d2t must be int64, t2d bool)

plus the reduced-vocabulary invariant of EAGLE-3 (Li et al. 2025, "EAGLE-3", §3: the draft predicts over
the N most frequent target tokens):

    d2t [N] int64, t2d [V] bool,   target_id = draft_id + d2t[draft_id],   nonzero(t2d) == arange(N) + d2t

Where the real consumer runs on this machine (transformers for a draft, speculators for EAGLE-3), the
exporter also runs it; those checks live with the exporter.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from draftsmith.checksums import checksum_problems
from draftsmith.errors import ArtifactError, show
from draftsmith.layouts.common import GUARD, read_guard
from draftsmith.schema import vocab_map_problems  # noqa: F401 (the one reader of d2t / t2d; exporters import it here)

Spec = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, safetensors dtype name)
# torch dtypes -> safetensors header dtype names
TORCH_TO_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


class VerificationError(ArtifactError):
    """An export does not match what its serving stack expects (message names every problem)."""


def read_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor names, shapes and dtypes from a safetensors file's JSON header (no tensor is loaded).

    Format: 8-byte little-endian header length, then a JSON object {name: {dtype, shape, data_offsets}}.
    """
    path = Path(path)
    if not path.is_file():
        raise VerificationError(f"{path}: missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise VerificationError(f"{path}: truncated ({size} bytes, not even a safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise VerificationError(f"{path}: truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise VerificationError(f"{path}: not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise VerificationError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    end = check_layout(path, header)
    if 8 + n + end > size:
        raise VerificationError(f"{path}: truncated (tensor data ends at byte {8 + n + end}, file has {size})")
    if 8 + n + end < size:
        raise VerificationError(f"{path}: {size - 8 - n - end} bytes after the last tensor's data (no tensor "
                                "covers them)")
    return {name: (tuple(info["shape"]), info["dtype"]) for name, info in header.items()}


ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_layout(path: Path, header: dict) -> int:
    """The tensors' `data_offsets` tile the data area exactly: each [begin, end) holds dtype size x numel
    bytes, and sorted by begin they follow one another from 0 with no gap and no overlap (a header whose
    tensors all point at tensor 0's bytes, or overlap, would load other weights than were saved). Returns
    the data area's length."""
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict):
            raise VerificationError(f"{where}: its header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ST_ITEMSIZE:
            raise VerificationError(f"{where}: unknown dtype {show(dtype)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise VerificationError(f"{where}: shape {show(shape)} is not a list of sizes >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise VerificationError(f"{where}: data_offsets {show(offsets)} is not [begin, end]")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * ST_ITEMSIZE[dtype]:
            raise VerificationError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its "
                                    f"{dtype} shape {shape} needs {numel * ST_ITEMSIZE[dtype]}")
        spans.append((offsets[0], offsets[1], name))
    at, before = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            how = f"overlaps tensor '{before}'" if begin < at else f"leaves bytes {at}-{begin} unused"
            raise VerificationError(f"{path}: tensor '{name}': data_offsets [{begin}, {end}] {how}")
        at, before = end, name
    return at


def read_tensors(path: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in (names or list(f.keys()))}


def nonfinite_tensors(folder: str | Path) -> list[str]:
    """One line per floating tensor holding a NaN or an infinity, in every weight file under `folder` (a
    serving stack would load it without a word and draft garbage, or crash mid-request)."""
    from safetensors import safe_open

    folder = Path(folder)
    problems = []
    for path in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        problems.append(f"{path}: tensor '{name}' holds non-finite values")
        except Exception as e:  # safetensors raises its own error types; a file it cannot read is a problem
            first = str(e).splitlines()[0][:200] if str(e) else ""
            problems.append(f"{path}: cannot be read to scan for non-finite values ({type(e).__name__}: {first})")
    return problems


def st_dtype(dtype: torch.dtype) -> str:
    return TORCH_TO_ST[dtype]


def compare(found: dict[str, tuple[tuple[int, ...], str]], expected: Spec,
            optional: Spec | None = None) -> list[str]:
    """Problems, one line each, naming the tensor: missing / unexpected / shape / dtype."""
    optional = optional or {}
    problems = []
    for name in sorted(expected.keys() - found.keys()):
        problems.append(f"missing tensor '{name}' (expected shape {list(expected[name][0])})")
    for name in sorted(found.keys() - expected.keys() - optional.keys()):
        problems.append(f"unexpected tensor '{name}' (the stack would drop it silently)")
    for name in sorted(found.keys() & (expected.keys() | optional.keys())):
        shape, dtype = found[name]
        want_shape, want_dtype = expected.get(name) or optional[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"tensor '{name}' has shape {list(shape)}, expected {list(want_shape)}")
        if want_dtype and dtype != want_dtype:
            problems.append(f"tensor '{name}' has dtype {dtype}, expected {want_dtype}")
    return problems


def check(where: str | Path, problems: list[str]) -> None:
    if problems:
        head = f"{where}: export verification failed ({len(problems)} problem{'s' if len(problems) > 1 else ''}): "
        raise VerificationError(head + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))


def guard_vocab_size(out: Path) -> int | None:
    """The target vocabulary size an export recorded in its draftsmith.json (None: not recorded)."""
    return (read_guard(out).get("target") or {}).get("vocab_size")


def run_verifier(path: Path, fmt: str, target=None, shown: Path | None = None) -> list[str]:
    """The weight checksums recorded in draftsmith.json, then the format's verifier. An exporter verifies
    its temporary folder before swapping it in: `shown` is the final path, named in the messages instead."""
    path = Path(path)
    recorded = read_guard(path).get("checksums")
    sums = checksum_problems(path, recorded, GUARD) + nonfinite_tensors(path)
    try:
        try:
            checks = VERIFIERS[fmt](path, target)
        except VerificationError as e:  # the layout's problems first, then which files changed
            raise VerificationError("; ".join([str(e), *sums])) from None
        check(path, sums)
    except VerificationError as e:
        if shown is None:
            raise
        raise VerificationError(str(e).replace(str(path), str(shown))) from None
    if recorded:
        checks.insert(0, f"sha256 of {len(recorded)} weight file(s) equal draftsmith.json's")
    return checks


VERIFIERS: dict = {}  # format name -> fn(out_dir, target|None) -> list[str]; each method's export.py registers its own


def register_verifier(fmt: str):
    def deco(fn):
        VERIFIERS[fmt] = fn
        return fn
    return deco
