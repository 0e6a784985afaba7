"""Export entry points: `export_artifact` (any kind, any stack) and `import_export` (back into draftsmith).

Each method (methods.py) names its exporter: distill/export.py writes a draft model (the same HF folder for every
stack); medusa/export.py and eagle/export.py read heads into the layout every head shares (export/heads.py).
One module per stack (export/vllm.py, sglang.py, trtllm.py, hf.py) says which layout a head family takes
there and how to launch it. Every export is verified
by re-reading it (export/verify.py) unless verify=False.

The export is written to a temporary sibling of `out`, verified there, and only then swapped in: an export
that fails verification leaves the previous one exactly as it was. An existing `out` is replaced only if it
is a draftsmith export (or empty), unless overwrite=True.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith import artifact, methods
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.export.common import ExportResult, read_guard, stack_module
from draftsmith.export.verify import VERIFIERS, VerificationError, run_verifier
from draftsmith.storage import check_replaceable

log = logging.getLogger(__name__)


def export_artifact(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
                    num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
                    verifier: str | None = None) -> ExportResult:
    """Export a draftsmith artifact for `stack` into `out`: written to a temporary folder, verified there,
    then swapped in. The artifact's method (methods.py) says which layout each stack takes.

    `verifier`: the target's name where the export will be served (a hub id such as
    meta-llama/Llama-3.1-8B-Instruct); written into config.json, serve.md and the model card instead of
    the local folder the target was loaded from.

    `num_speculative_tokens`: the draft length written into serve.md; None = the method's own (Medusa: one
    token per exported head, the only length vLLM's Medusa drafts without a head of random weights; DFlash:
    its block size - 1; EAGLE and draft models: 4)."""
    artifact_dir, out = Path(artifact_dir), Path(out)
    stack_module(stack)
    check_replaceable(out, "export", overwrite)  # before any work: a folder that is not ours stays untouched
    kind = artifact.load_manifest(artifact_dir)["kind"]
    method = methods.get(kind)
    if method.export is None:
        raise ConfigError(f"{artifact_dir}: no serving stack takes a {kind} artifact")
    result = method.get("export")(artifact_dir=artifact_dir, stack=stack, out=out, target=target,
                                  num_speculative_tokens=num_speculative_tokens, verify=verify,
                                  overwrite=overwrite, verifier=verifier)
    if stack == "vllm":
        from draftsmith.export.vllm import refusal

        manifest = artifact.load_manifest(artifact_dir)
        kind_key = _export_kind(manifest)
        warning = refusal(((manifest.get("target") or {}).get("architecture") or {}).get("model_type"), kind_key)
        if warning:
            log.warning("%s: %s", out, warning)
            result.checks.append(f"WARNING: {warning}")
    return result


def _export_kind(manifest: dict) -> str:
    """The kind as vLLM's table names it: eagle3 / eagle1 (an EAGLE artifact's version), medusa, draft."""
    kind = manifest["kind"]
    if kind == "eagle":
        version = (manifest.get("config") or {}).get("version")
        return "eagle1" if version in (1, "eagle1") else "eagle3"
    return kind


def import_export(export_dir: str | Path, out: str | Path, fingerprint: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Read an export back into a draftsmith artifact (same weights): each method's `reimport` (methods.py)
    recognizes its own layouts (vLLM / FasterDecoding Medusa, speculators / midlayer / EAGLE-1). The
    fingerprint comes from draftsmith.json unless given."""
    export_dir = Path(export_dir)
    guard = read_guard(export_dir) if (export_dir / "draftsmith.json").is_file() else {}
    if guard.get("format") in _verifiers():
        run_verifier(export_dir, guard["format"])  # checksums and layout, before reading any weight
    fp = fingerprint or guard.get("target")
    if fp is None:
        raise ConfigError(f"{export_dir}: no draftsmith.json; pass the target fingerprint")
    meta = {"imported_from": str(export_dir), "format": guard.get("format")}
    for method in methods.all_methods():  # the first method whose reader recognizes the layout reads it
        found = method.get("reimport")(export_dir, guard) if method.reimport is not None else None
        if found is not None:
            cfg, state, writer = found
            manifest = artifact.make_manifest(method.name, fp, {}, **meta)
            return artifact.save_artifact(out, manifest, state, cfg, writer=writer, overwrite=overwrite)
    readers = ", ".join(m.name for m in methods.all_methods() if m.reimport is not None)
    raise ArtifactError(f"{export_dir}: no method reads this layout back ({readers} exports can be imported)")


def _verifiers() -> dict:
    """Every export format's verifier: each method's layout module registers its own when imported, so the
    registry's export references are resolved here (export/ names no method)."""
    for method in methods.all_methods():
        if method.export is not None:
            method.get("export")
    return VERIFIERS


def verify_export(out: str | Path, target=None) -> list[str]:
    """Re-verify an export directory from its draftsmith.json (format) alone. Returns the checks done."""
    out = Path(out)
    guard = read_guard(out)
    fmt = guard.get("format")
    if fmt not in _verifiers():
        raise VerificationError(f"{out}: unknown export format '{fmt}'")
    return run_verifier(out, fmt, target)
