"""`make bench` / `make bench-quick`: the numbers BENCHMARKS.md publishes, side by side in one run.

    python scripts/bench.py [--quick] [--artifact medusa:runs/medusa/smollm2-135m ...] [--prompts FILE ...]

1. data engine: continuous batching vs one prompt at a time vs HF `generate`, and with capture
   (`draftsmith.data.bench`, the same prompts in one process);
2. evaluation: n-gram and every artifact given, each against plain decoding (k = 0) and HF `generate`
   in the same run, per domain of ../shared/data/eval (and --prompts files).
Writes bench/results/<date>/ (engine.json, eval/<name>/report.{json,md,png}, summary.md). Training the
artifacts is not part of this script yet: pass the ones to measure with --artifact.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from draftsmith.cli import run_entry_point

ROOT = Path(__file__).resolve().parent.parent


def table(name: str, report: dict) -> str:
    lines = [f"### {name}", "", f"command: `{report.get('command', '')}`", "",
             "| domain | n | α | τ | τ from α | tokens/s | plain tokens/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(report["domains"].items()) + [("overall", report["overall"])]
    for domain, r in rows:
        def f(key, fmt, r=r):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, int | float) else "–"
        lines.append(f"| {domain} | {r.get('n_prompts', '')} | {f('alpha', '.3f')} | {f('tau', '.2f')} | "
                     f"{f('tau_predicted_from_alpha', '.2f')} | {f('tokens_per_s', '.1f')} | {f('baseline_tokens_per_s', '.1f')} | "
                     f"{f('speedup', '.2f')} | {r.get('lossless')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke budget (a few minutes)")
    parser.add_argument("--artifact", action="append", default=[], help="proposer spec, e.g. medusa:PATH")
    parser.add_argument("--prompts", nargs="*", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from draftsmith.data import bench as engine_bench
    from draftsmith.evaluation import evaluate, write_report
    from draftsmith.targets import load_target

    out = Path(args.out or ROOT / "bench" / "results" / dt.date.today().isoformat())
    out.mkdir(parents=True, exist_ok=True)
    n, max_new, limit = (8, 48, 2) if args.quick else (32, 128, 8)
    print(f"== data engine ({n} prompts, {max_new} new tokens)", flush=True)
    engine = engine_bench.main([str(n), str(max_new), f"cb:{n},cap:{n},hf:{min(n, 16)},cb:1"])
    (out / "engine.json").write_text(json.dumps(engine, indent=2))

    target = load_target("smollm2-135m")
    summary = [f"# bench {dt.date.today().isoformat()} ({'quick' if args.quick else 'full'})", "",
               "## data engine (tokens/s, same prompts, one process)", "", "```", json.dumps(engine, indent=2),
               "```", ""]
    for spec in ["ngram", *args.artifact]:
        name = spec.split(":")[0] if spec == "ngram" else spec.split(":")[0] + "-" + Path(spec.split(":", 1)[1]).name
        print(f"== evaluate {spec}", flush=True)
        tree = spec.split(":")[0] in ("medusa", "eagle")
        report = evaluate(target, spec, prompts=args.prompts, limit_per_domain=limit, max_new_tokens=max_new,
                          k=4, tree_from_proposer=tree, command=" ".join(sys.argv) + f"  # {spec}")
        write_report(report, out / "eval" / name)
        summary.append(table(name, report))
    (out / "summary.md").write_text("\n".join(summary))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_entry_point(main))
