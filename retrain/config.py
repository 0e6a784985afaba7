"""`RetrainConfig` (YAML `kind: retrain`): what a scheduled retraining run watches and how it may act."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.config import register_config
from draftsmith.retrain.decide import GateRule, Thresholds


@dataclass
class TrafficConfig:
    dir: str = "runs/traffic"  # folder of *.jsonl request logs
    window_days: float = 7.0
    max_per_domain: int = 64  # rows sampled per domain from the window
    eval_share: float = 0.5  # of the sampled rows, the share held out to measure α (never trained on)
    max_eval_per_domain: int = 8
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.eval_share < 1:
            raise ValueError(f"traffic.eval_share must be in (0, 1), got {self.eval_share}")
        if self.window_days <= 0 or self.max_per_domain < 2 or self.max_eval_per_domain < 1:
            raise ValueError("traffic: window_days > 0, max_per_domain >= 2, max_eval_per_domain >= 1")


@dataclass
class MeasureConfig:
    """How α is measured (the evaluator, greedy, so losslessness is checked too)."""

    baseline_prompts: list[str] = field(default_factory=list)  # empty = the evaluator's default eval sets
    baseline_limit_per_domain: int = 4
    max_new_tokens: int = 48
    k: int = 4
    # production acceptance (planning/production.py): a running vLLM server's /metrics URL, a dump of it, or request
    # logs with per-request counters; when given, its per-domain α is checked against the same thresholds as the
    # measured α
    production: str | None = None
    # an earlier /metrics dump (the window between the two), or "last": the window since this job's previous
    # check (the metrics it read are kept beside the registry)
    production_since: str | None = None
    production_model_domains: dict[str, str] = field(default_factory=dict)  # vLLM model_name -> domain


@dataclass
class BudgetConfig:
    """A bounded retraining: fresh self-distilled data from traffic + replay of the old data."""

    max_steps: int = 200
    replay_fraction: float = 0.3  # share of the new training set drawn from the current version's data
    warm_start: bool = True  # start from the current version's weights (else from scratch)
    data_overrides: list[str] = field(default_factory=list)  # dotted overrides for the data config
    job_overrides: list[str] = field(default_factory=list)  # dotted overrides for the job config

    def __post_init__(self):
        if self.max_steps < 1:
            raise ValueError("budget.max_steps must be >= 1")
        if not 0 <= self.replay_fraction < 1:
            raise ValueError("budget.replay_fraction must be in [0, 1)")


@register_config("retrain")
@dataclass
class RetrainConfig:
    artifact_kind: str = "medusa"  # what this registry holds: a method's name (methods.py)
    target: str = "smollm2-135m"
    registry: str = "runs/registry"
    job_config: str = "configs/smollm2-135m/medusa.yaml"  # the training preset for `kind`
    data_config: str = "configs/smollm2-135m/data.yaml"  # generation settings for traffic prompts
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    thresholds: Thresholds = field(default_factory=Thresholds)
    gate: GateRule = field(default_factory=GateRule)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    policy_alpha_floor: float = 0.3  # domains below this after retraining: "disable speculation"

    def __post_init__(self):
        from draftsmith import methods

        methods.get(self.artifact_kind, "artifact_kind")
