"""What a capture keeps: the `capture` section of a data preset (`DataConfig.capture`, data/config.py), read
by `draftsmith data generate` (capture while the target writes) and `draftsmith data capture` (offline.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from draftsmith.config import LAYER, Range, validated


@validated
@dataclass
class CaptureConfig:
    """Keep what the target computes while it generates (offline cache for head training): the `capture`
    section of a data preset."""

    enabled: bool = False
    layers: list[Annotated[int, LAYER]] = field(default_factory=list)  # convention of layers.py (-1 = last, pre-norm)
    topk: Annotated[int, Range(ge=0, le=1 << 20)] = 0  # 0 = no logits kept
    last_hidden: bool = False  # the post-norm state the lm_head sees (Medusa's input)
    # teacher-forced capture (`draftsmith data capture`, and `responses: keep` with enabled)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bf16 where native (targets/precision.py)
    batch_tokens: Annotated[int, Range(ge=1, le=1 << 24)] = 8192  # padded tokens per prefill batch (rows sorted by length)

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"capture.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.enabled and not (self.layers or self.topk or self.last_hidden):
            raise ValueError("capture.enabled needs layers, topk or last_hidden")
