"""transformers' own `model.generate`: the outside reference our decoders are checked against.

Its two users share this one wrapper: evaluation decodes each prompt with it (and with HF assisted
generation) as the independent reference for `lossless` and for plain decoding's speed
(evaluation/decode.py), and `generation.engine: hf` writes data with it in static, left-padded batches
(data/engines/hf.py). A `SamplingConfig` maps to generate's arguments here only: greedy passes
`do_sample=False` and clears temperature, top_p and top_k, so that a model's own generation_config cannot
turn sampling back on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.decoding.sampling import SamplingConfig


def generate_kwargs(sampling: SamplingConfig) -> dict:
    """`model.generate`'s sampling arguments for `sampling`."""
    if sampling.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k or None}


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int | None,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch: input ids [B, P] and their attention mask (0 on the padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 0 if pad_token_id is None else pad_token_id, dtype=torch.long,
                     device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                eos_ids: Sequence[int], pad_token_id: int | None, **extra) -> list[list[int]]:
    """`model.generate` on a left-padded batch (`left_padded`); each row's new tokens as generate returns them
    (past an EOS: padding, see `cut_at_eos`). `extra` goes to generate as it is (e.g. `assistant_model`)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids) or None, pad_token_id=pad_token_id,
                             **generate_kwargs(sampling), **extra)
    return out[:, ids.shape[1]:].tolist()


def cut_at_eos(tokens: Sequence[int], eos: set[int], limit: int | None = None) -> tuple[list[int], bool]:
    """The tokens up to and including the first EOS, at most `limit` of them; and whether an EOS ended them."""
    out: list[int] = []
    for t in tokens[:limit]:
        out.append(t)
        if t in eos:
            return out, True
    return out, False
