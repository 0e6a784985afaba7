"""Artifact directories: what every training job writes and every consumer reads.

    <dir>/model.safetensors   weights (no pickles anywhere)
    <dir>/config.json         the module's own config (for a draft: the HF config)
    <dir>/manifest.json       kind, format version, target fingerprint, training data summary,
                              training metrics, eval summary, lineage, and `checksums`: the sha256 of
                              every weight file, verified by every reader (load, warm start, export, check)

A directory is written to a temporary sibling and renamed into place, so it exists complete or not at all;
an existing folder is replaced only if it is an artifact itself (or the caller passes overwrite=True).
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith import __version__, methods, schema
from draftsmith.checksums import verify_checksums, weight_checksums
from draftsmith.errors import ArtifactError
from draftsmith.outputs import atomic_dir, atomic_write_json
from draftsmith.targets.fingerprint import check_compatible

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def make_manifest(kind: str, target_fingerprint: dict, config: dict, data: dict | None = None,
                  metrics: dict | None = None, parent: str | None = None, **extra: Any) -> dict:
    if methods.find(kind) is None:
        raise ArtifactError(f"unknown artifact kind '{kind}' (known: {', '.join(methods.names())})")
    return {
        "kind": kind,
        "format_version": FORMAT_VERSION,
        "draftsmith_version": __version__,
        "created": now_iso(),
        "target": target_fingerprint,
        "config": config,
        "data": data or {},
        "metrics": metrics or {},
        "eval": {},
        "parent": parent,
        **extra,
    }


def contiguous_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared or non-contiguous storage: give every tensor its own copy."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def save_artifact(out: str | Path, manifest: dict, state: dict[str, torch.Tensor] | None = None,
                  config: dict | None = None, writer=None, overwrite: bool = False, verify=None) -> Path:
    """Write an artifact directory atomically.

    `state` goes to model.safetensors and `config` to config.json; `writer(tmp_dir)` may add more files
    (an HF draft saves itself with save_pretrained there). The manifest records the sha256 of every weight
    file. An existing `out` is replaced only if it is an artifact (or empty), unless overwrite=True.
    `verify(tmp_dir)` may refuse the finished folder (by raising) before it is swapped in.
    """
    out = Path(out)
    with atomic_dir(out, overwrite=overwrite, kind="artifact", verify=verify) as tmp:
        if writer is not None:
            writer(tmp)
        if state is not None:
            save_file(contiguous_state(state), str(tmp / WEIGHTS), metadata={"format": "pt", "kind": manifest["kind"]})
        if config is not None:
            atomic_write_json(tmp / "config.json", config)
        atomic_write_json(tmp / MANIFEST, {**manifest, "checksums": weight_checksums(tmp)})
    return out


ZOO = Path(__file__).resolve().parent / "zoo"  # reference artifacts shipped with the package


def resolve_path(path: str | Path) -> Path:
    """An artifact path as given, or a shipped reference artifact by name: `zoo/<target>/<name>` names
    draftsmith's own zoo/ folder wherever it runs from (a local folder of that name comes first)."""
    path = Path(path)
    if not path.exists() and path.parts[:1] == ("zoo",) and (ZOO.parent / path).is_dir():
        return ZOO.parent / path
    return path


def load_manifest(path: str | Path, kind: str | None = None) -> dict:
    """The one reader of manifest.json: every field a consumer uses checked for type and range (kind, format
    version, target fingerprint, checksums, the summaries), or an ArtifactError naming the file and field."""
    path = resolve_path(path)
    if not os.path.lexists(path / MANIFEST):
        raise ArtifactError(f"{path}: not a draftsmith artifact (no {MANIFEST})")
    where = path / MANIFEST
    manifest = schema.read_doc(where)
    if "kind" not in manifest:
        raise ArtifactError(f"{where}: not a draftsmith manifest (no 'kind' field)")
    schema.get(manifest, "kind", where, "str")
    if kind is not None and manifest.get("kind") != kind:
        raise ArtifactError(f"{where}: artifact kind is '{manifest.get('kind')}', expected '{kind}'")
    version = schema.get(manifest, "format_version", where, "int", lo=0, default=0)
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{where}: format_version {version} is newer than this draftsmith's {FORMAT_VERSION}")
    schema.get(manifest, "target", where, "dict")
    schema.get(manifest, "target.vocab_size", where, "int", lo=1, null=True, default=None)
    for name in ("config", "data", "metrics", "eval"):
        schema.get(manifest, name, where, "dict", null=True, default=None)
    schema.checksums(manifest, where)
    return manifest


def target_vocab(manifest: dict) -> int | None:
    """The vocabulary size of the target an artifact was made for (its fingerprint's), None where unrecorded."""
    return (manifest.get("target") or {}).get("vocab_size")


def load_artifact(path: str | Path, kind: str | None = None, target=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Manifest and weights; with `target`, refuse an artifact made for another target."""
    path = resolve_path(path)
    manifest = load_manifest(path, kind)
    if target is not None:
        check_compatible(manifest["target"], target.fingerprint(), what=f"artifact {path}")
    if not (path / WEIGHTS).is_file():
        raise ArtifactError(f"{path}: missing {WEIGHTS}")
    verify_weights(path, manifest)
    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ArtifactError(f"{path / WEIGHTS}: cannot be read ({type(e).__name__}: {e})") from None
    problems = vocab_problems(state, target_vocab(manifest))
    if problems:
        raise ArtifactError(f"{path / WEIGHTS}: {problems[0]}")
    return manifest, state


def vocab_problems(tensors: dict[str, torch.Tensor], vocab_size: int | None) -> list[str]:
    """A draft vocabulary's maps, whatever the method (every method names them d2t / t2d, the serving stacks'
    names): dtypes, shapes, ids inside the target's vocabulary and distinct (schema.py)."""
    d2t = tensors.get("d2t")
    if d2t is None:
        return []
    t2d = tensors.get("t2d")
    vocab = vocab_size or (t2d.numel() if t2d is not None else None)
    if vocab is None:
        return []
    return schema.vocab_map_problems(d2t, t2d, vocab)


def verify_weights(path: str | Path, manifest: dict) -> None:
    """Every weight file the manifest lists is present with the sha256 recorded at save time (artifacts
    written before checksums were recorded have none to compare)."""
    verify_checksums(path, manifest.get("checksums"), f"{Path(path) / MANIFEST}")


def load_strict(module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load an artifact's weights into the module its config.json describes; a tensor that is missing,
    unexpected or of another shape is one line naming the files (torch lists every mismatch over many)."""
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), str(e))
        raise ArtifactError(f"{Path(path) / WEIGHTS}: does not fit the module {Path(path) / 'config.json'} "
                            f"describes ({first})") from None


def update_manifest(path: str | Path, **fields: Any) -> dict:
    """Merge fields into an artifact's manifest (atomic rewrite)."""
    manifest = load_manifest(path)
    manifest.update(fields)
    atomic_write_json(Path(path) / MANIFEST, manifest)
    return manifest
