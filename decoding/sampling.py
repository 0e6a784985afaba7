"""Sampling rules shared by the target and every proposer.

Lossless speculative sampling needs the proposer's distribution q and the target's distribution p to be
the SAME transformation of their logits (temperature, then top-k, then top-p), so one function,
`probs_from_logits`, makes both. Temperature 0 means greedy: the "distribution" is a one-hot on the
argmax (ties broken by the lowest token id, as `torch.argmax` does), which turns every rejection-sampling
rule into "accept iff the draft token is the target's argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_flags(cls, do_sample: bool, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingConfig:
        """`generation.do_sample` (data/config.py): off is greedy whatever temperature says."""
        return cls(temperature, top_k, top_p) if do_sample else cls()


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p.

    Greedy gives a one-hot on the argmax. top-k keeps the k largest logits; top-p then keeps the smallest
    set of most-probable tokens whose mass reaches top_p (the token that crosses the threshold is kept),
    exactly as HF's logits warpers order them (temperature -> top-k -> top-p).
    """
    logits = logits.float()
    if cfg.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= cfg.top_p  # the first token is always kept (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator | None, device: torch.device | str = "cpu") -> float:
    return float(torch.rand((), generator=generator, device=device).item())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to sample from after rejecting a draw from q
    (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, eq. 1). If p == q on the support (nothing
    left), p itself is returned — that branch has probability zero of being reached."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p
