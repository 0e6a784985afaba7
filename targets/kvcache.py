"""KV-cache rollback for transformers 5 `DynamicCache`: crop to a length, or keep a tree's accepted path.

transformers 5 changed `DynamicCache.crop(n)`: a positive n is refused by the layers, a negative n removes
|n| tokens. These helpers take the length to KEEP and work on `cache.layers[i].keys/values`
([B, heads, T, head_dim]) directly, so both chain rollback (crop) and tree rollback (gather the accepted
path's entries to the front of the block, then crop) are one tensor operation per layer.

Every layer keeps every position, sliding-window ones included (`new_cache`): a window's layer that dropped
the oldest positions could not be rolled back past them, and gpt-oss's window is 128 tokens. The model
still attends within the window, from its own masks (or the per-layer-type tree masks of decoding/verify.py);
only the memory of the local layers grows with the context. A cache built with sliding layers elsewhere is
rolled back while it still holds every position, and refused past that.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError


def new_cache(model):
    """A cache of full layers for `model` (module docstring: no layer evicts, so every rollback is exact)."""
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise DraftsmithError(f"unsupported KV cache type {type(cache).__name__} (need a transformers 5 DynamicCache)")
    return layers


def _check_layer(layer, length: int) -> None:
    if not getattr(layer, "is_initialized", True) or layer.keys is None:
        return
    stored = layer.keys.shape[-2]
    if getattr(layer, "is_sliding", False) and stored != getattr(layer, "cumulative_length", stored):
        raise DraftsmithError(
            f"cannot roll back a sliding-window KV cache past its window ({layer.sliding_window} tokens); "
            "use shorter prompts/generations for this target"
        )
    if stored < length:
        raise DraftsmithError(f"KV cache holds {stored} positions, cannot keep {length}")


def crop(cache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        _check_layer(layer, length)
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = length


def keep_positions(cache, start: int, keep: list[int]) -> None:
    """Tree rollback: of the block that begins at `start`, keep block offsets `keep` (ascending), moved to
    start, start+1, ...; everything after is dropped. keep == [0, 1, ..., m-1] is a plain crop."""
    if keep == list(range(len(keep))):
        crop(cache, start + len(keep))
        return
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        _check_layer(layer, start + max(keep) + 1)
        idx = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + start
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = start + len(keep)
