"""How acceptance grows with data: train one method at several training-set sizes, same held-out rows and
same optimizer steps for every point, then evaluate each head with the speculative decoder.

    python scripts/learning_curve.py --method eagle --config configs/smollm2-135m/eagle3.yaml \\
        --data runs/b31/data --rows 67,134,268,536 --steps 150 --out runs/curve/eagle3 \\
        capture_cache=runs/b31/data/capture prompt_context=64

Each point is `draftsmith train METHOD --config C data=D train.train_rows=N train.max_steps=S ...` (the
command is printed and kept in curve.json): the first N rows of the training split in its seeded order, so
a smaller point's rows are part of a larger point's and the held-out split is the same for all
(data/batching.py split_rows). Two ways to spend compute, and they differ:
  --steps S     equal compute: every point takes S optimizer steps, so a small point sees its rows many
                times and a large one may not see all of its rows once (epochs < 1);
  --epochs E    equal epochs: a point of N rows takes ceil(E * N / rows per step) steps.
Every point records what it trained on: rows seen (steps x batch x grad_accum), epochs (rows seen / N) and
tokens trained on (epochs x the learned tokens of its N rows); the charts put tokens trained on the x-axis and
write each point's epochs beside it.

Each head is then evaluated on the default eval sets (`--eval-limit` prompts per domain): τ with the tree the
cost model cuts for this machine and with the GPU-sized tree, α, and losslessness. Held-out top-1 comes from
the training log's last evaluation (EAGLE: per TTT step; Medusa: per head).
Outputs in --out: one folder per point (artifact, training log, eval/), curve.json, curve.md (the table)
and curve.png. Rerunning skips the points whose artifact and evaluation are complete.

    python scripts/learning_curve.py together OUT.png runs/curve/eagle3-a runs/curve/eagle3-b
    python scripts/learning_curve.py replot runs/curve/eagle3-a [...]

draws finished curves in one chart; `replot` adds rows seen, epochs and tokens trained on to curves kept
without them (from each point's command: its config's batch size and the overrides) and redraws them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def final_summary(train_dir: Path) -> dict:
    """The run's final summary record (log.jsonl), with the log's path for messages under "_log"."""
    log_path = train_dir / "log.jsonl"
    summary = None
    for line in log_path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "summary":
            summary = rec
    if summary is None:
        raise SystemExit(f"{log_path}: no summary record (the run did not finish)")
    return {**summary, "_log": str(log_path)}


def held_out_top1(summary: dict) -> list[float]:
    """Top-1 per TTT step (EAGLE), per head (Medusa) or per block slot (DFlash: slot 1 is the first drafted
    token) from a run's final summary."""
    for key, first in (("eval/step{}/acc", 0), ("eval/head{}/top1", 0), ("eval/slot{}/acc", 1)):
        vals = []
        while key.format(first + len(vals)) in summary:
            vals.append(summary[key.format(first + len(vals))])
        if vals:
            return vals
    raise SystemExit(f"{summary['_log']}: the summary has no held-out top-1 (eval/step0/acc, eval/head0/top1, "
                     "eval/slot1/acc)")


def learned_tokens(dataset, eval_fraction: float, seed: int, n: int) -> int:
    """Learned tokens of the first n training rows: the split the job makes (data/batching.py)."""
    from draftsmith.data.batching import split_rows

    train, _ = split_rows(dataset, eval_fraction, seed, n)
    return int(sum(sum(m) for m in train["loss_mask"]))


def rows_per_step(config: str, overrides: list[str]) -> int:
    """Rows one optimizer step reads in one process: train.batch_size x train.grad_accum of the job config."""
    from draftsmith.config import load_config

    cfg = load_config(config, [o for o in overrides if o.split("=", 1)[0].startswith("train.")
                               and o.split("=", 1)[0] in ("train.batch_size", "train.grad_accum")])
    return cfg.train.batch_size * cfg.train.grad_accum


def trained_on(point: dict, per_step: int) -> dict:
    """Rows seen, epochs and tokens trained on of a point (equal-compute curves differ here, not in steps)."""
    seen = point["steps"] * per_step
    epochs = seen / point["rows"]
    return {"rows_per_step": per_step, "rows_seen": seen, "epochs": round(epochs, 3),
            "tokens_trained": int(round(epochs * point["learned_tokens"]))}


def _command_overrides(command: str) -> list[str]:
    return [t for t in command.split() if "=" in t and t.startswith("train.")]


def table(points: list[dict]) -> list[str]:
    lines = ["| rows | learned tokens | steps | epochs | tokens trained on | held-out top-1 (per step/head) | "
             "τ cut tree | τ GPU-sized tree | lossless |", "|---|---|---|---|---|---|---|---|---|"]
    for q in points:
        lines.append(f"| {q['rows']} | {q['learned_tokens']:,} | {q['steps']} | {q['epochs']:.2f} | "
                     f"{q['tokens_trained']:,} | {' / '.join(f'{v:.3f}' for v in q['held_out_top1'])} "
                     f"| {q['tau_cut']:.2f} | {q['tau_gpu'] or 0:.2f} | {q['lossless']} |")
    return lines


def _annotate(ax, points: list[dict], x: list[float], y: list[float], ends_only: bool = False) -> None:
    for i, (p, xi, yi) in enumerate(zip(points, x, y)):
        if not ends_only or i in (0, len(points) - 1):
            ax.annotate(f"{p['epochs']:.2g} ep", (xi, yi), textcoords="offset points", xytext=(3, 4), fontsize=6)


# what held_out_top1's entries follow
POSITION = {"eagle": "step", "medusa": "head", "dflash": "draft token", "dspark": "draft token"}


def plot(points: list[dict], out: Path, method: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["tokens_trained"] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(len(points[0]["held_out_top1"])):
        a.plot(x, [p["held_out_top1"][i] for p in points], "o-", label=f"{POSITION[method]} {i}")
    _annotate(a, points, x, [p["held_out_top1"][0] for p in points])
    a.set(xscale="log", xlabel="tokens trained on (epochs beside each point)", ylabel="held-out top-1",
          title="held-out top-1")
    a.legend(fontsize=8)
    b.plot(x, [p["tau_cut"] for p in points], "o-", label="tree cut for this CPU")
    b.plot(x, [p["tau_gpu"] for p in points], "s-", label="GPU-sized tree")
    _annotate(b, points, x, [p["tau_gpu"] or 0 for p in points])
    b.set(xscale="log", xlabel="tokens trained on (epochs beside each point)", ylabel="τ (tokens per target step)",
          title="accepted length τ")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_together(dirs: list[Path], out: Path) -> None:
    """Several finished curves (their curve.json) in one chart: step-0 top-1 and both τ against data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for d in dirs:
        pts = json.loads((d / "curve.json").read_text())["points"]
        x = [p["tokens_trained"] for p in pts]
        a.plot(x, [p["held_out_top1"][0] for p in pts], "o-", label=d.name)
        _annotate(a, pts, x, [p["held_out_top1"][0] for p in pts], ends_only=True)
        line = b.plot(x, [p["tau_gpu"] for p in pts], "s-", label=f"{d.name}, GPU-sized tree")[0]
        b.plot(x, [p["tau_cut"] for p in pts], "o--", color=line.get_color(), label=f"{d.name}, cut tree")
        _annotate(b, pts, x, [p["tau_gpu"] or 0 for p in pts], ends_only=True)
    a.set(xscale="log", xlabel="tokens trained on (epochs beside the first and last point)",
          ylabel="held-out top-1, step 0 (own split)")
    b.set(xscale="log", xlabel="tokens trained on (epochs beside the first and last point)",
          ylabel="τ on the eval sets")
    a.legend(fontsize=8)
    b.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def replot(folder: Path) -> None:
    """Add rows seen, epochs and tokens trained on to a kept curve.json (each point's batch from its config and
    command) and rewrite curve.json, curve.md and curve.png."""
    curve = json.loads((folder / "curve.json").read_text())
    for p in curve["points"]:
        per_step = rows_per_step(curve["config"], _command_overrides(p.get("command", "")))
        p.update(trained_on(p, per_step))
    (folder / "curve.json").write_text(json.dumps(curve, indent=1))
    (folder / "curve.md").write_text("\n".join(table(curve["points"])) + "\n")
    plot(curve["points"], folder / "curve.png", curve["method"])
    print(f"{folder}: " + ", ".join(f"{p['rows']} rows {p['epochs']:.2f} epochs" for p in curve["points"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["together"]:  # learning_curve.py together OUT.png DIR [DIR ...]
        plot_together([Path(d) for d in argv[2:]], Path(argv[1]))
        return 0
    if argv[:1] == ["replot"]:  # learning_curve.py replot DIR [DIR ...]
        for d in map(Path, argv[1:]):
            replot(d)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, choices=sorted(POSITION))
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--rows", required=True, help="training rows per point, comma-separated (e.g. 67,134,268,536)")
    spend = p.add_mutually_exclusive_group(required=True)
    spend.add_argument("--steps", type=int, help="optimizer steps for every point (equal compute)")
    spend.add_argument("--epochs", type=float, help="passes over its rows for every point (equal epochs)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--eval-limit", type=int, default=4, help="eval prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--domains", default="",
                   help="comma-separated: evaluate on these domains of the eval sets only (a point comparable "
                        "with curves measured before the eval sets had more domains: the same prompts per domain)")
    p.add_argument("--train-only", action="store_true",
                   help="train the missing points and stop (evaluate later, on a quiet machine: the cut tree is "
                        "chosen from timings)")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every point's training")
    a = p.parse_args(argv)
    from draftsmith import artifact
    from draftsmith.config import load_config
    from draftsmith.evaluation.after_training import EvalAfterTraining, evaluate_into_artifact
    from draftsmith.targets import load_target

    rows = sorted(int(n) for n in a.rows.split(","))
    domains = [d for d in a.domains.split(",") if d]
    cfg = load_config(a.config, [f"data={a.data}", *a.overrides])  # the preset's kind picks the class
    target = dataset = None
    if not a.train_only:
        from draftsmith.data.generate import load_distilled

        target = load_target(cfg.target)
        dataset = load_distilled(a.data, target)  # once: every point's learned tokens are counted from it
    exe = str(Path(sys.executable).parent / "draftsmith")
    a.out.mkdir(parents=True, exist_ok=True)
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    points = []
    for n in rows:
        steps = a.steps if a.steps is not None else max(1, math.ceil(a.epochs * n / per_step))
        head, run = a.out / f"rows{n}", a.out / f"rows{n}.train"
        cmd = [exe, "train", a.method, "--config", a.config, f"data={a.data}", *a.overrides,
               f"train.train_rows={n}", f"train.max_steps={steps}", f"output={head}", f"train.output_dir={run}",
               "evaluate.enabled=false", "train.progress=false", "train.save_every=50"]
        if not (head / artifact.MANIFEST).is_file():
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        if a.train_only:
            continue
        manifest = artifact.load_manifest(head)
        if not manifest.get("eval"):  # a trained artifact holds an empty eval until evaluated
            evaluate_into_artifact(head, target, a.method, EvalAfterTraining(
                limit_per_domain=a.eval_limit, max_new_tokens=a.max_new_tokens,
                domains=domains),
                command=" ".join(["python", "scripts/learning_curve.py", *argv]) + f"  (point rows={n})")
            manifest = artifact.load_manifest(head)
        report = json.loads((head / "eval" / "report.json").read_text())
        overall = report["overall"]
        summary = final_summary(run)
        point = {"rows": n, "learned_tokens": learned_tokens(dataset, cfg.eval_fraction, cfg.train.seed, n),
                 "steps": steps}
        points.append({
            **point, **trained_on(point, per_step), "train_wall_s": round(summary.get("wall_s", 0.0), 1),
            "held_out_top1": [round(v, 4) for v in held_out_top1(summary)],
            "tau_cut": overall["tau"], "tau_gpu": (overall.get("gpu_tree") or {}).get("tau"),
            "alpha": overall["alpha"], "lossless": overall["lossless"], "command": " ".join(cmd),
        })
        print(f"rows {n}: top-1 {points[-1]['held_out_top1']}, tau {overall['tau']:.2f} (cut) / "
              f"{points[-1]['tau_gpu'] or 0:.2f} (GPU-sized), lossless {overall['lossless']}", flush=True)
    if a.train_only:
        return 0
    evaluated = {"limit_per_domain": a.eval_limit, "max_new_tokens": a.max_new_tokens,
                 "domains": domains or "all"}
    (a.out / "curve.json").write_text(json.dumps({"method": a.method, "config": a.config, "data": a.data,
                                                   "overrides": a.overrides, "eval": evaluated, "points": points},
                                                  indent=1))
    lines = table(points)
    (a.out / "curve.md").write_text("\n".join(lines) + "\n")
    plot(points, a.out / "curve.png", a.method)
    print("\n".join(lines))
    print(f"curve: {a.out / 'curve.md'}, {a.out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
