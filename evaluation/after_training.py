"""The evaluation every training job runs at its end, written into the artifact it judges.

`EvalAfterTraining` is the `evaluate:` section of the Medusa, EAGLE and distillation job configs;
`evaluate_into_artifact` runs the evaluator with the artifact as proposer and stores report.json,
report.md and plots under `<artifact>/eval/`, and a per-domain summary in the manifest's `eval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from draftsmith import artifact, methods

SUMMARY_FIELDS = ("n_prompts", "alpha", "tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "lossless",
                  "per_position_acceptance", "predicted_speedup")


@dataclass
class EvalAfterTraining:
    enabled: bool = True
    prompts: list[str] = field(default_factory=list)  # empty = the evaluator's default eval sets of `split`
    split: str = "dev"  # the end-of-training evaluation chooses (checkpoints, recipes): never the test split
    limit_per_domain: int | None = 8
    max_new_tokens: int = 64
    k: int = 4  # chain length (draft models, and heads when tree is false)
    tree: bool = True  # heads: verify the artifact's own tree (Medusa calibrated tree, EAGLE-2 budget)
    hf_reference: bool = True  # HF generate beside: the independent reference `lossless` is judged against
    cost_model: bool = True  # measure v(k) and c on this machine -> recommended k

    def __post_init__(self):
        if self.limit_per_domain is not None and self.limit_per_domain < 1:
            raise ValueError("evaluate.limit_per_domain must be >= 1 or null")
        if self.split not in ("dev", "test"):
            raise ValueError(f"evaluate.split must be dev or test, got {self.split!r}")
        if self.max_new_tokens < 1 or self.k < 1:
            raise ValueError("evaluate.max_new_tokens and evaluate.k must be >= 1")


def evaluate_into_artifact(path: str | Path, target, kind: str, opts: EvalAfterTraining,
                           command: str | None = None) -> dict:
    """Evaluate artifact `path` (proposer `<kind>:<path>`) and write the report into it. Returns the report."""
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    path = Path(path)
    report = evaluate(target, f"{kind}:{path}", prompts=opts.prompts or None, split=opts.split,
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
