"""On-policy training against more data, per CPU-hour: rounds of rollouts + replay training of an EAGLE-3
head, next to rounds of plain self-distillation on the same prompts, both warm-started from one head.

    python scripts/onpolicy_rounds.py --start runs/curve/eagle3-a600/rows536 --data runs/b31/data \\
        --prompts results/onpolicy-smollm2-135m/round1.yaml,results/onpolicy-smollm2-135m/round2.yaml \\
        --steps 150 --replay-weight 2 --out runs/onpolicy

Each round r of a lever takes the round's prompts (a data preset) and
  1. writes their rows: lever `onpolicy` with our speculative decoder and the lever's current head
     (`generation.engine=speculative`, data/engines/rollout.py: the target's rows plus where the head's draft was
     rejected); lever `data` with the batched engine (the same rows, no marks);
  2. merges them with everything the lever had (`draftsmith data merge`) and captures the merged rows
     (teacher-forced, `draftsmith data capture`);
  3. trains the lever's head on the merged rows for --steps, warm-started from its previous head, with
     `replay_weight` (onpolicy) or without (data);
  4. evaluates the head on the shared eval sets (τ with the cut and the GPU-sized tree, α, lossless).
Steps 1-3 are timed (wall-clock on this machine's 2 cores: CPU-hours = seconds x 2 / 3600); evaluation is
measurement, not cost. Outputs in --out: the levers' folders, rounds.json, rounds.md and rounds.png.
Rerunning skips the stages whose outputs are complete (their recorded times are kept).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LEVERS = ("data", "onpolicy")
CAPTURE = ["capture.enabled=true", "capture.layers=[2,15,27]", "capture.topk=1", "capture.last_hidden=true"]


def run(cmd: list[str], done: bool, times: dict, key: str) -> None:
    """Run a stage unless its output is complete; record its wall-clock seconds under `key`."""
    if done:
        if key not in times:
            raise SystemExit(f"{key}: its output is complete but no time was recorded for it; remove it to rerun")
        return
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    times[key] = round(time.perf_counter() - t0, 1)


def summary_of(train_dir: Path) -> dict:
    for line in reversed((train_dir / "log.jsonl").read_text().splitlines()):
        rec = json.loads(line)
        if rec.get("type") == "summary":
            return rec
    raise SystemExit(f"{train_dir}/log.jsonl: no summary record (the run did not finish)")


def top1(summary: dict) -> list[float]:
    out, j = [], 0
    while f"eval/step{j}/acc" in summary:
        out.append(round(summary[f"eval/step{j}/acc"], 4))
        j += 1
    return out


def point(head: Path) -> dict:
    report = json.loads((head / "eval" / "report.json").read_text())["overall"]
    return {"tau_cut": report["tau"], "tau_gpu": (report.get("gpu_tree") or {}).get("tau"), "alpha": report["alpha"],
            "lossless": report["lossless"]}


def plot(rounds: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for lever, pts in rounds.items():
        x = [p["cpu_hours"] for p in pts]
        line = a.plot(x, [p["tau_gpu"] for p in pts], "s-", label=f"{lever}, GPU-sized tree")[0]
        a.plot(x, [p["tau_cut"] for p in pts], "o--", color=line.get_color(), label=f"{lever}, cut tree")
        b.plot(x, [p["held_out_top1"][0] if p.get("held_out_top1") else None for p in pts], "o-", label=lever)
    a.set(xlabel="CPU-hours spent after the start head (2 cores)", ylabel="τ on the shared eval sets")
    b.set(xlabel="CPU-hours spent after the start head (2 cores)", ylabel="held-out top-1, step 0")
    a.legend(fontsize=7)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", type=Path, required=True, help="the EAGLE-3 head both levers start from")
    p.add_argument("--data", type=Path, required=True, help="the rows the start head was trained on (captured)")
    p.add_argument("--prompts", required=True, help="one data preset per round, comma-separated")
    p.add_argument("--config", default="configs/smollm2-135m/eagle3.yaml")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--replay-weight", type=float, default=2.0)
    p.add_argument("--k", type=int, default=0, help="the rollouts' chain length; 0: the head's tree cut by the cost "
                   "model measured here, as the decoder runs on this machine (generation.tree_auto)")
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--eval-limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every training")
    a = p.parse_args(argv)
    from draftsmith import artifact
    from draftsmith.evaluation.after_training import EvalAfterTraining, evaluate_into_artifact
    from draftsmith.targets import load_target

    exe = str(Path(sys.executable).parent / "draftsmith")
    a.out.mkdir(parents=True, exist_ok=True)
    record_path = a.out / "rounds.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"times": {}}
    times = record["times"]
    prompts = a.prompts.split(",")
    target = load_target("smollm2-135m")
    start = point(a.start)
    start.update(cpu_hours=0.0, round=0, head=str(a.start), held_out_top1=None)
    rounds: dict[str, list[dict]] = {}
    for lever in a.levers.split(","):
        head, data = a.start, a.data
        pts = [dict(start)]
        spent = 0.0
        for r, preset in enumerate(prompts, 1):
            d = a.out / lever / f"round{r}"
            rows, merged, new_head, train_dir = d / "rows", d / "data", d / "head", d / "head.train"
            gen = [exe, "data", "generate", "--config", preset, f"output_dir={rows}", "--no-progress"]
            if lever == "onpolicy":
                # float32: one row at a time, the verifier's few-row products are fastest in float32 here
                # (targets/gemm.py); the batched engine is fastest in bf16 (generation.dtype: auto)
                gen += ["generation.engine=speculative", f"generation.proposer=eagle:{head}",
                        "generation.dtype=float32"]
                gen += ["generation.tree_auto=true"] if a.k == 0 else [f"generation.k={a.k}"]
            run(gen, (rows / "provenance.json").is_file(), times, f"{lever}/{r}/generate")
            run([exe, "data", "merge", str(data), str(rows), "--out", str(merged)],
                (merged / "provenance.json").is_file(), times, f"{lever}/{r}/merge")
            prov = json.loads((merged / "provenance.json").read_text())
            run([exe, "data", "capture", "--config", preset, f"output_dir={merged}", "--no-progress", *CAPTURE],
                bool(prov.get("capture")), times, f"{lever}/{r}/capture")
            train = [exe, "train", "eagle", "--config", a.config, f"data={merged}", f"capture_cache={merged}/capture",
                     "prompt_context=64", f"output={new_head}", f"train.output_dir={train_dir}",
                     f"train.warm_start={head}", f"train.max_steps={a.steps}", f"train.lr={a.lr}",
                     "train.warmup_steps=10", "evaluate.enabled=false", "train.progress=false",
                     f"replay_weight={a.replay_weight if lever == 'onpolicy' else 0}", *a.overrides]
            run(train, (new_head / artifact.MANIFEST).is_file(), times, f"{lever}/{r}/train")
            record_path.write_text(json.dumps(record, indent=1))
            if not artifact.load_manifest(new_head).get("eval"):
                evaluate_into_artifact(new_head, target, "eagle", EvalAfterTraining(
                    limit_per_domain=a.eval_limit, max_new_tokens=a.max_new_tokens),
                    command=" ".join(["python", "scripts/onpolicy_rounds.py", *argv]) + f"  ({lever}, round {r})")
            spent += sum(times[f"{lever}/{r}/{s}"] for s in ("generate", "merge", "capture", "train"))
            gp = json.loads((rows / "provenance.json").read_text())["timing"]
            q = point(new_head)
            q.update(round=r, head=str(new_head), cpu_hours=round(spent * 2 / 3600, 3),
                     held_out_top1=top1(summary_of(train_dir)), rows_added=json.loads(
                         (merged / "provenance.json").read_text())["merge"]["rows"][-1],
                     generate_tok_s=gp.get("tokens_per_s"), rollout=gp.get("rollout"),
                     stage_seconds={s: times[f"{lever}/{r}/{s}"] for s in ("generate", "merge", "capture", "train")})
            pts.append(q)
            print(f"{lever} round {r}: τ {q['tau_cut']:.2f} cut / {q['tau_gpu'] or 0:.2f} GPU-sized, top-1 "
                  f"{q['held_out_top1']}, {q['cpu_hours']:.3f} CPU-h", flush=True)
            head, data = new_head, merged
        rounds[lever] = pts
    record.update(rounds=rounds, args={k: str(v) for k, v in vars(a).items()})
    record_path.write_text(json.dumps(record, indent=1))
    lines = ["| lever | round | CPU-hours | rows added | generate tok/s | rollout τ | held-out top-1 (steps 0-5) "
             "| τ cut tree | τ GPU-sized tree | α | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lever, pts in rounds.items():
        for q in pts:
            roll = (q.get("rollout") or {}).get("tau")
            lines.append(f"| {lever} | {q['round']} | {q['cpu_hours']:.3f} | {q.get('rows_added', '–')} "
                         f"| {q.get('generate_tok_s') or '–'} | {f'{roll:.2f}' if roll else '–'} "
                         f"| {' / '.join(f'{v:.3f}' for v in q['held_out_top1'] or []) or '–'} | {q['tau_cut']:.2f} "
                         f"| {q['tau_gpu'] or 0:.2f} | {q['alpha']:.3f} | {q['lossless']} |")
    (a.out / "rounds.md").write_text("\n".join(lines) + "\n")
    plot(rounds, a.out / "rounds.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
