"""A generated set's rows in one compressed file, so that the set grows from machine to machine instead of
being regenerated.

Generating rows is the slow part of a self-distilled set (the target writes every answer); everything else is
derived from them: the dataset folder is assembled from the rows, and the hidden states a head trains on are one
teacher-forced read (`draftsmith data capture`). A pack keeps exactly what cannot be derived: the generation key
(run.json: target fingerprint, precision, sampling), each magpie source's written requests, and every finished
row as generation recorded it (ids, loss mask, text, domain, source). `draftsmith data pack DIR --out FILE`
writes one, also from an interrupted run; `draftsmith data generate --resume-from FILE` unpacks it into
output_dir and goes on where it stopped, generating only the prompts the pack does not answer (both in
data/generate.py, which knows the folder's layout; this module is the file format).

The file is xz-compressed JSON lines (its CRC is checked on every read); line 1 is the header, then one row a
line in row-id order. Beside it, `<name>.json` (the pack's manifest) records its sha256, the generation key and
the counts per domain and source; a pack whose bytes do not match the manifest is refused.
"""

from __future__ import annotations

import json
import lzma
import re
from collections import Counter
from pathlib import Path
from typing import Any

from draftsmith.checksums import sha256_file
from draftsmith.data.rows import RowLimits, check_row, pack_limits
from draftsmith.errors import DataError, FileFormatError
from draftsmith.outputs import atomic_write_bytes, atomic_write_json
from draftsmith.reading import jsonl_records, read_json

PACK_KIND = "draftsmith-rows"
PACK_VERSION = 1
MAX_UNPACKED = 8 << 30  # bytes of JSON lines a pack may unpack to


def manifest_path(pack: str | Path) -> Path:
    """`rows.jsonl.xz` -> `rows.json`: the manifest beside the pack."""
    pack = Path(pack)
    name = pack.name
    for suffix in (".xz", ".jsonl"):
        name = name.removesuffix(suffix)
    return pack.with_name(name + ".json")


def write_pack(pack: str | Path, key: dict, requests: dict[str, dict], rows: dict[int, dict], *,
               level: int = 9) -> dict[str, Any]:
    """Write `rows` (by row id, as generation records them), the resume `key` and each magpie source's requests
    ({"key": its request key, "records": [...]}) into `pack`, then the manifest beside it; returns the manifest.
    Each file is written whole or not at all; a run stopped between the two leaves a pack its old manifest refuses
    (sha256), and packing again mends it."""
    pack = Path(pack).expanduser()
    if not rows:
        raise DataError(f"{pack}: no finished rows to pack")
    header = {"kind": PACK_KIND, "version": PACK_VERSION, "run": key, "requests": requests, "rows": len(rows)}
    # ensure_ascii=False keeps text small; readers split records at "\n" alone (reading.jsonl_records)
    lines = [json.dumps(header, ensure_ascii=False)]
    lines += [json.dumps(rows[i], ensure_ascii=False) for i in sorted(rows)]
    atomic_write_bytes(pack, lzma.compress(("\n".join(lines) + "\n").encode("utf-8"), preset=level))
    kept = [r for r in rows.values() if "skipped" not in r]
    learned: Counter = Counter()
    for r in kept:
        learned[r["domain"]] += sum(r["loss_mask"])
    manifest = {
        "kind": PACK_KIND, "version": PACK_VERSION, "file": pack.name, "sha256": sha256_file(pack),
        "bytes": pack.stat().st_size, "generation_key": key,
        "rows": len(rows), "skipped_rows": len(rows) - len(kept),
        "tokens": sum(len(r["input_ids"]) for r in kept), "loss_tokens": sum(learned.values()),
        "rows_per_domain": dict(sorted(Counter(r["domain"] for r in kept).items())),
        "loss_tokens_per_domain": dict(sorted(learned.items())),
        "rows_per_source": dict(sorted(Counter(r["source"] for r in kept).items())),
        "requests": {name: len(v["records"]) for name, v in requests.items()},
    }
    atomic_write_json(manifest_path(pack), manifest)
    return manifest


def read_pack(pack: str | Path, limits: RowLimits | None = None) -> tuple[dict, list[dict]]:
    """The header and rows of `pack`, checked against its manifest (sha256) where one lies beside it, every row
    checked (data/rows.py) against `limits` (the target's), else against what the pack's generation key records."""
    pack = Path(pack).expanduser()
    if not pack.is_file():
        raise DataError(f"{pack}: no such pack")
    man = manifest_path(pack)
    if man.is_file():
        recorded = read_json(man)
        want = recorded.get("sha256") if isinstance(recorded, dict) else None
        if want != sha256_file(pack):
            raise DataError(f"{pack}: its sha256 does not match {man} (damaged or replaced)")
    try:
        unxz = lzma.LZMADecompressor()
        text = unxz.decompress(pack.read_bytes(), max_length=MAX_UNPACKED).decode("utf-8")
        if not unxz.eof:  # cut short, or a small file that unpacks to more than a pack of rows ever holds
            raise lzma.LZMAError(f"the stream does not end within {MAX_UNPACKED >> 30} GiB unpacked")
    except (lzma.LZMAError, UnicodeDecodeError, EOFError) as e:
        raise DataError(f"{pack}: not a readable xz pack ({type(e).__name__}: {e})") from None
    try:
        lines = jsonl_records(text, pack)
    except FileFormatError as e:
        raise DataError(str(e)) from None
    header, rows = (lines[0], lines[1:]) if lines else ({}, [])
    if not isinstance(header, dict) or header.get("kind") != PACK_KIND or header.get("version") != PACK_VERSION:
        raise DataError(f"{pack}: field 'kind'/'version' is not {PACK_KIND} v{PACK_VERSION} (a draftsmith row pack)")
    if header.get("rows") != len(rows):
        raise DataError(f"{pack}: field 'rows' says {header.get('rows')} rows, the file holds {len(rows)} (truncated?)")
    _check_requests(header.get("requests"), pack)
    limits = pack_limits(header, f"{pack}:1", limits)
    seen: set[int] = set()
    for n, row in enumerate(rows, 2):
        check_row(row, f"{pack}:{n}", limits)
        if row["row_id"] in seen:
            raise DataError(f"{pack}:{n}: field 'row_id' {row['row_id']} repeats an earlier row's")
        seen.add(row["row_id"])
    return header, rows


SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a source name as a file name: no path, no dot file


def _check_requests(requests, pack: Path) -> None:
    """The header's magpie requests: {source name: {"key": ..., "records": [request, ...]}}, each name a plain file
    name (it names a file in output_dir) and each request as a request file holds it."""
    from draftsmith.data.magpie import check_request

    if not isinstance(requests, dict):
        raise DataError(f"{pack}:1: field 'requests' is not an object of source name -> requests")
    for name, packed in requests.items():
        if not SAFE_NAME.fullmatch(name):
            raise DataError(f"{pack}:1: field 'requests' names source {name!r:.60}, not a plain file name")
        if not isinstance(packed, dict) or "key" not in packed or not isinstance(packed.get("records"), list):
            raise DataError(f"{pack}:1: field 'requests.{name}' is not {{\"key\": ..., \"records\": [...]}}")
        for i, rec in enumerate(packed["records"]):
            check_request(rec, f"{pack}:1: requests.{name}.records[{i}]")
