"""Training a DFlash drafter on a frozen target through the one training loop.

Each step draws `anchors_per_row` random anchors per row (positions whose next token is target-written) and
trains every block in one forward (`DFlashDraft.forward`): slot j of the block at a predicts x_{a+j},
weighted by exp(-(j-1)/γ). The target supplies the tapped layers' outputs (online, or offline from the
capture cache EAGLE-3 uses, through `CaptureSource`); with `loss: kd` also its post-norm last hidden state, so
each slot learns the target's whole next-token distribution at a+j-1 rather than the one token it wrote.

`draft_vocab_size` N (EAGLE-3's reduced vocabulary, heads/vocab.py): the draft gets its own lm_head over the N
tokens the training split's target-written tokens hold most often, started from the target's rows. A block's
logits are then N wide instead of V: at SmolLM2's 49,152 rows, 16 anchors x 8 slots x 8 rows of full logits
are most of a step's multiply-adds, and an 8,192-token head cuts them 6x. Labels outside the draft vocabulary
leave the CE loss (logged as `outside`); the KD teacher is the target restricted to the draft vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch

from draftsmith import artifact
from draftsmith.config import LAYER, TOKENS, VOCAB, Range, register_config, to_dict, validated
from draftsmith.dflash.model import (
    DFlashDraft,
    block_targets,
    dflash_loss,
    position_weights,
    reference_layers,
    sample_anchors,
)
from draftsmith.errors import ConfigError
from draftsmith.heads.vocab import draft_index, draft_vocabulary, token_counts, vocab_coverage
from draftsmith.training.config import EvalAfterTraining, TrainConfig, check_output_folders
from draftsmith.training.job import RowsJob, unwrap

log = logging.getLogger(__name__)

# the reference's decay per block size (paper and SpecForge recipes): γ = 7 at 16, 5 at 10, 4 at 8
DEFAULT_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


@register_config("dflash")
@validated
@dataclass
class DFlashJobConfig:
    target: str = "smollm2-135m"
    data: str = "runs/data/smollm2-135m"  # a self-distilled dataset (draftsmith data generate)
    output: str = "runs/dflash/smollm2-135m"
    num_layers: Annotated[int, Range(ge=1, le=16)] = 1  # draft decoder layers
    # anchor + block_size-1 drafted tokens; vLLM serves it with num_speculative_tokens = bs-1
    block_size: Annotated[int, Range(ge=2, le=64)] = 8
    # output-of-layer ids the context reads (ascending); None: the reference's rule with one tap per draft
    # layer, and three for a one-layer draft (one tap would lose the low/high-level mix EAGLE-3 found useful)
    target_layers: list[Annotated[int, LAYER]] | None = None
    # a token id whose (frozen) embedding row marks the slots to predict; None: a row no token of the
    # tokenizer uses where the embedding is padded, else the highest special token the training data
    # never contains
    mask_token_id: Annotated[int, Range(ge=0, lt=VOCAB.le)] | None = None
    # slot weight exp(-(j-1)/γ); None: 4 at block 8, 7 at block 16 (DEFAULT_GAMMA)
    gamma: Annotated[float, Range(gt=0, le=1000)] | None = None
    # how the block's slots weigh in the loss: decay, the fixed exp(-(j-1)/γ) above (the DFlash paper's); dpace,
    # D-PACE's weights from the draft's own per-slot confidence, the gradient of the block's expected accepted
    # length (dflash/model.py dpace_weights; arXiv 2605.18810, speculators' default since its PR #980)
    slot_weights: Literal["decay", "dpace"] = "decay"
    # D-PACE's smoothing q̃ = (1-α)·q + α (speculators' and Model-Optimizer's default 0.5; 1 = flat weights)
    dpace_alpha: Annotated[float, Range(gt=0, le=1)] = 0.5
    anchors_per_row: Annotated[int, Range(ge=1, le=1 << 16)] = 16  # blocks trained per row and step
    loss: Literal["ce", "kd"] = "ce"  # ce: the token the target wrote; kd: the target's distribution there
    # an own lm_head over the N most frequent target-written tokens (EAGLE-3's reduced vocabulary); None: the
    # target's lm_head, shared (SGLang serves only that: it ignores an own lm_head and d2t)
    draft_vocab_size: Annotated[int, VOCAB] | None = None
    init_std: Annotated[float, Range(gt=0, le=1)] = 0.02
    max_length: Annotated[int, TOKENS] = 512
    prompt_context: Annotated[int, TOKENS] | None = None
    eval_fraction: Annotated[float, Range(gt=0, lt=0.5)] = 0.05
    capture_cache: str | None = None  # offline target features (capture/cache.py); None = online
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvalAfterTraining = field(default_factory=EvalAfterTraining)

    def __post_init__(self):
        check_output_folders(self.output, self.train.output_dir)
        if self.target_layers is not None and list(self.target_layers) != sorted(set(self.target_layers)):
            raise ValueError(f"target_layers must be distinct and ascending, got {self.target_layers}")
        if self.max_length < 2 * self.block_size:
            raise ValueError(f"max_length must be >= 2·block_size ({2 * self.block_size}), got {self.max_length}")
        if self.slot_weights == "dpace" and self.gamma is not None:
            raise ValueError(f"gamma: {self.gamma} sets the fixed slot decay, which slot_weights: dpace replaces; "
                             "leave gamma null, or set slot_weights: decay")

    @property
    def slot_gamma(self) -> float | None:
        return self.gamma if self.gamma is not None else DEFAULT_GAMMA.get(self.block_size, self.block_size / 2)

    @property
    def dpace(self) -> float | None:
        """D-PACE's α where the slots weigh by it (`dflash_loss`'s dpace_alpha), else None."""
        return self.dpace_alpha if self.slot_weights == "dpace" else None


def default_layers(num_layers: int, draft_layers: int) -> list[int]:
    return reference_layers(num_layers, 3 if draft_layers == 1 else draft_layers)


def features(cfg: DFlashJobConfig, target) -> dict:
    """What the job reads of the target per token (methods.Method.features): the tapped layers (resolved
    draftsmith ids), and the post-norm last hidden for the KD loss."""
    from draftsmith.capture.layers import resolve_layers

    L = target.num_layers
    return {"layers": resolve_layers(list(cfg.target_layers or default_layers(L, cfg.num_layers)), L), "topk": 0,
            "last_hidden": cfg.loss == "kd", "logsumexp": False}


def pick_mask_token(target, counts: torch.Tensor) -> int:
    """A row of the target's embedding that marks the slots to predict (DFlashJobConfig.mask_token_id): a row
    no token of the tokenizer maps to where the embedding is padded (Qwen3's), else the highest special token
    the training data never holds (SmolLM2's <empty_output>), else the rarest token of the training data."""
    tok = target.tokenizer
    V = target.vocab_size
    if V > len(tok):
        return len(tok)
    keep = {tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}
    special = ({int(i) for i in getattr(tok, "all_special_ids", [])}
               | set(getattr(tok, "added_tokens_decoder", None) or {}))
    for i in sorted(special, reverse=True):
        if i < V and i not in keep and int(counts[i]) == 0:
            return i
    rare = int(torch.argmin(counts[:V].flip(0))) if len(counts) >= V else V - 1
    i = V - 1 - rare
    log.warning("mask_token_id: no spare embedding row or unused special token; using token %d, written %d times "
                "in the training data (name mask_token_id to choose)", i, int(counts[i]))
    return i


@dataclass
class Blocks:
    """What `DFlashJob.blocks` hands a loss."""

    out: Any  # the module's output over the learned slots
    labels: torch.Tensor  # [n] target ids
    slots: torch.Tensor  # [n] slot index j of each
    valid: torch.Tensor  # bool [B, n_anchors, bs]: which slots are the rows of `out`
    teacher: torch.Tensor | None  # [n, V'] the target's logits there (loss: kd)
    vocab: tuple[torch.Tensor, torch.Tensor] | None  # (d2t, target id -> draft id) of a reduced vocabulary
    # [n, H] the target's post-norm last hidden state where each slot is verified, where the job captures it
    verify_hidden: torch.Tensor | None = None


class DFlashJob(RowsJob):
    kind = "dflash"

    def data_path(self) -> str | None:
        return self.cfg.data

    def __init__(self, cfg: DFlashJobConfig, target, dataset=None):
        from draftsmith.capture.layers import uncapturable_layers
        from draftsmith.capture.online import CaptureSource

        self.cfg, self.target = cfg, target
        if dataset is None:
            from draftsmith.data import load_distilled

            dataset = load_distilled(cfg.data, target)
        self.use_rows(dataset, target, cfg.eval_fraction, cfg.train, cfg.max_length, cfg.prompt_context)
        L = target.num_layers
        needs = self.capture_needs()
        self.layers = needs["layers"]
        if self.layers != sorted(set(self.layers)):
            raise ConfigError(f"target_layers: {cfg.target_layers} name a layer twice or out of order on this "
                              f"{L}-layer target (resolved {self.layers})")
        lost = uncapturable_layers(self.layers, L)
        if lost:
            raise ConfigError(f"target_layers: layer(s) {lost} of this {L}-layer target (the last layer's output) "
                              f"are captured by no serving stack: pick layers up to {L - 2}")
        self.counts = token_counts(self.train_set, target.vocab_size)
        self.mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token(target, self.counts)
        # an id out of the vocabulary is refused by DFlashConfig when the draft is built, in one line
        written = int(self.counts[self.mask_id]) if self.mask_id < len(self.counts) else 0
        if written:
            log.warning("mask_token_id %d occurs %d times in the training data's target-written tokens", self.mask_id,
                        written)
        self.vocab = None  # (d2t, t2d, target id -> draft id) of a reduced draft vocabulary
        if cfg.draft_vocab_size is not None:
            if cfg.draft_vocab_size >= target.vocab_size:
                raise ConfigError(f"draft_vocab_size: {cfg.draft_vocab_size} is not below the target's vocabulary "
                                  f"({target.vocab_size}): set null to share the target's lm_head")
            d2t, t2d, _ = draft_vocabulary(self.counts, cfg.draft_vocab_size)
            self.vocab = (d2t, t2d, draft_index(t2d))
        self.weights = position_weights(cfg.block_size, cfg.slot_gamma)
        self.features = CaptureSource(target, cache_dir=cfg.capture_cache, **needs)
        self.generator = torch.Generator().manual_seed(cfg.train.seed)

    def capture_needs(self) -> dict:
        """What the job reads of the target (`features`; a method on this backbone may read more)."""
        return features(self.cfg, self.target)

    def announce(self) -> None:
        slots = f"D-PACE α {self.cfg.dpace_alpha}" if self.cfg.dpace is not None else f"γ {self.cfg.slot_gamma}"
        log.info("DFlash: %d layer(s), block %d, taps %s, mask token %d, slots weigh by %s, lm_head %s",
                 self.cfg.num_layers, self.cfg.block_size, self.layers, self.mask_id, slots,
                 f"own, {self.cfg.draft_vocab_size} tokens" if self.vocab else "the target's")

    module_class = DFlashDraft  # a method on this backbone (DSpark) trains its subclass

    def draft_fields(self) -> dict:
        """Config fields of `module_class` beyond DFlash's (none here)."""
        return {}

    def build_module(self) -> DFlashDraft:
        return self.module_class.from_target(self.target.model, self.layers, self.cfg.num_layers, self.cfg.block_size,
                                             self.mask_id, self.cfg.init_std,
                                             draft_vocab=self.vocab[:2] if self.vocab else None, **self.draft_fields())

    def setup(self, accelerator) -> None:
        self.target.model = self.features.placed_target(accelerator)  # the embedding and lm_head come from it

    def learned_tokens(self, batch) -> int:
        """Anchors a block can start from (a >= 1 with x_{a+1} learned); a batch without any is skipped."""
        return int(batch["loss_mask"][:, 2:].sum())

    def loss(self, module, batch):
        blocks = self.blocks(module, batch)
        return dflash_loss(blocks.out, blocks.labels, blocks.slots, self.weights, blocks.teacher, blocks.vocab,
                           blocks=blocks.valid, dpace_alpha=self.cfg.dpace)

    def blocks(self, module, batch) -> Blocks:
        """One step's blocks: random anchors per row, the module's forward over their learned slots (`out`: what
        `module(..., select=valid)` returns, DFlash's logits [n_valid, V]), their labels and slots, the KD teacher
        and the reduced vocabulary's maps."""
        draft = unwrap(module)
        draft.attach_target(self.target.model)
        feats = self.features(batch)
        ids, lmask = batch["input_ids"], batch["loss_mask"]
        lengths = batch["attention_mask"].sum(1)
        bs = self.cfg.block_size
        anchors = sample_anchors(lmask, lengths, self.cfg.anchors_per_row, self.row_generators(batch))
        x = torch.cat([feats[f"layer.{i}"] for i in self.layers], dim=-1)
        labels, valid = block_targets(ids, lmask, anchors, bs)
        slots = torch.arange(bs, device=ids.device).expand_as(valid)[valid]
        out = module(ids, x, anchors, select=valid)
        teacher = hidden = None
        if "last_hidden" in feats:  # slot j is verified by the target's distribution at a+j-1
            pos = (anchors.clamp(min=0)[..., None] + torch.arange(bs, device=ids.device) - 1).clamp(min=0)
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None, None].expand_as(pos)
            hidden = feats["last_hidden"][rows[valid], pos[valid]]
            if self.cfg.loss == "kd":
                with torch.no_grad():
                    teacher = draft.target_logits(hidden)
        vocab = (draft.d2t, self.vocab[2]) if draft.config.reduced_vocab else None
        return Blocks(out, labels[valid], slots, valid, teacher, vocab, hidden)

    def row_generators(self, batch) -> list[torch.Generator] | torch.Generator:
        """A row's anchors are drawn from (seed, row id, epoch) (`Job.epoch`, set by the loop), so they do not
        depend on which rows share its batch or its rank, nor on a resume: 2 ranks train the blocks 1 process
        trains. Rows without an id draw from the job's own generator."""
        if "row_id" not in batch:
            return self.generator
        return [torch.Generator().manual_seed(hash((self.cfg.train.seed, rid, self.epoch)) % 2**63)
                for rid in batch["row_id"].tolist()]

    def save_artifact(self, module, out_dir, metrics) -> Path:
        draft = unwrap(module)
        dest = self.artifact_dest(out_dir)
        reduced = draft.config.reduced_vocab
        # of the vocabulary the draft holds, on this job's training tokens
        coverage = vocab_coverage(self.counts, draft.t2d.cpu()) if reduced else 1.0
        config = {**asdict(draft.config), "architecture": self.kind, "embeddings": "target",
                  "lm_head": "draft" if reduced else "target", "draft_vocab_coverage": coverage,
                  "feature_convention": "pre-norm decoder layer outputs (capture/layers.py)",
                  "gamma": self.cfg.slot_gamma}
        manifest = artifact.make_manifest(
            self.kind, self.target.fingerprint(), to_dict(self.cfg),
            data={"path": self.cfg.data, "train_rows": len(self.train_set), "eval_rows": len(self.eval_set),
                  "target_written_tokens": int(self.counts.sum()), "draft_vocab_coverage": coverage},
            metrics=metrics,
        )
        return artifact.save_artifact(dest, manifest, dict(draft.state_dict()), config)

    def artifact_dest(self, out_dir) -> Path:
        return Path(self.cfg.output) if self.cfg.output else Path(out_dir)
