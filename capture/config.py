"""What a capture keeps: the `capture` section of a data preset (`DataConfig.capture`, data/config.py), read
by `draftsmith data generate` (capture while the target writes, or from the capture replicas that write the
answers: `backend: vllm`, data/served.py) and `draftsmith data capture` (offline.py)."""

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
    # padded tokens per prefill batch (rows sorted by length)
    batch_tokens: Annotated[int, Range(ge=1, le=1 << 24)] = 8192
    # who computes the features: target = the target draftsmith loads (while it writes, or once over the finished
    # rows); vllm = the servers that write the answers are capture replicas (vLLM's extract_hidden_states and
    # draftsmith's KV connector, fleet/vllm_capture.py), and each row's features come from the file of its last
    # turn's request: the target runs only its final norm and lm_head (needs generation.backend: openai)
    backend: Literal["target", "vllm"] = "target"
    # backend vllm: the connector's capture_dir, which draftsmith must read (shared storage in a fleet); required
    # with generation.base_urls, else the local replica draftsmith starts writes into <output_dir>/served
    served_dir: str | None = None
    # backend vllm: seconds to wait, in all, for the capture files of rows just answered (the connector writes a
    # request's file just after its answer went out); a row whose file is still missing is captured by the target
    served_wait: Annotated[float, Range(ge=0, le=3600)] = 60.0

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"capture.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.enabled and not (self.layers or self.topk or self.last_hidden):
            raise ValueError("capture.enabled needs layers, topk or last_hidden")
        if self.backend not in ("target", "vllm"):
            raise ValueError(f"capture.backend must be target or vllm, got {self.backend!r}")
        if self.backend == "vllm" and not self.enabled:
            raise ValueError("capture.backend vllm names who captures: it needs capture.enabled")
