"""Capture what a frozen target computes in one forward pass: per-layer hidden states and top-k logits.

Layers follow the convention of layers.py (layer i is the OUTPUT of decoder layer i, before the final norm).
transformers 5 gives hidden_states[-1] AFTER the final norm, so the pre-norm output of the last layer is
taken with a forward hook instead of from output_hidden_states; the post-norm state comes back as
`last_hidden`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.capture.layers import resolve_layers
from draftsmith.targets.families import decoder_layers


@dataclass
class Capture:
    logits: torch.Tensor  # [B, T, V] (or None when not asked for)
    last_hidden: torch.Tensor  # [B, T, H] post-final-norm, what the lm_head sees
    layers: dict[int, torch.Tensor]  # layer index -> [B, T, H] pre-norm layer outputs
    past_key_values: object = None


@torch.no_grad()
def capture_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    layers: list[int] | tuple[int, ...] = (), want_logits: bool = True,
                    past_key_values=None, position_ids=None, use_cache: bool = False, **kw) -> Capture:
    """One forward pass of the target returning logits, post-norm last hidden state and chosen layers."""
    stack = decoder_layers(model)
    wanted = resolve_layers(list(layers), len(stack))
    grabbed: dict[int, torch.Tensor] = {}
    handles = []
    for idx in sorted(set(wanted)):
        def hook(_mod, _inp, out, idx=idx):
            grabbed[idx] = out[0] if isinstance(out, tuple) else out
        handles.append(stack[idx].register_forward_hook(hook))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                    position_ids=position_ids, use_cache=use_cache, output_hidden_states=True, **kw)
    finally:
        for h in handles:
            h.remove()
    return Capture(
        logits=out.logits if want_logits else None,
        last_hidden=out.hidden_states[-1],
        layers={i: grabbed[j] for i, j in zip(layers, wanted)},
        past_key_values=getattr(out, "past_key_values", None),
    )


def topk_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values and indices along the vocab; distillation stores these instead of [T, V]."""
    values, indices = torch.topk(logits.float(), k, dim=-1)
    return values, indices


def topk_with_logsumexp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k values and indices plus the logsumexp of the full logits (float32, upcast once): what a capture
    stores so that top-k KD knows the teacher's exact tail mass (heads/losses.py)."""
    full = logits.float()
    values, indices = topk_logits(full, k)  # its .float() is a no-op on `full`
    return values, indices, torch.logsumexp(full, dim=-1)
