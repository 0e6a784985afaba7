"""Medusa-2: the heads trained jointly with a LoRA adapter on the target (Cai et al. 2024, §2.2.2).

Medusa-1 freezes the target, so the heads can only read what the last hidden state already carries.
Medusa-2 also trains low-rank adapters on the target's projections, with a combined loss that keeps the
target's own next-token distribution:

    L = L_medusa(heads on the ADAPTED target's last hidden state) + λ · KL(p_original ‖ p_adapted)

over the learned positions, where p_original is the frozen target's distribution (the adapted model is
distilled towards the model it started as, the paper's self-distillation form of its "combined loss"),
λ = `base_weight`. Online, the original target runs in every step next to the adapted one. With a capture
cache (`capture_cache`), p_original is its cached top-k logits instead, so a step runs the target once,
not twice: KL(p_original|S ‖ p_adapted|S), both conditioned on the top-k support S
(`distill.losses.topk_divergence`, tail="renormalize"). The cache keeps no log-normaliser, so the mass the
adapted target moves outside S is not penalised (a larger k covers more of it).
The adapted target is a different model: speculative decoding with these heads is
lossless with respect to the ADAPTED target (the merged target ships with the artifact's export, and the
evaluator verifies with it), and the KL term is what keeps that target close to the original.

Artifact: model.safetensors holds the heads (as for Medusa-1), `adapter_model.safetensors` +
`adapter_config.json` the LoRA adapter (peft layout, loadable with `PeftModel.from_pretrained`), and
config.json `"medusa2": {...}`. `adapted_target(target, path)` merges the adapter into a copy of the target.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.config import WEIGHT, Range, validated
from draftsmith.errors import ArtifactError
from draftsmith.heads.lora import LoraSpec
from draftsmith.targets.families import pad_token_id

# below this held-out greedy-token agreement with the original, a Medusa-2 job warns that the target drifted: on
# SmolLM2 an adapter at 81% agreement made the target repeat one sentence where the original answered
DRIFT_WARN = 0.95
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@validated
@dataclass
class Medusa2Config(LoraSpec):
    """The LoRA adapter on the target (r, alpha, dropout, target_modules: None = attention and MLP
    projections), λ, the weight of KL(original target ‖ adapted target) next to the heads' loss, and the
    adapter's learning rate as a multiple of the heads' (the paper's differential learning rates: the target
    is trained already, the heads are not). Start from heads trained alone (`train.warm_start` = a Medusa-1
    artifact), as the paper's heads warm-up does: fresh heads' gradients would move the target for nothing."""

    base_weight: Annotated[float, WEIGHT] = 1.0
    # on SmolLM2 the adapter at the heads' lr (1e-3) moved the target to a held-out KL of 0.89 nats within 50
    # steps with no gain in head accuracy over Medusa-1 (BENCHMARKS.md)
    adapter_lr_scale: Annotated[float, Range(gt=0, le=10)] = 0.1


class Medusa2Module(nn.Module):
    """What the training loop optimises: the heads and a LoRA-wrapped COPY of the target (the shared target
    object stays the frozen original, the teacher of the KL term)."""

    def __init__(self, heads: nn.Module, target_model: nn.Module, cfg: Medusa2Config):
        super().__init__()
        from draftsmith.heads.lora import apply_lora

        self.heads = heads
        backbone = copy.deepcopy(target_model)
        backbone.requires_grad_(False)
        self.backbone = apply_lora(backbone, cfg.r, cfg.alpha, cfg.dropout, cfg.target_modules)  # adapters train

    def forward(self, batch: dict[str, torch.Tensor], select: torch.Tensor, sels: list[torch.Tensor]):
        """One forward for the loss (through __call__, so a DDP wrapper sees it): the adapted target's logits at
        `select` [N, V] and head i's logits at its positions `sels[i]`."""
        hidden, logits = self.hidden_and_logits(batch, select)
        dtype = next(self.heads.parameters()).dtype
        return logits, self.heads([hidden[sel].to(dtype) for sel in sels])

    def hidden_and_logits(self, batch: dict[str, torch.Tensor], select: torch.Tensor | None):
        """Post-norm last hidden state [B, T, H] of the adapted target, and its logits at `select` [N, V]."""
        out = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1]
        logits = self.backbone.get_output_embeddings()(hidden[select]) if select is not None else None
        return hidden, logits


def base_kl(adapted_logits: torch.Tensor, original_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_original ‖ p_adapted), mean over positions (full vocabulary)."""
    log_p = F.log_softmax(original_logits.float(), -1)
    log_q = F.log_softmax(adapted_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def adapter_state(module: Medusa2Module) -> tuple[dict[str, torch.Tensor], dict]:
    from peft import get_peft_model_state_dict

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(module.backbone).items()}
    cfg = module.backbone.peft_config["default"].to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"]) if cfg.get("target_modules") else None
    return state, json.loads(json.dumps(cfg, default=str))


def has_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_WEIGHTS).is_file()


def adapted_target(target, path: str | Path):
    """A new Target: a copy of `target`'s model with the artifact's LoRA adapter merged in."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from draftsmith.targets import Target, freeze

    path = Path(path)
    if not has_adapter(path):
        raise ArtifactError(f"{path}: no {ADAPTER_WEIGHTS} (not a Medusa-2 artifact)")
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    fields = {k: raw[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "bias") if k in raw}
    model = copy.deepcopy(target.model)
    peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **fields))
    result = set_peft_model_state_dict(peft, load_file(str(path / ADAPTER_WEIGHTS)))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise ArtifactError(f"{path}: the adapter misses {missing[:3]}")
    merged = peft.merge_and_unload()
    return Target(f"{target.name}+medusa2", freeze(merged), target.tokenizer, f"{target.spec}+{path}", None)


@torch.no_grad()
def target_drift(original, adapted, rows, pad_id: int, max_length: int, batch_size: int = 8) -> dict[str, float]:
    """How far an adapter moved the target, at the positions whose next token is learned in `rows`
    (self-distilled rows): the share where the adapted target's greedy token is the original's, and
    KL(original ‖ adapted) over the full vocabulary (mean per position)."""
    from draftsmith.data.batching import next_token_learned, pad_rows

    agree = kl = n = 0.0
    rows = list(rows)
    for i in range(0, len(rows), batch_size):
        b = pad_rows(rows[i:i + batch_size], pad_id, max_length)
        sel = next_token_learned(b["loss_mask"])
        if not sel.any():
            continue
        lo, la = (_logits_at(model, b, sel) for model in (original, adapted))  # the two may sit on other devices
        m = int(sel.sum())
        agree += float((lo.argmax(-1) == la.argmax(-1)).sum())
        kl += float(base_kl(la, lo)) * m
        n += m
    if n == 0:
        raise ArtifactError("no learned positions in the rows given: nothing to compare")
    return {"positions": int(n), "agreement": agree / n, "kl": kl / n}


def _logits_at(model, batch: dict[str, torch.Tensor], sel: torch.Tensor) -> torch.Tensor:
    """model's float32 logits at the positions `sel` [B, T] of a right-padded batch, on the CPU: [n, V]."""
    dev = next(model.parameters()).device
    out = model(input_ids=batch["input_ids"].to(dev), attention_mask=batch["attention_mask"].to(dev)).logits
    return out[sel.to(dev)].float().cpu()


def held_out_drift(artifact: str | Path, data: str | Path, target_spec: str = "smollm2-135m",
                   eval_fraction: float = 0.05, seed: int = 0, max_length: int = 384) -> dict:
    """`draftsmith medusa2-drift`: the adapter's drift on the dataset's held-out rows (the split a Medusa job
    with the same seed and fraction holds out): `target_drift`'s numbers and the rows they come from."""
    from draftsmith.data import load_distilled
    from draftsmith.data.batching import split_rows
    from draftsmith.targets import load_target

    target = load_target(target_spec)
    _, held_out = split_rows(load_distilled(data, target), eval_fraction, seed)
    drift = target_drift(target.model, adapted_target(target, artifact).model, held_out, pad_token_id(target),
                         max_length)
    return {"rows": len(held_out), **drift}
