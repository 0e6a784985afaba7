"""`RetrainConfig` (YAML `kind: retrain`): what a scheduled retraining run watches and how it may act."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from draftsmith.config import (
    DRAFT_TOKENS,
    FRACTION,
    HELD_OUT,
    ROWS,
    SEED,
    TOKENS,
    Range,
    register_config,
    validated,
)
from draftsmith.retrain.decide import GateRule, Thresholds


@validated
@dataclass
class TrafficConfig:
    dir: str = "runs/traffic"  # folder of *.jsonl request logs
    window_days: Annotated[float, Range(gt=0, le=3650)] = 7.0
    max_per_domain: Annotated[int, Range(ge=2, le=10**7)] = 64  # rows sampled per domain from the window
    # domains kept under their own name, the largest by volume; the rest are one "other" (clients name
    # domains: thousands of one-row domains would each go whole to the held-out share, leaving nothing to train)
    max_domains: Annotated[int, Range(ge=1, le=10**6)] = 32
    # of the sampled rows, the share held out to measure α (never trained on)
    eval_share: Annotated[float, Range(gt=0, lt=1)] = 0.5
    max_eval_per_domain: Annotated[int, Range(ge=1, le=10**7)] = 8
    seed: Annotated[int, SEED] = 0
    # the folder a capture replica's KV connector writes (fleet/vllm_capture.py): the candidate trains on the
    # hidden states the fleet computed while serving the traffic rows, joined by request id, instead of
    # regenerating their answers and running the target over them (data/served.py); null = regenerate
    captures: str | None = None


@validated
@dataclass
class MeasureConfig:
    """How α is measured (the evaluator, greedy, so losslessness is checked too)."""

    baseline_prompts: list[str] = field(default_factory=list)  # empty = the evaluator's default eval sets
    baseline_limit_per_domain: Annotated[int, ROWS] = 4
    max_new_tokens: Annotated[int, TOKENS] = 48
    k: Annotated[int, DRAFT_TOKENS] = 4
    # production acceptance (planning/production.py): a running vLLM server's /metrics URL, a dump of it, or request
    # logs with per-request counters; when given, its per-domain α is checked against the same thresholds as the
    # measured α
    production: str | None = None
    # an earlier /metrics dump (the window between the two), or "last": the window since this job's previous
    # check (the metrics it read are kept beside the registry)
    production_since: str | None = None
    production_model_domains: dict[str, str] = field(default_factory=dict)  # vLLM model_name -> domain
    # with request logs as `production` (the fleet's traffic folder, fleet/middleware.py): a routing policy file
    # whose router gives a logged request without a domain its domain, from its prompt (else "unknown")
    production_policy: str | None = None
    # the shape α is measured in (decoding/served_shape.py): vllm | sglang | trtllm, draftsmith (its own decoder), or
    # null = vllm when the config promotes to vLLM (gate.serve_check, production α from vLLM, promote.servers), else
    # draftsmith's own decoder (`RetrainConfig.measured_as`)
    as_served: str | None = None


@validated
@dataclass
class BudgetConfig:
    """A bounded retraining: fresh self-distilled data from traffic + replay of the old data."""

    max_steps: Annotated[int, Range(ge=1, le=10**9)] = 200
    # share of the new training set drawn from the current version's data
    replay_fraction: Annotated[float, HELD_OUT] = 0.3
    warm_start: bool = True  # start from the current version's weights (else from scratch)
    data_overrides: list[str] = field(default_factory=list)  # dotted overrides for the data config
    job_overrides: list[str] = field(default_factory=list)  # dotted overrides for the job config


@validated
@dataclass
class CanaryConfig:
    """How a drafter swapped into running servers is watched (retrain/promote.py): its per-request α per domain,
    read from the servers' traffic log for this version alone, against what the gate measured for it."""

    requests: Annotated[int, Range(ge=0, le=10**7)] = 32  # counted requests of the new version; 0 = no canary
    timeout_s: Annotated[float, Range(gt=0, le=7 * 86400)] = 600.0  # the verdict is given then with what came
    # a domain's α below min_ratio x the gate's measured α for it, or below alpha_floor: the old version goes back
    min_ratio: Annotated[float, FRACTION] = 0.8
    alpha_floor: Annotated[float, FRACTION] = 0.0
    min_domain_requests: Annotated[int, Range(ge=1, le=10**6)] = 4  # fewer: the domain is reported, not judged
    traffic: str | None = None  # the folder the servers' traffic log writes (default: traffic.dir)
    # fewer than `requests` counted by timeout_s: keep the new version (and say so), or roll back
    rollback_when_inconclusive: bool = False


@validated
@dataclass
class PromoteConfig:
    """Promotion in place (retrain/promote.py, docs/retraining.md): each promoted version is swapped into these
    running vLLM servers (their base URL, e.g. http://10.0.0.5:8000) without a restart, then watched."""

    servers: list[str] = field(default_factory=list)  # empty: the registry is updated, the fleet restarts itself
    token_env: str = "DRAFTSMITH_PROMOTE_TOKEN"  # the variable holding the servers' bearer token
    timeout_s: Annotated[float, Range(gt=0, le=3600)] = 300.0  # one server's swap, at most
    canary: CanaryConfig = field(default_factory=CanaryConfig)


@register_config("retrain")
@validated
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
    promote: PromoteConfig = field(default_factory=PromoteConfig)
    policy_alpha_floor: Annotated[float, FRACTION] = 0.3  # domains below this after retraining: "disable speculation"

    def __post_init__(self):
        from draftsmith import methods

        methods.get(self.artifact_kind, "artifact_kind")
        if self.measure.as_served not in (None, "draftsmith", "vllm", "sglang", "trtllm"):
            raise ValueError(f"measure.as_served must be vllm, sglang, trtllm, draftsmith or null, got "
                             f"{self.measure.as_served!r}")

    @property
    def measured_as(self) -> str | None:
        """The engine whose shape the gate scores (None: draftsmith's own decoder): `measure.as_served`, or, left
        null, vLLM's where this config promotes to vLLM (the gate serve-checks there, production α comes from a
        vLLM server, or promotion swaps the drafter into running vLLM servers), so the candidate is judged in the
        shape that will serve it."""
        chosen = self.measure.as_served
        if chosen is None:
            to_vllm = self.gate.serve_check or self.measure.production or self.promote.servers
            return "vllm" if to_vllm else None
        return None if chosen == "draftsmith" else chosen
