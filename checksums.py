"""sha256 of what draftsmith hashes: text, JSON (canonical: sorted keys, no spaces), files, and the weight
files an artifact's or export's manifest records, checked against that record (`verify_checksums`: a
changed, truncated or missing weight file, or a listed path that leads outside its folder, is one line
naming it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from draftsmith.outputs import json_default


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=json_default))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_checksums(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 of every weight file (`*.safetensors`, at any depth) under `folder`, keyed by relative path."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): sha256_file(p)
            for p in sorted(folder.rglob("*.safetensors")) if not any(part.startswith(".") for part in
                                                                        p.relative_to(folder).parts)}


def checksum_problems(folder: str | os.PathLike, recorded: dict[str, str] | None, manifest: str) -> list[str]:
    """One line per weight file that is missing or whose sha256 differs from what `manifest` recorded."""
    folder = Path(folder)
    if recorded is not None and not isinstance(recorded, dict):
        return [f"{manifest}: field 'checksums' is not a mapping of weight file -> sha256"]
    problems = []
    root = folder.resolve()
    for rel, want in sorted((recorded or {}).items()):
        path = folder / rel
        if not path.resolve().is_relative_to(root):  # `../../etc/x`, an absolute path, a symlink out: never read
            problems.append(f"{path}: outside {folder} (listed in {manifest}): refused, not read")
        elif not path.is_file():
            problems.append(f"{path}: missing (listed in {manifest})")
        elif sha256_file(path) != want:
            problems.append(f"{path}: sha256 differs from the one {manifest} recorded when it was written "
                            f"(the file was changed, truncated or corrupted since)")
    return problems


def verify_checksums(folder: str | os.PathLike, recorded: dict[str, str] | None, manifest: str) -> None:
    """Raise IntegrityError naming the first weight file that differs from its recorded checksum."""
    from draftsmith.errors import IntegrityError

    problems = checksum_problems(folder, recorded, manifest)
    if problems:
        raise IntegrityError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
