"""Evaluation: every artifact judged by the built-in speculative decoder, per domain.

    from draftsmith.evaluation import evaluate, write_report
    report = evaluate(target, "medusa:runs/medusa/smollm2-135m", limit_per_domain=8, tree=[4, 3, 2])
    write_report(report, "runs/eval/medusa")   # report.json, report.md, PNG plots
"""

from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.evaluate import evaluate
from draftsmith.evaluation.report import write_report

__all__ = ["EvalConfig", "evaluate", "write_report"]
