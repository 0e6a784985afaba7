"""Offline capture cache: what the frozen target computes per dataset row, in sharded safetensors.

Training a Medusa / EAGLE head or distilling a draft needs, per token, some of: the output of decoder
layer i (pre-norm, see layers.py for the layer convention), the post-norm last hidden state,
and the target's top-k logits. Computing them online costs one target forward per step; computing them
once (`capture_dataset`, the `capture` step) lets every later epoch, sweep and retrain skip the target.

On disk (`out_dir/`):

    shard-00000.safetensors   concatenated rows: layer.<i> [N, H] (hidden_dtype), last_hidden [N, H],
                              topk_values [N, k] float32, topk_indices [N, k] int32,
                              topk_logsumexp [N] float32 (optional: the logsumexp of the full logits,
                              so top-k KD knows the exact tail mass); the safetensors
                              metadata holds {"rows": [[row_id, offset, length], ...]}. Top-k rows of
                              positions no loss reads (a prompt's positions before the one that
                              predicts the first learned token) may be zeros: the data engine skips
                              their lm_head
    index.json                layers, topk, hidden_size, hidden_dtype, fields, target fingerprint,
                              rows: {row_id: [shard, offset, length]}, shards

A shard is written to a temp file and renamed, so every `shard-*.safetensors` is complete; a rerun
after a kill reads the shards' metadata, skips rows already in them and appends new shards.

Disk: tokens · (H · bytes(hidden_dtype) · (#layers + last_hidden) + k · 8). SmolLM2-135M (H=576), one
layer, bf16, top-64: 1,664 bytes/token, i.e. ~1.7 GB per million tokens.

`CaptureSource` gives a job the same tensors either way: online (target forward inside the step) or
offline (from the cache, keyed by the batch's `row_id`), padded to the batch's length.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.capture.forward import capture_forward, topk_with_logsumexp
from draftsmith.errors import DataError
from draftsmith.outputs import atomic_write_json, fsync_dir
from draftsmith.reading import is_int, read_json
from draftsmith.targets.families import pad_token_id

log = logging.getLogger(__name__)

INDEX = "index.json"
_SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def estimate_disk_bytes(n_tokens: int, hidden: int, n_layers: int, topk: int,
                        dtype: torch.dtype = torch.bfloat16, last_hidden: bool = False) -> int:
    """Bytes the cache needs: hidden states in `dtype`, top-k as float32 values + int32 indices."""
    per_token = hidden * torch.finfo(dtype).bits // 8 * (n_layers + int(last_hidden)) + topk * (4 + 4)
    return int(n_tokens) * per_token


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _shards(out_dir: Path) -> list[tuple[int, Path]]:
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _SHARD_RE.match(p.name))]
    return sorted(found)


_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one of ours
_SHAPE = {"layers": "a list of layer indices", "topk": "an integer >= 0", "hidden_dtype": "a dtype name",
          "hidden_size": "an integer >= 1 or null", "last_hidden": "true or false", "logsumexp": "true or false",
          "rows": "a non-empty list of [row_id, offset, length] (a shard is written with at least one row)"}


def safetensors_header(path: Path) -> dict:
    """A safetensors file's header, read without the library (whose errors name no file), and checked to
    describe the bytes that follow it: a shard cut short by a full disk or a bad copy fails here."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise DataError(f"{path}: torn ({size} bytes, its header says otherwise): not a whole safetensors file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None
    except (ValueError, RecursionError):
        raise DataError(f"{path}: torn or not safetensors (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: not safetensors (its header is not an object)")
    ends = [t.get("data_offsets", [0, 0])[-1] if isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
            and t["data_offsets"] else None for k, t in header.items() if k != "__metadata__"]
    if any(not is_int(e, 0) for e in ends) or 8 + n + max(ends, default=0) != size:
        raise DataError(f"{path}: torn ({size} bytes, its header describes {8 + n + max(ends, default=0)}): "
                        "not a whole safetensors file")
    return header


def _shard_meta(path: Path) -> dict:
    """A shard's own description (its safetensors metadata), validated: one line naming the shard and the
    field when it is torn, unreadable or not a shard of ours."""
    header = safetensors_header(path)
    try:
        meta = json.loads((header.get("__metadata__") or {})["draftsmith"])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise DataError(f"{path}: not a capture shard (no draftsmith metadata)") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: not a capture shard (its metadata is not an object)")
    checks = {"layers": lambda v: isinstance(v, list) and all(is_int(i, -(2**31)) for i in v),
              "topk": lambda v: is_int(v, 0), "hidden_dtype": lambda v: v in _DTYPE_NAMES.values(),
              "hidden_size": lambda v: v is None or is_int(v, 1), "last_hidden": lambda v: isinstance(v, bool),
              "logsumexp": lambda v: isinstance(v, bool),
              "rows": lambda v: isinstance(v, list) and v and all(isinstance(r, list) and len(r) == 3
                                                                  and is_int(r[0], 0) and is_int(r[1], 0)
                                                                  and is_int(r[2], 1) for r in v)}
    for key, check in checks.items():
        if key not in meta and key != "logsumexp":  # shards of older caches have no logsumexp
            raise DataError(f"{path}: missing field '{key}'")
        if key in meta and not check(meta[key]):
            raise DataError(f"{path}: field '{key}' must be {_SHAPE[key]}, got {json.dumps(meta[key])[:40]}")
    lengths = {t["shape"][0] for k, t in header.items() if k != "__metadata__" and isinstance(t.get("shape"), list)
               and t["shape"] and is_int(t["shape"][0], 0)}
    if any(o + n > min(lengths, default=0) for _, o, n in meta["rows"]):
        raise DataError(f"{path}: field 'rows' points past its tensors' {min(lengths, default=0)} positions")
    return meta


def _faults(path: Path) -> list[DataError]:
    try:
        _shard_meta(path)
    except DataError as e:
        return [e]
    return []


def _whole_shards(out_dir: Path) -> tuple[list[tuple[int, Path, dict]], list[Path]]:
    """The shards of a cache that read whole, with their metadata, and those that do not (each named in a
    warning, with the count): a job that can go on without their rows goes on."""
    whole, skipped = [], []
    for idx, path in _shards(out_dir):
        try:
            whole.append((idx, path, _shard_meta(path)))
        except DataError as e:
            log.warning("%s", e)
            skipped.append(path)
    if skipped:
        log.warning("capture cache %s: %d torn or unreadable shard(s) skipped (%s): their rows are not read",
                    out_dir, len(skipped), ", ".join(p.name for p in skipped))
    return whole, skipped


class ShardWriter:
    """Append rows, flush a shard every `shard_tokens` tokens or `flush_seconds` seconds (whichever comes
    first, so a killed capture loses at most that much work), write index.json on close. Resumable."""

    def __init__(self, out_dir: str | Path, layers: list[int], topk: int, hidden_dtype: torch.dtype = torch.bfloat16,
                 shard_tokens: int = 1 << 18, fingerprint: dict | None = None, flush_seconds: float = 60.0) -> None:
        self.out_dir = Path(out_dir)
        self.layers = [int(i) for i in layers]
        self.topk = int(topk)
        self.hidden_dtype = hidden_dtype
        self.shard_tokens = int(shard_tokens)
        self.flush_seconds = float(flush_seconds)
        self._buf_since: float | None = None
        self.fingerprint = fingerprint
        self.hidden_size: int | None = None
        self.has_last_hidden: bool | None = None
        self.has_logsumexp: bool | None = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for p in self.out_dir.iterdir():  # temp files of a shard killed mid-write
            if p.name.startswith(".shard-") and ".tmp" in p.name:
                p.unlink(missing_ok=True)
        self.rows: dict[int, tuple[int, int, int]] = {}
        self._next_shard = 0
        whole, self.skipped = _whole_shards(self.out_dir)
        for path in self.skipped:  # set aside (never read again), its rows captured anew
            os.replace(path, path.with_name(f".{path.name}.torn"))
        for idx, path, meta in whole:
            self._check_compatible(meta, path)
            for row_id, offset, length in meta["rows"]:
                self.rows[int(row_id)] = (idx, offset, length)
            self._next_shard = idx + 1
        self._next_shard = max([self._next_shard, *(int(_SHARD_RE.match(p.name)[1]) + 1 for p in self.skipped)])
        self._buf: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._buf_tokens = 0
        self.closed = False

    def _check_compatible(self, meta: dict, where: Path) -> None:
        mine = {"layers": self.layers, "topk": self.topk, "hidden_dtype": _DTYPE_NAMES[self.hidden_dtype]}
        for k, v in mine.items():
            if meta[k] != v:
                raise DataError(f"capture cache {where} has {k}={meta[k]}, asked for {v}: use another directory")
        self.hidden_size = meta["hidden_size"]
        self.has_last_hidden = meta["last_hidden"]
        self.has_logsumexp = meta.get("logsumexp", False)  # shards of older caches have none

    def __contains__(self, row_id: int) -> bool:
        return int(row_id) in self.rows or any(r == int(row_id) for r, _ in self._buf)

    def add(self, row_id: int, layers: dict[int, torch.Tensor], topk_values: torch.Tensor | None = None,
            topk_indices: torch.Tensor | None = None, last_hidden: torch.Tensor | None = None,
            logsumexp: torch.Tensor | None = None) -> bool:
        """Buffer one row ([T, H] per layer, [T, k] top-k, [T] logsumexp of the full logits). Returns False if
        the row is already stored."""
        if self.closed:
            raise DataError("ShardWriter is closed")
        if row_id in self:
            return False
        if sorted(layers) != sorted(self.layers):
            raise DataError(f"row {row_id}: layers {sorted(layers)} given, writer stores {sorted(self.layers)}")
        if (topk_values is None) != (self.topk == 0) or (topk_indices is None) != (self.topk == 0):
            raise DataError(f"row {row_id}: top-k values/indices must be given iff topk > 0 (topk={self.topk})")
        if self.has_last_hidden is None:
            self.has_last_hidden = last_hidden is not None
        elif self.has_last_hidden != (last_hidden is not None):
            raise DataError(f"row {row_id}: last_hidden given for some rows and not others")
        if logsumexp is not None and not self.topk:
            raise DataError(f"row {row_id}: logsumexp belongs with top-k logits (topk=0)")
        if self.has_logsumexp is None:
            self.has_logsumexp = logsumexp is not None
        elif self.has_logsumexp != (logsumexp is not None):
            raise DataError(f"row {row_id}: logsumexp given for some rows and not others")
        tensors: dict[str, torch.Tensor] = {}
        T = None
        for i, h in layers.items():
            tensors[f"layer.{i}"] = h.detach().to("cpu", self.hidden_dtype)
            T = h.shape[0]
        if last_hidden is not None:
            tensors["last_hidden"] = last_hidden.detach().to("cpu", self.hidden_dtype)
            T = last_hidden.shape[0]
        if self.topk:
            if topk_values.shape[-1] != self.topk:
                raise DataError(f"row {row_id}: top-k has {topk_values.shape[-1]} entries, writer stores {self.topk}")
            tensors["topk_values"] = topk_values.detach().to("cpu", torch.float32)
            tensors["topk_indices"] = topk_indices.detach().to("cpu", torch.int32)
            if logsumexp is not None:
                tensors["topk_logsumexp"] = logsumexp.detach().to("cpu", torch.float32).reshape(-1)
            T = topk_values.shape[0]
        if T is None:
            raise DataError(f"row {row_id}: nothing to store")
        for k, t in tensors.items():
            if t.shape[0] != T:
                raise DataError(f"row {row_id}: {k} has {t.shape[0]} positions, expected {T}")
            if k.startswith("layer.") or k == "last_hidden":
                if self.hidden_size is None:
                    self.hidden_size = t.shape[1]
                elif t.shape[1] != self.hidden_size:
                    raise DataError(f"row {row_id}: hidden size {t.shape[1]}, cache has {self.hidden_size}")
        self._buf.append((int(row_id), tensors))
        self._buf_tokens += T
        if self._buf_since is None:
            self._buf_since = time.monotonic()
        if self._buf_tokens >= self.shard_tokens or time.monotonic() - self._buf_since >= self.flush_seconds:
            self.flush()
        return True

    def flush(self) -> None:
        """Write the buffered rows as one shard (temp file + rename: the shard appears complete or not at all)."""
        if not self._buf:
            return
        idx = self._next_shard
        keys = list(self._buf[0][1])
        rows, offset = [], 0
        for row_id, t in self._buf:
            n = next(iter(t.values())).shape[0]
            rows.append([row_id, offset, n])
            offset += n
        data = {k: torch.cat([t[k] for _, t in self._buf]).contiguous() for k in keys}
        meta = {"layers": self.layers, "topk": self.topk, "hidden_dtype": _DTYPE_NAMES[self.hidden_dtype],
                "hidden_size": self.hidden_size, "last_hidden": bool(self.has_last_hidden),
                "logsumexp": bool(self.has_logsumexp), "rows": rows}
        final = self.out_dir / f"shard-{idx:05d}.safetensors"
        tmp = self.out_dir / f".{final.name}.tmp-{os.getpid()}"
        save_file(data, str(tmp), metadata={"draftsmith": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.out_dir)
        for row_id, o, n in rows:
            self.rows[row_id] = (idx, o, n)
        self._next_shard = idx + 1
        self._buf, self._buf_tokens, self._buf_since = [], 0, None

    def close(self) -> Path:
        """Flush and write index.json. Returns its path."""
        self.flush()
        index = {
            "layers": self.layers, "topk": self.topk, "hidden_size": self.hidden_size,
            "hidden_dtype": _DTYPE_NAMES[self.hidden_dtype], "last_hidden": bool(self.has_last_hidden),
            "logsumexp": bool(self.has_logsumexp), "fingerprint": self.fingerprint, "n_rows": len(self.rows),
            "n_tokens": sum(n for _, _, n in self.rows.values()),
            "shards": [p.name for _, p in _shards(self.out_dir)],
            "rows": {str(r): list(v) for r, v in sorted(self.rows.items())},
        }
        atomic_write_json(self.out_dir / INDEX, index)
        self.closed = True
        return self.out_dir / INDEX

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.flush()  # keep what was captured: a rerun resumes from it


class ShardReader:
    """Read rows back: `reader.get(row_id)` -> {"layer.<i>": [T, H], "last_hidden", "topk_values", "topk_indices",
    "topk_logsumexp"} (what the cache holds)."""

    def __init__(self, cache_dir: str | Path) -> None:
        self.dir = Path(cache_dir)
        whole, self.skipped = _whole_shards(self.dir)  # every shard's own metadata, validated
        index = _read_index(self.dir / INDEX) if os.path.lexists(self.dir / INDEX) else None
        if not whole and (index is None or index.get("rows")):
            if self.skipped:  # the first one's own fault, named again for the one line the job stops with
                why = next((str(e) for e in _faults(self.skipped[0])), f"{self.skipped[0]}: unreadable")
                raise DataError(f"{why}; no shard of the capture cache {self.dir} reads whole: capture it again")
            raise DataError(f"{self.dir}: not a capture cache (no {INDEX}, no shards)")
        # the shards say which rows they hold (index.json too, but a capture killed after it was written, or a
        # torn shard, leaves it saying more than the shards hold)
        self._rows: dict[int, tuple[int, int, int]] = {}
        first = whole[0][2] if whole else index
        for idx, path, meta in whole:
            for key in ("layers", "topk", "hidden_dtype", "last_hidden"):
                if meta[key] != first[key]:
                    raise DataError(f"{path}: field '{key}' is {meta[key]}, the cache's other shards have {first[key]}")
            for row_id, o, n in meta["rows"]:
                self._rows[int(row_id)] = (idx, o, n)
        self.index = {k: first[k] for k in ("layers", "topk", "hidden_size", "hidden_dtype", "last_hidden")}
        self.index["logsumexp"] = (all(meta.get("logsumexp", False) for _, _, meta in whole) if whole
            else bool(first.get("logsumexp")))
        self.index["fingerprint"] = index.get("fingerprint") if index is not None else None
        self.layers: list[int] = self.index["layers"]
        self.topk: int = self.index["topk"]
        self.hidden_size: int = self.index["hidden_size"]
        self.fingerprint: dict | None = self.index.get("fingerprint")
        self._open: dict[int, Any] = {}

    @property
    def rows(self) -> list[int]:
        return sorted(self._rows)

    def __contains__(self, row_id: int) -> bool:
        return int(row_id) in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def _handle(self, shard: int):
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.dir / f"shard-{shard:05d}.safetensors"), framework="pt")
        return self._open[shard]

    def get(self, row_id: int) -> dict[str, torch.Tensor]:
        if int(row_id) not in self._rows:
            raise DataError(f"row {row_id} is not in the capture cache {self.dir}")
        shard, offset, length = self._rows[int(row_id)]
        f = self._handle(shard)
        out = {k: f.get_slice(k)[offset:offset + length] for k in f.keys()}
        if "topk_indices" in out:
            out["topk_indices"] = out["topk_indices"].long()
        return out


def _read_index(path: Path) -> dict:
    """A cache's index.json, checked for what the reader takes from it (the target fingerprint; the shape
    fields of a cache with no shard): one line naming the file and the field."""
    from draftsmith.errors import FileFormatError

    try:
        index = read_json(path)
    except (FileFormatError, OSError, RecursionError) as e:
        detail = str(e).removeprefix(f"{path}: ") if isinstance(e, FileFormatError) else type(e).__name__
        raise DataError(f"{path}: unreadable ({detail})") from None
    if not isinstance(index, dict):
        raise DataError(f"{path}: not a JSON object")
    if not (index.get("fingerprint") is None or isinstance(index["fingerprint"], dict)):
        raise DataError(f"{path}: field 'fingerprint' must be an object or null")
    if not isinstance(index.get("rows", {}), dict):
        raise DataError(f"{path}: field 'rows' must be an object of row -> [shard, offset, length]")
    if not index.get("rows"):
        for key in ("layers", "topk", "hidden_size", "hidden_dtype", "last_hidden"):
            if key not in index:
                raise DataError(f"{path}: missing field '{key}'")
    return index


def _row_ids(rows: Sequence[Any]) -> list[int]:
    return [int(r["row_id"]) if isinstance(r, dict) and "row_id" in r else i for i, r in enumerate(rows)]


def capture_dataset(target, rows: Sequence[Any], out_dir: str | Path, layers: list[int], topk: int,
                    batch_size: int = 8, hidden_dtype: torch.dtype = torch.bfloat16, last_hidden: bool = False,
                    shard_tokens: int = 1 << 18, progress: bool = True) -> ShardReader:
    """The standalone `capture` step: run the target over `rows` (dicts with `input_ids`, optional
    `row_id`, default the position) and cache what `layers` / `topk` / `last_hidden` ask for. Resumable."""
    from tqdm.auto import tqdm

    ids = _row_ids(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    writer = ShardWriter(out_dir, layers, topk, hidden_dtype, shard_tokens, fingerprint=target.fingerprint())
    todo = [i for i, rid in enumerate(ids) if rid not in writer]
    need = estimate_disk_bytes(sum(lengths[i] for i in todo), target.hidden_size, len(layers), topk, hidden_dtype,
                               last_hidden)
    print(f"capture: {len(todo)} of {len(rows)} rows to do ({len(rows) - len(todo)} cached), "
          f"{sum(lengths[i] for i in todo)} tokens, estimated disk {_fmt_bytes(need)} -> {out_dir}", file=sys.stderr)
    model = target.model
    device = target.device
    pad = pad_token_id(target) if getattr(target, "tokenizer", None) is not None else 0
    bar = tqdm(total=len(todo), desc="capture", unit="row", disable=not progress)
    with writer:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            T = max(lengths[i] for i in chunk)
            input_ids = torch.full((len(chunk), T), pad or 0, dtype=torch.long)
            mask = torch.zeros((len(chunk), T), dtype=torch.long)
            for b, i in enumerate(chunk):  # right padding: causal positions < length never see the pad
                input_ids[b, :lengths[i]] = torch.as_tensor(rows[i]["input_ids"])
                mask[b, :lengths[i]] = 1
            cap = capture_forward(model, input_ids.to(device), mask.to(device), layers=layers, want_logits=topk > 0)
            tv, ti, lse = topk_with_logsumexp(cap.logits, topk) if topk > 0 else (None, None, None)
            for b, i in enumerate(chunk):
                n = lengths[i]
                writer.add(ids[i], {layer: cap.layers[layer][b, :n] for layer in layers},
                           tv[b, :n] if tv is not None else None, ti[b, :n] if ti is not None else None,
                           cap.last_hidden[b, :n] if last_hidden else None, lse[b, :n] if lse is not None else None)
            bar.update(len(chunk))
    bar.close()
    return ShardReader(out_dir)
