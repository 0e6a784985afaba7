"""The package's import rules (scripts/check_imports.py, also run by `make lint`): no cycle between files,
counting imports inside functions, nothing above targets/ imported from it, and the folders imported in
the layer order of docs/architecture.md (method folders never import one another), and imports by name
(`"draftsmith.module:attr"` strings) checked against the same layers."""

from __future__ import annotations

from repo_scripts import load_script


def _checker():
    return load_script("check_imports")


def test_the_package_has_no_import_cycle_and_targets_imports_nothing_above_it():
    checker = _checker()
    assert checker.problems(checker.graph()) == []


def test_the_checker_finds_a_function_level_cycle_and_an_upward_import(tmp_path):
    checker = _checker()
    (tmp_path / "__init__.py").write_text("")
    for pkg in ("targets", "decoding"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from draftsmith.b import g\n")
    (tmp_path / "b.py").write_text("from draftsmith import a\n")
    (tmp_path / "targets" / "load.py").write_text("from draftsmith.errors import X\n")
    (tmp_path / "targets" / "cache.py").write_text("def f():\n    from draftsmith.decoding.verify import v\n")
    (tmp_path / "decoding" / "verify.py").write_text("from ..targets import load\n")
    (tmp_path / "errors.py").write_text("")
    found = checker.problems(checker.graph(tmp_path), allowed={}, layers=None)
    assert found[0] == "import cycle between 2 files: draftsmith.a -> draftsmith.b, draftsmith.b -> draftsmith.a"
    assert found[1].startswith("draftsmith.targets.cache imports draftsmith.decoding.verify: targets/ is the bottom")
    # rule 6: targets/ and decoding/ import each other through different files (no file-level cycle)
    assert found[2] == ("package-level import cycle between decoding, targets: decoding -> targets, "
                        "targets -> decoding")
    assert len(found) == 3  # targets/load.py may import errors; the a <-> b cycle is named once, as files
    stale = checker.problems(checker.graph(tmp_path), allowed={frozenset({"draftsmith.x", "draftsmith.y"}): "why"},
                             layers=None)
    assert "ALLOWED_CYCLES lists a cycle that no longer occurs: draftsmith.x, draftsmith.y" in stale


def test_the_checker_finds_an_import_against_the_layer_order(tmp_path):
    checker = _checker()
    (tmp_path / "__init__.py").write_text("")
    for pkg in ("data", "evaluation", "medusa", "distill", "stray"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "data" / "rows.py").write_text("def f():\n    from draftsmith.evaluation import cost\n")
    (tmp_path / "evaluation" / "cost.py").write_text("from draftsmith.data import rows\n")
    (tmp_path / "medusa" / "job.py").write_text("from draftsmith.distill import losses\n")
    (tmp_path / "distill" / "losses.py").write_text("")
    g = checker.graph(tmp_path)
    assert checker.layer_problems(g, allowed={}) == [
        "draftsmith.stray is in no layer: place it in LAYERS (scripts/check_imports.py)",
        "draftsmith.data.rows imports draftsmith.evaluation.cost: data comes before evaluation in LAYERS",
        "draftsmith.medusa.job imports draftsmith.distill.losses: the method folders medusa/ and distill/ import "
        "nothing of each other",
    ]
    allowed = {("draftsmith.data.rows", "draftsmith.evaluation.cost"): "why", ("draftsmith.x", "draftsmith.y"): "why"}
    found = checker.layer_problems(g, allowed=allowed)
    assert "ALLOWED_UPWARD lists an import that no longer occurs: draftsmith.x -> draftsmith.y" in found
    assert not any(line.startswith("draftsmith.data.rows") for line in found)
    # a module placed in a layer other than its folder's is refused, not honoured
    assert checker.layer_problems(g, layers=[("__init__", "data", "evaluation", "medusa", "distill", "stray",
                                              "evaluation.cost")],
                                  allowed={}) == [
        "LAYERS names evaluation.cost: a layer holds whole folders and top-level modules, and a module sits in its "
        "folder's layer",
        "draftsmith.medusa.job imports draftsmith.distill.losses: the method folders medusa/ and distill/ import "
        "nothing of each other",
    ]


def test_imports_by_name_in_the_package_are_in_layer_order():
    checker = _checker()
    refs = checker.references()
    assert "draftsmith.eagle.job" in refs["draftsmith.eagle"]  # METHOD's "module:attr" strings are read
    assert "draftsmith.runner.commands" in refs["draftsmith.cli"]
    assert checker.reference_problems(refs) == []


def test_the_checker_finds_a_misplaced_import_by_name(tmp_path):
    checker = _checker()
    (tmp_path / "__init__.py").write_text("")
    for pkg in ("data", "evaluation", "medusa", "heads"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "heads" / "lora.py").write_text("")
    (tmp_path / "medusa" / "job.py").write_text("")
    # a method's registration naming a module outside its folder, and a stage naming a later one
    (tmp_path / "medusa" / "__init__.py").write_text('METHOD = dict(job="draftsmith.medusa.job:MedusaJob",\n'
                                                     '              lora="draftsmith.heads.lora:apply")\n')
    (tmp_path / "data" / "rows.py").write_text('STAGE = "draftsmith.evaluation.cost:measure"\n'
                                               'NOT_A_MODULE = "draftsmith.json"\n')
    (tmp_path / "evaluation" / "cost.py").write_text('ROWS = "draftsmith.data.rows"\n')  # downward: fine
    layers = [("data",), ("heads",), ("medusa",), ("evaluation",)]
    refs = checker.references(tmp_path)
    found = checker.reference_problems(refs, layers, declared={}, methods={"medusa"})
    assert found == [
        "draftsmith.data.rows names draftsmith.evaluation.cost: data comes before evaluation in LAYERS (an import "
        "by name; declare it in BY_NAME with its reason, or move it)",
        "draftsmith.medusa names draftsmith.heads.lora: a method folder's references by name point into medusa/ "
        "itself",
    ]
    declared = {("draftsmith.data.rows", "evaluation"): "why", ("draftsmith.x", "method folders"): "why"}
    assert checker.reference_problems(refs, layers, declared=declared, methods={"medusa"}) == [
        found[1], "BY_NAME declares a reference that no longer occurs: draftsmith.x -> method folders"]


def test_the_checker_holds_every_engine_side_file_to_no_draftsmith_import(tmp_path):
    """What runs in the serving engine's environment (fleet/, the serve-check runner export/vllm_run.py, a
    method folder's vllm_patches.py that the runner loads by path) imports no draftsmith module: draftsmith's
    dependencies are not installed there. fleet/ may import itself; a method's own modules elsewhere may
    import what their layer allows."""
    checker = _checker()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "errors.py").write_text("")
    for pkg in ("fleet", "export", "dflash"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "fleet" / "record.py").write_text("import json\n")
    (tmp_path / "fleet" / "middleware.py").write_text("from draftsmith.fleet import record\n"
                                                      "from draftsmith.errors import X\n")
    (tmp_path / "export" / "vllm_run.py").write_text("def f():\n    from draftsmith.errors import X\n")
    (tmp_path / "export" / "api.py").write_text("from draftsmith.errors import X\n")
    patches = "import torch\nfrom draftsmith.dflash import model\n"
    (tmp_path / "dflash" / "vllm_patches.py").write_text(patches)
    (tmp_path / "dflash" / "model.py").write_text("from draftsmith.errors import X\n")
    assert checker.engine_problems(checker.graph(tmp_path), methods={"dflash"}) == [
        "draftsmith.dflash.vllm_patches imports draftsmith.dflash.model: it runs in the serving engine's "
        "environment (loaded by path there) and imports no draftsmith module",
        "draftsmith.export.vllm_run imports draftsmith.errors: it runs in the serving engine's environment "
        "(loaded by path there) and imports no draftsmith module",
        "draftsmith.fleet.middleware imports draftsmith.errors: fleet/ runs in the serving engine's "
        "environment and imports no draftsmith module outside it",
    ]
    assert checker.engine_side("draftsmith.dflash.vllm_patches", methods={"dflash"})
    assert not checker.engine_side("draftsmith.dflash.model", methods={"dflash"})


def test_every_module_of_a_method_folder_serves_the_method():
    """A method folder is what the method ships: each of its modules is reached from its registration
    (METHOD's references and what they import, by name or by import) or is a fix of vLLM's code its serving
    entry names (rule 5). A helper only a test runs (a script for vLLM's environment, a reference) belongs
    under tests/."""
    checker = _checker()
    g, refs = checker.graph(), checker.references()
    for method in sorted(checker.METHODS):
        folder = f"draftsmith.{method}"
        reached, todo = set(), [folder]
        while todo:
            mod = todo.pop()
            if mod in reached:
                continue
            reached.add(mod)
            todo += [m for m in g.get(mod, set()) | refs.get(mod, set()) if m.startswith(folder + ".")]
        own = {m for m in g if m.startswith(folder + ".")}
        stray = sorted(m for m in own - reached if not checker.engine_side(m))
        assert stray == [], f"{method}/ holds modules its method never reaches: {stray}"


def test_what_starts_vllm_is_a_text_engine_and_data_generation_stays_in_data():
    """Starting vLLM (finding its environment, `vllm serve`) sits in data/engines/, below every stage that
    starts one, so the capture replica, which writes a data set's answers and features, is data/'s, and no
    module of export/ generates data (it verifies, writes and serves what was trained)."""
    g = _checker().graph()
    server = "draftsmith.data.engines.vllm_server"
    assert {"draftsmith.data.generate", server} <= g["draftsmith.data.capture_replica"]
    assert server in g["draftsmith.export.serve_check"]
    generating = sorted((m, d) for m, deps in g.items() if m.startswith("draftsmith.export.") for d in deps
                        if d.startswith("draftsmith.data.") and d != server)
    assert generating == []


def test_the_checker_finds_two_top_level_names_that_import_each_other(tmp_path):
    """artifact.py importing layouts/ while layouts/ imports artifact.py: no file-level cycle and one shared layer,
    but one unit in two places (rule 6), refused until what both need moves to the lower one."""
    checker = _checker()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "__init__.py").write_text("")
    (tmp_path / "layouts" / "schema.py").write_text("X = 1\n")
    (tmp_path / "layouts" / "common.py").write_text("from draftsmith.artifact import now\n")
    (tmp_path / "artifact.py").write_text("from draftsmith.layouts import schema\nnow = 1\n")
    found = checker.problems(checker.graph(tmp_path), allowed={}, layers=None)
    assert found == ["package-level import cycle between artifact, layouts: artifact -> layouts, layouts -> artifact"]
    (tmp_path / "schema.py").write_text((tmp_path / "layouts" / "schema.py").read_text())
    (tmp_path / "layouts" / "schema.py").unlink()
    (tmp_path / "artifact.py").write_text("from draftsmith import schema\nnow = 1\n")
    assert checker.problems(checker.graph(tmp_path), allowed={}, layers=None) == []
