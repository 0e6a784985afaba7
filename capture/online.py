"""The features a training job reads per batch, online (the frozen target runs in the step) or offline
(the capture cache, cache.py), as the same tensors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.capture.cache import ShardReader
from draftsmith.capture.forward import capture_forward, topk_logits, topk_with_logsumexp
from draftsmith.errors import DataError


class CaptureSource:
    """"Give me layer 27 and the top-k logits for this batch", online or offline, same tensors.

    `source(batch)` returns {"layer.<i>": [B, T, H], "last_hidden": [B, T, H] (if asked),
    "topk_values": [B, T, k], "topk_indices": [B, T, k], "topk_logsumexp": [B, T] (if asked: the full
    logits' logsumexp)}; positions past a row's length are zero.
    Online it runs the frozen target on batch["input_ids"] / ["attention_mask"] (right-padded);
    offline (`cache_dir` given) it reads rows batch["row_id"] from the capture cache, from each row's
    batch["offset"] on (the window a long row is trained on, data/batching.py).
    """

    def __init__(self, target, layers: Sequence[int] = (), topk: int = 0, last_hidden: bool = False,
                 cache_dir: str | Path | None = None, dtype: torch.dtype | None = None,
                 logsumexp: bool = False) -> None:
        self.target = target
        self.layers = list(layers)
        self.topk = int(topk)
        self.logsumexp = bool(logsumexp)
        if self.logsumexp and not self.topk:
            raise ValueError("CaptureSource: logsumexp comes with top-k logits (topk > 0)")
        self.last_hidden = bool(last_hidden)
        self.dtype = dtype or target.dtype
        self.model = target.model
        self.reader: ShardReader | None = None
        if cache_dir is not None:
            from draftsmith.targets.fingerprint import check_compatible

            self.reader = ShardReader(cache_dir)
            missing = [i for i in self.layers if i not in self.reader.layers]
            if missing:
                raise DataError(f"capture cache {cache_dir} has layers {self.reader.layers}, job needs {self.layers}")
            if self.topk > self.reader.topk:
                raise DataError(f"capture cache {cache_dir} has top-{self.reader.topk}, job needs top-{self.topk}")
            if self.last_hidden and not self.reader.index.get("last_hidden"):
                raise DataError(f"capture cache {cache_dir} has no last_hidden, job needs it")
            if self.logsumexp and not self.reader.index.get("logsumexp"):
                raise DataError(f"capture cache {cache_dir} has no logsumexp (made before it was stored), "
                                "job needs it")
            if self.reader.fingerprint is not None:
                check_compatible(self.reader.fingerprint, target.fingerprint(), what=f"capture cache {cache_dir}")

    @property
    def offline(self) -> bool:
        return self.reader is not None

    def place(self, accelerator) -> None:
        """Put the frozen target on the training device (online only; offline never runs it)."""
        if not self.offline:
            from draftsmith.targets.frozen import place_frozen

            self.model = place_frozen(self.model, accelerator)

    def placed_target(self, accelerator):
        """Place the target (`place`) and return the model a head reads the target's embedding and lm_head from:
        the placed one online (under ZeRO-3 the model inside its inference engine, whose hooks gather its
        layers), or, offline, the target placed whole on this rank's device (not sharded: only its embedding and
        lm_head rows are read)."""
        from draftsmith.targets.frozen import place_frozen

        self.place(accelerator)
        if self.offline:
            return place_frozen(self.target.model, accelerator, shard=False)
        return getattr(self.model, "module", self.model)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.offline_features(batch) if self.offline else self.online_features(batch)

    @torch.no_grad()
    def online_features(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        cap = capture_forward(self.model, ids, mask, layers=self.layers, want_logits=self.topk > 0)
        out = {f"layer.{i}": cap.layers[i] for i in self.layers}
        if self.last_hidden:
            out["last_hidden"] = cap.last_hidden
        if self.logsumexp:
            out["topk_values"], out["topk_indices"], out["topk_logsumexp"] = topk_with_logsumexp(cap.logits, self.topk)
        elif self.topk:
            out["topk_values"], out["topk_indices"] = topk_logits(cap.logits, self.topk)
        if mask is not None:  # zero the padding, as offline does
            keep = mask.bool()
            out = {k: v.masked_fill(~(keep if v.dim() == 2 else keep.unsqueeze(-1)), 0) for k, v in out.items()}
        return out

    def offline_features(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "row_id" not in batch:
            raise DataError("offline capture needs a 'row_id' per row in the batch (keep it in collate)")
        ids = batch["input_ids"]
        B, T = ids.shape
        lengths = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else [T] * B
        offsets = batch["offset"].tolist() if "offset" in batch else [0] * B  # window starts (data/batching.py)
        keys = [f"layer.{i}" for i in self.layers] + (["last_hidden"] if self.last_hidden else [])
        out: dict[str, torch.Tensor] = {}
        for b, row_id in enumerate(batch["row_id"].tolist()):
            row = self.reader.get(row_id)
            n, o = int(lengths[b]), int(offsets[b])
            stored = next(iter(row.values())).shape[0]
            if stored < o + n:
                raise DataError(f"capture cache row {row_id} has {stored} tokens, the batch needs {o + n}: "
                                "the cache was made from other data")
            for k in (keys + (["topk_values", "topk_indices"] if self.topk else []) +
                    (["topk_logsumexp"] if self.logsumexp else [])):
                t = row[k][o : o + n]
                if k in ("topk_values", "topk_indices"):
                    t = t[:, : self.topk]
                if k not in out:
                    dtype = self.dtype if k in keys else (torch.long if k == "topk_indices" else torch.float32)
                    out[k] = torch.zeros((B, T) + tuple(t.shape[1:]), dtype=dtype)
                out[k][b, :n] = t.to(out[k].dtype)
        return {k: v.to(ids.device) for k, v in out.items()}
