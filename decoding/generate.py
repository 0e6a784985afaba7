"""`speculative_generate`: the decoding loop around the verifier, for a batch of prompts.

Plain decoding is the same loop with k = 0 (an empty proposal every step), so the baseline and the
speculative runs share every line of code except the proposer — a speedup can only come from proposing.

Batches: rows accept different numbers of tokens, so each row keeps its own KV cache and proposer state
(`SequenceVerifier`) and rows are decoded one after another. This is exact for every row (greedy output
equals the target's greedy output row by row) at the price of not batching rows into one forward.

EOS and the token budget are applied inside a block: the emitted tokens of a step are cut after the first
EOS and at `max_new_tokens`, and proposals are never longer than the remaining budget minus one (the
verification step always adds one target token of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftsmith.decoding.proposer import NullProposer, Proposer, TreeSpec, as_model
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.verify import SequenceVerifier, StepStats
from draftsmith.errors import ConfigError


@dataclass
class GenerationStats:
    """Counters summed over the rows of one call (see `StepStats` for the per-field meaning)."""

    proposed: int = 0
    pruned: int = 0
    accepted: int = 0
    target_forwards: int = 0  # verification forwards (prefill not included)
    prefill_forwards: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0  # first tokens, produced by the prefill forward
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    tried_per_position: list[int] = field(default_factory=list)
    proposer_time: float = 0.0
    target_time: float = 0.0
    wall_time: float = 0.0

    def add(self, s: StepStats, new_tokens: int) -> None:
        self.proposed += s.proposed
        self.pruned += s.pruned
        self.accepted += s.accepted
        self.target_forwards += s.steps
        self.prefill_forwards += 1 if new_tokens else 0
        self.prefill_tokens += 1 if new_tokens else 0
        self.new_tokens += new_tokens
        for mine, theirs in ((self.proposed_per_position, s.proposed_at), (self.accepted_per_position, s.accepted_at),
                             (self.tried_per_position, s.tried_at)):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v
        self.proposer_time += s.proposer_time
        self.target_time += s.target_time

    def merge(self, other: GenerationStats) -> None:
        """Add another call's counters and times (e.g. to aggregate prompts into a domain)."""
        for name in ("proposed", "pruned", "accepted", "target_forwards", "prefill_forwards", "prefill_tokens",
                     "new_tokens", "proposer_time", "target_time", "wall_time"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.proposed_per_position, other.proposed_per_position),
                             (self.accepted_per_position, other.accepted_per_position),
                             (self.tried_per_position, other.tried_per_position)):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def alpha(self) -> float | None:
        """α = accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tau(self) -> float | None:
        """τ = tokens emitted per verification forward, bonus included (1.0 = plain decoding). The first
        token of each row comes from the prefill forward and is counted in neither."""
        steps_tokens = self.new_tokens - self.prefill_tokens
        return steps_tokens / self.target_forwards if self.target_forwards else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """[d] = P(the first d+1 draft tokens are all accepted | a proposal reached depth d+1)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """[d] = P(the draft token at depth d+1 is accepted | the first d were and a token at depth d+1 was
        tried): the acceptance of each position on its own, which training-time test aims to keep flat."""
        return [a / t if t else None for a, t in zip(self.accepted_per_position, self.tried_per_position)]

    def to_dict(self) -> dict:
        return {
            "proposed": self.proposed, "pruned": self.pruned, "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "prefill_forwards": self.prefill_forwards, "prefill_tokens": self.prefill_tokens,
            "new_tokens": self.new_tokens,
            "proposed_per_position": list(self.proposed_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "tried_per_position": list(self.tried_per_position),
            "per_position_acceptance": self.per_position_acceptance,
            "conditional_acceptance": self.conditional_acceptance, "alpha": self.alpha, "tau": self.tau,
            "proposer_time": self.proposer_time, "target_time": self.target_time, "wall_time": self.wall_time,
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row (EOS included when produced)
    stats: GenerationStats
    row_stats: list[StepStats]
    k_history: list[list[int]] = field(default_factory=list)  # adaptive k: the chain length of every step, per row


def _rows(input_ids, attention_mask) -> list[torch.Tensor]:
    if isinstance(input_ids, list | tuple):
        return [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in input_ids]
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if attention_mask is None:
        return [row for row in ids]
    return [row[m.bool()] for row, m in zip(ids, torch.as_tensor(attention_mask))]


def _spec(k: int | None, tree: TreeSpec | tuple[int, ...] | list[int] | None) -> TreeSpec:
    if tree is not None and k:
        raise ConfigError("give either k (a chain) or tree, not both")
    if tree is not None:
        spec = tree if isinstance(tree, TreeSpec) else TreeSpec(tuple(int(b) for b in tree))
        if any(b < 1 for b in spec.branching):
            raise ConfigError(f"tree branching factors must be >= 1, got {spec.branching}")
        return spec
    if k is None or k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    return TreeSpec.chain(k)


def speculative_generate(target, proposer: Proposer | None, input_ids, max_new_tokens: int, k: int | None = 4,
                         tree: TreeSpec | tuple[int, ...] | None = None, temperature: float = 0.0,
                         top_p: float = 1.0, top_k: int = 0, seed: int | None = 0,
                         eos_ids: list[int] | None = None, attention_mask=None,
                         adaptive=None, cost=None) -> GenerationResult:
    """Generate up to `max_new_tokens` per row with `proposer` verified by `target`.

    target: a `Target` or an HF causal LM. input_ids: [B, T] tensor (with `attention_mask` for padding),
    a 1-D tensor, or a list of token lists. k: chain length (0 = plain decoding); tree: branching factors
    per depth instead of k. eos_ids: default = the target's EOS ids. seed: sampling seed (per call).
    adaptive: a `decoding.adaptive.AdaptiveK` controller: every step's chain length is chosen by it (at most
    k), 0 meaning a plain step; it is reset for every row.
    cost: a `decoding.budget.VerifyCost` (v(n) measured on this target): proposals that carry node scores
    (Medusa, EAGLE-2 trees) are cut every step to the nodes that pay for their verification.
    """
    model = as_model(target)
    if eos_ids is None:
        eos_ids = list(getattr(target, "eos_token_ids", []) or [])
    eos = set(int(e) for e in eos_ids)
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    spec = _spec(0 if (proposer is None and tree is None) else k, tree)
    proposer = proposer or NullProposer()
    sampling = SamplingConfig(temperature, top_k, top_p)
    device = next(model.parameters()).device
    generator = seeded_generator(sampling, device, 0 if seed is None else seed)
    vocab = getattr(target, "vocab_size", None)

    stats = GenerationStats()
    if adaptive is not None and not spec.is_chain:
        raise ConfigError("adaptive k chooses chain lengths: give k, not a tree")
    out_tokens: list[list[int]] = []
    row_stats: list[StepStats] = []
    k_history: list[list[int]] = []
    wall0 = time.perf_counter()
    for row in _rows(input_ids, attention_mask):
        seq = SequenceVerifier(model, proposer, sampling, generator, vocab, cost=cost)
        if adaptive is not None:
            adaptive.reset()
        new = decode_row(seq, row, max_new_tokens, spec, eos, adaptive)
        out_tokens.append(new)
        row_stats.append(seq.stats)
        k_history.append(list(adaptive.history) if adaptive is not None else [])
        stats.add(seq.stats, len(new))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.wall_time = time.perf_counter() - wall0
    return GenerationResult(out_tokens, stats, row_stats, k_history)


def seeded_generator(sampling: SamplingConfig, device: torch.device, seed: int) -> torch.Generator | None:
    """The generator a sampled decode draws from (None when greedy: nothing is drawn)."""
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def decode_row(seq: SequenceVerifier, prompt: torch.Tensor, max_new_tokens: int, spec: TreeSpec, eos: set[int],
               adaptive=None, on_step: Callable[[int, list[int]], None] | None = None) -> list[int]:
    """One row: the prefill's token, then verification steps until an EOS or `max_new_tokens` new tokens.

    A step proposes at most the budget left minus one (verification adds a token of its own); its tokens
    are cut after the first EOS and at the budget. `adaptive` chooses each step's chain length instead of
    `spec`. `on_step(emitted, tokens)` sees every step's tokens before the cut, with the number of tokens
    emitted before it (the rollouts mark where a draft was rejected: data/engines/rollout.py)."""
    new: list[int] = []
    if max_new_tokens <= 0:
        return new
    new.append(seq.begin(prompt))
    while len(new) < max_new_tokens and new[-1] not in eos:
        depth = min(spec.depth, max_new_tokens - len(new) - 1)
        if adaptive is not None:
            k_step = min(adaptive.next_k(), depth)
            step_tokens = seq.step(TreeSpec.chain(k_step))
            adaptive.update(k_step, *seq.last_step)
        else:
            step_tokens = seq.step(spec.truncated(depth))
        if on_step is not None:
            on_step(len(new), step_tokens)
        done = False
        for t in step_tokens:
            new.append(t)
            if t in eos or len(new) >= max_new_tokens:
                done = True
                break
        seq.stats.emitted = len(new)
        if done:
            break
    return new
