"""Import rules of the package, checked from the source (ast; nothing is imported):

1. no import cycle between files: every `import` / `from ... import` of a draftsmith module counts, at module
   level and inside functions alike (a function-level import is a dependency all the same, only a later one);
2. `targets/` is the bottom layer: it imports no other draftsmith subpackage (the package root's `errors`,
   `lazy`, file modules and `__init__` only), so a target loads without training, decoding or export;
3. the folders are layers in the order the data flows (LAYERS, drawn in docs/architecture.md): a module
   imports only its own layer and the layers before it, and the method folders (METHODS) never import
   one another, so a method is one folder that can be added or removed alone, except a method declared in
   BUILDS_ON as built on another's backbone, which imports that one folder (DSpark on DFlash). Every top-level
   module or folder must be placed in a layer. ALLOWED_UPWARD lists the imports against the order still
   accepted, each with its reason; like ALLOWED_CYCLES it is reported when an entry no longer occurs.
4. imports by name are imports: a string constant that is, whole, a draftsmith module with or without an
   attribute (`"draftsmith.eagle.job:EagleJob"` in a method's `METHOD`, `methods.BUILTIN`, `cli.COMMAND_MODULES`,
   `config.CONFIG_MODULES`, a `python -m draftsmith.cli` argument) is a dependency resolved at run time, and is
   checked against LAYERS like an import (not for cycles: nothing runs it when the module is imported). A
   method folder's references point into the folder itself; a reference to a later layer is declared in
   BY_NAME by the layer it reaches ("method folders" for any of METHODS), with its reason, and a declaration
   that no longer occurs is reported.
5. what runs in the serving engine's environment, where draftsmith's dependencies are not installed, imports
   no draftsmith module: `fleet/` (vLLM loads it by import path, inside its own process) none outside itself;
   ENGINE_SCRIPTS (serve-check's runner) and each method folder's ENGINE_PATCHES module (the fixes of vLLM's
   code its serving entry names, which the runner loads by path) none at all.
6. no cycle between top-level folders or modules either (`artifact` importing `layouts` while `layouts`
   imports `artifact`), whatever their layers: what two of them both need moves to the lower one.

    python scripts/check_imports.py          # exit 1 with one line per violation, else one line of totals

`from draftsmith.eagle import export` is a dependency on the submodule eagle/export.py; a package's own
`__init__` (run first by any import of its submodules) counts only where a file imports a name it defines.
ALLOWED_CYCLES lists the cycles still accepted, each with its reason; a listed cycle that no longer occurs is
reported too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "draftsmith"
# runs/: the presets' git-ignored output
SKIP = {"tests", "scripts", "results", "configs", "docs", "build", "dist", "runs"}
BOTTOM = "targets"  # rule 2
# targets/ reads and writes its cache and the target's files with the base's file modules
BOTTOM_MAY_IMPORT = {"draftsmith", "draftsmith.errors", "draftsmith.lazy", "draftsmith.outputs",
                     "draftsmith.reading", "draftsmith.checksums", "draftsmith.paths"}
# rule 5: fleet/ runs inside the serving engine's process and environment (vLLM loads it by import path),
# where draftsmith's dependencies are not installed: it imports no draftsmith module but its own
ENGINE_SIDE = "fleet"
# rule 5, the files run there by path: serve-check's runner (a script of vLLM's environment), and in each
# method folder the module of its fixes of vLLM's code (`layouts.serving.VllmPatch`), which that runner loads
ENGINE_SCRIPTS = {"export.vllm_run"}
ENGINE_PATCHES = "vllm_patches"

# The layers, first to last: each name is a top-level module or folder of the package ("__init__" is the
# package's own), whole: a module sits in its folder's layer, never in one of its own (a dotted name is
# refused). Names in one layer may import each other, except the method folders (rule 3).
def _builtin_methods() -> set[str]:
    """The method folders methods.BUILTIN names (read from the source: adding a method is its folder and that
    one line, not an edit here too)."""
    tree = ast.parse((ROOT / "methods.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUILTIN" for t in node.targets):
            return {ast.literal_eval(e).rsplit(".", 1)[-1] for e in node.value.elts}
    raise SystemExit("check_imports: methods.py defines no BUILTIN")


METHODS = _builtin_methods()
# a method built on another's backbone imports that method's folder (its model, job, proposer and export, shared,
# not copied), and only that one; the base never imports it back (rule 1 would see the cycle, rule 3 says so)
BUILDS_ON = {"dspark": "dflash"}  # DSpark = DFlash's block drafter + a Markov head + a confidence head

LAYERS: list[tuple[str, ...]] = [
    # the shared base; its file modules: atomic writes and output folders (outputs), the readers' shared rules
    # and caps (reading), sha256 and weight checksums (checksums), where files are found (paths)
    ("__init__", "errors", "nofollow", "reading", "schema", "locks", "outputs", "checksums", "paths", "net",
     "formatting", "lazy", "methods", "config"),
    ("fleet",),  # runs inside the serving engine (rule 5): the traffic middleware, the capture connector
    ("targets",),  # load a target, its family table, fingerprint, a frozen target placed for training
    # what the frozen target computes, kept: layer convention, forward capture, the cache on disk, offline
    # capture of a dataset, online capture in a training step (the verifier, the data engine and training read it)
    ("capture",),
    # the artifact directory every method writes and every later stage reads; layouts/: what every export layout
    # is written and read back with (guard, card, the safetensors reader, the head writer, each stack's launch)
    ("artifact", "layouts"),
    ("decoding",),  # the decoder: proposer interface, one verifier, sampling, KV cache, trees, cost model
    ("data",),  # sources -> rows, and data/engines/: everything that produces text, behind one interface
    ("training",),  # the one accelerate loop, checkpoints, trackers, online capture
    ("heads",),  # what the methods share: draft vocabularies, LoRA, KD losses
    ("memory",),  # the memory counting rules (serving, training) every method's estimate is written with
    tuple(sorted(METHODS)),  # one folder per method: methods.BUILTIN, read from methods.py
    ("evaluation",),  # per-domain alpha/tau/speedup, lossless against a reference, reports
    # the one runner: train any method's job, then evaluate what it wrote; `draftsmith train` calls it
    ("runner",),
    ("export",),  # export_artifact and serve-check: any method's layouts, through the registry
    ("checks",),  # `draftsmith check`: artifacts, exports and datasets, read back
    ("planning", "benchmark"),  # memory plans, routing, production alpha; every benchmark and its results
    ("retrain",),  # drift -> retrain -> gate -> promote
    ("cli",),  # the one command line
]

# (importer, imported) -> why the import against the layer order stays, for now
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

# frozenset of the modules of one cycle -> why it stays
ALLOWED_CYCLES: dict[frozenset[str], str] = {}

METHOD_LAYER = "method folders"  # how BY_NAME names a reference to any of METHODS
# (module, the layer it reaches by name) -> why it names that later layer rather than importing it (rule 4)
BY_NAME: dict[tuple[str, str], str] = {
    ("draftsmith.methods", METHOD_LAYER): "BUILTIN names the folders that declare the built-in methods, "
        "imported on first use: the registry sits below every stage that reads it",
    ("draftsmith.config", "data"): "CONFIG_MODULES: the preset kinds' config classes register themselves "
        "when imported, and load_config imports them on first use",
    ("draftsmith.config", "training"): "CONFIG_MODULES (as for data)",
    ("draftsmith.config", "evaluation"): "CONFIG_MODULES (as for data)",
    ("draftsmith.config", "retrain"): "CONFIG_MODULES (as for data)",
    ("draftsmith.config", "benchmark"): "CONFIG_MODULES (as for data)",
    ("draftsmith.benchmark.run", "cli"): "the whole bench runs each stage as `python -m draftsmith.cli` in a "
        "process of its own, so each number carries its command and memory is returned between stages",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or rel.parts[0].startswith("."):
            continue
        found[module_name(path, root)] = path
    return found


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The draftsmith modules `path` imports (module level and inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:  # `from draftsmith.eagle import export` imports the submodule
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in known else mod)
    deps = set()
    for mod in out:
        if not (mod == PACKAGE or mod.startswith(PACKAGE + ".")):
            continue
        while mod and mod not in known:  # `from x.y import func`: the module is x.y
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            deps.add(mod)
    return deps


def references_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The draftsmith modules `path` names by string (rule 4): each string constant that is, whole, a known
    module other than the package itself, with or without `:attribute`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            mod = node.value.partition(":")[0]
            if mod in known and mod not in (PACKAGE, name):
                out.add(mod)
    return out


def references(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: refs for name, path in known.items() if (refs := references_of(path, name, known))}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(path, name, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def top(module: str) -> str:
    """The top-level module or folder a module belongs to: draftsmith.data.engines.continuous -> data."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_key(module: str, rank: dict[str, int]) -> str:
    """The LAYERS name a module falls under: its top-level module or folder, whatever `rank` lists (a module
    sits in its folder's layer)."""
    return top(module)


def layer_problems(g: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS,
                   allowed: dict[tuple[str, str], str] = ALLOWED_UPWARD) -> list[str]:
    """Rule 3: one line per import against the layer order, per module in no layer, per stale allowance."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    found, seen = [], set()
    for name in sorted(n for n in rank if "." in n):
        found.append(f"LAYERS names {name}: a layer holds whole folders and top-level modules, and a module sits "
                     "in its folder's layer")
    for name in sorted({layer_key(m, rank) for m in g} - set(rank)):
        found.append(f"{PACKAGE}.{name} is in no layer: place it in LAYERS (scripts/check_imports.py)")
    for mod, deps in sorted(g.items()):
        a = layer_key(mod, rank)
        for dep in sorted(deps):
            b = layer_key(dep, rank)
            if a == b or a not in rank or b not in rank:
                continue
            if rank[b] > rank[a]:
                why = f"{a} comes before {b} in LAYERS"
            elif a in METHODS and b in METHODS and BUILDS_ON.get(a) != b:
                why = f"the method folders {a}/ and {b}/ import nothing of each other"
            else:
                continue
            if (mod, dep) in allowed:
                seen.add((mod, dep))
                continue
            found.append(f"{mod} imports {dep}: {why}")
    for mod, dep in sorted(set(allowed) - seen):
        found.append(f"ALLOWED_UPWARD lists an import that no longer occurs: {mod} -> {dep}")
    return found


def reference_problems(refs: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS,
                       declared: dict[tuple[str, str], str] = BY_NAME,
                       methods: set[str] | None = None) -> list[str]:
    """Rule 4: one line per import by name against the layers, per stale declaration."""
    methods = METHODS if methods is None else methods
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    found, seen = [], set()
    for mod, names in sorted(refs.items()):
        a = layer_key(mod, rank)
        for ref in sorted(names):
            b = layer_key(ref, rank)
            if a in methods:
                if b != a:
                    found.append(f"{mod} names {ref}: a method folder's references by name point into {a}/ itself")
                continue
            if a == b or a not in rank or b not in rank or rank[b] <= rank[a]:
                continue
            reached = METHOD_LAYER if b in methods else b
            if (mod, reached) in declared:
                seen.add((mod, reached))
                continue
            found.append(f"{mod} names {ref}: {a} comes before {b} in LAYERS (an import by name; declare it in "
                         "BY_NAME with its reason, or move it)")
    for mod, reached in sorted(set(declared) - seen):
        found.append(f"BY_NAME declares a reference that no longer occurs: {mod} -> {reached}")
    return found


def problems(g: dict[str, set[str]], allowed: dict[frozenset[str], str] = ALLOWED_CYCLES,
             layers: list[tuple[str, ...]] | None = LAYERS) -> list[str]:
    found = [] if layers is None else layer_problems(g, layers, ALLOWED_UPWARD if layers is LAYERS else {})
    for comp in cycles(g):
        if frozenset(comp) not in allowed:
            edges = [f"{a} -> {b}" for a in comp for b in sorted(g[a]) if b in comp]
            found.append(f"import cycle between {len(comp)} files: {', '.join(edges)}")
    seen = {frozenset(c) for c in cycles(g)}
    for cycle in allowed:
        if cycle not in seen:
            found.append(f"ALLOWED_CYCLES lists a cycle that no longer occurs: {', '.join(sorted(cycle))}")
    bottom = f"{PACKAGE}.{BOTTOM}"
    for mod, deps in sorted(g.items()):
        if mod != bottom and not mod.startswith(bottom + "."):
            continue
        for dep in sorted(deps):
            if dep in BOTTOM_MAY_IMPORT or dep == bottom or dep.startswith(bottom + "."):
                continue
            found.append(f"{mod} imports {dep}: {BOTTOM}/ is the bottom layer and imports no other draftsmith "
                         "subpackage")
    return found + engine_problems(g) + package_problems(g)


def package_problems(g: dict[str, set[str]]) -> list[str]:
    """Rule 6: top-level folders and modules import each other one way. Two of them that import each other
    (through any of their files) are one unit in two places even where no file-level cycle exists and they
    share a layer; what both need belongs in the lower one."""
    pg: dict[str, set[str]] = {}
    for mod, deps in g.items():
        a = top(mod)
        pg.setdefault(a, set()).update(top(d) for d in deps if top(d) != a)
    reported = {frozenset(top(m) for m in comp) for comp in cycles(g)}  # a file cycle is named as one already
    found = []
    for comp in cycles(pg):
        if frozenset(comp) in reported:
            continue
        edges = [f"{a} -> {b}" for a in comp for b in sorted(pg[a]) if b in comp]
        found.append(f"package-level import cycle between {', '.join(comp)}: {', '.join(edges)}")
    return found


def engine_side(module: str, methods: set[str] | None = None) -> bool:
    """Whether `module` runs in the serving engine's environment (rule 5)."""
    methods = METHODS if methods is None else methods
    rel = module.removeprefix(PACKAGE + ".")
    return (top(module) == ENGINE_SIDE or rel in ENGINE_SCRIPTS
            or rel in {f"{m}.{ENGINE_PATCHES}" for m in methods})


def engine_problems(g: dict[str, set[str]], methods: set[str] | None = None) -> list[str]:
    """Rule 5: one line per draftsmith import of a module that runs in the serving engine's environment."""
    side, found = f"{PACKAGE}.{ENGINE_SIDE}", []
    for mod, deps in sorted(g.items()):
        if not engine_side(mod, methods):
            continue
        if top(mod) == ENGINE_SIDE:
            found += [f"{mod} imports {dep}: {ENGINE_SIDE}/ runs in the serving engine's environment and imports "
                      "no draftsmith module outside it" for dep in sorted(deps)
                      if dep not in (PACKAGE, side) and not dep.startswith(side + ".")]
        else:
            found += [f"{mod} imports {dep}: it runs in the serving engine's environment (loaded by path "
                      "there) and imports no draftsmith module" for dep in sorted(deps)]
    return found


def main() -> int:
    g = graph()
    refs = references()
    found = problems(g) + reference_problems(refs)
    for line in found:
        print(line)
    edges = sum(len(v) for v in g.values())
    if found:
        print(f"check_imports: {len(found)} problem(s) in {len(g)} modules, {edges} imports", file=sys.stderr)
        return 1
    print(f"check_imports: {len(g)} modules, {edges} imports, no cycle, {BOTTOM}/ imports nothing above it, "
          f"{len(LAYERS)} layers in order ({len(ALLOWED_CYCLES)} cycle(s), {len(ALLOWED_UPWARD)} upward "
          f"import(s) allowed), {sum(len(v) for v in refs.values())} imports by name checked "
          f"({len(BY_NAME)} declared upward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
