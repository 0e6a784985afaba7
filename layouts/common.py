"""What every exporter shares: the stacks, the result record, the compatibility guard file, serve.md.

Every export directory holds, besides the stack's own files:

    draftsmith.json   {"target": <fingerprint>, "format": ..., "stack": ..., "artifact": <manifest summary>,
                       "checksums": {<weight file>: sha256}}
                      `draftsmith check --artifact EXPORT_DIR --target SPEC` reads the fingerprint from here
    serve.md          the exact launch command / config for the stack
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith import __version__, schema
from draftsmith.artifact import now_iso
from draftsmith.checksums import weight_checksums
from draftsmith.errors import ArtifactError
from draftsmith.methods import STACKS
from draftsmith.outputs import atomic_write_json, atomic_write_text

GUARD = "draftsmith.json"
SERVE = "serve.md"


@dataclass
class ExportResult:
    out: Path
    stack: str
    format: str  # the layout written (one verifier per format in layouts/verify.py)
    files: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # what verification did, one line each

    def summary(self) -> str:
        lines = [f"exported {self.format} for {self.stack} to {self.out}"]
        lines += [f"  verified: {c}" for c in self.checks]
        return "\n".join(lines)


def manifest_summary(manifest: dict) -> dict[str, Any]:
    """The part of an artifact manifest worth carrying into an export (no full training config)."""
    keep = ("kind", "format_version", "draftsmith_version", "created", "metrics", "eval", "parent", "data")
    out = {k: manifest.get(k) for k in keep if k in manifest}
    metrics = out.get("metrics") or {}
    out["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool)}
    return out


def write_guard(out: Path, manifest: dict, stack: str, fmt: str, extra: dict | None = None) -> None:
    """draftsmith.json: the target fingerprint under `target` (the key `draftsmith check` reads)."""
    atomic_write_json(out / GUARD, {
        "target": manifest["target"],
        "format": fmt,
        "stack": stack,
        "exported": now_iso(),
        "draftsmith_version": __version__,
        "artifact": manifest_summary(manifest),
        **(extra or {}),
    })


def record_checksums(out: Path) -> None:
    """Add the sha256 of every weight file to draftsmith.json (call after the last weight is written)."""
    guard = read_guard(out)
    guard["checksums"] = weight_checksums(out)
    atomic_write_json(out / GUARD, guard)


def read_guard(out: str | Path) -> dict:
    """The one reader of draftsmith.json: the fields export/ and the verifiers use, checked for type and range
    (format, stack, target fingerprint, checksums, draft length, a DFlash block, a Medusa tree's presence), or a
    FieldError naming the file and the field. A folder without one is no draftsmith export."""
    path = Path(out) / GUARD
    if not os.path.lexists(path):
        raise ArtifactError(f"{out}: not a draftsmith export (no {GUARD})")
    guard = schema.read_doc(path)
    schema.get(guard, "target", path, "dict", default=None)
    schema.get(guard, "target.vocab_size", path, "int", lo=1, hi=schema.MAX_VOCAB, null=True, default=None)
    schema.get(guard, "format", path, "str", null=True, default=None)
    schema.get(guard, "stack", path, "str", null=True, default=None, choices=(*STACKS, None))
    schema.get(guard, "kind", path, "str", null=True, default=None)
    schema.get(guard, "num_speculative_tokens", path, "int", lo=1, hi=64, null=True, default=None)
    schema.get(guard, "dflash.block_size", path, "int", lo=2, hi=64, default=None)
    schema.get(guard, "eagle.target_rope_theta", path, "number", lo=0, null=True, default=None)
    for name in ("artifact", "eagle", "dflash"):
        schema.get(guard, name, path, "dict", null=True, default=None)
    schema.get(guard, "medusa_choices", path, "list", null=True, default=None)  # the paths: medusa/model.py
    schema.checksums(guard, path)
    return guard


def check_stack(stack: str) -> None:
    """A stack name `--to` may take (one line naming the known ones)."""
    if stack not in STACKS:
        from draftsmith.errors import ConfigError

        raise ConfigError(f"unknown stack '{stack}' (known: {', '.join(STACKS)})")


def verifier_ref(target, verifier: str | None) -> str:
    """How config.json and serve.md name the target: the user's hub id when given (`--verifier`), else the
    folder it was loaded from."""
    if verifier:
        return verifier
    return str(target.folder or target.spec) if target is not None else "<target HF folder>"


def write_serve(out: Path, title: str, body: str) -> None:
    atomic_write_text(out / SERVE, f"# {title}\n\n{body.strip()}\n")


def fenced(text: str, lang: str = "bash") -> str:
    return f"```{lang}\n{text.strip()}\n```"


def state_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype of a state dict (the first floating tensor's)."""
    for t in state.values():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
