"""Prompt-lookup (n-gram) proposer: no model, no training.

Take the last n tokens of the context (n from `max_ngram` down to `min_ngram`), find their most recent
earlier occurrence in the prompt + output so far, and propose the tokens that followed it (Saxena 2023,
"prompt lookup decoding"; HF's `prompt_lookup_num_tokens`). Candidates are deterministic (q = None), so
the verifier's sampling rule 2 keeps it lossless at any temperature.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import ConfigError


def find_continuation(context: torch.Tensor, n: int, length: int, earliest: bool = False) -> torch.Tensor | None:
    """Tokens following the most recent (`earliest`: the first) earlier occurrence of context[-n:], up to `length` of
    them."""
    total = context.numel()
    if total <= n or length <= 0:
        return None
    suffix = context[-n:]
    windows = context[:-1].unfold(0, n, 1)  # [total-n, n]; excludes the suffix's own window
    hits = torch.nonzero((windows == suffix).all(dim=1)).flatten()
    if hits.numel() == 0:
        return None
    start = int(hits[0] if earliest else hits[-1]) + n
    cont = context[start:start + length]
    return cont if cont.numel() else None


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, earliest: bool = False):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # vLLM's n-gram proposer drafts after the FIRST occurrence of the longest matching n-gram
        # (vllm/v1/spec_decode/ngram_proposer.py); draftsmith's own lookup after the most recent one
        self.earliest = earliest

    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            cont = find_continuation(context, n, spec.depth, self.earliest)
            if cont is not None:
                return Proposal.chain(cont, None, device=context.device)
        return Proposal.empty(context.device)
