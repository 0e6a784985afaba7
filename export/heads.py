"""Export any head method's artifact: the part every head shares (stack check, guard, serve.md, model card,
checksums, verification in a temporary folder), given the method's `HeadExport` (its layout family, its
weights and how to write them). A method's exporter (`Method.export`, see methods.py) reads its artifact
into a `HeadExport` and calls `export_heads`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import ConfigError
from draftsmith.export.card import write_card
from draftsmith.export.common import (
    ExportResult,
    record_checksums,
    stack_module,
    verifier_ref,
    write_guard,
    write_serve,
)
from draftsmith.export.verify import run_verifier
from draftsmith.storage import atomic_dir, check_replaceable
from draftsmith.targets.fingerprint import check_compatible


@dataclass
class HeadExport:
    """One artifact, read for export.

    layout: the layout family (medusa, eagle1, eagle3): the stack modules' `serve` and `refuse` take it.
    formats: stack -> the export format (export/verify.py's name for the layout) that stack reads;
    unsupported: stack -> why that stack takes none (one line for the user).
    write(tmp, fmt, target, target_ref, out, num_speculative_tokens) -> target_ref: writes the layout into
    tmp; returns how serve.md must name the target (a method that ships its own adapted target changes it).
    guard: extra fields for draftsmith.json (what `import_export` needs to read the layout back).
    tree: a calibrated tree to record beside the layout (tree.json, `medusa_choices`), or None.
    serve(stack, out, target_ref, num_speculative_tokens) -> serve.md's body; None: the stack module's
    `serve` for this layout (export/vllm.py, ...), which knows the built-in head families. A new method
    with a layout of its own says here how each stack launches it.
    """

    layout: str
    formats: dict[str, str]
    manifest: dict
    cfg: dict
    write: Callable[..., str]
    guard: dict = field(default_factory=dict)
    tree: list | None = None
    unsupported: dict[str, str] = field(default_factory=dict)
    serve: Callable[[str, Path, str, int], str] | None = None


def export_heads(plan: HeadExport, artifact_dir: Path, stack: str, out: str | Path, target=None,
                 num_speculative_tokens: int = 4, verify: bool = True, *, overwrite: bool = False,
                 verifier: str | None = None) -> ExportResult:
    from draftsmith.storage import atomic_write_json

    out = Path(out)
    module = stack_module(stack)
    check_replaceable(out, "export", overwrite)
    sub, cfg = plan.layout, plan.cfg
    if stack not in plan.formats:
        raise ConfigError(plan.unsupported.get(stack, f"{stack} does not take {sub} heads"))
    refuse = getattr(module, "refuse", None)
    if refuse is not None and refuse(sub, cfg):
        raise ConfigError(f"{artifact_dir}: {refuse(sub, cfg)}")
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
        if plan.tree is not None:
            extra["medusa_choices"] = plan.tree
            atomic_write_json(tmp / "tree.json", {"paths": plan.tree})
        if target is not None and target.folder is not None:
            extra["target_folder"] = str(target.folder)  # where verification finds the weights it needs
        write_guard(tmp, plan.manifest, stack, fmt, extra)
        if plan.serve is not None:
            body = plan.serve(stack, out, target_ref, num_speculative_tokens)
        else:
            body = module.serve(sub, out, target_ref, num_speculative_tokens, cfg, plan.tree)
        write_serve(tmp, f"Serving these {sub} heads with {stack}", body)
        write_card(tmp, plan.manifest, sub, stack, fmt, target_ref, body)
        record_checksums(tmp)
    return result
