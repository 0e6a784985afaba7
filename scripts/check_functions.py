"""The function-length rule, checked from the source (ast; nothing is imported):

    a function of the package is at most 60 lines; one in tests/ or scripts/ at most 100.

A function's length is its lines from `def` to its last line (`end_lineno - lineno + 1`, as
scripts/layout_stats.py counts it): docstring, comments and blank lines included, decorators not; a method
and a function nested in another count alone, and inside the function that holds them too. Package code is
every file check_imports.py reads as the package (all but tests/, scripts/, results/, configs/, docs/,
build/, dist/ and hidden folders). A test reads as one scenario top to bottom and a measurement script
as one recipe, so they may run longer, but not without bound. An algorithm that needs more than 60 lines
is read in pieces with names.

    python scripts/check_functions.py     # exit 1 with one line per function over its limit
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_imports  # noqa: E402  (the same reading of what is package code)

PACKAGE_LIMIT = 60
LONGER = {"tests": 100, "scripts": 100}  # top-level folder -> its limit


def limit_for(rel: Path) -> int | None:
    """The limit a file's functions have, None for a file the rule does not read."""
    top = rel.parts[0]
    if top in LONGER:
        return LONGER[top]
    if top in check_imports.SKIP or top.startswith("."):
        return None
    return PACKAGE_LIMIT


def problems(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        limit = limit_for(rel)
        if limit is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno}: {node.name} is {lines} lines, over the {limit}-line limit "
                                 "(split it into named pieces)")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if found:
        print(f"check_functions: {len(found)} function(s) over their limit", file=sys.stderr)
        return 1
    print(f"check_functions: every function within its limit ({PACKAGE_LIMIT} lines; tests/ and scripts/ "
          f"{LONGER['tests']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
