"""Which target families vLLM serves with which kind of draftsmith export, measured in the real vLLM.

For every family of draftsmith's table (targets/families.py) a tiny random target (4 layers, head_dim 32) is
built with the family's own transformers config class; an EAGLE-3 head, an EAGLE-1 head, Medusa heads and a
distilled draft are trained on rows it wrote (a few steps: loading and losslessness are the question, not
acceptance), exported for vLLM and run by `draftsmith serve-check` (export/serve_check.py): loaded or vLLM's own
error, greedy output identical to vLLM's without speculation, vLLM's per-position acceptance beside
draftsmith's. vLLM's n-gram lookup is the control (nothing of ours loaded: it tells whether vLLM runs the target).

    .venv/bin/python scripts/vllm_families.py --out results/vllm-families   # needs `make setup-vllm`

Writes report.json (a row per family and kind, written after each, so an interrupted run resumes where it
stopped) and report.md. The methods' measured vLLM refusals (`Method.serving.vllm_refuses`, the warning at
export) and the table in docs/your-model.md are checked against the committed report by tests/test_vllm_families.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family builders the tests use, one definition

KINDS = ("eagle3", "eagle1", "medusa", "draft", "ngram")


def _cell(family, kind: str) -> dict:
    """One serve-check of one kind on one family's tiny target, as a row of the report."""
    from draftsmith.export.serve_check import ServeCheckError

    row: dict = {"kind": kind}
    export = None
    if kind != "ngram":
        try:
            res = family.export(kind)
        except Exception as e:  # draftsmith's own export refused it: the row says so, in its words
            return {**row, "exported": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        export, row["exported"] = res.out, True
        row["export_warnings"] = [c for c in res.checks if c.startswith("WARNING")]
    try:
        r = family.check(kind, export)
    except ServeCheckError as e:  # vLLM did not run the target itself
        return {**row, "target_ran": False, "loaded": False, "error": str(e)}
    row.update(target_ran=True, loaded=r["loaded"], error=r.get("error"), vllm_version=r.get("vllm_version"))
    if r["loaded"]:
        d = r.get("draftsmith") or {}
        row.update(lossless=r["lossless"], draftsmith_lossless=d.get("lossless"),
                   vllm_acceptance=r["vllm"]["per_position_acceptance"],
                   draftsmith_acceptance=d.get("per_position_acceptance"),
                   acceptance_matches=r.get("acceptance_matches"), max_difference=max(
                       (x for x in r.get("per_position_difference") or [] if x is not None), default=None))
    return row


def verdict(row: dict) -> str:
    """The table's word for one row: serves (lossless), refused (vLLM's error), or not run (why)."""
    if row.get("exported") is False:
        return f"export refused: {row['error']}"
    if row.get("target_ran") is False:  # the temporary folder of the tiny target says nothing in a table
        return "target not run: " + re.sub(r"the target /\S+ itself", "the target itself", row["error"])
    if not row.get("loaded"):
        return f"refused: {row['error']}"
    if not row.get("lossless"):
        return "loads, NOT lossless"
    return "serves, lossless"


def render(report: dict) -> str:
    kinds = report["kinds"]
    lines = [f"# Which families vLLM {report.get('vllm_version') or ''} serves, per kind of export".rstrip(), "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}; date {report['date']}.", "",
             "Tiny random targets of each family (4 layers, head_dim 32), heads trained a few steps on rows the "
             "target wrote, exported for vLLM and run by serve-check: greedy, "
             f"{report['prompts']} prompts, chain of {report['k']}.", "",
             "| family | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for fam, rows in report["families"].items():
        by = {r["kind"]: r for r in rows}
        lines.append(f"| `{fam}` | " + " | ".join(verdict(by[k]).replace("|", "/") if k in by else "—" for k in kinds)
                     + " |")
    lines += ["", "Acceptance, vLLM vs draftsmith per position (where served):", ""]
    for fam, rows in report["families"].items():
        for r in rows:
            if r.get("loaded") and r.get("vllm_acceptance") is not None:
                v = " / ".join(f"{x:.3f}" for x in r["vllm_acceptance"])
                d = " / ".join(f"{x:.3f}" for x in r.get("draftsmith_acceptance") or [])
                lines.append(f"- {fam} {r['kind']}: vLLM {v}; draftsmith {d}")
    return "\n".join(lines) + "\n"


KIND_NAMES = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1", "medusa": "Medusa", "draft": "draft model",
              "ngram": "n-gram (vLLM's own)"}
DOCS = ROOT / "docs" / "your-model.md"
BEGIN, END = "<!-- vllm-families: results/vllm-families/report.json -->", "<!-- /vllm-families -->"


def docs_table(report: dict) -> str:
    """The family x kind table of docs/your-model.md, rendered from the report: a cell says "serves" (loaded,
    lossless against vLLM's own greedy output), "refused" / "target not run" with vLLM's words in a note below,
    or "loads, NOT lossless"."""
    kinds = report["kinds"]
    notes: list[str] = []

    def cell(row: dict | None) -> str:
        if row is None:
            return "—"
        word = verdict(row)
        if word.startswith("serves"):
            return "serves"
        if ":" not in word:
            return word
        head, _, why = word.partition(": ")
        if why not in notes:
            notes.append(why)
        return f"{head} ({notes.index(why) + 1})"

    lines = ["| family | " + " | ".join(KIND_NAMES[k] for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
    for fam, rows in report["families"].items():
        by = {r["kind"]: r for r in rows}
        lines.append(f"| `{fam}` | " + " | ".join(cell(by.get(k)) for k in kinds) + " |")
    lines.append("")
    lines += [f"({i}) `{why.replace('`', chr(39))}`  " for i, why in enumerate(notes, 1)]
    return "\n".join(lines).rstrip() + "\n"


def write_docs(report: dict, path: Path = DOCS) -> None:
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + docs_table(report) + END + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from served_family import PROMPTS, K, TinyFamily
    from tiny_models import FAMILY_NAMES, build_tiny_tokenizer

    from draftsmith.outputs import atomic_write_json, atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/vllm-families")
    ap.add_argument("--families", nargs="+", default=list(FAMILY_NAMES))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--steps", type=int, default=20, help="training steps per artifact")
    ap.add_argument("--write-docs", action="store_true", help="only render the committed report into " + str(DOCS))
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.write_docs:
        write_docs(json.loads((out / "report.json").read_text()))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report.update(command="python scripts/vllm_families.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
                  machine=f"{platform.machine()}, {platform.processor() or 'cpu'}, {platform.node()}",
                  date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), kinds=list(a.kinds), k=K, prompts=len(PROMPTS))
    report.setdefault("families", {})
    tok = build_tiny_tokenizer()
    for fam in a.families:
        done = {r["kind"] for r in report["families"].get(fam, [])}
        todo = [k for k in a.kinds if k not in done]
        if not todo:
            print(f"{fam}: done", flush=True)
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"vllm-{fam}-") as tmp:
            try:
                family = TinyFamily(fam, tok, Path(tmp), kinds=[k for k in todo if k != "ngram"], steps=a.steps)
            except Exception as e:  # a family draftsmith cannot train on: every row says why
                err = f"{type(e).__name__}: {e}".splitlines()[0]
                report["families"][fam] = [{"kind": k, "exported": False, "error": f"training: {err}"} for k in todo]
                atomic_write_json(path, report)
                continue
            # the control first: it tells whether vLLM runs the target at all, and measures the plain output
            for kind in sorted(todo, key=lambda k: k != "ngram"):
                row = _cell(family, kind)
                report["vllm_version"] = row.get("vllm_version") or report.get("vllm_version")
                report["families"].setdefault(fam, []).append(row)
                atomic_write_json(path, report)
                print(f"{fam:12s} {kind:7s} {verdict(row)}", flush=True)
        print(f"{fam}: {time.perf_counter() - t0:.0f} s", flush=True)
    atomic_write_text(out / "report.md", render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
