"""An artifact directory read the way every consumer reads it, naming every problem: the one structural reader
`draftsmith check` reports with and `import_export` runs on what it is about to write (so an import never
writes an artifact that `check` calls damaged).

manifest.json through its reader (artifact.load_manifest), the weight files' checksums, the safetensors header,
tensor names and shapes against the module config.json describes (each method's `tensors` reader, which also
reads its config and any file beside it: a Medusa tree), the draft vocabulary's maps against the target's
vocabulary, and finite weights. The target fingerprint is compared by the caller.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import methods
from draftsmith.artifact import MANIFEST, WEIGHTS, load_manifest, target_vocab, vocab_problems
from draftsmith.checksums import checksum_problems
from draftsmith.errors import ArtifactError, DraftsmithError
from draftsmith.layouts.verify import VerificationError, compare, nonfinite_tensors, read_header, read_tensors

REQUIRED_FIELDS = ("kind", "format_version", "target", "config", "created")


def inspect_artifact(path: str | Path) -> tuple[list[str], list[str]]:
    """(problems, checks done) of an artifact directory, each one line naming the file / field / tensor."""
    path = Path(path)
    try:
        manifest = load_manifest(path)
    except ArtifactError as e:
        return [str(e)], []
    problems, checks = _manifest_problems(path, manifest)
    if problems and manifest.get("kind") not in methods.names():
        return problems, checks
    if not (path / WEIGHTS).is_file():
        return problems + [f"{path / WEIGHTS}: missing"], checks
    try:
        found = read_header(path / WEIGHTS)
    except VerificationError as e:
        return problems + [str(e)], checks
    try:
        expected, optional, extra = _expected_tensors(path, manifest["kind"])
    except FileNotFoundError as e:
        return problems + [f"{e.filename}: missing"], checks
    except DraftsmithError as e:  # the method's reader names the file and the field
        return problems + [str(e)], checks
    except (KeyError, TypeError, ValueError) as e:  # a registered method whose reader does not check its fields
        return problems + [f"{path / 'config.json'}: cannot build the {manifest['kind']} module it describes "
                           f"({type(e).__name__}: {e})"], checks
    shapes = [f"{path / WEIGHTS}: {p}" for p in compare(found, expected, optional)]
    vocab = _vocab_problems(path, found, target_vocab(manifest))
    nonfinite = nonfinite_tensors(path)
    problems += shapes + vocab + extra + nonfinite
    if not expected:
        checks.append(f"the {manifest['kind']} method declares no tensor shapes: names and shapes not compared")
    elif not shapes:
        checks.append(f"{len(found)} tensors match the {manifest['kind']} module's names and shapes")
    if "d2t" in found and not vocab:
        checks.append("d2t / t2d: a draft vocabulary of distinct target ids inside the target's vocabulary")
    if not nonfinite:
        checks.append("every weight is finite")
    return problems, checks


def _manifest_problems(path: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """Fields missing, an unknown kind, and the weight files' checksums against the manifest's."""
    missing = [f for f in REQUIRED_FIELDS if f not in manifest]
    problems = [f"{path / MANIFEST}: missing field '{f}'" for f in missing]
    checks = [] if missing else [f"{MANIFEST}: fields {', '.join(REQUIRED_FIELDS)} present"]
    if manifest.get("kind") not in methods.names():
        problems.append(f"{path / MANIFEST}: field 'kind' is {manifest.get('kind')!r} "
                        f"(known: {', '.join(methods.names())})")
        return problems, checks
    sums = manifest.get("checksums")
    if sums:
        found = checksum_problems(path, sums, MANIFEST)
        problems += found
        if not found:
            checks.append(f"sha256 of {len(sums)} weight file(s) equal {MANIFEST}'s")
    else:
        checks.append(f"{MANIFEST} records no checksums (written before they were recorded): not compared")
    return problems, checks


def _expected_tensors(path: Path, kind: str) -> tuple[dict, dict, list[str]]:
    """(required, optional) name -> (shape, dtype or "") of the module `config.json` describes, and other
    problems, as the artifact's method computes them (methods.py `tensors`)."""
    method = methods.get(kind)
    if method.tensors is None:
        return {}, {}, []
    return method.get("tensors")(path)


def _vocab_problems(path: Path, found: dict, vocab: int | None) -> list[str]:
    """d2t / t2d read from the weights (two small tensors) and checked (artifact.vocab_problems)."""
    names = [n for n in ("d2t", "t2d") if n in found]
    if "d2t" not in names:
        return []
    try:
        tensors = read_tensors(path / WEIGHTS, names)
    except Exception as e:  # safetensors raises its own error types; the header was read, the data may be torn
        return [f"{path / WEIGHTS}: d2t / t2d cannot be read ({type(e).__name__}: {str(e)[:200]})"]
    return [f"{path / WEIGHTS}: {p}" for p in vocab_problems(tensors, vocab)]
