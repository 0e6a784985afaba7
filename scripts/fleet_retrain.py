"""Retraining from what the fleet served against re-running the target on the same traffic, on smollm2-135m.

    python scripts/fleet_retrain.py --out results/fleet-retrain-smollm2-135m

1. The fleet (vLLM's CPU build, measured, not timed): the traffic prompts (two domains: `math`, gsm8k's training
   questions; `general`, self-instruct's seed tasks) go as chat completions to a capture replica (`vllm serve`
   with extract_hidden_states, draftsmith's KV connector and the traffic middleware), which answers them and
   keeps their hidden states. The held-out prompts (the eval test split's gsm8k and alpaca) go to a replica
   serving v1 — the shipped head zoo/smollm2-135m/eagle3-broad — with per-request metrics: α per domain
   before, as vLLM counts it.
2. Three ways to a candidate, each in its own process (wall time, peak RSS), in rotating order, --repeats each:
     served  the captures of the traffic (joined to the traffic log by response id) imported into a dataset and
             capture cache (data/served.py: the target's final norm and lm_head run, no decoder layer), then
             training from that cache;
     online  what `draftsmith retrain` does without `traffic.captures`: the same prompts answered by the target
             (draftsmith's batched engine, greedy), then training with the target run in every step;
     regen   the cheapest way to re-run the target: answered by the engine capturing the layers while it writes,
             then training from that cache.
   Training: EAGLE-3 from the shipped preset, warm-started from v1, --steps steps of batch 8.
3. τ and α of the three candidates on the held-out prompts (draftsmith's evaluator, chain of 4).
4. The served candidate exported and served by vLLM with per-request metrics on the held-out prompts: α per
   domain after, as vLLM counts it.
Outputs in --out: report.json, report.md. A stage whose output is complete is not run again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "zoo" / "smollm2-135m" / "eagle3-broad"
PRESET = ROOT / "configs" / "smollm2-135m" / "eagle3.yaml"
LAYERS = [1, 14, 26]  # the preset's EAGLE-3 layers (default_eagle3_layers(30))
K = 3


def traffic_prompts(n: int) -> list[dict]:
    """n/2 math and n/2 general chat prompts from the training sources (never the eval splits)."""
    def read(name: str, key: str) -> list[str]:
        with gzip.open(ROOT / "prompts" / "train" / name, "rt") as f:
            return [json.loads(line)[key] for line in f]
    math = read("gsm8k_train.jsonl.gz", "question")[: n // 2]
    general = [p for p in read("self_instruct_seed_tasks.jsonl.gz", "instruction") if len(p) > 20][: n - n // 2]
    return [{"domain": "math", "prompt": p} for p in math] + [{"domain": "general", "prompt": p} for p in general]


def held_prompts(n: int) -> list[dict]:
    out = []
    for name, domain in (("gsm8k", "math"), ("alpaca", "general")):
        rows = [json.loads(line) for line in (ROOT / "prompts/eval/test" / f"{name}.jsonl").read_text().splitlines()]
        out += [{"domain": domain, "prompt": r["turns"][0]} for r in rows[:n]]
    return out


def chat(server, rows: list[dict], max_new: int, concurrency: int = 4) -> None:
    """Send the rows as a client fleet does, `concurrency` at a time; each answer bounded in time."""
    from draftsmith import net

    def one(r):
        body = {"model": server.served_name, "messages": [{"role": "user", "content": r["prompt"]}],
                "max_tokens": max_new, "temperature": 0.0, "domain": r["domain"]}
        net.request(f"{server.base_url}/chat/completions", json.dumps(body).encode(), deadline=600.0,
                    max_bytes=net.ANSWER_MAX_BYTES, headers={"Content-Type": "application/json"}).json()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, rows))


def wait_written(folder: Path, pattern: str, n: int, lines: bool, timeout: float = 120.0) -> None:
    def count():
        files = sorted(folder.glob(pattern))
        return sum(len(f.read_text().splitlines()) for f in files) if lines else len(files)
    end = time.monotonic() + timeout
    while count() < n and time.monotonic() < end:
        time.sleep(0.5)
    if count() < n:
        raise SystemExit(f"{folder}: {count()} of {n} written")


def serve(target, out: Path, name: str, spec: dict, extra: tuple, traffic: Path, rows: list[dict], max_new: int,
          wait: tuple | None = None) -> None:
    """One replica, started, fed `rows`, its logs (and `wait`: (folder, pattern, n) of files) written, stopped."""
    from draftsmith.data.engines.vllm_server import VllmServer

    log = ("--middleware", "draftsmith.fleet.middleware.TrafficLog")
    with VllmServer(target.folder, out / f"{name}.log", speculative_config=spec, served_name="fleet",
                    max_model_len=2048, extra=(*log, *extra), env={"DRAFTSMITH_TRAFFIC_DIR": str(traffic)}) as srv:
        chat(srv, rows, max_new)
        wait_written(traffic, "traffic-*.jsonl", len(rows), lines=True)
        if wait:
            wait_written(*wait, lines=False)


def fleet(a, target) -> dict:
    """Stage 1: the capture replica serves the traffic; v1 serves the held-out prompts (α before)."""
    from draftsmith.data.served import serving_config, vllm_layer_ids
    from draftsmith.export.api import export_artifact
    from draftsmith.export.serve_check import speculative_config
    from draftsmith.planning.production import production_alpha

    out = a.out
    traffic = traffic_prompts(a.traffic)
    if not (out / "captures").is_dir() or len(list((out / "captures").glob("*.safetensors"))) < len(traffic):
        spec, kv = serving_config(vllm_layer_ids(LAYERS, target.num_layers), out / "captures")
        t0 = time.perf_counter()
        serve(target, out, "capture-replica", spec, ("--kv-transfer-config", json.dumps(kv)), out / "traffic",
              traffic, a.max_new, (out / "captures", "*.safetensors", len(traffic)))
        (out / "capture_seconds.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}))
    if not (out / "v1-vllm").is_dir():
        export_artifact(V1, "vllm", out / "v1-vllm", target, num_speculative_tokens=K)
    if not list((out / "traffic-v1").glob("traffic-*.jsonl")):
        serve(target, out, "v1-replica", speculative_config(out / "v1-vllm", K),
              ("--per-request-spec-decode-metrics", "detailed"), out / "traffic-v1", held_prompts(a.held), a.max_new)
    return production_alpha(out / "traffic-v1")


WAYS = ("served", "online", "regen")


def train_overrides(a, run: Path, data: Path) -> list[str]:
    cache = [f"capture_cache={data / 'capture'}"] if (data / "capture").is_dir() else []  # else: online
    return [f"target={a.target}", f"data={data}", *cache, f"output={run / 'candidate'}",
            f"train.output_dir={run / 'train'}", f"train.max_steps={a.steps}", f"train.warm_start={V1}",
            "train.resume=never", "train.progress=false", "evaluate.enabled=false", "train.save_every=0"]


def path_served(a, run: Path, target) -> dict:
    from draftsmith.data.served import import_served
    from draftsmith.retrain.traffic import read_traffic

    t0 = time.perf_counter()
    sample = read_traffic(a.out / "traffic", window_days=3650)
    domains = {r.request_id: r.domain for r in sample.rows if r.request_id}
    import_served(a.out / "captures", target, run / "data", LAYERS, topk=1, last_hidden=True, logsumexp=True,
                  domains=domains, only=set(domains), hidden_dtype=target.dtype, progress=False)
    return {"data_seconds": time.perf_counter() - t0}


def path_regen(a, run: Path, target, capture: bool = True) -> dict:
    import dataclasses

    from draftsmith.data import generate_dataset
    from draftsmith.data.config import DomainRule, SourceConfig
    from draftsmith.data.generate import load_data_config

    prompts = run / "traffic.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [r["prompt"]], "category": r["domain"]}) + "\n"
                               for r in traffic_prompts(a.traffic)))
    cap = ["capture.enabled=true", f"capture.layers={LAYERS}", "capture.topk=1", "capture.last_hidden=true",
           "capture.dtype=float32"] if capture else ["capture.enabled=false"]
    preset = load_data_config(str(ROOT / "configs" / "smollm2-135m" / "data.yaml"),
                              [f"generation.max_new_tokens={a.max_new}", *cap])
    source = SourceConfig(name="traffic", type="jsonl", path=str(prompts), turns="turns", domain="traffic",
                          domain_rules=[DomainRule("category", f"^{d}$", d) for d in ("math", "general")])
    t0 = time.perf_counter()
    generate_dataset(dataclasses.replace(preset, sources=[source], output_dir=str(run / "data"), target=a.target,
                                         max_rows=None), target, progress=False)
    return {"data_seconds": time.perf_counter() - t0}


def one_path(a) -> None:
    """`path NAME RUN`: one timed run in this process (the parent reads its wall time and peak RSS)."""
    from draftsmith.runner.train import train_method
    from draftsmith.targets import load_target

    run = Path(a.run)
    t0 = time.perf_counter()
    target = load_target(a.target)
    timing = {"load_seconds": time.perf_counter() - t0}
    if a.name == "served":
        timing.update(path_served(a, run, target))
    else:
        timing.update(path_regen(a, run, target, capture=a.name == "regen"))
    t1 = time.perf_counter()
    train_method("eagle", str(PRESET), train_overrides(a, run, run / "data"))
    timing["train_seconds"] = time.perf_counter() - t1
    timing["seconds"] = time.perf_counter() - t0
    timing["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    (run / "timing.json").write_text(json.dumps(timing, indent=1))


def timed_runs(a) -> list[dict]:
    """Stage 2: the ways in rotating order (served, online, regen; online, regen, served; ...), each a fresh
    process."""
    order = [WAYS[(r + i) % len(WAYS)] for r in range(a.repeats) for i in range(len(WAYS))]
    out = []
    for i, name in enumerate(order):
        run = a.out / "runs" / f"{i:02d}-{name}"
        if not (run / "timing.json").is_file():
            run.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, __file__, "path", name, str(run), "--out", str(a.out), "--target", a.target,
                            "--traffic", str(a.traffic), "--max-new", str(a.max_new), "--steps", str(a.steps)],
                           check=True)
        out.append({"name": name, "run": str(run), **json.loads((run / "timing.json").read_text())})
        print(f"{name}: {out[-1]['seconds']:.0f} s, peak {out[-1]['peak_rss_gb']:.2f} GB", flush=True)
    return out


def candidates(a, runs: list[dict]) -> dict:
    """Stage 3: τ and α of the first candidate of each way on the held-out prompts, side by side."""
    from draftsmith.evaluation import evaluate
    from draftsmith.targets import load_target

    held = a.out / "held.jsonl"
    held.write_text("".join(json.dumps({"turns": [r["prompt"]], "category": r["domain"]}) + "\n"
                            for r in held_prompts(a.held)))
    target, out = load_target(a.target), {}
    for name in WAYS:
        run = Path(next(r["run"] for r in runs if r["name"] == name))
        rep = evaluate(target, f"eagle:{run / 'candidate'}", prompts=[str(held)], max_new_tokens=64, k=4,
                       cost_model=False, repeats=1, remeasure=0)
        out[name] = {"candidate": str(run / "candidate"), "tau": rep["overall"]["tau"],
                     "alpha": rep["overall"]["alpha"], "lossless": rep["overall"].get("lossless"),
                     "domains": {d: {"alpha": v["alpha"], "tau": v["tau"]} for d, v in rep["domains"].items()}}
    return out


def after(a, cand: Path) -> dict:
    """Stage 4: the served candidate as the fleet serves it; vLLM's per-request α on the held-out prompts."""
    from draftsmith.export.api import export_artifact
    from draftsmith.export.serve_check import speculative_config
    from draftsmith.planning.production import production_alpha
    from draftsmith.targets import load_target

    target = load_target(a.target)
    if not (a.out / "v2-vllm").is_dir():
        export_artifact(cand, "vllm", a.out / "v2-vllm", target, num_speculative_tokens=K)
    if not list((a.out / "traffic-v2").glob("traffic-*.jsonl")):
        serve(target, a.out, "v2-replica", speculative_config(a.out / "v2-vllm", K),
              ("--per-request-spec-decode-metrics", "detailed"), a.out / "traffic-v2", held_prompts(a.held), a.max_new)
    return production_alpha(a.out / "traffic-v2")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def summary(runs: list[dict]) -> dict:
    out = {}
    for name in WAYS:
        mine = [r for r in runs if r["name"] == name]
        out[name] = {k: _median([r[k] for r in mine]) for k in ("seconds", "data_seconds", "train_seconds",
                                                                 "load_seconds", "peak_rss_gb")}
    for base in ("online", "regen"):
        out[f"speedup_vs_{base}"] = out[base]["seconds"] / out["served"]["seconds"]
        out[f"data_speedup_vs_{base}"] = out[base]["data_seconds"] / out["served"]["data_seconds"]
    return out


def render(r: dict) -> str:
    s, c = r["summary"], r["candidates"]
    lines = [f"# Retraining from the fleet's states ({r['date']})", "", f"`{r['command']}`", "",
             f"Machine: {r['machine']}. Traffic: {r['config']['traffic']} prompts (math, general), answers of at most "
             f"{r['config']['max_new']} tokens; training: EAGLE-3 preset, {r['config']['steps']} steps, warm start "
             f"from v1; {r['config']['repeats']} runs of each way, alternating (medians).", "",
             "| way | wall s | data s | train s | peak RSS GB | candidate τ | α |", "|---|---|---|---|---|---|---|"]
    for name, label in (("served", "the fleet's states (data/served.py)"),
                        ("online", "re-run the target: regenerate, target in every step (retrain today)"),
                        ("regen", "re-run the target: regenerate capturing, train from the cache")):
        lines.append(f"| {label} | {s[name]['seconds']:.0f} | {s[name]['data_seconds']:.0f} | "
                     f"{s[name]['train_seconds']:.0f} | {s[name]['peak_rss_gb']:.2f} | {c[name]['tau']:.3f} | "
                     f"{c[name]['alpha']:.3f} |")
    lines += ["", f"Served states against retraining today: {s['speedup_vs_online']:.2f}x (data stage "
              f"{s['data_speedup_vs_online']:.1f}x); against the cheapest re-run: {s['speedup_vs_regen']:.2f}x (data "
              f"stage {s['data_speedup_vs_regen']:.1f}x). "
              f"τ served / online {c['served']['tau'] / c['online']['tau']:.3f}, "
              f"served / regen {c['served']['tau'] / c['regen']['tau']:.3f}.", "",
              "| domain | vLLM α v1 (before) | vLLM α v2 (after) |", "|---|---|---|"]
    for d in sorted(r["vllm_before"]["domains"]):
        b, a_ = r["vllm_before"]["domains"][d]["alpha"], r["vllm_after"]["domains"].get(d, {}).get("alpha")
        lines.append(f"| {d} | {b:.3f} | {a_:.3f} |" if a_ is not None else f"| {d} | {b:.3f} | – |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # fleet: stage 1 only (vLLM's measurements, no timing: it may run beside other work); all: every stage
    p.add_argument("stage", nargs="?", default="all", choices=["all", "fleet", "path"])
    p.add_argument("name", nargs="?")
    p.add_argument("run", nargs="?")
    p.add_argument("--out", type=Path, default=Path("runs/fleet-retrain"))
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--traffic", type=int, default=160, help="traffic prompts (half math, half general)")
    p.add_argument("--held", type=int, default=12, help="held-out prompts per domain")
    p.add_argument("--max-new", type=int, default=96, help="tokens per answer")
    p.add_argument("--steps", type=int, default=40, help="training steps (batch 8): two epochs of 160 rows")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    if a.stage == "path":
        return one_path(a)
    import platform

    from draftsmith.targets import load_target

    a.out.mkdir(parents=True, exist_ok=True)
    before = fleet(a, load_target(a.target))
    if a.stage == "fleet":
        return print(json.dumps({d: r["alpha"] for d, r in before["domains"].items()}))
    runs = timed_runs(a)
    cands = candidates(a, runs)
    served = next(r for r in runs if r["name"] == "served")
    report = {"date": time.strftime("%Y-%m-%d"), "command": "python scripts/fleet_retrain.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.platform()}, {__import__('os').cpu_count()} CPUs", "config": {
                  "traffic": a.traffic, "held": a.held, "max_new": a.max_new, "steps": a.steps, "repeats": a.repeats,
                  "layers": LAYERS, "v1": str(V1.relative_to(ROOT)), "k_vllm": K},
              "capture_replica_seconds": json.loads((a.out / "capture_seconds.json").read_text())["seconds"],
              "runs": runs, "summary": summary(runs), "candidates": cands, "vllm_before": before,
              "vllm_after": after(a, Path(served["run"]) / "candidate")}
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    (a.out / "report.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
