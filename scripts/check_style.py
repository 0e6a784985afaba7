"""Style rules ruff does not check, read from the source (tokenize; nothing is imported):

    no backslash line continuation: a statement runs over lines inside parentheses, brackets or braces (the
    house convention, and what tools that read the code line by line follow), never after a trailing `\\`.

Every Python file of the repository is read (the package, tests/ and scripts/), but not results/, build/,
dist/ or hidden folders; a backslash inside a string (a docstring's line ending in `\\`) is text, not a
continuation.

    python scripts/check_style.py     # exit 1 with one line per continuation (file:line)
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"results", "bench", "build", "dist", "runs"}


def files(root: Path = ROOT) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in SKIP or any(part.startswith(".") for part in rel.parts):
            continue
        out.append(p)
    return out


def continuations(source: str) -> list[int]:
    """The line numbers that end in a backslash continuation (outside every string token)."""
    lines = source.splitlines()
    in_string: set[int] = set()  # lines whose end lies inside a (multi-line) string token
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING or tok.type in _FSTRING:
            in_string.update(range(tok.start[0], tok.end[0]))
    return [i for i, line in enumerate(lines, 1)
            if line.rstrip("\r\n").endswith("\\") and i not in in_string and not _comment(line)]


_FSTRING = {getattr(tokenize, n) for n in ("FSTRING_MIDDLE", "FSTRING_START", "FSTRING_END") if hasattr(tokenize, n)}


def _comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def main() -> int:
    found = []
    for path in files():
        for n in continuations(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(ROOT)}:{n}: a backslash line continuation (use parentheses)")
    for line in found:
        print(line)
    if found:
        print(f"check_style: {len(found)} backslash continuation(s)", file=sys.stderr)
        return 1
    print(f"check_style: {len(files())} files, no backslash continuation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
