"""`make demo`: the main job on the embedded default target, end to end, in under 40 minutes on 2 cores.

    target  load smollm2-135m (dequantised once, then from the safetensors cache)
    data    the target answers a mixed prompt set (math, NLP tasks, general, code) itself
    train   Medusa heads on the frozen target through the one training loop, from the hidden states the target
            computed while it wrote the data (the offline capture cache)
    eval    plain decoding and HF generate vs n-gram lookup vs Medusa (chain and tree) vs the EAGLE-3 head
            shipped in zoo/ (trained on the broad set, longer than a demo can), side by side in one run, per
            domain of the dev split: α, τ, speedup, lossless (against HF generate). On a machine other jobs
            keep busy throughout, the evaluation says so at once and decodes each prompt once: α, τ and
            losslessness are measured, speedups are not (a busy machine cannot time them validly)
    export  the Medusa heads in vLLM's layout, verified by reloading

Every stage is resumable: rerunning `make demo` skips what is already complete. Outputs: runs/demo/.
Budget knobs: DEMO_ROWS, DEMO_STEPS, DEMO_EVAL_LIMIT (environment variables).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

from draftsmith.cli import run_entry_point
from draftsmith.targets.device import release_memory

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("DEMO_OUT", ROOT / "runs" / "demo"))
ROWS = int(os.environ.get("DEMO_ROWS", "96"))
STEPS = int(os.environ.get("DEMO_STEPS", "40"))
EVAL_LIMIT = int(os.environ.get("DEMO_EVAL_LIMIT", "1"))  # 8 domains: one prompt each keeps the stage as long as it was


def stage(name: str):
    def deco(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name} ===", flush=True)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            release_memory()  # what the stage freed goes back to the system before the next one grows
            print(f"--- {name}: done in {time.perf_counter() - start:.0f} s, peak resident memory so far "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB", flush=True)
            return result
        return run
    return deco


@stage("target")
def load():
    from draftsmith.targets import load_target

    target = load_target("smollm2-135m")
    fp = target.fingerprint()
    print(f"smollm2-135m: {sum(p.numel() for p in target.model.parameters()) / 1e6:.1f}M params, "
          f"vocab {fp['vocab_size']}, {fp['architecture']['num_hidden_layers']} layers, "
          f"tokenizer {fp['tokenizer_hash'][:12]}, cached in {target.folder}")
    return target


@stage("data: self-distillation by the target")
def data(target) -> Path:
    from draftsmith.data import generate_dataset, read_provenance
    from draftsmith.data.generate import load_data_config

    out = OUT / "data"
    if not (out / "provenance.json").is_file():
        # the post-norm last hidden state the heads read is kept while the target writes: training reads it
        # from this capture cache instead of running the target again in every step
        cfg = load_data_config(ROOT / "configs/smollm2-135m/data.yaml", [
            f"output_dir={out}", f"max_rows={ROWS}", "generation.max_new_tokens=96", "capture.enabled=true",
            "capture.last_hidden=true",
            # the KV cache is preallocated for every row of the batch (30 layers, float32 where the CPU has no
            # native bf16): the preset's 96 rows took the demo to 4.35 GB resident, 48 keep it well under 4 GB
            "generation.batch_size=48"])
        generate_dataset(cfg, target)
    prov = read_provenance(out)
    print(f"dataset: {out} ({prov.get('counts', {})})")
    return out


@stage("train: Medusa heads on the frozen target")
def train(target, data_path: Path) -> Path:
    from draftsmith.config import load_config
    from draftsmith.data.generate import CAPTURE_DIR
    from draftsmith.medusa.job import MedusaJobConfig
    from draftsmith.runner.train import run

    out = OUT / "medusa"
    if (out / "manifest.json").is_file():
        print(f"artifact exists: {out}")
        return out
    cfg = load_config(ROOT / "configs/smollm2-135m/medusa.yaml", [
        f"data={data_path}", f"output={out}", f"train.output_dir={OUT / 'medusa.train'}",
        f"train.max_steps={STEPS}", "train.eval_every=0", "train.save_every=20", "train.log_every=5",
        # the preset's 8 rows a step, as 2 x 4: the heads' logits over a batch are the stage's largest tensors, and
        # halving them keeps the demo's peak well under 4 GB (it reached 3.98 GB on a busy machine)
        "train.batch_size=4", "train.grad_accum=2",
        "max_length=256", "evaluate.enabled=false", "calibration_rows=48",
        # each head projects onto the 8,192 tokens the target writes most (exported with vLLM's token_map):
        # over the full 49,152-token vocabulary the heads' logits and optimizer state took the demo past 7 GB
        "draft_vocab_size=8192",
        # a dataset from an older demo has no capture cache: then the target runs in the step
        *([f"capture_cache={data_path / CAPTURE_DIR}"] if (data_path / CAPTURE_DIR).is_dir() else [])],
        cls=MedusaJobConfig)
    return run("medusa", cfg).artifact


@stage("evaluate: plain vs n-gram vs Medusa vs the shipped EAGLE-3 head, per domain, side by side")
def evaluate(target, medusa: Path) -> dict:
    """One run decodes every prompt with each proposer, plain decoding and HF generate, interleaved and
    repeated (the median of 3 is each run's time), so every speedup is measured against the same plain runs
    and a burst of load is re-measured or left out; greedy output is checked against HF generate's."""
    from draftsmith.evaluation import evaluate as run_eval
    from draftsmith.evaluation import write_report

    out = OUT / "eval"
    if (out / "report.json").is_file():
        import json

        print(f"report exists: {out}/report.md")
        return json.loads((out / "report.json").read_text())
    report = run_eval(target, "eagle:zoo/smollm2-135m/eagle3-broad", limit_per_domain=EVAL_LIMIT, max_new_tokens=64,
                      tree_from_proposer=True, cost_repeats=3, command="scripts/demo.py (evaluate)",
                      compare=["ngram@chain=4", f"medusa:{medusa}@chain=4", f"medusa:{medusa}@tree"])
    write_report(report, out)
    print(f"report: {out}/report.md")
    return report


@stage("export: Medusa heads for vLLM")
def export(target, medusa: Path) -> Path:
    from draftsmith.export import export_artifact

    result = export_artifact(medusa, "vllm", OUT / "export" / "vllm", target=target)
    print(result.summary())
    print(f"launch command: {result.out / 'serve.md'}")
    return result.out


NAMES = {"spec": "eagle3-broad", "ngram@chain=4": "ngram", "@chain=4": "medusa-chain", "@tree": "medusa-tree"}


def _label(entry: str) -> str:
    return next(v for k, v in NAMES.items() if entry == k or (k.startswith("@") and entry.endswith(k)))


def summary(report: dict) -> None:
    """Per proposer and domain: α, τ, speedup (against the faster plain decoding; '–' where no prompt of the
    domain could be timed validly) and losslessness against HF generate."""
    print("\n=== summary (greedy, this machine; speedup vs the faster of our plain decoding and HF generate) ===")
    print(f"{'proposer':<14} {'domain':<14} {'alpha':>6} {'tau':>5} {'speedup':>8} {'timed':>6} lossless")
    fmt = lambda v, w, p=2: f"{v:{w}.{p}f}" if v is not None else f"{'–':>{w}}"  # noqa: E731
    rows = [("spec", lambda d: d)] + [(name, lambda d, n=name: d["compare"][n])
                                      for name in report["overall"].get("compare", {})]
    for entry, pick in rows:
        for domain, d in sorted(report["domains"].items()):
            row = pick(d)
            print(f"{_label(entry):<14} {domain:<14} {fmt(row['alpha'], 6, 3)} {fmt(row['tau'], 5)} "
                  f"{fmt(row['speedup'], 8)} {row['n_timed']:>3}/{d['n_prompts']:<2} {row['lossless']}")
    busy = report.get("contention") or {}
    if busy.get("busy_prompts"):
        print(f"SPEEDUPS NOT MEASURED: {busy['note']}")
    elif busy.get("speedups_valid") is False:
        print(f"SPEEDUPS LEFT OUT: {busy['note']}")
    s = report["settings"]
    for entry, kw in [("spec", s)] + list(s.get("compare_settings", {}).items()):
        if kw.get("tree") is not None and s.get("prune_tree"):
            verified = s["tree_verified"] if entry == "spec" else kw["tree"]
            print(f"{_label(entry)}: tree cut by the cost model to {kw['tree_max_nodes']} node(s), branching "
                  f"{verified}" + (" = plain decoding (no node pays on this machine; α '–')" if not verified else ""))
    print("a speedup with τ = 1.00 is the timing noise of the run")
    print(f"\noutputs: {OUT}")


def main() -> int:
    target = load()
    data_path = data(target)
    medusa = train(target, data_path)
    report = evaluate(target, medusa)
    export(target, medusa)
    summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(run_entry_point(main))
