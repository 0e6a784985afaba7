"""The one interface every text engine has: requests in, completions out.

`generate_dataset` (data/generate.py) and the magpie source (data/magpie.py) hand an engine a list of
`Request`s; the engine hands back one `Completion` per request through `on_done` as soon as that row is
finished, in whatever order it finishes them (the caller keys rows by `Request.key`), and counts generated
tokens through `on_tokens` for the progress bar. What an engine samples with, where it stops and what it
captures are fixed when it is built (`data.engines.engine_for`), so a caller never asks which engine it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Request:
    key: Any  # the caller's handle (e.g. a row id)
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int = 0
    # with top-k capture: the first prompt position whose logits are wanted (the one before the first learned
    # token); earlier positions are stored as zeros, which skips the lm_head over most of a prompt.
    # None: every position.
    logits_from: int | None = None


@dataclass
class Completion:
    key: Any
    prompt_ids: list[int]
    tokens: list[int]  # generated ids, the stop token included when one was produced
    stopped: bool  # True: ended with an EOS id; False: hit max_new_tokens
    # {"layers": {i: [T,H]}, "last_hidden": [T,H], "topk_values"/"topk_indices": [T,k], "topk_logsumexp": [T]}
    capture: dict[str, Any] | None = None
    # on-policy rollouts (data/engines/rollout.py): per position of prompt + tokens, where the draft was rejected
    replay: list[int] | None = None


class TextEngine(ABC):
    """Something that writes completions: the batched decode loop, transformers `generate`, OpenAI-compatible
    servers, or speculative rollouts with a head (data/engines/__init__.py picks one)."""

    # run() fills Completion.capture itself (the batched engine built with a CaptureSpec); for any other engine
    # generation has the target read the finished rows once afterwards (capture/offline.py)
    captures: bool = False
    # the key of provenance.json's `timing` that describe() is recorded under (None: nothing to record)
    report_as: str | None = None
    # set by engine_for: the target the rows are formatted, masked and captured with (for the local engines,
    # the target as it writes, in the generation dtype), and what run.json records of who wrote the rows (a
    # resumed run must match it)
    target: Any = None
    precision: dict | None = None

    @abstractmethod
    def run(self, requests: Sequence[Request], on_done: Callable[[Completion], None],
            on_tokens: Callable[[int], None] | None = None) -> dict[str, float]:
        """Write every request; `on_done` gets each Completion as soon as it is finished, `on_tokens` the number
        of tokens just generated. Returns at least generated_tokens, seconds and tokens_per_s."""

    def describe(self) -> dict | None:
        """What the run measured beyond the counters `run` returns (recorded under `report_as`)."""
        return None


def run_stats(generated: int, seconds: float) -> dict[str, float]:
    """The counters every engine's `run` returns."""
    return {"generated_tokens": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds > 0 else 0.0}
