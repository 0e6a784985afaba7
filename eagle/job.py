"""Training EAGLE heads (EAGLE-1 / EAGLE-3) on a frozen target through the one training loop.

The job differs from its siblings only by its module (`EagleHead`), its features (the target's layers,
online in the step or offline from a capture cache, through `CaptureSource`) and its loss
(`eagle1_loss` / `eagle3_loss`). Positions: TTT step j at base t predicts x_{t+2+j}; it is trained where
that token is target-written (loss_mask[t+2+j] = 1), against the target's distribution at t+1+j.

EAGLE-3 teacher: the target's post-norm last hidden state times the draft-vocabulary rows of its lm_head
(p̃ restricted to the draft vocabulary, EAGLE-3 §3.2), and its argmax over the full vocabulary (top-1 of
the capture) for `step{j}/acc`. EAGLE-1 teacher: the target's last-layer feature f_{t+1+j} (the regression
target) and lm_head(norm(f_{t+1+j})). With `objective: lk_alpha | lk_lambda` (EAGLE-3) each step is trained for
its acceptance rate (eagle/model.py lk_loss), which reads the target's probabilities normalised over its whole
vocabulary: the capture keeps the full logits' logsumexp for it. `ttt_depth: served` unrolls the `served_k` steps
the engine drafts instead of `ttt_steps`.

The draft vocabulary is counted on the training split's target-written tokens before training.
Default size: SmolLM2 (H = 576, V = 49,152) does ~134M multiply-adds per token in a target step; the
draft layer plus fc is ~4M, a full-vocabulary lm_head would add 28M (7x the layer), an 8,192-token head
adds 4.7M: a draft step is then ~7% of a target step, and on self-distilled data the top 8k tokens cover
well over 95% of what the target writes (the coverage is measured and stored in the manifest).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch

from draftsmith import artifact
from draftsmith.config import (
    LAYER,
    PROBABILITY,
    TOKENS,
    VOCAB,
    WEIGHT,
    Range,
    register_config,
    to_dict,
    validated,
)
from draftsmith.eagle.model import (
    EagleHead,
    check_architecture,
    eagle1_loss,
    eagle3_loss,
    exportable,
    shift_left,
    step_weights,
)
from draftsmith.eagle.variants import VARIANTS, variant
from draftsmith.errors import ConfigError
from draftsmith.heads.vocab import draft_vocabulary, token_counts, vocab_coverage
from draftsmith.targets.families import family, lm_head, whole
from draftsmith.training.config import EvalAfterTraining, TrainConfig, check_output_folders
from draftsmith.training.job import RowsJob, unwrap

log = logging.getLogger(__name__)


@register_config("eagle")
@validated
@dataclass
class EagleJobConfig:
    target: str = "smollm2-135m"
    data: str = "runs/data/smollm2-135m"  # a self-distilled dataset (draftsmith data generate)
    output: str = "runs/eagle/smollm2-135m"  # the artifact directory
    version: str = "eagle3"  # a variant of eagle/variants.py VARIANTS: eagle3 | eagle1
    target_layers: list[Annotated[int, LAYER]] | None = None  # None: EAGLE-3 default_eagle3_layers(L), EAGLE-1 [-1]
    ttt_steps: Annotated[int, Range(ge=1, le=16)] = 7  # EAGLE-3 training-time test unroll (EAGLE-1 preset: 1)
    # fixed: unroll ttt_steps; served: unroll served_k steps, the chain the engine drafts (vLLM serves EAGLE-3 as
    # a chain of num_speculative_tokens, SGLang as num_steps deep): no step is trained that is never drafted, and
    # every drafted depth is (ttt_steps is then not read)
    ttt_depth: Literal["fixed", "served"] = "fixed"
    # the draft length the head is served at: vLLM's num_speculative_tokens (export's default, 4)
    served_k: Annotated[int, Range(ge=1, le=16)] = 4
    # what each step's draft is trained for: kl, the target's distribution on the draft vocabulary (soft
    # cross-entropy, EAGLE-3's); lk_alpha / lk_lambda, the acceptance rate itself (LK losses, arXiv 2602.23881,
    # SpecForge PR #492: eagle/model.py lk_loss). LK reads the target's logsumexp (the capture keeps it)
    objective: Literal["kl", "lk_alpha", "lk_lambda"] = "kl"
    # lk_lambda's λ = exp(-lk_eta·α): how soon a row's loss moves from KL to the acceptance (speculators' 3)
    lk_eta: Annotated[float, Range(ge=0, le=100)] = 3.0
    ttt_tokens: Literal["target", "draft"] = "target"  # which token step j >= 1 reads (eagle/model.py)
    step_decay: Annotated[float, PROBABILITY] = 0.8  # step j weighs step_decay**j
    norm_before_residual: bool = False
    # EAGLE-3.1 (eagle/model.py EagleConfig): a norm over the fused layers' concatenation before fc, or one per
    # layer; the next test-time step reads the normalised output. vLLM and speculators serve them
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # the draft's decoder layer: "llama" = a Llama layer with the target's shapes, what vLLM / SGLang /
    # TensorRT-LLM / speculators EAGLE drafters build whatever the target family; "target" = the target
    # family's own layer (targets/families.py), which only draftsmith's decoder runs unless it is a Llama layer
    draft_layer: Literal["llama", "target"] = "llama"
    # refuse before training a head that no serving stack loads (draft_layer: target on a non-Llama family);
    # false trains it for draftsmith's own decoder and evaluation
    exportable: bool = True
    draft_vocab_size: Annotated[int, VOCAB] = 8192  # EAGLE-3 only (see module docstring)
    w_cls: Annotated[float, WEIGHT] = 0.1  # EAGLE-1: weight of the token loss next to the feature regression
    # on-policy training (EAGLE-3): data written by rollouts of our decoder with a head (generation.engine:
    # speculative, data/engines/rollout.py) marks where verification rejected its draft; those (base, TTT step)
    # pairs count 1 + replay_weight times in the loss. 0 = plain supervised training on any rows
    replay_weight: Annotated[float, WEIGHT] = 0.0
    max_length: Annotated[int, Range(ge=8, le=TOKENS.le)] = 512
    # keep at most this many prompt tokens before a row's first learned token (data/batching.py): from
    # the capture cache every feature has seen the whole row, and the draft layer gets its context from them
    prompt_context: Annotated[int, Range(ge=2, le=TOKENS.le)] | None = None
    eval_fraction: Annotated[float, Range(gt=0, lt=0.5)] = 0.05
    capture_cache: str | None = None  # offline target features (capture/cache.py); None = online
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvalAfterTraining = field(default_factory=EvalAfterTraining)

    def __post_init__(self):
        check_output_folders(self.output, self.train.output_dir)
        if self.version not in VARIANTS:
            raise ValueError(f"version must be one of {', '.join(VARIANTS)}, got {self.version!r}")
        v = variant(self.version)
        if self.replay_weight and not v.replay:
            raise ValueError(f"replay_weight: on-policy replay is not implemented for {v.name} heads "
                             f"(variants with it: {', '.join(n for n, x in VARIANTS.items() if x.replay)})")
        if self.prompt_context is not None and not self.capture_cache:
            log.warning("prompt_context without capture_cache: the target too reads only the cut prompt")
        if (self.norm_before_fc or self.fc_norm) and not v.fuse_layers:
            raise ValueError(f"norm_before_fc / fc_norm: {v.name} fuses no target layers (EAGLE-3.1 options)")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm: choose one (one norm over the concatenation, "
                             "or one per layer)")
        if self.norm_output and not v.draft_vocab:
            raise ValueError(f"norm_output: {v.name} has no final norm of its own to feed back (an EAGLE-3.1 option)")
        if self.target_layers is not None and len(self.target_layers) != v.feature_layers:
            raise ValueError(f"target_layers: {v.name} reads {v.feature_layers} layer(s), got {self.target_layers}")
        if self.objective != "kl" and v.teacher != "logits":
            raise ValueError(f"objective: {self.objective} trains against the target's distribution, and {v.name} "
                             "regresses features (LK losses are for EAGLE-3)")

    @property
    def steps(self) -> int:
        """The test-time unroll trained: served_k where ttt_depth is served, else ttt_steps."""
        return self.served_k if self.ttt_depth == "served" else self.ttt_steps


VOCAB_MARGIN = 0.01  # a warm start keeps its draft vocabulary unless the rows' own covers this much more


def _warm_start_vocabulary(path: str | None, vocab_size: int) -> torch.Tensor | None:
    """The t2d of the head a warm start loads, or None (no warm start, no draft vocabulary, not readable: the
    loop's warm start reads the artifact again, checked, and refuses it in one line)."""
    file = Path(path or "") / "model.safetensors"
    if not path or not file.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            prior = f.get_tensor("t2d") if "t2d" in f.keys() else None
    except (OSError, SafetensorError):
        return None
    return prior.bool() if prior is not None and prior.shape == (vocab_size,) else None


def features(cfg: EagleJobConfig, target) -> dict:
    """What the job reads of the target per token (methods.Method.features): the feature layers (resolved
    draftsmith ids, in the head's order), plus for a logits teacher the post-norm last hidden and the top-1."""
    from draftsmith.capture.layers import resolve_layers

    v, L = variant(cfg.version), target.num_layers
    # LK's acceptance needs the target's probabilities normalised over its whole vocabulary: its logsumexp
    return {"layers": resolve_layers(list(cfg.target_layers or v.default_layers(L)), L),
            "logsumexp": cfg.objective != "kl", **v.capture()}


class EagleJob(RowsJob):
    kind = "eagle"

    def data_path(self) -> str | None:
        return self.cfg.data

    def __init__(self, cfg: EagleJobConfig, target, dataset=None):
        from draftsmith.capture.layers import uncapturable_layers
        from draftsmith.capture.online import CaptureSource

        check_architecture(target.config, cfg.draft_layer)
        if cfg.exportable and not exportable(target.config, cfg.draft_layer):
            raise ConfigError(f"draft_layer: target on this {family(target.config).model_type} target gives a head "
                              "no serving stack loads (their EAGLE drafters are Llama layers): use draft_layer: "
                              "llama, or set exportable: false to train it for draftsmith's own decoder only")
        self.cfg, self.target = cfg, target
        if dataset is None:  # the self-distilled rows cfg.data names
            from draftsmith.data import load_distilled

            dataset = load_distilled(cfg.data, target)
        columns = getattr(dataset, "column_names", None)
        has_replay = "replay" in columns if columns is not None else all("replay" in r for r in dataset)
        if cfg.replay_weight and not has_replay:
            raise ConfigError(f"replay_weight: {cfg.data} has no 'replay' column (write it with generation.engine: "
                              "speculative, data/engines/rollout.py), or set replay_weight: 0")
        self.use_rows(dataset, target, cfg.eval_fraction, cfg.train, cfg.max_length, cfg.prompt_context)
        L = target.num_layers
        self.variant = v = variant(cfg.version)
        needs = features(cfg, target)
        self.layers = needs["layers"]
        if v.fuse_layers:  # the stacks capture fused layers as auxiliary outputs; EAGLE-1's last layer is their own
            lost = uncapturable_layers(self.layers, L)
            if cfg.exportable and lost:
                # refused here, before any step: once trained, export would have to refuse the head
                raise ConfigError(f"target_layers: layer(s) {lost} of this {L}-layer target (the last layer's "
                                  f"output) are captured by no serving stack (vLLM and SGLang take outputs of "
                                  f"layers 0..{L - 2}): pick layers up to {L - 2}, or set exportable: false to "
                                  "train it for draftsmith's own decoder only")
        self.weights = step_weights(cfg.steps, cfg.step_decay)
        # draft vocabulary from the training split's target-written tokens
        self.counts = token_counts(self.train_set, target.vocab_size)
        if v.draft_vocab:
            self.d2t, self.t2d = self._draft_vocab(cfg)
        else:
            self.d2t = self.t2d = None
        # the feature layers, plus for a logits teacher the post-norm last hidden and the top-1 (EAGLE-3);
        # a features teacher (EAGLE-1) reads the last layer's pre-norm output as both input and teacher
        self.features = CaptureSource(target, cache_dir=cfg.capture_cache,
                                      **{**needs, "layers": sorted(set(self.layers))})
        self._teacher_w: torch.Tensor | None = None

    # --- the job protocol -------------------------------------------------------------------------
    def build_module(self) -> EagleHead:
        return EagleHead.from_target(
            self.target.model, self.cfg.version, self.layers,
            draft_vocab=(self.d2t, self.t2d) if self.variant.draft_vocab else None, ttt_steps=self.cfg.steps,
            ttt_tokens=self.cfg.ttt_tokens, norm_before_residual=self.cfg.norm_before_residual,
            draft_layer=self.cfg.draft_layer, norm_before_fc=self.cfg.norm_before_fc, fc_norm=self.cfg.fc_norm,
            norm_output=self.cfg.norm_output)

    def setup(self, accelerator) -> None:
        self.target.model = self.features.placed_target(accelerator)  # the embedding and lm_head come from it

    def _draft_vocab(self, cfg: EagleJobConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t, t2d): the top tokens of the training rows. With a warm start, the vocabulary of the head it
        starts from is kept while it covers this job's learned tokens within VOCAB_MARGIN of what the rows' own
        vocabulary would (a retraining set is small; the earlier head's vocabulary was counted on more data); when
        it does not (the traffic moved to another domain), the rows' own vocabulary is taken, the earlier one a
        prior for the slots they leave (half a count a token)."""
        from draftsmith.heads.vocab import vocab_coverage

        prior = _warm_start_vocabulary(cfg.train.warm_start, self.counts.numel())
        if prior is None:
            return draft_vocabulary(self.counts, cfg.draft_vocab_size)[:2]
        d2t, t2d, _ = draft_vocabulary(self.counts.float() + 0.5 * prior.float(), cfg.draft_vocab_size)
        own, kept = vocab_coverage(self.counts, t2d), vocab_coverage(self.counts, prior)
        if int(prior.sum()) == d2t.numel() and kept >= own - VOCAB_MARGIN:
            ids = prior.nonzero().flatten()
            log.info("warm start: keeps its draft vocabulary (it covers %.2f%% of the learned tokens, the rows' own "
                     "would cover %.2f%%)", 100 * kept, 100 * own)
            return ids - torch.arange(ids.numel()), prior.clone()
        log.info("warm start: the rows' own draft vocabulary (%.2f%% of the learned tokens, the earlier one %.2f%%)",
                 100 * own, 100 * kept)
        return d2t, t2d

    def warm_start_weights(self, weights: dict, module) -> dict:
        """A warm start keeps this job's draft vocabulary, counted on its own training rows: the version it starts
        from drafted the tokens of its own data, and loading its d2t would leave a new domain's tokens undraftable
        (a retrained head stuck at the old domain's vocabulary). The lm_head row of a token in both vocabularies
        moves to the token's new place; a token new to the vocabulary keeps the row it was built with (the
        target's lm_head row)."""
        if not self.variant.draft_vocab or "d2t" not in weights or "lm_head.weight" not in weights:
            return weights
        old_ids = torch.arange(weights["d2t"].numel()) + weights["d2t"].long().cpu()
        new_ids = torch.arange(module.d2t.numel()) + module.d2t.long().cpu()
        if torch.equal(old_ids, new_ids):
            return weights
        where = {int(t): i for i, t in enumerate(old_ids.tolist())}
        lm = module.lm_head.weight.detach().cpu().clone()
        kept = [(j, where[t]) for j, t in enumerate(new_ids.tolist()) if t in where]
        if kept:
            rows, src = zip(*kept, strict=True)
            lm[list(rows)] = weights["lm_head.weight"][list(src)].to(lm.dtype)
        log.info("warm start: the draft vocabulary of this job's rows (%d tokens; %d new, their lm_head rows from "
                 "the target's)", len(new_ids), len(new_ids) - len(kept))
        return {**weights, "lm_head.weight": lm, "d2t": module.d2t.detach().cpu(), "t2d": module.t2d.detach().cpu()}

    def learned_tokens(self, batch) -> int:
        """Positions the first test-time step learns from (label x_{t+2} target-written; later steps' are a
        subset). A batch whose only learned tokens sit at position 1 has none: the loop skips and counts it
        instead of training on a loss of 0."""
        return int(shift_left(batch["loss_mask"], 2).sum())

    def loss(self, module, batch):
        head = unwrap(module)
        head.attach_target(self.target.model)  # the placed target (device / dtype of this rank)
        feats = self.features(batch)
        ids, lmask = batch["input_ids"], batch["loss_mask"]
        S = self.cfg.steps
        # step j at base t predicts x_{t+2+j}: train where that token is target-written
        select = [shift_left(lmask, 2 + j).bool() for j in range(S)]
        x = torch.cat([feats[f"layer.{i}"] for i in self.layers], dim=-1)
        out = module(ids, x, steps=S, select=select)
        if self.variant.teacher == "logits":
            return self._logits_loss(head, feats, batch, out, select)
        return self._features_loss(head, feats, out, select)

    def _logits_loss(self, head, feats, batch, out, select):
        """EAGLE-3: soft cross-entropy against the target's next-token distribution on the draft vocabulary."""
        lmask, S = batch["loss_mask"], self.cfg.steps
        # step j's teacher at base t is the target at position t+1+j, so every step's teachers are rows of
        # one product over the positions whose next token is learned (not S products over shifted copies)
        w = self.teacher_rows(head)
        at = shift_left(lmask, 1).bool()
        row_of = torch.full(lmask.shape, -1, dtype=torch.long, device=lmask.device)
        row_of[at] = torch.arange(int(at.sum()), device=lmask.device)
        logits_at = feats["last_hidden"][at].to(w.dtype) @ w.T  # the target's logits on the draft vocabulary
        top1_at = feats["topk_indices"][..., 0][at]
        rows = [shift_left(row_of, 1 + j, fill=-1)[select[j]] for j in range(S)]
        replay = None
        if "replay" in batch:  # rollout marks: replay[t] = j + 1 where step j at base t was rejected
            replay = [(batch["replay"] == j + 1)[select[j]] for j in range(S)]
        logprobs = None
        if "topk_logsumexp" in feats:  # log p over the whole vocabulary, at the draft vocabulary's tokens
            lp_at = logits_at.float() - feats["topk_logsumexp"][at].float()[:, None]
            logprobs = [lp_at[r] for r in rows]
        return eagle3_loss(out.logits, [logits_at[r] for r in rows], [top1_at[r] for r in rows], head.d2t,
                           self.weights, replay, self.cfg.replay_weight, logprobs, self.cfg.objective,
                           self.cfg.lk_eta)

    def _features_loss(self, head, feats, out, select):
        """EAGLE-1: regress the next feature, plus the weighted token cross-entropy through the target's head."""
        f = feats[f"layer.{self.layers[0]}"]
        preds, targets, teacher = [], [], []
        for j in range(self.cfg.steps):
            tf = shift_left(f, 1 + j)[select[j]]  # f_{t+1+j}
            preds.append(out.hidden[j][select[j]])
            targets.append(tf)
            with torch.no_grad():
                teacher.append(head.logits(tf))
        return eagle1_loss(preds, targets, out.logits, teacher, self.weights, self.cfg.w_cls)

    def teacher_rows(self, head: EagleHead) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary [N, H] (frozen)."""
        w = whole(lm_head(self.target.model)).weight  # a whole copy where ZeRO-3 partitions the target
        if self._teacher_w is None or self._teacher_w.device != w.device or self._teacher_w.dtype != w.dtype:
            self._teacher_w = w[head.t2d.to(w.device)].detach()
        return self._teacher_w

    def save_artifact(self, module, out_dir, metrics) -> Path:
        head = unwrap(module)
        dest = self.artifact_dest(out_dir)
        # of the vocabulary the head holds (a warm start brings its own), on this job's training tokens
        t2d = getattr(head, "t2d", None)  # EAGLE-1 predicts over the whole vocabulary
        coverage = 1.0 if t2d is None else vocab_coverage(self.counts, t2d.cpu())
        config = {
            **asdict(head.config),
            "architecture": head.config.model_type,
            "embeddings": "target",  # not saved: take embed_tokens from the target named by the manifest
            "feature_convention": "pre-norm decoder layer outputs (capture/layers.py)",
            "draft_vocab_coverage": coverage,
        }
        fp = self.target.fingerprint()
        manifest = artifact.make_manifest(
            "eagle", fp, to_dict(self.cfg),
            data={"path": self.cfg.data, "train_rows": len(self.train_set), "eval_rows": len(self.eval_set),
                  "target_written_tokens": int(self.counts.sum()), "draft_vocab_coverage": coverage},
            metrics=metrics,
        )
        state = {k: v for k, v in head.state_dict().items()}
        return artifact.save_artifact(dest, manifest, state, config)

    def artifact_dest(self, out_dir) -> Path:
        """The artifact goes where the config says (the loop's default is <train.output_dir>/artifact)."""
        return Path(self.cfg.output) if self.cfg.output else Path(out_dir)
