"""The DSpark / DFlash depth sweep in one table: per trained drafter its steps (equal CPU by the train-step report),
its held-out metrics at the end of training, and its test-split τ from the evaluate reports (its own shape and the
GPU-sized tree); written as summary.json and printed as BENCHMARKS.md's table.

    python scripts/dspark_sweep_summary.py --runs runs/dspark/sweep --results results/dspark-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def held_out(run: Path) -> dict:
    """The last held-out evaluation of a training run's log (tau, per-slot accuracy, the confidence's ECE)."""
    rows = [json.loads(line) for line in (run.parent / f"{run.name}.train" / "log.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["type"] == "eval"][-1]
    slots = [round(last.get(f"slot{j}/acc", 0.0), 3) for j in range(1, 8)]
    out = {"step": last["step"], "tau": round(last["tau"], 3), "slot_acc": slots}
    if "conf/ece" in last:
        out["confidence_ece"] = round(last["conf/ece"], 3)
    return out


def test_split(results: Path) -> dict:
    """name -> {own: τ of its own shape, gpu: τ of its GPU-sized tree, chain: τ of its whole chain, lossless}."""
    out: dict = {}
    for rep in sorted(results.glob("eval-*/report.json")):
        r = json.loads(rep.read_text())
        o = r["overall"]
        main = r["proposer"]
        out.setdefault(main, {}).update(own=o["tau"], gpu=(o.get("gpu_tree") or {}).get("tau"),
                                        lossless=o["lossless"] and (o.get("gpu_tree") or {}).get("lossless", True),
                                        calibration=(o.get("calibration") or {}).get("ece"), report=str(rep))
        for name, c in (o.get("compare") or {}).items():
            key, _, shape = name.partition("@")
            out.setdefault(key, {})["chain" if shape.startswith("chain") else "own"] = c["tau"]
            if c.get("gpu_tree"):
                out[key]["gpu"] = c["gpu_tree"]["tau"]
            out[key]["lossless"] = (out[key].get("lossless", True) and c.get("lossless") and
                (c.get("gpu_tree") or {}).get("lossless", True))
            out[key].setdefault("report", str(rep))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, required=True)
    p.add_argument("--results", type=Path, required=True)
    a = p.parse_args(argv)
    steps = json.loads((a.results / "train-step" / "report.json").read_text())
    tests = test_split(a.results)
    rows = {}
    for run in sorted(d for d in a.runs.iterdir() if (d / "model.safetensors").is_file()):
        kind = json.loads((run / "manifest.json").read_text())["kind"]
        spec = f"{kind}:{run}"
        rows[run.name] = {"spec": spec, "held_out": held_out(run), "test": tests.get(spec, {})}
    summary = {"step_costs_s": {k: v["median_s"] for k, v in steps["steps"].items()}, "drafters": rows,
               "references": {k: v for k, v in tests.items() if k.startswith(("eagle:", "dflash:zoo"))}}
    (a.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, r in rows.items():
        t, h = r["test"], r["held_out"]
        print(f"| {name} | {h['step']} | {t.get('gpu')} | {t.get('chain', t.get('own'))} | {t.get('own')} | "
              f"{h['tau']} | {' / '.join(f'{v:.2f}' for v in h['slot_acc'])} | {h.get('confidence_ece', '–')} |")
    for name, t in summary["references"].items():
        print(f"| {name} | – | {t.get('gpu')} | – | {t.get('own')} | – | – | – |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
