"""`draftsmith check`: is an artifact, export or dataset whole, and was it made for this target?

`inspect_artifact` (layouts/inspect.py) reads an artifact the way every consumer will (manifest fields,
checksums, tensor names and shapes against what its method's module holds, the draft vocabulary, finite
weights); an export is re-verified the way
`export` verified it; a dataset has only its target fingerprint to compare.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import lazy
from draftsmith.errors import ArtifactError

# inspect_artifact and REQUIRED_FIELDS (layouts/inspect.py) are imported on first use: registering `check` on
# the command line must not load torch (lazy.py)
__getattr__ = lazy.names(__name__, {"inspect_artifact": "draftsmith.layouts.inspect",
                                    "REQUIRED_FIELDS": "draftsmith.layouts.inspect"})
__all__ = ["read_fingerprint", "structure_problems"]


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "check", help="check an artifact / export (files, checksums, tensor names and shapes, the export's own "
        "verification) and that it / a dataset matches a target; exit 0 ok, 3 other target, 4 damaged")
    c.add_argument("--artifact", required=True, help="artifact dir, export dir or dataset dir")
    c.add_argument("--target", default=None, help="target spec (default: smollm2-135m)")
    c.set_defaults(func=run_check)


FINGERPRINT_FILES = ["manifest.json", "draftsmith.json", "provenance.json"]


def read_fingerprint(path: Path) -> tuple[dict, str]:
    """The target fingerprint recorded in an artifact, export or dataset directory."""
    from draftsmith.schema import read_doc

    for name in FINGERPRINT_FILES:
        f = path / name
        if f.is_file():
            data = read_doc(f)  # one line naming the file: not JSON, too deep, not an object
            fp = data.get("target") or data.get("target_fingerprint")
            if isinstance(fp, dict) and isinstance(fp.get("fingerprint"), dict):  # dataset provenance
                fp = fp["fingerprint"]
            if isinstance(fp, dict) and "tokenizer_hash" in fp:
                return fp, name
    raise ArtifactError(f"{path}: no target fingerprint found (looked for {', '.join(FINGERPRINT_FILES)})")


def structure_problems(path: Path, target=None) -> tuple[list[str], list[str]]:
    """(problems, checks) of an artifact (`inspect_artifact`) or an export (the verification that
    `export` runs, checksums included); a dataset has no weights to check here."""
    from draftsmith.artifact import MANIFEST
    from draftsmith.errors import DraftsmithError
    from draftsmith.export.api import verify_export
    from draftsmith.layouts.common import GUARD
    from draftsmith.layouts.inspect import inspect_artifact

    if (path / GUARD).is_file():
        try:
            return [], verify_export(path, target)
        except DraftsmithError as e:
            return [str(e)], []
    if (path / MANIFEST).is_file():
        return inspect_artifact(path)
    return [], []


def run_check(args) -> int:
    from draftsmith.targets import differences, load_target

    path = Path(args.artifact)
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such directory")
    expected, source = read_fingerprint(path)  # nothing to check against a target without one
    target = load_target(args.target)
    problems, checks = structure_problems(path, target)
    for line in checks:
        print(f"  checked: {line}")
    for line in problems:
        print(f"PROBLEM: {line}")
    actual = target.fingerprint()
    diffs = differences(expected, actual)
    if diffs:
        print(f"MISMATCH: {path} ({source}) was made for a different target than {target.name}:")
        for field in diffs:
            print(f"  {field}: artifact {expected.get(field)!r} vs target {actual.get(field)!r}")
        return 3
    if problems:
        print(f"DAMAGED: {path}: {len(problems)} problem(s) above")
        return 4
    same_weights = expected.get("weights_hash") == actual.get("weights_hash")
    note = "" if same_weights else " (target weights differ from training time: acceptance may have drifted)"
    print(f"ok: {path} ({source}) matches target {target.name}{note}")
    return 0
