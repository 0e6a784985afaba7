"""Export any head method's artifact: the part every head shares (stack check, guard, serve.md, model card,
checksums, verification in a temporary folder), given the method's `HeadExport` (its layout family, its
weights, how to write them and how each stack launches them). A method's exporter (`Method.export`, see
methods.py) reads its artifact into a `HeadExport` and calls `export_heads`; nothing here knows a method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import ConfigError
from draftsmith.layouts.card import write_card
from draftsmith.layouts.common import (
    ExportResult,
    check_stack,
    record_checksums,
    verifier_ref,
    write_guard,
    write_serve,
)
from draftsmith.layouts.verify import run_verifier
from draftsmith.outputs import atomic_dir, check_replaceable
from draftsmith.targets.fingerprint import check_compatible


@dataclass
class HeadExport:
    """One artifact, read for export.

    layout: the layout family (medusa, eagle1, eagle3, ...): a tag of the model card.
    what: the drafter in words, for serve.md's and the model card's titles ("an EAGLE-3 head").
    formats: stack -> the export format (the name its verifier is registered under) that stack reads;
    unsupported: stack -> why that stack takes none (one line for the user, naming the artifact).
    write(tmp, fmt, target, target_ref, out, num_speculative_tokens) -> target_ref: writes the layout into
    tmp; returns how serve.md must name the target (a method that ships its own adapted target changes it).
    serve(stack, out, target_ref, num_speculative_tokens) -> serve.md's body: how that stack launches it.
    guard: extra fields for draftsmith.json (what `import_export` needs to read the layout back).
    """

    layout: str
    what: str
    formats: dict[str, str]
    manifest: dict
    write: Callable[..., str]
    serve: Callable[[str, Path, str, int], str]
    guard: dict = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)


def export_heads(plan: HeadExport, artifact_dir: Path, stack: str, out: str | Path, target=None,
                 num_speculative_tokens: int = 4, verify: bool = True, *, overwrite: bool = False,
                 verifier: str | None = None) -> ExportResult:
    out = Path(out)
    check_stack(stack)
    check_replaceable(out, "export", overwrite)
    if stack not in plan.formats:
        raise ConfigError(plan.unsupported.get(stack, f"{artifact_dir}: {stack} does not take {plan.what}"))
    fmt = plan.formats[stack]
    if target is not None:
        check_compatible(plan.manifest["target"], target.fingerprint(), what=f"artifact {artifact_dir}")
    target_ref = verifier_ref(target, verifier)
    result = ExportResult(out, stack, fmt)

    def verified(tmp: Path) -> None:
        result.files = sorted(p.name for p in tmp.iterdir())
        if verify:
            result.checks = run_verifier(tmp, fmt, target, shown=out)

    with atomic_dir(out, overwrite=overwrite, kind="export", verify=verified) as tmp:
        target_ref = plan.write(tmp, fmt, target, target_ref, out, num_speculative_tokens)
        extra = {"kind": plan.manifest["kind"], "num_speculative_tokens": num_speculative_tokens, **plan.guard}
        if target is not None and target.folder is not None:
            extra["target_folder"] = str(target.folder)  # where verification finds the weights it needs
        write_guard(tmp, plan.manifest, stack, fmt, extra)
        body = plan.serve(stack, out, target_ref, num_speculative_tokens)
        write_serve(tmp, f"Serving {plan.what} with {stack}", body)
        write_card(tmp, plan.manifest, plan.what, plan.layout, stack, fmt, target_ref, body)
        record_checksums(tmp)
    return result
