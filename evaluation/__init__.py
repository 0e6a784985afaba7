"""Evaluation: every artifact judged by the built-in speculative decoder, per domain.

    from draftsmith.evaluation import evaluate, write_report
    report = evaluate(target, "medusa:runs/medusa/smollm2-135m", limit_per_domain=8, tree=[4, 3, 2])
    write_report(report, "runs/eval/medusa")   # report.json, report.md, PNG plots

Its names are imported on first use (lazy.py).
"""

from __future__ import annotations

from draftsmith import lazy

__getattr__ = lazy.names(__name__, {
    "EvalConfig": "draftsmith.evaluation.config",
    "evaluate": "draftsmith.evaluation.evaluate",
    "write_report": "draftsmith.evaluation.report",
})
__all__ = [
    "EvalConfig", "evaluate", "write_report"
]
