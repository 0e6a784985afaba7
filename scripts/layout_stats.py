"""The numbers the layout is judged by (docs/architecture.md), read from the source with ast:
the ten longest functions and how many run over 60 lines, each built-in method's files in its folder and the
modules outside it that its registration points at, and the import graph between top-level folders.

    python scripts/layout_stats.py [ROOT]     # ROOT: a checkout of the package (default: this one)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
sys.path.insert(0, str(ROOT / "scripts"))
import check_imports as ci  # noqa: E402  (the same module walk and import graph as the lint rule)

SKIP = ci.SKIP
# functions
funcs = []
for p in sorted(ROOT.rglob("*.py")):
    rel = p.relative_to(ROOT)
    if rel.parts[0] in SKIP or rel.parts[0].startswith("."):
        continue
    t = ast.parse(p.read_text())
    for n in ast.walk(t):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.append((n.end_lineno - n.lineno + 1, f"{rel}:{n.name}"))
funcs.sort(reverse=True)
print("longest functions:")
for n, f in funcs[:10]:
    print(f"  {n:4d} {f}")
print("functions over 60 lines:", sum(1 for n, _ in funcs if n > 60))
# methods
text = (ROOT / "methods.py").read_text()
builtin = ast.literal_eval(text.split("BUILTIN = ")[1].split(")")[0] + ")")
for pkg in builtin:
    folder = pkg.split(".", 1)[1].replace(".", "/")
    init = (ROOT / folder / "__init__.py").read_text()
    refs = set()
    tree = ast.parse(init)
    for n in ast.walk(tree):
        if (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("draftsmith.")
                and ":" in n.value):
            refs.add(n.value.split(":")[0])
    outside = sorted(r for r in refs if not r.startswith(pkg + "."))
    own = sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py"))
    print(f"method {pkg}: {len(own)} files in {folder}/, registration points at {len(outside)} modules outside: "
          f"{outside}")
# package graph
g = ci.graph(ROOT)


def top(m: str) -> str:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


pg = {}
for m, deps in g.items():
    a = top(m)
    pg.setdefault(a, set())
    for d in deps:
        b = top(d)
        if b != a:
            pg[a].add(b)
print("package-level imports:")
for a in sorted(pg):
    print(f"  {a} -> {', '.join(sorted(pg[a]))}")
sccs = ci.cycles(pg)
print("package-level cycles:", len(sccs))
for c in sccs:
    print("  ", ", ".join(c))
if hasattr(ci, "LAYERS"):  # the layer rule (scripts/check_imports.py): the graph between its layers
    rank = {name: i for i, layer in enumerate(ci.LAYERS) for name in layer}
    lg: dict[str, set[str]] = {}
    for m, deps in g.items():
        a = ci.layer_key(m, rank)
        lg.setdefault(a, set()).update(ci.layer_key(d, rank) for d in deps if ci.layer_key(d, rank) != a)
    print(f"layers: {len(ci.LAYERS)}; cycles between layer names: {len(ci.cycles(lg))}; imports against the "
          f"layer order allowed: {len(ci.ALLOWED_UPWARD)}; problems: {len(ci.problems(g))}")
    for i, layer in enumerate(ci.LAYERS):
        print(f"  {i:2d} {', '.join(layer)}")
