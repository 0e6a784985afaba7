"""The headline by engine: what a user of each serving engine gets of each shipped drafter, rendered from the
committed reports that measured it.

    <!-- by-engine: results/by-engine-smollm2-135m/sources.json -->
    ... (rendered) ...
    <!-- /by-engine -->

README.md and BENCHMARKS.md hold the block; `draftsmith bench headline --write` renders it beside the headline
block (benchmark/headline.py) and tests/test_headline.py fails on any difference. The sources file names, per
drafter, the reports each column reads:

    vllm         a serve-check report (export/serve_check.py): τ from vLLM's own spec-decode counters, the export
                 served as vLLM runs it (the method alone, its chain or block of k), with draftsmith's evaluator
                 in the same shape beside it
    serve-bench  served speedup at 1 and 16 requests in flight (benchmark/serve_bench.py), from the report in the
                 `--out` folder of `serve_bench_command`; until that run is committed the cells are "–" and a
                 footnote says the run is pending
    sglang       an `evaluate --as-served sglang` report: SGLang's EAGLE tree (topk, num_steps, num_draft_tokens)
    trtllm       an `evaluate --as-served trtllm` report: TensorRT-LLM's chain or Medusa tree
    draftsmith   the headline report: draftsmith's own decoder (cost-model-cut trees) and its CPU speedup

A drafter an engine's column has no run of says why in the drafter's `not_run` ({engine: the cell's words}:
"refused: no Medusa" where the engine does not serve it, "not modelled" where draftsmith's profiles do not decode
that engine's form of it); tests/test_headline.py checks that the engine profile (decoding/served_shape.py) does
refuse each one, so the table cannot leave out a shape draftsmith could measure.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from draftsmith.errors import DataError, show
from draftsmith.formatting import fmt_num, md_cell, md_row

BEGIN = re.compile(r"<!-- by-engine: (?P<path>\S+) -->\n")
END = "<!-- /by-engine -->"
ENGINES = ("sglang", "trtllm")  # the columns read from `evaluate --as-served ENGINE` reports
CONCURRENCY = ("1", "16")  # the serve-bench columns: one request in flight, and a busy server
HEADER = ("drafter", "vLLM: τ from its counters, its shape", "vLLM: served speedup, 1 request in flight",
          "vLLM: served speedup, 16 in flight", "SGLang: τ, its shape", "TensorRT-LLM: τ, its shape",
          "draftsmith's own decoder, CPU: speedup, τ, its shape")


SOURCES = {"target": str, "max_new_tokens": int, "drafters": list, "sglang": str, "trtllm": str, "draftsmith": str,
           "serve_bench_command": str, "note": str}
DRAFTER = {"name": str, "spec": str, "vllm": str, "draftsmith": str}


def read_sources(path: str | Path) -> dict:
    """The sources file a by-engine block names, each field checked (one line naming the file and the field)."""
    from draftsmith.reading import read_json

    data = read_json(path)
    where = [("", data, SOURCES)] + [(f"drafters[{i}].", d, DRAFTER) for i, d in enumerate(data.get("drafters") or [])]
    for prefix, node, fields in where:
        if not isinstance(node, dict):
            raise DataError(f"{path}: {prefix.rstrip('.')} is not an object")
        for key, kind in fields.items():
            if not isinstance(node.get(key), kind) or isinstance(node.get(key), bool):
                raise DataError(f"{path}: {prefix}{key} is {show(node.get(key))}, expected {kind.__name__}")
    if not data["drafters"]:
        raise DataError(f"{path}: drafters is empty")
    return {**data, "_path": str(path)}


def read_serve_check(path: Path) -> dict:
    """A serve-check report, with the fields the block prints checked."""
    from draftsmith.reading import read_json

    report = read_json(path)
    tau = (report.get("vllm") or {}).get("tau") if isinstance(report.get("vllm"), dict) else None
    if not isinstance(tau, int | float) or isinstance(tau, bool):
        raise DataError(f"{path}: vllm.tau is {show(tau)}, expected a number (a serve-check report of a loaded export)")
    if not isinstance(report.get("lossless"), bool) or not isinstance(report.get("k"), int):
        raise DataError(f"{path}: lossless or k is missing (a serve-check report of a loaded export)")
    return report


def serve_bench_path(sources: dict) -> str:
    """The serve-bench report the sources' command writes: report.json in its `--out` folder."""
    words = shlex.split(sources["serve_bench_command"])
    if "--out" not in words[:-1]:
        raise DataError(f"{sources['_path']}: serve_bench_command has no --out folder")
    return str(Path(words[words.index("--out") + 1]) / "report.json")


def _entry(report: dict, spec: str) -> tuple[dict, dict] | None:
    """(overall summary, shape) of the run of `report` whose proposer is `spec` (the main one or a side-by-side one,
    compared without its `@shape` suffix), or None."""
    if report["proposer"].partition("@")[0] == spec:
        return report["overall"], report.get("shape") or {}
    for name, cs in (report["settings"].get("compare_settings") or {}).items():
        if name.partition("@")[0] == spec:
            return report["overall"]["compare"][name], cs.get("shape") or {}
    return None


def _engine_cell(report: dict, drafter: dict, engine: str, path: str) -> str:
    found = _entry(report, drafter["spec"])
    if found is not None:
        summary, shape = found
        return f"{fmt_num(summary['tau'], '.2f')}, {fmt_num(shape.get('label'))}"
    why = (drafter.get("not_run") or {}).get(engine)
    if not isinstance(why, str):
        raise DataError(f"{path}: no run of {drafter['spec']}, and its sources' not_run.{engine} names no reason")
    return why


def _draftsmith_cell(report: dict, spec: str, path: str) -> str:
    from draftsmith.benchmark.headline import entries

    specs = [report["proposer"], *(report["settings"].get("compare_settings") or {})]
    for found, (label, summary, _, _) in zip(specs, entries(report)):
        if found == spec:
            shape = label.rpartition(", ")[2]  # the label ends in the shape: "tree cut by ...", "chain of 6"
            return f"{fmt_num(summary['speedup'], '.2f')}x, τ {fmt_num(summary['tau'], '.2f')}, {shape}"
    raise DataError(f"{path}: no run of {spec}")


def _speedups(bench: dict | None, name: str | None) -> list[str]:
    if bench is None or name is None or name not in bench["comparisons"]:
        return [fmt_num(None)] * len(CONCURRENCY)
    rows = bench["comparisons"][name]["by_concurrency"]
    return [fmt_num((rows.get(c) or {}).get("speedup"), ".2f") for c in CONCURRENCY]


def _row(drafter: dict, reports: dict, sources: dict, bench: dict | None) -> str:
    from draftsmith.decoding.served_shape import served_shape

    vllm = reports[drafter["vllm"]]
    # the shape vLLM served: its engine profile at the report's k (what serve-check's own evaluator decodes)
    label = served_shape("vllm", drafter["spec"], vllm["k"]).label()
    vllm_cell = f"{fmt_num(vllm['vllm']['tau'], '.2f')}, {label}" + ("" if vllm["lossless"] else ", NOT lossless")
    cells = [drafter["name"], vllm_cell, *_speedups(bench, drafter.get("serve_bench"))]
    cells += [_engine_cell(reports[sources[e]], drafter, e, sources[e]) for e in ENGINES]
    cells.append(_draftsmith_cell(reports[sources["draftsmith"]], drafter["draftsmith"], sources["draftsmith"]))
    return md_row(*cells)


def render(sources: dict, root: Path, path: str) -> str:
    """The block for `sources` (read by `read_sources` from `path`, relative to `root`, the checkout the reports it
    names are relative to): where each column comes from, then one row per drafter."""
    from draftsmith.evaluation.report_file import read_report
    from draftsmith.reading import read_json

    served = [d["vllm"] for d in sources["drafters"]]
    paths = served + [sources[e] for e in (*ENGINES, "draftsmith")]
    reports = {p: read_serve_check(root / p) if p in served else read_report(root / p) for p in paths}
    bench_path = serve_bench_path(sources)
    bench = read_json(root / bench_path) if (root / bench_path).is_file() else None
    if bench is not None and not isinstance(bench.get("comparisons"), dict):
        raise DataError(f"{root / bench_path}: comparisons is {show(bench.get('comparisons'))}, expected an object "
                        "(a serve-bench report)")
    links = ", ".join(f"[{Path(p).parent.name}]({p})" for p in served)
    names = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "draftsmith": "draftsmith's decoder"}
    links += "".join(f"; {name} [{reports[sources[key]]['date'][:10]}]({sources[key]})" for key, name in names.items())
    lines = [f"Target `{sources['target']}`, the eval **test** split, greedy, {sources['max_new_tokens']} new tokens. "
             f"Reports ([{path}]({path}) names them): vLLM {links}"
             + (f"; serve-bench [{bench.get('date')}]({bench_path})" if bench else "") + ".", "",
             md_row(*HEADER), "|---" * len(HEADER) + "|"]
    lines += [_row(d, reports, sources, bench) for d in sources["drafters"]]
    note = ("" if bench else "Served speedups: – until the serve-bench run (BENCHMARKS.md, \"Served throughput by "
            "concurrency\") is committed; it needs a quiet machine. ")
    lines += ["", note + md_cell(sources["note"])]
    return "\n".join(lines) + "\n"


def rewrite(doc: Path, root: Path) -> int:
    """Replace every by-engine block of `doc` by the rendering of its sources; returns the number of blocks."""
    from draftsmith.benchmark.headline import blocks

    text = doc.read_text(encoding="utf-8")
    found = blocks(text, BEGIN, END)
    for start, end, path in reversed(found):
        text = text[:start] + render(read_sources(root / path), root, path) + text[end:]
    doc.write_text(text, encoding="utf-8")
    return len(found)
