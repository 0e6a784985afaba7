"""Typed evaluation config (`kind: eval`); the CLI flags of `draftsmith evaluate` mirror these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from draftsmith.config import (
    DRAFT_TOKENS,
    PROBABILITY,
    REPEATS,
    ROWS,
    SEED,
    TEMPERATURE,
    TOKENS,
    Range,
    check_tree,
    register_config,
    validated,
)
from draftsmith.methods import STACKS
from draftsmith.targets.context import MAX_NEW_TOKENS

TURNS = ("all", "first")  # which user turns of a multi-turn prompt are measured
ENGINES = tuple(s for s in STACKS if s != "hf")  # the serving engines `as_served` names (decoding/served_shape.py)


@register_config("eval")
@validated
@dataclass
class EvalConfig:
    # the target model: an embedded name (`draftsmith targets`), an HF model folder or a GGUF file
    target: str = "smollm2-135m"
    # what proposes the draft tokens: ngram | ngram:N (prompt lookup, matching up to N tokens) | METHOD:ARTIFACT_DIR
    # (draft, medusa, eagle, dflash) | multi:A+B (their trees merged) | route:POLICY.json (per domain)
    proposer: str = "ngram"
    prompts: list[str] = field(default_factory=list)  # jsonl prompt files; empty = the shipped eval sets of `split`
    # only these domains of the prompt files (empty = all): the same prompts per domain as a run over all of them
    domains: list[str] = field(default_factory=list)
    # which shipped eval sets: dev for choosing heads, trees and policies; test for the published numbers only
    split: str = "dev"
    # tokens generated per prompt (per user turn), at most
    max_new_tokens: Annotated[int, Range(ge=1, le=MAX_NEW_TOKENS)] = 128
    # draft tokens proposed and verified per step, a chain (ignored when a tree is given)
    k: Annotated[int, Range(ge=0, le=64)] = 4
    tree: list[Annotated[int, DRAFT_TOKENS]] | None = None  # branching factor per depth, e.g. [4, 2, 1]
    tree_from_proposer: bool = False  # use the proposer's own tree (Medusa's calibrated tree, EAGLE-2's budget)
    prune_tree: bool = True  # trees with node scores are cut every step to the nodes that pay (decoding/budget.py)
    # with a cut tree, also decode every prompt with the uncut tree of a GPU-sized budget (EAGLE-2's defaults,
    # Medusa's whole calibrated tree) and report its τ: the field's τ are measured so
    gpu_tree: bool = True
    # sampling temperature; 0 = greedy, where `lossless` is exact token equality
    temperature: Annotated[float, TEMPERATURE] = 0.0
    # nucleus sampling: keep the smallest set of tokens with this much probability (fraction)
    top_p: Annotated[float, PROBABILITY] = 1.0
    top_k: Annotated[int, Range(ge=0, le=1 << 24)] = 0  # sample among the k most likely tokens only (0 = no cut)
    # prompts per domain, a seeded random choice (none: every prompt)
    limit_per_domain: Annotated[int, ROWS] | None = None
    seed: Annotated[int, SEED] = 0  # seeds the prompt choice and sampling
    out: str = "runs/eval"  # report folder (report.json, report.md); one evaluation at a time per folder
    # HF generate (stock kernels) on every prompt: the independent reference `lossless` is judged against, and
    # the other plain decoding speedups are stated against; off, `lossless` is null (not judged)
    hf_reference: bool = True
    repeats: Annotated[int, REPEATS] = 3  # timed runs of each decoding per prompt, interleaved; the median is the time
    # extra rounds for a prompt whose runs were not quiet (other processes used the CPU) `repeats` times
    remeasure: Annotated[int, Range(ge=0, le=1000)] = 3
    cost_model: bool = True  # measure v(k), the target's (k+1)-token forward time over its 1-token time
    cost_context: Annotated[int, TOKENS] = 256  # cached tokens the cost model's timed forwards attend to
    cost_k_max: Annotated[int, Range(ge=1, le=256)] = 16  # the largest k (draft tokens) v(k) is measured for
    cost_repeats: Annotated[int, REPEATS] = 9  # timed forwards per k of the cost model; the median is kept
    # the speedup (a ratio; measured, else predicted) below which the per-domain policy turns speculation off
    policy_threshold: Annotated[float, Range(gt=0, le=1000)] = 1.0
    adaptive: bool = False  # also decode every prompt with adaptive k (chains up to k) and compare with fixed k
    # a sweep: one evaluation per temperature (evaluation/sweep.py)
    temperatures: list[Annotated[float, TEMPERATURE]] | None = None
    compare: list[str] = field(default_factory=list)  # more proposers decoded on the same prompts in the same run
    # passed to the target's chat template for every prompt, as the data config's `chat_template_kwargs` were for
    # the rows the head learned from (a reasoning target: {enable_thinking: false} answers without thinking)
    chat_template_kwargs: dict = field(default_factory=dict)
    # all: every user turn of a multi-turn prompt is one measured generation, its context the earlier turns with
    # the target's own answers (evaluation/turns.py); first: the first user turn only
    turns: str = "all"
    device: str = "auto"  # cpu | cuda | cuda:N; auto = CUDA when there is a GPU, else the CPU
    dtype: str = "auto"  # the target's: float32 | bfloat16 | float16; auto = bf16 on a GPU with it, else float32
    # the proposers' own networks (draft model, Medusa/EAGLE/DFlash heads): float32 | bfloat16 | float16; auto =
    # bf16 next to a float32 target on a CPU with native bf16 (decoding/proposer.draft_dtype), else the target's
    draft_dtype: str = "auto"
    # vllm | sglang | trtllm: decode every proposer exactly as that engine serves it (decoding/served_shape.py: vLLM's
    # chain or block of k, SGLang's EAGLE tree, TensorRT-LLM's tree); none = draftsmith's own decoder (merged trees,
    # routing, cost-model cuts and GPU-sized trees are its own, and the report labels them so)
    as_served: str | None = None
    # the engine's own settings where it has some: SGLang's EAGLE {topk, num_steps, num_draft_tokens}; vLLM's DSpark
    # {adaptive_verification: false} (on by default with a confidence head)
    as_served_options: dict = field(default_factory=dict)

    def __post_init__(self):
        check_tree(self.tree, "tree")
        if self.as_served is not None:
            self._check_as_served()
        if self.temperatures is not None and (not self.temperatures or any(t < 0 for t in self.temperatures)):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")
        if self.adaptive and (self.tree is not None or self.tree_from_proposer or self.k < 1):
            raise ValueError("adaptive k chooses chain lengths: use it with k >= 1, not with a tree")
        if self.turns not in TURNS:
            raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if self.split not in ("dev", "test"):
            raise ValueError(f"split must be dev or test, got {self.split!r}")

    def _check_as_served(self) -> None:
        if self.as_served not in ENGINES:
            raise ValueError(f"as_served must be one of {', '.join(ENGINES)} or null, got {self.as_served!r}")
