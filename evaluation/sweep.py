"""Temperature sweep: the same proposer, prompts and seeds evaluated at several sampling temperatures.

`draftsmith evaluate --proposer P --temperature 0 0.7 1.0` lands here. Each temperature is a full
evaluation (evaluation/evaluate.py) written to `<out>/T=<t>/`; the target and the proposer are loaded once.
At temperature 0 losslessness is checked token for token; above it the verifier's sampling rules keep the
target's distribution (tested by the chi-square tests in tests/test_decoding.py), and the report says
`lossless: None` (not checkable per prompt). The sweep summary (`sweep.json`, `sweep.md`, `sweep.png`)
shows α, τ and speedup per domain against temperature and the change of α from the first temperature.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from draftsmith.evaluation.config import EvalConfig
from draftsmith.formatting import fmt_num, md_cell
from draftsmith.outputs import atomic_write_json, atomic_write_text, save_figure

log = logging.getLogger(__name__)


def sweep_temperatures(cfg: EvalConfig, command: str | None = None, write: bool = True) -> dict:
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report
    from draftsmith.targets import load_target

    temps = list(cfg.temperatures or [cfg.temperature])
    target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)
    prop = build_proposer(cfg.proposer, target, **({"k": cfg.k} if cfg.proposer.startswith("multi") else {}))
    runs = {}
    for i, t in enumerate(temps):
        log.info("temperature sweep: %d/%d, temperature %g", i + 1, len(temps), t)
        one = dataclasses.replace(cfg, temperature=float(t), temperatures=None,
                                  cost_model=cfg.cost_model and i == 0)
        report = evaluate(target, prop, config=one, command=command)
        report["proposer"] = cfg.proposer
        if write:
            write_report(report, Path(cfg.out) / f"T={t:g}")
        runs[f"{t:g}"] = report
    summary = summarize(runs, cfg.proposer, command)
    if write:
        out = Path(cfg.out)
        atomic_write_json(out / "sweep.json", summary)
        atomic_write_text(out / "sweep.md", render(summary))
        plot(summary, out / "sweep.png")
    return summary


def summarize(runs: dict[str, dict], proposer: str, command: str | None) -> dict:
    temps = list(runs)
    first = runs[temps[0]]
    domains = sorted({d for r in runs.values() for d in r["domains"]}) + ["overall"]
    table: dict[str, dict] = {}
    for d in domains:
        row = {}
        for t, r in runs.items():
            x = r["overall"] if d == "overall" else r["domains"].get(d, {})
            row[t] = {k: x.get(k) for k in ("alpha", "tau", "speedup", "tokens_per_s", "lossless")}
        for key in ("alpha", "tau"):  # for trees α is per node; τ is the number to compare
            x0 = row[temps[0]][key]
            for t in temps:
                x = row[t][key]
                row[t][f"{key}_change"] = (x - x0) if x is not None and x0 is not None else None
        table[d] = row
    return {"kind": "temperature_sweep", "proposer": proposer, "target": first["target"]["name"],
            "command": command, "date": first["date"], "machine": first["machine"], "temperatures": temps,
            "settings": {k: v for k, v in first["settings"].items() if k != "temperature"}, "domains": table}


def render(summary: dict) -> str:
    temps = summary["temperatures"]
    lines = [f"# Temperature sweep: {md_cell(summary['proposer'])} on {md_cell(summary['target'])}", "",
             f"- date: {summary['date']}", f"- command: `{md_cell(summary['command'])}`", "",
             "| domain | " + " | ".join(f"T={t}: α / τ / speedup" for t in temps) +
             f" | Δα (T={temps[-1]} vs T={temps[0]}) | Δτ |",
             "|---|" + "---|" * (len(temps) + 2)]
    for d, row in summary["domains"].items():
        cells = [f"{fmt_num(row[t]['alpha'])} / {fmt_num(row[t]['tau'])} / {fmt_num(row[t]['speedup'])}" for t in temps]
        last = row[temps[-1]]
        lines.append(f"| {md_cell(d)} | " + " | ".join(cells)
                     + f" | {fmt_num(last['alpha_change'])} | {fmt_num(last['tau_change'])} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = summary["temperatures"]
    xs = [float(t) for t in temps]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.6))
    for d, row in summary["domains"].items():
        lw = 2.5 if d == "overall" else 1.2
        a1.plot(xs, [row[t]["alpha"] or 0 for t in temps], marker="o", label=d, linewidth=lw)
        a2.plot(xs, [row[t]["speedup"] or 0 for t in temps], marker="o", label=d, linewidth=lw)
    a1.set(xlabel="temperature", ylabel="α", title="acceptance vs temperature", ylim=(0, 1))
    a2.set(xlabel="temperature", ylabel="speedup", title="speedup vs temperature")
    a2.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    a1.legend(fontsize=7)
    fig.suptitle(summary["proposer"], fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
