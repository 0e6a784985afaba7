"""On-policy rollouts: our speculative decoder, with the head being trained, writes the rows.

`generation.engine: speculative` (data/config.py) hands the requests of `generate_dataset` to this engine
instead of the batched decode loop. Each row is decoded alone by the decoder's own row loop
(`decoding.generate.decode_row`, the loop `speculative_generate` runs for evaluation) with
`generation.proposer` (e.g. `eagle:runs/eagle/round0`), so the rows are the target's own (greedy output
equals the target's greedy output; sampling keeps its distribution) and, on top of what the batched engine
writes, every row records the positions where verification rejected the draft:

    replay[t] = j + 1   the draft that started at base t (it read the target's features up to t and the
                        pending token x_{t+1}) had its first j tokens accepted and its (j+1)-th rejected:
                        TTT step j at base t (eagle/model.py) is where the head failed on its own path
    replay[t] = 0       no draft started at t, or it was wholly accepted

That is the on-policy signal (Draft-OPD, arXiv 2605.29343: drafting replayed from the positions where
verification rejected the draft, supervised by the target): EAGLE training with `replay_weight` weighs those
(base, step) pairs up, with the target's distribution there as the teacher (teacher-forced capture of the
finished rows). The state at such a pair is the one the head's own proposals reached: its first j tokens
were accepted, so they are the target's tokens, which is what TTT with `ttt_tokens: target` feeds.

Rows are decoded one at a time (the verifier keeps one sequence), so on a CPU this writes fewer tokens per
second than the batched engine: the price of the on-policy signal, measured in BENCHMARKS.md. Multi-turn
rows keep the marks of their last turn (earlier turns are re-read as prompt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from draftsmith.data.engines.base import Completion, Request, TextEngine, run_stats
from draftsmith.decoding.generate import GenerationStats, decode_row, seeded_generator
from draftsmith.decoding.proposer import TreeSpec
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.verify import SequenceVerifier


class SpeculativeEngine(TextEngine):
    """`run(requests, on_done, on_tokens)` like `data.engines.continuous.ContinuousBatcher`, one row at a time through
    the speculative decoder; each Completion carries `replay` (module docstring) over prompt + tokens."""

    report_as = "rollout"  # provenance.json: the head's acceptance on its own rows

    def __init__(self, target, proposer, spec: TreeSpec, sampling: SamplingConfig, cost=None):
        self.target, self.proposer, self.spec, self.sampling, self.cost = target, proposer, spec, sampling, cost
        self.model = target.model
        self.eos = set(int(e) for e in target.eos_token_ids)
        self.stats = GenerationStats()
        self.spec_string: str | None = None

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], on_done: Callable[[Completion], None],
            on_tokens: Callable[[int], None] | None = None) -> dict:
        device = next(self.model.parameters()).device
        t0 = time.perf_counter()
        tokens = 0
        for req in requests:
            done = self._rollout(req, device)
            tokens += len(done.tokens)
            if on_tokens is not None:
                on_tokens(len(done.tokens))
            on_done(done)
        seconds = time.perf_counter() - t0
        self.stats.wall_time += seconds
        return run_stats(tokens, seconds)

    def _rollout(self, req: Request, device: torch.device) -> Completion:
        """One row through the decoder's own row loop (`decoding.generate.decode_row`), marking where the
        draft was rejected."""
        seq = SequenceVerifier(self.model, self.proposer, self.sampling,
                               seeded_generator(self.sampling, device, req.seed), self.target.vocab_size,
                               cost=self.cost)
        P = len(req.prompt_ids)
        replay = [0] * (P + req.max_new_tokens)

        def mark(emitted: int, step: list[int]) -> None:
            base = P + emitted - 2  # the pending token x_{base+1} is the last one emitted
            if seq.last_rejected and base >= 0:
                replay[base] = len(step)  # accepted j = len(step) - 1: step j failed -> j + 1

        new = decode_row(seq, torch.tensor(req.prompt_ids, dtype=torch.long), req.max_new_tokens, self.spec,
                         self.eos, on_step=mark)
        seq.stats.emitted = len(new)
        self.stats.add(seq.stats, len(new))
        return Completion(req.key, list(req.prompt_ids), new, stopped=bool(new) and new[-1] in self.eos,
                          replay=replay[: P + len(new)])

    def describe(self) -> dict:
        """What the rollouts measured: the head's acceptance on its own rows (provenance.json)."""
        s = self.stats
        return {"proposer": self.spec_string, "tree": list(self.spec.branching), "cut_by_cost": self.cost is not None,
                "alpha": s.alpha, "tau": s.tau, "per_position_acceptance": s.per_position_acceptance,
                "new_tokens": s.new_tokens, "target_forwards": s.target_forwards}


def speculative_engine(target, gen) -> SpeculativeEngine:
    """The engine of `generation` (engine: speculative) on `target`."""
    from draftsmith.decoding.factory import build_proposer

    proposer = build_proposer(gen.proposer, target)
    spec = TreeSpec(tuple(gen.tree)) if gen.tree else TreeSpec.chain(gen.k)
    sampling = SamplingConfig.from_flags(gen.do_sample, gen.temperature, gen.top_p)
    cost = None
    if gen.tree_auto:  # as `draftsmith evaluate --tree auto` decodes (evaluation/setup.py `_cut_trees`)
        from draftsmith.decoding.budget import VerifyCost
        from draftsmith.decoding.cost import measure_verify_cost
        from draftsmith.errors import ConfigError

        spec = proposer.default_tree_spec()
        if spec is None:
            raise ConfigError(f"generation.tree_auto: proposer '{gen.proposer}' has no tree of its own; give "
                              "generation.tree or generation.k")
        cost = VerifyCost.from_measurement(measure_verify_cost(target, 256, spec.capacity(), 5, 0, tree_mask=True))
        spec = proposer.fit_tree(spec, cost)
    engine = SpeculativeEngine(target, proposer, spec, sampling, cost)
    engine.spec_string = gen.proposer
    return engine
