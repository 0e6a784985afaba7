"""`draftsmith targets` (list / prepare the embedded targets) and `draftsmith check` (does an artifact,
export or dataset match a target, and what differs)."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import ArtifactError


def register(subparsers) -> None:
    p = subparsers.add_parser("targets", help="list the embedded targets; `prepare NAME` caches one")
    p.add_argument("action", nargs="?", choices=["list", "prepare", "fingerprint"], default="list")
    p.add_argument("name", nargs="?", help="target spec for prepare / fingerprint")
    p.set_defaults(func=run_targets)

    c = subparsers.add_parser(
        "check", help="check an artifact / export (files, checksums, tensor names and shapes, the export's own "
        "verification) and that it / a dataset matches a target; exit 0 ok, 3 other target, 4 damaged")
    c.add_argument("--artifact", required=True, help="artifact dir, export dir or dataset dir")
    c.add_argument("--target", default=None, help="target spec (default: smollm2-135m)")
    c.set_defaults(func=run_check)


def run_targets(args) -> int:
    from draftsmith.targets import list_targets, load_target

    if args.action == "list":
        rows = list_targets()
        print(f"{'name':<14} {'installed':<10} {'cached':<7} description")
        for r in rows:
            mark = " (default)" if r["default"] else ""
            inst = "yes" if r["installed"] else "no"
            print(f"{r['name']:<14} {inst:<10} {'yes' if r['cached'] else 'no':<7} {r['description']}{mark}")
            if not r["installed"]:
                print(f"{'':<14} install: {r['install']}")
        return 0
    target = load_target(args.name)
    if args.action == "prepare":
        print(f"{target.name}: ready in {target.folder}")
    else:
        print(json.dumps(target.fingerprint(), indent=2))
    return 0


FINGERPRINT_FILES = ["manifest.json", "draftsmith.json", "provenance.json"]


def read_fingerprint(path: Path) -> tuple[dict, str]:
    """The target fingerprint recorded in an artifact, export or dataset directory."""
    for name in FINGERPRINT_FILES:
        f = path / name
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ArtifactError(f"{f}: not valid JSON ({e})") from None
            if not isinstance(data, dict):
                continue
            fp = data.get("target") or data.get("target_fingerprint")
            if isinstance(fp, dict) and isinstance(fp.get("fingerprint"), dict):  # dataset provenance
                fp = fp["fingerprint"]
            if isinstance(fp, dict) and "tokenizer_hash" in fp:
                return fp, name
    raise ArtifactError(f"{path}: no target fingerprint found (looked for {', '.join(FINGERPRINT_FILES)})")


def structure_problems(path: Path, target=None) -> tuple[list[str], list[str]]:
    """(problems, checks) of an artifact (artifact.inspect_artifact) or an export (the verification that
    `export` runs, checksums included); a dataset has no weights to check here."""
    from draftsmith.artifact import MANIFEST, inspect_artifact
    from draftsmith.errors import DraftsmithError
    from draftsmith.export.common import GUARD
    from draftsmith.export.verify import verify_export

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
