"""Export entry points: `export_artifact` (any kind, any stack) and `import_export` (back into draftsmith).

Each method (methods.py) names its exporter (`Method.export`, its folder's export.py): which layout each stack
takes, how to write it and how each stack launches it are the method's own, written with layouts/ (a draft
model's HF folder, or the writer every head layout shares, layouts/heads.py); export/ reaches the methods only
through the registry. Every export is verified by re-reading it (layouts/verify.py) unless verify=False.

The export is written to a temporary sibling of `out`, verified there, and only then swapped in: an export
that fails verification leaves the previous one exactly as it was. An existing `out` is replaced only if it
is a draftsmith export (or empty), unless overwrite=True.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from draftsmith import artifact, methods
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.layouts.common import GUARD, ExportResult, check_stack, read_guard
from draftsmith.layouts.inspect import inspect_artifact
from draftsmith.layouts.verify import VERIFIERS, VerificationError, run_verifier
from draftsmith.outputs import check_replaceable

log = logging.getLogger(__name__)


def export_artifact(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
                    num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
                    verifier: str | None = None) -> ExportResult:
    """Export a draftsmith artifact for `stack` into `out`: written to a temporary folder, verified there,
    then swapped in. The artifact's method (methods.py) says which layout each stack takes.

    `verifier`: the target's name where the export will be served (a hub id such as
    meta-llama/Llama-3.1-8B-Instruct); written into config.json, serve.md and the model card instead of
    the local folder the target was loaded from.

    `num_speculative_tokens`: the draft length written into serve.md; None = the method's own (a drafter whose
    length is fixed by what it learned says so: one token per Medusa head, a DFlash block less its anchor;
    others: 4)."""
    artifact_dir, out = Path(artifact_dir), Path(out)
    check_stack(stack)
    check_replaceable(out, "export", overwrite)  # before any work: a folder that is not ours stays untouched
    kind = artifact.load_manifest(artifact_dir)["kind"]
    method = methods.get(kind)
    if method.export is None:
        raise ConfigError(f"{artifact_dir}: no serving stack takes a {kind} artifact")
    result = method.get("export")(artifact_dir=artifact_dir, stack=stack, out=out, target=target,
                                  num_speculative_tokens=num_speculative_tokens, verify=verify,
                                  overwrite=overwrite, verifier=verifier)
    if stack == "vllm":  # where the measured vLLM refuses this target family and layout, the export says so
        from draftsmith.export.vllm import layout_of, refusal

        manifest = artifact.load_manifest(artifact_dir)
        model_type = ((manifest.get("target") or {}).get("architecture") or {}).get("model_type")
        warning = refusal(model_type, layout_of(manifest))
        if warning:
            log.warning("%s: %s", out, warning)
            result.checks.append(f"WARNING: {warning}")
    return result


def import_export(export_dir: str | Path, out: str | Path, fingerprint: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Read an export back into a draftsmith artifact (same weights): each method's `reimport` (methods.py)
    recognizes its own layouts. The fingerprint comes from draftsmith.json unless given. What is written is read
    by the reader `draftsmith check` uses (layouts/inspect.py) before it is swapped in: an export that does not
    make a whole artifact is refused in one line, and nothing is written."""
    export_dir, out = Path(export_dir), Path(out)
    guard = read_guard(export_dir) if os.path.lexists(export_dir / GUARD) else {}
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
            return artifact.save_artifact(out, manifest, state, cfg, writer=writer, overwrite=overwrite,
                                          verify=_whole(export_dir, out, method.name))
    readers = ", ".join(m.name for m in methods.all_methods() if m.reimport is not None)
    raise ArtifactError(f"{export_dir}: no method reads this layout back ({readers} exports can be imported)")


def _whole(export_dir: Path, out: Path, kind: str):
    """The check an imported artifact passes before it is swapped in: `draftsmith check`'s reader, no problem."""
    def verify(tmp: Path) -> None:
        problems, _ = inspect_artifact(tmp)
        if problems:
            named = [p.replace(str(tmp), str(out)) for p in problems]
            raise ArtifactError(f"{export_dir}: does not read back into a whole {kind} artifact, nothing written: "
                                f"{named[0]}" + (f" (and {len(named) - 1} more)" if len(named) > 1 else ""))
    return verify


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
