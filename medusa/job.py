"""Training Medusa heads through the one training loop: on a frozen target (Medusa-1) or jointly with a
LoRA adapter on the target (Medusa-2, `medusa2.enabled`, see medusa/medusa2.py).

The job differs from its siblings only by its module (MedusaHeads, or heads + adapted target), its
batches (self-distilled rows) and its loss (`medusa.model.medusa_loss`, plus Medusa-2's KL term). After training,
the heads are calibrated on held-out rows: per-head rank accuracies give the sparse candidate tree saved with the
artifact.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import torch

from draftsmith import artifact
from draftsmith.config import (
    FRACTION,
    PROBABILITY,
    ROWS,
    TOKENS,
    VOCAB,
    Range,
    register_config,
    to_dict,
    validated,
)
from draftsmith.data.batching import next_token_learned
from draftsmith.errors import ConfigError
from draftsmith.heads.losses import topk_divergence
from draftsmith.heads.vocab import draft_index, draft_vocabulary, token_counts, vocab_coverage
from draftsmith.medusa.medusa2 import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Medusa2Config
from draftsmith.medusa.model import (
    MedusaHeads,
    build_tree,
    head_labels,
    head_positions,
    head_weights,
    medusa_loss,
    rank_accuracies,
)
from draftsmith.outputs import atomic_write_json
from draftsmith.targets.families import family
from draftsmith.training.config import EvalAfterTraining, TrainConfig, check_output_folders
from draftsmith.training.job import RowsJob, unwrap

log = logging.getLogger(__name__)


def _reads(cfg: MedusaJobConfig, teacher_from_cache: bool) -> dict:
    """CaptureSource's arguments: the post-norm last hidden the heads read (not when Medusa-2's adapted target
    gives it in the step), and top-k logits for the KD loss or Medusa-2's cached teacher."""
    return {"layers": [], "topk": cfg.kd_topk if (cfg.kd_weight > 0 or teacher_from_cache) else 0,
            "last_hidden": not teacher_from_cache, "logsumexp": False}


def features(cfg: MedusaJobConfig, target) -> dict:
    """What a Medusa-1 job reads of the frozen target per token (methods.Method.features). Medusa-2 trains the
    target itself: its features change every step, so no capture, the fleet's included, stands for them."""
    if cfg.medusa2.enabled:
        raise ConfigError("medusa2.enabled: Medusa-2 adapts the target as it trains, so no captured states (the "
                          "fleet's included) stand for its features: train it with the target")
    return _reads(cfg, False)



@register_config("medusa")
@validated
@dataclass
class MedusaJobConfig:
    target: str = "smollm2-135m"
    data: str = "runs/data/smollm2-135m"  # a self-distilled dataset (draftsmith data generate)
    output: str = "runs/medusa/smollm2-135m"  # the artifact directory
    num_heads: Annotated[int, Range(ge=1, le=16)] = 4
    num_layers: Annotated[int, Range(ge=1, le=64)] = 1
    share_lm_head: bool = False
    # heads over the N tokens the target writes most often in the training split (medusa/model.py); None = all
    draft_vocab_size: Annotated[int, VOCAB] | None = None
    decay: Annotated[float, PROBABILITY] = 0.8  # head i weighs decay**i
    kd_weight: Annotated[float, FRACTION] = 0.0  # mix in KL to the target's own distribution (its top-k logits)
    # k of the target's top-k logits used as a teacher: head KD (kd_weight), and for Medusa-2 trained from a
    # capture cache the KL term's teacher (at most the cache's k)
    kd_topk: Annotated[int, Range(ge=1, le=1 << 24)] = 64
    max_length: Annotated[int, Range(ge=8, le=TOKENS.le)] = 512
    eval_fraction: Annotated[float, Range(gt=0, lt=0.5)] = 0.05
    calibration_rows: Annotated[int, ROWS] = 64
    tree_budget: Annotated[int, Range(ge=1, le=4096)] = 48  # nodes of the sparse candidate tree
    tree_max_rank: Annotated[int, Range(ge=1, le=1024)] = 8  # candidates per head considered by the tree builder
    # offline target features (capture/cache.py); None = online. Medusa-2 runs its adapted target online
    # anyway and reads only the original target's top-k logits (its KL teacher) from the cache
    capture_cache: str | None = None
    medusa2: Medusa2Config = field(default_factory=Medusa2Config)  # joint LoRA training of the target
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvalAfterTraining = field(default_factory=EvalAfterTraining)

    def __post_init__(self):
        check_output_folders(self.output, self.train.output_dir)
        if self.draft_vocab_size is not None and (self.draft_vocab_size < 1 or self.share_lm_head):
            raise ValueError("draft_vocab_size must be >= 1 and cannot be combined with share_lm_head (the shared "
                             "projection is the target's whole lm_head)")
        if isinstance(self.medusa2, dict):
            self.medusa2 = Medusa2Config(**self.medusa2)


class MedusaJob(RowsJob):
    kind = "medusa"

    def data_path(self) -> str | None:
        return self.cfg.data

    @classmethod
    def check_launch(cls, cfg: MedusaJobConfig, accelerator) -> None:
        from draftsmith.training.launch import SHARDED, preset_kind

        if cfg.medusa2.enabled and accelerator.num_processes > 1 and preset_kind(accelerator) in SHARDED:
            raise ConfigError(f"medusa2.enabled: Medusa-2 adapts the target itself and checks its drift against a "
                              f"whole target on rank 0; under {preset_kind(accelerator)} the target is sharded "
                              "across ranks: use a DDP preset (configs/accelerate/multi_gpu_ddp.yaml) for Medusa-2")

    def __init__(self, cfg: MedusaJobConfig, target, dataset=None):
        family(target.config)  # a family outside targets/families.py: one line, before any work
        if dataset is None:  # the self-distilled rows cfg.data names
            from draftsmith.data import load_distilled

            dataset = load_distilled(cfg.data, target)
        self.cfg, self.target = cfg, target
        self.use_rows(dataset, target, cfg.eval_fraction, cfg.train, cfg.max_length)
        self._calib_hidden: dict[tuple[str, int], torch.Tensor] = {}  # before_artifact's target hidden states
        self.weights = head_weights(cfg.num_heads, cfg.decay)
        from draftsmith.capture.online import CaptureSource

        # Medusa-2 from a capture cache: the adapted target runs in the step (its features change every step),
        # the frozen original is not run at all: its cached top-k logits are the KL teacher
        teacher_from_cache = self.medusa2 and cfg.capture_cache is not None
        self.features = CaptureSource(target, cache_dir=cfg.capture_cache, **_reads(cfg, teacher_from_cache))
        self.draft_vocab, self.counts = None, None
        if cfg.draft_vocab_size is not None:
            self.counts = token_counts(self.train_set, target.vocab_size)
            d2t, t2d, _ = draft_vocabulary(self.counts, cfg.draft_vocab_size)
            self.draft_vocab = (d2t, t2d)

    # --- the job protocol -------------------------------------------------------------------------
    @property
    def medusa2(self) -> bool:
        return self.cfg.medusa2.enabled

    def build_module(self):
        heads = MedusaHeads.from_target(self.target.config, self.cfg.num_heads, self.cfg.num_layers,
                                        self.cfg.share_lm_head, lm_head=self.target.model.lm_head,
                                        draft_vocab=self.draft_vocab)
        if not self.medusa2:
            return heads
        from draftsmith.medusa.medusa2 import Medusa2Module

        return Medusa2Module(heads, self.target.model, self.cfg.medusa2)

    def lr_scale(self, name: str) -> float:
        """The training loop's lr multiplier per parameter: Medusa-2's adapter learns at adapter_lr_scale."""
        return self.cfg.medusa2.adapter_lr_scale if self.medusa2 and "lora_" in name else 1.0

    def warm_start_module(self, module):
        """What a warm-start artifact's weights load into: the heads (a Medusa-2 module also holds the adapted
        target; its adapter starts at zero, the heads from a Medusa-1 or Medusa-2 artifact)."""
        return module.heads if self.medusa2 else module

    def setup(self, accelerator) -> None:
        self.features.place(accelerator)  # Medusa-2: the frozen original target, the teacher of the KL term

    def learned_tokens(self, batch) -> int:
        """Positions this job learns from: head 0's (label x_{t+2} learned; the later heads' are a subset),
        and for Medusa-2 also the adapter's next-token positions. A batch whose only learned tokens sit at
        position 1 has none for the heads: the loop skips and counts it instead of scoring a loss of 0."""
        mask = batch["loss_mask"]
        n = int(head_positions(mask, 0).sum())
        return n + int(next_token_learned(mask).sum()) if self.medusa2 else n

    def target_outputs(self, batch, module=None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Post-norm last hidden state [B, T, H] (and top-k logits when KD is on), online or from the cache;
        for Medusa-2 the ADAPTED target's (no grad: calibration)."""
        if self.medusa2 and module is not None:
            with torch.no_grad():
                hidden, _ = unwrap(module).hidden_and_logits(batch, None)
            feats = self.features(batch) if self.cfg.kd_weight > 0 else {}
            teacher = (feats["topk_values"], feats["topk_indices"]) if self.cfg.kd_weight > 0 else None
            return hidden, teacher
        feats = self.features(batch)
        teacher = (feats["topk_values"], feats["topk_indices"]) if self.cfg.kd_weight > 0 else None
        return feats["last_hidden"], teacher

    def loss(self, module, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        sels = [head_positions(mask, i) for i in range(self.cfg.num_heads)]
        base_kl = None
        if self.medusa2:
            from draftsmith.medusa.medusa2 import base_kl as kl_fn

            select = next_token_learned(mask)
            adapted, logits = module(batch, select, sels)  # heads read the ADAPTED target (grad flows into LoRA)
            feats = self.features(batch)  # the frozen original target, online or its cached top-k logits
            if self.features.offline:
                # both distributions conditioned on the cached top-k support: the cache keeps no log-normaliser,
                # so a bucketed tail would read the teacher's as 0 and push the adapted target to sharpen
                base_kl = topk_divergence(adapted, feats["topk_values"][select], feats["topk_indices"][select],
                                          "forward_kl", tail="renormalize")
                original_top1 = feats["topk_indices"][select][:, 0]
            else:
                with torch.no_grad():
                    original = self.target.model.get_output_embeddings()(feats["last_hidden"][select])
                base_kl = kl_fn(adapted, original)
                original_top1 = original.argmax(-1)
            # how often the adapted target's greedy token is still the original's (what its outputs keep)
            base_agree = (adapted.detach().argmax(-1) == original_top1).float().mean()
            teacher = (feats["topk_values"], feats["topk_indices"]) if self.cfg.kd_weight > 0 else None
        else:
            hidden, teacher = self.target_outputs(batch)
            dtype = next(module.parameters()).dtype
            # each head sees only the positions whose label is an assistant token
            logits = module([hidden[sel].to(dtype) for sel in sels])
        lookup = self._lookup(module)
        labels = [self._draft_ids(lookup, head_labels(ids, sel, i)) for i, sel in enumerate(sels)]
        t = None
        if teacher is not None:  # the target at t+1+i is the teacher of head i at t
            t = [tuple(torch.roll(x, shifts=-(i + 1), dims=1)[sel] for x in teacher) for i, sel in enumerate(sels)]
            t = [(v, self._draft_ids(lookup, idx)) for v, idx in t]
        loss, metrics = medusa_loss(logits, labels, self.weights, t, self.cfg.kd_weight)
        if base_kl is not None:
            loss = loss + self.cfg.medusa2.base_weight * base_kl
            metrics["base/kl"] = float(base_kl.detach())
            metrics["base/agree"] = float(base_agree)
        return loss, metrics

    def _lookup(self, module) -> torch.Tensor | None:
        """Target id -> draft id of the vocabulary the MODULE holds: a warm start or a resume loads its
        own (d2t, t2d) buffers, which may differ from the one counted on this job's data."""
        heads = unwrap(module)
        heads = heads.heads if self.medusa2 else heads
        return None if heads.t2d is None else draft_index(heads.t2d)

    @staticmethod
    def _draft_ids(lookup: torch.Tensor | None, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> the heads' output ids (-1 outside a draft vocabulary)."""
        return target_ids if lookup is None else lookup.to(target_ids.device)[target_ids.long()]

    def save_artifact(self, module, out_dir, metrics) -> Path:
        acc = self.calibrate(module)
        tree = build_tree(acc, self.cfg.tree_budget)
        heads = module.heads if self.medusa2 else module
        config = {**asdict(heads.config), "target_layer": "last_hidden (post-norm)"}
        adapter = None
        if self.medusa2:
            from draftsmith.medusa.medusa2 import DRIFT_WARN, adapter_state, target_drift

            adapter = adapter_state(module)
            config["medusa2"] = {"adapter": ADAPTER_WEIGHTS, "base_weight": self.cfg.medusa2.base_weight,
                                 "note": "verify with the adapted target (the adapter merged into the target)"}
            with torch.no_grad():  # what the adapted target still writes as the original did, on held-out rows
                drift = target_drift(self.target.model, unwrap(module).backbone.eval(),
                                     list(self.eval_set)[: self.cfg.calibration_rows], self.pad_id, self.cfg.max_length)
            metrics = {**metrics, "target_drift": drift}
            if drift["agreement"] < DRIFT_WARN:
                log.warning("the adapted target's greedy token is the original's at only %.1f%% of held-out "
                            "positions (KL %.3f): decoding with these heads is lossless w.r.t. a target that writes "
                            "other text; raise medusa2.base_weight or lower medusa2.adapter_lr_scale",
                            100 * drift["agreement"], drift["kl"])
        manifest = artifact.make_manifest(
            "medusa", self.target.fingerprint(), to_dict(self.cfg),
            data={"path": self.cfg.data, "train_rows": len(self.train_set), "eval_rows": len(self.eval_set)},
            metrics={**metrics, "calibration_rank_accuracy": acc, "tree_expected_length": tree.expected_length,
                     "draft_vocab_coverage": (1.0 if heads.t2d is None
                                              else vocab_coverage(self.counts, heads.t2d.cpu()))},
        )

        def write_tree(tmp: Path) -> None:
            atomic_write_json(tmp / "tree.json", tree.to_json())
            if adapter is not None:
                from safetensors.torch import save_file

                save_file(adapter[0], str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
                atomic_write_json(tmp / ADAPTER_CONFIG, adapter[1])

        return artifact.save_artifact(self.artifact_dest(out_dir), manifest, heads.state_dict(), config,
                                      writer=write_tree)

    def artifact_dest(self, out_dir) -> Path:
        """The artifact goes where the config says (the loop's default is <train.output_dir>/artifact)."""
        return Path(self.cfg.output or out_dir)

    # --- calibration ------------------------------------------------------------------------------
    def _calibration_rows(self, split: str) -> list:
        return list(self.eval_set if split == "eval" else self.train_set)[: self.cfg.calibration_rows]

    @torch.no_grad()
    def before_artifact(self) -> None:
        """Every rank, before rank 0 writes the artifact: the frozen target's hidden states on the calibration
        rows. Under FSDP / ZeRO-3 the target is sharded across ranks and its forward is collective (each layer
        is all-gathered), so rank 0 cannot run it alone inside `save_artifact`; all ranks run it here on the
        same rows and rank 0 keeps the result. Medusa-2 calibrates with its own adapted backbone instead."""
        if self.medusa2:
            return
        self._calib_hidden = {}
        device = next(self.target.model.parameters()).device
        for split in ("eval", "train"):
            rows = self._calibration_rows(split)
            for start in range(0, len(rows), 8):
                batch = {k: v.to(device) for k, v in self.collate(rows[start : start + 8]).items()}
                self._calib_hidden[(split, start)] = self.target_outputs(batch)[0].cpu()

    @torch.no_grad()
    def calibrate(self, module) -> list[list[float]]:
        """acc[i][r]: how often head i's rank-r candidate is the right token, on held-out rows."""
        module.eval()
        acc = self._rank_accuracies(module, "eval")
        if acc is None:  # held-out rows with no assistant token inside max_length: fall back to training rows
            log.warning("no held-out assistant tokens: calibrating the tree on training rows")
            acc = self._rank_accuracies(module, "train")
        if acc is None:
            raise ConfigError("no assistant tokens within max_length to calibrate the Medusa tree on")
        return acc

    def _rank_accuracies(self, module, split: str) -> list[list[float]] | None:
        R, K = self.cfg.tree_max_rank, self.cfg.num_heads
        hits = [[] for _ in range(K)]
        full = module
        module = module.heads if self.medusa2 else module
        device = next(module.parameters()).device
        rows = self._calibration_rows(split)
        cached = self._calib_hidden
        for start in range(0, len(rows), 8):
            batch = {k: v.to(device) for k, v in self.collate(rows[start : start + 8]).items()}
            if (split, start) in cached:
                hidden = cached[(split, start)].to(device)
            else:
                hidden, _ = self.target_outputs(batch, full if self.medusa2 else None)
            T = batch["input_ids"].shape[1]
            for i in range(K):
                shift = i + 2
                if T <= shift:
                    continue
                logits = module.head_logits(i, hidden[:, : T - shift].to(next(module.parameters()).dtype))
                ranked = module.to_target(logits.topk(R).indices)
                labels = batch["input_ids"][:, shift:]
                mask = batch["loss_mask"][:, shift:].bool()
                hits[i].append((ranked == labels.unsqueeze(-1))[mask])
        stacked = [torch.cat(h) if h else torch.zeros(0, R, dtype=torch.bool) for h in hits]
        n = min(len(h) for h in stacked)
        if n == 0:
            return None
        return rank_accuracies(torch.stack([h[:n] for h in stacked]))
