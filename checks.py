"""`draftsmith check`: is an artifact, export or dataset whole, and was it made for this target?

`inspect_artifact` reads an artifact the way every consumer will (manifest fields, checksums, tensor names
and shapes against what its method's module holds, finite weights); an export is re-verified the way
`export` verified it; a dataset has only its target fingerprint to compare.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith import methods
from draftsmith.artifact import MANIFEST, WEIGHTS, load_manifest
from draftsmith.errors import ArtifactError
from draftsmith.layouts.verify import VerificationError, compare, nonfinite_tensors, read_header
from draftsmith.storage import checksum_problems


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "check", help="check an artifact / export (files, checksums, tensor names and shapes, the export's own "
        "verification) and that it / a dataset matches a target; exit 0 ok, 3 other target, 4 damaged")
    c.add_argument("--artifact", required=True, help="artifact dir, export dir or dataset dir")
    c.add_argument("--target", default=None, help="target spec (default: smollm2-135m)")
    c.set_defaults(func=run_check)


REQUIRED_FIELDS = ("kind", "format_version", "target", "config", "created")


def inspect_artifact(path: str | Path) -> tuple[list[str], list[str]]:
    """(problems, checks done) of an artifact directory, each one line naming the file / field / tensor:
    manifest fields, weight files present, their checksums, tensor names and shapes against what the
    kind's module holds (built from config.json on the meta device: no weights loaded), and a Medusa
    tree that uses only heads that exist. The target fingerprint is compared by the caller."""
    path = Path(path)
    problems: list[str] = []
    try:
        manifest = load_manifest(path)
    except ArtifactError as e:
        return [str(e)], []
    checks = []
    missing = [f for f in REQUIRED_FIELDS if f not in manifest]
    problems += [f"{path / MANIFEST}: missing field '{f}'" for f in missing]
    if manifest.get("kind") not in methods.names():
        problems.append(f"{path / MANIFEST}: field 'kind' is {manifest.get('kind')!r} "
                        f"(known: {', '.join(methods.names())})")
        return problems, checks
    if not missing:
        checks.append(f"{MANIFEST}: fields {', '.join(REQUIRED_FIELDS)} present")
    sums = manifest.get("checksums")
    if sums:
        found = checksum_problems(path, sums, MANIFEST)
        problems += found
        if not found:
            checks.append(f"sha256 of {len(sums)} weight file(s) equal {MANIFEST}'s")
    else:
        checks.append(f"{MANIFEST} records no checksums (written before they were recorded): not compared")
    if not (path / WEIGHTS).is_file():
        problems.append(f"{path / WEIGHTS}: missing")
        return problems, checks
    try:
        found_tensors = read_header(path / WEIGHTS)
    except VerificationError as e:
        problems.append(str(e))
        return problems, checks
    try:
        expected, optional, extra = _expected_tensors(path, manifest["kind"])
    except FileNotFoundError as e:
        problems.append(f"{e.filename}: missing")
        return problems, checks
    except (ArtifactError, KeyError, TypeError, ValueError) as e:
        problems.append(f"{path / 'config.json'}: cannot build the {manifest['kind']} module it describes ({e})")
        return problems, checks
    shape_problems = [f"{path / WEIGHTS}: {p}" for p in compare(found_tensors, expected, optional)]
    nonfinite = nonfinite_tensors(path)
    problems += shape_problems + extra + nonfinite
    if not expected:
        checks.append(f"the {manifest['kind']} method declares no tensor shapes: names and shapes not compared")
    elif not shape_problems:
        checks.append(f"{len(found_tensors)} tensors match the {manifest['kind']} module's names and shapes")
    if not nonfinite:
        checks.append("every weight is finite")
    return problems, checks


def _expected_tensors(path: Path, kind: str) -> tuple[dict, dict, list[str]]:
    """(required, optional) name -> (shape, "") of the module `config.json` describes, and other problems,
    as the artifact's method computes them (methods.py `tensors`)."""
    method = methods.get(kind)
    if method.tensors is None:
        return {}, {}, []
    return method.get("tensors")(path)


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
    """(problems, checks) of an artifact (`inspect_artifact`) or an export (the verification that
    `export` runs, checksums included); a dataset has no weights to check here."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.export.api import verify_export
    from draftsmith.layouts.common import GUARD

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
