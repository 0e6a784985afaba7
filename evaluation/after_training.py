"""The evaluation every training job runs at its end, written into the artifact it judges.

`EvalAfterTraining` (training/config.py) is the `evaluate:` section of every job config;
`evaluate_into_artifact` runs the evaluator with the artifact as proposer and stores report.json,
report.md and plots under `<artifact>/eval/`, and a per-domain summary in the manifest's `eval`.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import artifact, methods
from draftsmith.training.config import EvalAfterTraining  # noqa: F401  (the section this evaluation reads)

SUMMARY_FIELDS = ("n_prompts", "alpha", "tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "lossless",
                  "per_position_acceptance", "predicted_speedup")


def evaluate_into_artifact(path: str | Path, target, kind: str, opts: EvalAfterTraining,
                           command: str | None = None) -> dict:
    """Evaluate artifact `path` (proposer `<kind>:<path>`) and write the report into it. Returns the report."""
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    path = Path(path)
    report = evaluate(target, f"{kind}:{path}", prompts=opts.prompts or None, split=opts.split,
                      domains=list(opts.domains),
                      limit_per_domain=opts.limit_per_domain, max_new_tokens=opts.max_new_tokens, k=opts.k,
                      tree_from_proposer=opts.tree and methods.get(kind).own_tree, hf_reference=opts.hf_reference,
                      cost_model=opts.cost_model, command=command or f"end-of-training evaluation of {path}")
    write_report(report, path / "eval")
    artifact.update_manifest(path, eval={
        "settings": report.get("settings"),
        "domains": {d: {k: v for k, v in r.items() if k in SUMMARY_FIELDS} for d, r in report["domains"].items()},
        "overall": {k: v for k, v in report["overall"].items() if k in SUMMARY_FIELDS},
        "recommended_k": report.get("recommended_k"),
        "policy": report.get("policy"),
        "report": "eval/report.json",
    })
    return report
