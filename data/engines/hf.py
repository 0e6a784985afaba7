"""`generation.engine: hf`: transformers' own `generate` writes the rows, the reference the batched loop is
compared with (decoding/hf.py is the wrapper evaluation shares).

Static batches of `batch_size` prompts, sorted by length and left-padded: a batch runs until its longest
row ends, which is the waste the continuous loop (continuous.py) avoids. A sampled batch is seeded by its
first row's seed, so unlike the loop a row's sample depends on the rows beside it. No capture: it needs the
loop's forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from draftsmith.data.engines.base import Completion, Request, TextEngine, run_stats
from draftsmith.decoding.hf import cut_at_eos, hf_generate, left_padded
from draftsmith.decoding.sampling import SamplingConfig


class HFEngine(TextEngine):
    def __init__(self, model, eos_token_ids: Sequence[int], pad_token_id: int, batch_size: int,
                 sampling: SamplingConfig | None = None):
        self.model = model
        self.eos = set(int(e) for e in eos_token_ids)
        self.pad = int(pad_token_id)
        self.batch_size = batch_size
        self.sampling = sampling or SamplingConfig()

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], on_done: Callable[[Completion], None],
            on_tokens: Callable[[int], None] | None = None) -> dict[str, float]:
        queue = sorted(requests, key=lambda r: len(r.prompt_ids))
        generated = 0
        t0 = time.perf_counter()
        for s in range(0, len(queue), self.batch_size):
            generated += self._batch(queue[s : s + self.batch_size], on_done, on_tokens)
        return run_stats(generated, time.perf_counter() - t0)

    def _batch(self, batch: list[Request], on_done, on_tokens) -> int:
        """One static batch; returns the tokens it generated."""
        ids, mask = left_padded([r.prompt_ids for r in batch], self.pad, next(self.model.parameters()).device)
        if not self.sampling.greedy:
            torch.manual_seed(batch[0].seed)
        rows = hf_generate(self.model, ids, mask, max(r.max_new_tokens for r in batch), self.sampling,
                           sorted(self.eos), self.pad)
        generated = 0
        for r, row in zip(batch, rows):
            tokens, stopped = cut_at_eos(row, self.eos, r.max_new_tokens)
            generated += len(tokens)
            if on_tokens:
                on_tokens(len(tokens))
            on_done(Completion(r.key, r.prompt_ids, tokens, stopped))
        return generated
