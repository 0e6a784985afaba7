"""Capture what a frozen target computes: per-layer hidden states and top-k logits.

Layer convention (used everywhere in draftsmith, artifacts included): layer i, 0-based, is the OUTPUT
of decoder layer i, before the final norm. Layer -1 means the last decoder layer's output (pre-norm).
`final` (the post-norm state the lm_head sees) is returned separately as `last_hidden` — that is
Medusa's input. transformers 5 gives hidden_states[-1] AFTER the final norm, so the pre-norm
output of the last layer is taken with a forward hook instead of from output_hidden_states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import ConfigError
from draftsmith.targets.families import decoder_layers


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    out = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ConfigError(f"layer {i} is out of range for a target with {num_layers} layers")
        out.append(j)
    return out


def default_eagle3_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 fusion layers the serving ecosystem defaults to, as draftsmith ids (decoder-layer outputs).

    vLLM, SGLang and speculators take the residual stream entering layers (2, L/2, L-3); entering layer i is
    the output of layer i-1, so draftsmith's ids are (1, L/2-1, L-4), and a head trained on them fuses the same
    features as the published speculators heads users start from. Targets too shallow for those three to be
    distinct (under 7 layers) get first / middle / last of the layers the stacks capture (outputs of 0..L-2:
    the last layer's output never enters a layer, so no stack captures it); under 4 layers there are not
    three of them.
    """
    L = num_layers
    picked = [1, L // 2 - 1, L - 4]
    if not 0 <= picked[0] < picked[1] < picked[2]:
        picked = sorted({0, (L - 1) // 2, L - 2})
    if len(picked) < 3 or picked[0] < 0:
        raise ConfigError(f"EAGLE-3 fuses 3 distinct layers a serving stack captures (outputs of layers 0..L-2), "
                          f"and this target has {L} layer(s): use EAGLE-1 or a deeper target")
    return picked


def bench_layers(num_layers: int) -> list[int]:
    """The layers a benchmark captures to cost what an EAGLE-3 job would: its default layers, or every layer of
    a target too shallow to have three a serving stack captures."""
    try:
        return default_eagle3_layers(num_layers)
    except ConfigError:
        return list(range(num_layers))


def uncapturable_layers(layers: list[int], num_layers: int) -> list[int]:
    """The EAGLE-3 feature layers (draftsmith ids, resolved) no serving stack captures.

    vLLM and SGLang record the residual stream entering decoder layers 0..L-1, i.e. the outputs of layers
    -1 (the embeddings) .. L-2: the output of the last layer (id L-1) is never captured, and a head fed it would
    get 2 features for its 3 x H fc once served.
    """
    return [i for i in layers if i >= num_layers - 1]


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
