"""`BenchConfig` (YAML `kind: bench`): every published number of one target, with its budgets.

    kind: bench
    target: smollm2-135m
    data: {config: configs/smollm2-135m/data.yaml}        # or {path: runs/data/...} to reuse a dataset
    artifacts:                                           # trained inside the bench, then evaluated
      - {name: draft,  job: distill, config: configs/smollm2-135m/distill.yaml, eval: {k: 4}}
      - {name: medusa, job: medusa,  config: configs/smollm2-135m/medusa.yaml, eval: {tree: auto}}
      - {name: eagle3, job: eagle,   config: configs/smollm2-135m/eagle3.yaml, eval: {tree: auto}}
    baselines: [{name: ngram, proposer: ngram, eval: {k: 4}}]   # proposers that need no training
    budgets:
      full:  {data_rows: 2000, train_steps: {draft: 300, medusa: 300, eagle3: 300}, limit_per_domain: 8, ...}
      quick: {data_rows: 24, train_steps: {draft: 4, medusa: 4, eagle3: 4}, limit_per_domain: 1, ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from draftsmith.config import DRAFT_TOKENS, REPEATS, ROWS, TOKENS, Range, register_config, validated


@validated
@dataclass
class DataStage:
    config: str | None = None  # a data preset (kind: data): generated inside the bench
    path: str | None = None  # or an existing self-distilled dataset (its rows are not regenerated)
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self):
        if (self.config is None) == (self.path is None):
            raise ValueError("bench data: give exactly one of config (generate) or path (reuse)")


@validated
@dataclass
class EvalSpec:
    k: Annotated[int, DRAFT_TOKENS] = 4
    tree: str | None = None  # "auto" = the artifact's own tree


@validated
@dataclass
class ArtifactStage:
    name: str
    job: str  # a registered method's name (methods.py) or alias (`distill` for `draft`)
    config: str
    overrides: list[str] = field(default_factory=list)
    eval: EvalSpec = field(default_factory=EvalSpec)

    def __post_init__(self):
        from draftsmith import methods

        if methods.find(self.job) is None:
            raise ValueError(f"bench artifact {self.name!r}: job must be one of {methods.names()}, got {self.job!r}")
        if isinstance(self.eval, dict):
            self.eval = EvalSpec(**self.eval)


@validated
@dataclass
class Baseline:
    name: str
    proposer: str
    eval: EvalSpec = field(default_factory=EvalSpec)

    def __post_init__(self):
        if isinstance(self.eval, dict):
            self.eval = EvalSpec(**self.eval)


@validated
@dataclass
class Budget:
    data_rows: Annotated[int, ROWS] | None = None  # None: every row the data preset yields
    data_new_tokens: Annotated[int, TOKENS] | None = None
    # artifact name -> max steps
    train_steps: dict[str, Annotated[int, Range(ge=1, le=10**9)]] = field(default_factory=dict)
    limit_per_domain: Annotated[int, ROWS] | None = 8
    max_new_tokens: Annotated[int, TOKENS] = 128
    hf_reference: bool = True
    engine_prompts: Annotated[int, ROWS] = 32
    engine_new_tokens: Annotated[int, TOKENS] = 128
    cost_repeats: Annotated[int, REPEATS] = 9


@register_config("bench")
@validated
@dataclass
class BenchConfig:
    target: str = "smollm2-135m"
    out: str = "results"  # results go to <out>/<date>[-quick]/
    benchmarks_md: str = "BENCHMARKS.md"  # the generated block of this target/budget is replaced there
    data: DataStage = field(default_factory=lambda: DataStage(config="configs/smollm2-135m/data.yaml"))
    artifacts: list[ArtifactStage] = field(default_factory=list)
    baselines: list[Baseline] = field(default_factory=lambda: [Baseline("ngram", "ngram")])
    prompts: list[str] = field(default_factory=list)  # extra prompt files (default: the shipped eval sets of `split`)
    split: str = "test"  # published numbers come from the split nothing was chosen on (prompts/README.md)
    budgets: dict[str, Budget] = field(default_factory=lambda: {"full": Budget(), "quick": Budget()})

    def __post_init__(self):
        if isinstance(self.data, dict):
            self.data = DataStage(**self.data)
        self.artifacts = [a if isinstance(a, ArtifactStage) else ArtifactStage(**a) for a in self.artifacts]
        self.baselines = [b if isinstance(b, Baseline) else Baseline(**b) for b in self.baselines]
        self.budgets = {k: v if isinstance(v, Budget) else Budget(**v) for k, v in self.budgets.items()}
        if self.split not in ("dev", "test"):
            raise ValueError(f"bench: split must be dev or test, got {self.split!r}")
        names = [a.name for a in self.artifacts] + [b.name for b in self.baselines]
        if len(set(names)) != len(names):
            raise ValueError(f"bench: artifact and baseline names must be unique, got {names}")
