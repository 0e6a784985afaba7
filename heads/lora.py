"""LoRA adapters (peft, Hu et al. 2022), shared by the methods that train a copy of a model cheaply: a distilled
draft retrained with adapters (distill/) and Medusa-2's jointly trained backbone (medusa/medusa2.py). The
adapters are merged into a plain HF model before anything is saved or served (`plain_model`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Annotated

from torch import nn

from draftsmith.config import HELD_OUT, Range, validated


@validated
@dataclass
class LoraSpec:
    """LoRA adapters on the draft (peft); merged into a plain HF model when the artifact is saved."""

    enabled: bool = False
    r: Annotated[int, Range(ge=1, le=4096)] = 16
    alpha: Annotated[int, Range(ge=1, le=1 << 16)] = 32
    dropout: Annotated[float, HELD_OUT] = 0.0
    target_modules: list[str] | None = None  # None = attention and MLP projections


def apply_lora(model: nn.Module, r: int = 16, alpha: int = 32, dropout: float = 0.0,
               target_modules: list[str] | None = None) -> nn.Module:
    """Wrap a draft in a peft LoRA model (only the adapters train): cheap retraining of an existing draft.

    LoRA (Hu et al. 2022): W x + (α/r)·B A x with A [r, d_in], B [d_out, r], B = 0 at start (the wrapped
    model starts equal to the draft).
    """
    from peft import LoraConfig, get_peft_model

    modules = target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, bias="none",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def plain_model(model: nn.Module) -> nn.Module:
    """A plain HF model to save or serve: a peft model is copied and merged (the original stays a peft model)."""
    if is_peft(model):
        return copy.deepcopy(model).merge_and_unload()
    return model
