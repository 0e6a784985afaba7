"""The one training loop: `train(job, cfg) -> TrainResult`, on `accelerate.Accelerator`.

Every registered method's job runs here; a job only supplies a module, batches and a loss
(`training/job.py`). One step, for each of the `grad_accum` micro-batches of every rank:

    loss, metrics = job.loss(module, batch)           # under autocast (bf16 on CUDA when supported)
    if any rank's loss is non-finite:  backward(0 · Σθ)   # keeps DDP's all-reduce in lock-step, grads = 0
    else:                              backward(loss / grad_accum)
  (a micro-batch with no learned token on some rank is skipped like a non-finite one and counted as empty)
  then, at the accumulation boundary:
    g = clip_grad_norm(θ, max_grad_norm)              # global norm, also our overflow detector
    if the window had a non-finite loss or g is non-finite: skip the update, zero grads, count it
    else: lr ← schedule(step); AdamW update; zero grads

Schedule (per step s of S total, W warmup steps; Goyal et al. 2017 warmup, Loshchilov & Hutter 2017 cosine):
    s < W:   lr = lr0 · (s + 1) / W
    cosine:  lr = lr0 · (m + (1 − m) · ½(1 + cos(π · p))),   p = (s − W) / max(1, S − W),  m = min_lr_ratio
    linear:  lr = lr0 · (m + (1 − m) · (1 − p))
    constant: lr = lr0

Data order is ours, not the DataLoader's: epoch e uses the permutation randperm(n, seed = cfg.seed·1000003 + e)
(with `group_by_length`, reordered so that each micro-batch index holds rows of similar length:
`data/batching.py`); micro-batch b of rank r is rows perm[(b·world + r)·B : (b·world + r + 1)·B]
(incomplete tail dropped), so a position (epoch, b) plus the seed pins every future batch and resume needs
no sampler pickles. Logging windows are flushed at every checkpoint step, so a resumed run's log equals the
uninterrupted one.

Never a silently wrong result: a skipped step is logged as skipped (its window's loss is null, not 0.0); a
loss above EXPLODE_FACTOR times the running median of recent losses warns; a checkpoint is written only
from finite weights, and an artifact too; a run in which no batch had a learned token fails instead of
writing an untrained artifact.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.config import to_dict
from draftsmith.data.batching import epoch_permutation, length_grouped, rank_batches, row_lengths
from draftsmith.errors import DataError, TrainingError
from draftsmith.training import checkpoint as ckpt
from draftsmith.training import sharded
from draftsmith.training.config import TrainConfig
from draftsmith.training.job import Job
from draftsmith.training.launch import make_accelerator
from draftsmith.training.loggers import RunLogger

ARTIFACT_DIR = "artifact"
EXPLODE_FACTOR = 100.0  # a loss this many times the running median (floored at EXPLODE_FLOOR) warns
EXPLODE_FLOOR = 0.1
EXPLODE_WINDOW = 32  # micro-batch losses in the running median
# train settings a resumed run may change (applied from the resume on, both values recorded); others that
# move the data position (batch_size, world size, seed, data) refuse
RESUMABLE_CHANGES = ("lr", "betas", "eps", "weight_decay", "schedule", "warmup_steps", "warmup_ratio",
                     "min_lr_ratio", "max_steps", "epochs", "max_grad_norm", "grad_accum", "mixed_precision")

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    artifact: Path | None  # where job.save_artifact wrote (None on ranks other than 0)
    steps: int
    metrics: dict[str, float]  # final eval metrics ("eval/..."), last train window ("train/..."), counters
    resumed_from: Path | None = None
    warm_start: str | None = None
    log_path: Path | None = None
    history: list[dict] = field(default_factory=list)  # the JSONL log records (rank 0)
    module: nn.Module | None = field(default=None, repr=False)  # the trained module, unwrapped (every rank)

    @property
    def artifact_path(self) -> Path | None:
        return self.artifact


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based). See the module docstring."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p
    return min_ratio + (1.0 - min_ratio) * decay


def param_groups(module: nn.Module, weight_decay: float, lr_scale=None) -> list[dict]:
    """AdamW groups: decay matrices, not biases / norm gains (1-D tensors). `lr_scale(name) -> float` (a job's
    optional `lr_scale`) puts parameters on a multiple of the base lr, each scale in groups of its own
    (Medusa-2: the target's adapter learns slower than the heads). Group order: scale 1 first, decay first."""
    groups: dict[tuple[float, bool], list] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            groups.setdefault((float(lr_scale(name)) if lr_scale else 1.0, p.ndim >= 2), []).append(p)
    order = sorted(groups, key=lambda k: (k[0] != 1.0, k[0], not k[1]))
    return [{"params": groups[k], "weight_decay": weight_decay if k[1] else 0.0, "lr_scale": k[0]} for k in order]




def _finite_state(state: dict[str, torch.Tensor]) -> str | None:
    """The first tensor of a state dict holding a non-finite value (None when all are finite)."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _Window:
    """Running sums of one logging window (local to this rank)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss = 0.0
        self.count = 0
        self.metrics: dict[str, float] = {}
        self.tokens = 0
        self.grad_norm = 0.0
        self.updates = 0
        self.skipped = 0  # optimizer steps skipped (non-finite loss / gradient, or only empty batches)
        self.empty = 0  # micro-batches without a learned token
        self.exploded = 0  # micro-batch losses far above the running median
        self.t0 = time.perf_counter()

    def add(self, loss: float, metrics: dict[str, float]) -> None:
        self.loss += loss
        self.count += 1
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + float(v)


class Trainer:
    """State of one run. `train()` is the public entry point; this class keeps the loop readable."""

    def __init__(self, job: Job, cfg: TrainConfig, accelerator=None) -> None:
        from accelerate.utils import DistributedType

        self.job, self.cfg = job, cfg
        self.acc = accelerator if accelerator is not None else make_accelerator(cfg)
        self.dist = self.acc.distributed_type
        self.sharded = self.dist in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.fsdp = self.dist == DistributedType.FSDP
        self.world, self.rank = self.acc.num_processes, self.acc.process_index
        self.main = self.acc.is_main_process
        self.out = Path(cfg.output_dir)

    def artifact_dest(self) -> Path:
        """Where the job will write its artifact: the job says so (`artifact_dest(default)`, Medusa and EAGLE
        take their `output`), else <train.output_dir>/artifact, the folder save_artifact is given."""
        default = self.out / ARTIFACT_DIR
        return Path(self.job.artifact_dest(default))

    # ---- setup -----------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step, in order: the output folder, the checkpoint to resume, the module,
        the step plan, the optimizer, the counters and the logger."""
        self._prepare_output()
        self._read_resume()
        module = self._build_module()
        self._plan_steps()
        self._prepare_optimizer(module)
        self._start_counters()

    def _prepare_output(self) -> None:
        from draftsmith.outputs import check_replaceable, clean_stale

        # before any work, on every rank (read-only: all of them stop with the same line, none waits at a
        # barrier): a folder that is not an artifact is not where this run's artifact will go
        check_replaceable(self.artifact_dest(), "artifact",
                          hint="set the job's output (or train.output_dir) to another path, or delete it")
        if self.main:
            if self.cfg.save_every > 0:  # the key that signs its checkpoint records: a bad one stops it here
                from draftsmith.training.trust import load_key

                load_key(create=True)
            _make_folder(self.out)
            ckpt.clean_temp(self.out)
            clean_stale(self.artifact_dest())  # what a run killed while saving its artifact left beside it
        self.acc.wait_for_everyone()

    def _read_resume(self) -> None:
        """The checkpoint this run resumes (`train.resume`), if any: its meta only when it is sharded (every rank
        reads its own slices once the module is prepared), which only a checkpoint this user's signed record
        vouches for can be (checkpoint.plan_resume)."""
        plan = ckpt.plan_resume(self.cfg.resume, self.out)
        self.resume_path = plan.path if plan is not None else None
        self.sharded_resume = plan is not None and plan.pickled
        self.loaded = None
        if self.resume_path is not None:
            self.loaded = (sharded.load_meta(self.resume_path) if self.sharded_resume
                else ckpt.load_checkpoint(self.resume_path))

    def _build_module(self) -> nn.Module:
        """The job's module, seeded alike on every rank, with the checkpoint's or a warm start's weights."""
        from accelerate.utils import set_seed

        set_seed(self.cfg.seed)  # same on every rank: identical initial module everywhere
        self.job.setup(self.acc)
        module = self.job.build_module()
        if self.loaded is not None and not self.sharded_resume:
            try:
                module.load_state_dict(self.loaded.model)
            except RuntimeError as e:  # torch lists every mismatch over many lines: name the first
                first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), str(e))
                raise TrainingError(f"checkpoint {self.resume_path} holds a module of another shape ({first}); "
                                    "resume with the same model settings, or set train.resume=never") from None
        elif self.cfg.warm_start:
            self._warm_start(module)
        return module

    def _plan_steps(self) -> None:
        """The rows, micro-batches per epoch, total and warmup steps, and the lengths rows are grouped by."""
        cfg = self.cfg
        self.train_rows = self.job.train_rows()
        self.eval_rows = self.job.eval_rows()
        n = len(self.train_rows)
        self.micro_per_epoch = n // (cfg.batch_size * self.world)
        # length grouping sorts the rows of one optimizer step together: a step reads the same rows whatever
        # mix of ranks and accumulation gives it its batch (so another world size can resume)
        self.length_group = cfg.batch_size * self.world * cfg.grad_accum
        if self.micro_per_epoch < 1:
            raise DataError(f"{n} training rows cannot fill one batch of {cfg.batch_size} on each of "
                            f"{self.world} ranks")
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.micro_per_epoch / cfg.grad_accum))
        self.warmup = cfg.resolved_warmup(self.total_steps)
        self.lengths = None
        if cfg.group_by_length:  # the job knows its max_length; else whole rows
            lengths = self.job.row_lengths()
            self.lengths = lengths if lengths is not None else row_lengths(self.train_rows)

    def _prepare_optimizer(self, module: nn.Module) -> None:
        """AdamW over the module, both prepared by accelerate; a sharded checkpoint's slices loaded into them."""
        cfg = self.cfg
        self._fill_deepspeed_autos()
        optimizer = torch.optim.AdamW(param_groups(module, cfg.weight_decay, self.job.lr_scale),
                                      lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        for g in optimizer.param_groups:
            g["base_lr"] = cfg.lr * g["lr_scale"]
        self.model, self.optimizer = self.acc.prepare(module, optimizer)
        # this run's optimizer settings: a resumed optimizer's param groups carry the checkpoint's
        self.fresh_groups = [{k: g[k] for k in ("base_lr", "betas", "eps", "weight_decay")}
                             for g in self.optimizer.param_groups]
        declared = self.loaded.state.get("format") if self.sharded_resume else None  # its vouched state.json
        if declared == sharded.DS_FORMAT:  # each rank its own ZeRO partition
            sharded.load_deepspeed(self.resume_path, self.model, self.world, self.out)
        elif self.sharded_resume:  # every rank reads the slices it owns now (any world size)
            sharded.load_sharded(self.resume_path, self.model, self.optimizer, self.out)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]

    def _start_counters(self) -> None:
        """The counters at zero, or as the checkpoint left them; the run logger, continuing a resumed log."""
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.step = 0
        self.micro = 0
        self.nonfinite_total = 0
        self.nonfinite_in_row = 0
        self.empty_total = 0
        self.updates_total = 0
        # seconds of training loop the steps so far took, over every resumed run (None: a resumed checkpoint
        # predates the count, so the total is not known); this run's share is added as it goes
        self.seconds_before: float | None = 0.0
        self.run_t0 = time.perf_counter()
        self.recent_losses: deque[float] = deque(maxlen=EXPLODE_WINDOW)
        self.tokens_total = 0
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}
        self.resume_changes: dict = {}
        log_text = ""
        if self.loaded is not None:
            self._restore()
            log_text = "".join(self.loaded.log_lines)
        else:
            set_seed(cfg.seed + 1 + self.rank)  # per-rank stream for dropout & co.
        resumed = self.loaded.state if self.loaded is not None else {}
        self.logger = RunLogger(self.out, cfg.loggers, to_dict(cfg), active=self.main,
                                project=cfg.project or cfg.wandb_project, initial_text=log_text,
                                state=resumed.get("trackers"), resume_step=resumed.get("step"))
        self.window = _Window()

    def _fill_deepspeed_autos(self) -> None:
        """DeepSpeed derives "auto" batch sizes from prepared DataLoaders; ours are not prepared (the loop
        owns the data order), so fill them from the config here."""
        from accelerate.utils import DistributedType

        if self.dist != DistributedType.DEEPSPEED:
            return
        cfg = self.cfg
        ds = self.acc.state.deepspeed_plugin.deepspeed_config
        fills = {"train_micro_batch_size_per_gpu": cfg.batch_size, "gradient_accumulation_steps": cfg.grad_accum,
                 "train_batch_size": cfg.batch_size * cfg.grad_accum * self.world,
                 "gradient_clipping": cfg.max_grad_norm or 0.0}
        for key, value in fills.items():
            if ds.get(key, "auto") == "auto":
                ds[key] = value

    def _warm_start(self, module: nn.Module) -> None:
        from draftsmith.artifact import load_artifact, load_manifest

        kind = self.job.kind
        if self.job.warm_start_kinds:  # another kind whose weights this job takes (DSpark: a DFlash drafter's)
            found = load_manifest(self.cfg.warm_start).get("kind")
            kind = found if found in self.job.warm_start_kinds else kind
        _, weights = load_artifact(self.cfg.warm_start, kind=kind, target=self.job.target)
        # the part of the module an artifact's weights belong to (Medusa-2: its heads, not the adapted target)
        module = self.job.warm_start_module(module)
        weights = self.job.warm_start_weights(weights, module)
        missing, unexpected = module.load_state_dict(weights, strict=False)
        # a tied weight (an LM head sharing the embedding) is saved once: it is loaded through its twin
        state = module.state_dict()
        loaded_ptrs = {state[k].data_ptr() for k in weights if k in state}
        missing = [k for k in missing if state[k].data_ptr() not in loaded_ptrs]
        if missing or unexpected:
            raise TrainingError(f"train.warm_start {self.cfg.warm_start}: weights do not fit the module "
                                f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")

    def _data_identity(self) -> dict:
        """What the data position of a checkpoint means: the job's data path and the training rows."""
        data = self.job.data_path()
        return {"path": str(data) if data is not None else None, "rows": len(self.train_rows)}

    def _restore(self) -> None:
        st = self.loaded.state
        seed = st.get("sampler_seed", self.cfg.seed)
        if seed != self.cfg.seed:  # it pins every epoch's permutation: another one repeats rows and skips others
            raise TrainingError(f"checkpoint {self.resume_path} was written with seed={seed}; this run has "
                                f"seed={self.cfg.seed} (the data position would not match: resume with the same "
                                "seed or train.resume=never)")
        old_data, new_data = st.get("data"), self._data_identity()
        if old_data is not None and old_data != new_data:
            raise TrainingError(
                f"checkpoint {self.resume_path} was trained on data {old_data['path']} ({old_data['rows']} rows); "
                f"this run has {new_data['path']} ({new_data['rows']} rows): its data position would point at "
                "other rows (use the same data, or set train.resume=never)")
        self.micro = self._translated_position(st)
        if not self.sharded_resume:  # a sharded checkpoint's optimizer state was loaded with the module
            opt = self.loaded.optimizer
            if "ranks" in opt and len(opt["ranks"]) != self.world:
                raise TrainingError(f"checkpoint {self.resume_path} holds optimizer shards of {len(opt['ranks'])} "
                                    f"ranks; this run has {self.world} (resume with the same world size)")
            try:
                self.optimizer.load_state_dict(opt["ranks"][self.rank] if "ranks" in opt else opt)
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
                raise TrainingError(f"checkpoint {self.resume_path}: optimizer.json does not fit this run's "
                                    f"optimizer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r})"
                                    "; resume with the same model settings, or set train.resume=never") from None
        for g, values in zip(self.optimizer.param_groups, self.fresh_groups):  # this run's, not the checkpoint's
            g.update(values)
        self._record_changed_settings(st.get("config") or {})
        self.step = st["step"]
        self.nonfinite_total, self.nonfinite_in_row = st["nonfinite_total"], st["nonfinite_in_row"]
        self.tokens_total = st["tokens_total"]
        self.empty_total = st.get("empty_total", 0)
        self.updates_total = st.get("updates_total", self.step)  # older checkpoints: assume every step updated
        self.seconds_before = st.get("train_seconds")
        self.last_eval, self.last_train = st["last_eval"], st["last_train"]
        if self.rank < len(self.loaded.rng_json):  # a rank the writing run did not have starts its own stream
            ckpt.restore_rng(self.loaded.rng_json[self.rank], self.loaded.rng_tensors[self.rank])
        else:
            from accelerate.utils import set_seed

            set_seed(self.cfg.seed + 1 + self.rank)

    def _translated_position(self, st: dict) -> int:
        """This run's micro-batch position for a checkpoint's. The same layout resumes as is; another world
        size resumes when every optimizer step still covers the same rows (batch_size * grad_accum * world
        unchanged, e.g. 2 ranks x 4 rows -> 1 rank x 4 rows x grad_accum 2), since micro-batch b of rank r
        reads rows perm[(b * world + r) * batch_size ...] (module docstring)."""
        cfg = self.cfg
        old_world, old_bs = st["world_size"], st["batch_size"]
        old_accum = (st.get("config") or {}).get("grad_accum", cfg.grad_accum)
        if cfg.group_by_length and st.get("length_group", old_world * old_bs) != self.length_group:
            raise TrainingError(
                f"checkpoint {self.resume_path} grouped rows by length in runs of "
                f"{st.get('length_group', old_world * old_bs)}; this run groups {self.length_group} "
                "(batch_size * grad_accum * world_size): its data position would point at other rows "
                "(keep that product, or set train.resume=never)")
        if old_world == self.world and old_bs == cfg.batch_size:
            return st["micro"]
        rows_before = st["micro"] * old_world * old_bs
        per_micro = self.world * cfg.batch_size
        same_step = old_world * old_bs * old_accum == self.world * cfg.batch_size * cfg.grad_accum
        same_epoch = st.get("micro_per_epoch", 0) * old_world * old_bs == self.micro_per_epoch * per_micro
        if not (same_step and same_epoch and rows_before % per_micro == 0):
            raise TrainingError(
                f"checkpoint {self.resume_path} was written with world_size={old_world}, batch_size={old_bs}, "
                f"grad_accum={old_accum}; this run has {self.world}, {cfg.batch_size}, {cfg.grad_accum}: the rows "
                "of a step differ (keep batch_size * grad_accum * world_size, with whole epochs of the same "
                "length, or train.resume=never)")
        return rows_before // per_micro

    def _record_changed_settings(self, old: dict) -> None:
        """A resumed optimizer carries the checkpoint's lr / betas / eps / weight decay in its param groups;
        this run's values are what the config (and so the manifest) says, so `_restore` applies them, and
        every setting that changed is logged with both values and recorded in the run's metrics."""
        cfg = self.cfg
        changes = {}
        for key in RESUMABLE_CHANGES:
            before, now = old.get(key), getattr(cfg, key)
            if isinstance(now, tuple):
                now = list(now)
            if key in old and before != now:
                changes[key] = {"checkpoint": before, "now": now}
        # the job's own settings (a Medusa kd_weight, an EAGLE ttt_steps ...): used from here on, both recorded
        old_job, now_job = (self.loaded.state.get("job_config") or {}), self._job_config()
        for key, before in old_job.items():
            if now_job.get(key) != before:
                changes[f"job.{key}"] = {"checkpoint": before, "now": now_job.get(key)}
        self.resume_changes = changes
        if changes and self.main:
            log.warning("resuming %s with changed settings, applied from here on: %s", self.resume_path,
                        ", ".join(f"{k} {v['checkpoint']} -> {v['now']}" for k, v in changes.items()))

    # ---- data ------------------------------------------------------------------------------------

    def _micro_batches(self) -> Iterator[dict[str, Any]]:
        """Endless stream of this rank's micro-batches from position self.micro on."""
        from torch.utils.data import DataLoader

        cfg = self.cfg
        epoch, start = divmod(self.micro, self.micro_per_epoch)
        while True:
            perm = epoch_permutation(len(self.train_rows), cfg.seed, epoch)
            if self.lengths is not None:
                perm = length_grouped(perm, self.lengths, self.length_group, cfg.seed, epoch)
            batches = rank_batches(perm, cfg.batch_size, self.world, self.rank, start)
            loader = DataLoader(self.train_rows, batch_sampler=batches, collate_fn=self.job.collate,
                                num_workers=cfg.num_workers)
            for batch in loader:
                self.job.epoch = epoch
                yield _to_device(batch, self.acc.device)
            epoch, start = epoch + 1, 0

    # ---- one step --------------------------------------------------------------------------------

    def _any_rank(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.acc.device)
        return bool(self.acc.reduce(t, reduction="sum").item() > 0)

    def _train_step(self, batches: Iterator[dict[str, Any]]) -> None:
        """One optimizer step: `grad_accum` micro-batches, then the update (or a counted skip)."""
        acc, cfg = self.acc, self.cfg
        self.model.train()
        bad = False
        acc.step = 0  # windows always start on a boundary (also after resume)
        used = 0  # micro-batches of this step that had learned tokens on every rank
        # the scheduled lr before any backward: under DeepSpeed accelerate steps the engine inside the last
        # micro-batch's backward, so an lr set at the update would reach only the next step (step 0 would run at
        # the optimizer's constructed lr: no warmup, no per-group scale)
        f = lr_factor(self.step, self.total_steps, self.warmup, cfg.schedule, cfg.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = g["base_lr"] * f
        for _ in range(cfg.grad_accum):
            batch = next(batches)
            with acc.accumulate(self.model):
                learned, nonfinite = self._micro_backward(batch)
                bad = bad or nonfinite
                used += learned
                self.window.tokens += self.job.count_tokens(batch)
                self.micro += 1
                if acc.sync_gradients:
                    bad = self._update(bad, used)
        self.step += 1
        self._count_nonfinite(bad)

    def _micro_backward(self, batch: dict[str, Any]) -> tuple[bool, bool]:
        """The backward of one micro-batch: (it had learned tokens on every rank and a finite loss, its loss
        was non-finite on some rank). An empty or non-finite one still runs a backward, of zero."""
        acc = self.acc
        n = self.job.learned_tokens(batch)
        empty = self._any_rank(n == 0)
        if not empty:
            with acc.autocast():
                loss, metrics = self.job.loss(self.model, batch)
        nonfinite = not empty and self._any_rank(not bool(torch.isfinite(loss.detach()).all()))
        if empty or nonfinite:
            if empty:
                self.window.empty += 1
                self.empty_total += 1
            # zero gradients through every parameter: DDP's hooks still fire in lock-step
            acc.backward(sum(p.sum() for p in self.trainable) * 0.0)
            return False, nonfinite
        acc.backward(loss)
        value = float(loss.detach())
        self._watch_explosion(value)
        self.window.add(value, metrics)
        return True, False

    def _update(self, bad: bool, used: int) -> bool:
        """At the accumulation boundary: clip, then step at the scheduled lr, or skip a step that had a
        non-finite loss or gradient norm or no learned token. Returns whether the step was bad."""
        acc, cfg = self.acc, self.cfg
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        norm = acc.clip_grad_norm_(self.trainable, max_norm)
        norm = float(norm) if norm is not None else 0.0
        if not bad and not math.isfinite(norm):
            bad = True
            if acc.scaler is not None:  # fp16: let the GradScaler see the inf and lower its scale
                self.optimizer.step()
        if bad or used == 0:
            self.optimizer.zero_grad(set_to_none=True)
            self.window.skipped += 1
            return bad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.window.grad_norm += norm
        self.window.updates += 1
        self.updates_total += 1
        return bad

    def _count_nonfinite(self, bad: bool) -> None:
        """Count a bad step; too many in a row stop the run, naming the last good checkpoint."""
        cfg = self.cfg
        if not bad:
            self.nonfinite_in_row = 0
            return
        self.nonfinite_total += 1
        self.nonfinite_in_row += 1
        if self.nonfinite_in_row >= cfg.max_nonfinite_in_row:
            last = ckpt.latest_intact(self.out)
            raise TrainingError(
                f"{self.nonfinite_in_row} non-finite losses/gradients in a row at step {self.step} "
                f"(train.max_nonfinite_in_row={cfg.max_nonfinite_in_row}); lower train.lr or check the data; "
                f"last good checkpoint: {last or 'none'}")

    def _watch_explosion(self, value: float) -> None:
        """Warn when a loss is far above the running median of the recent ones (training is diverging,
        even while every value is still finite)."""
        recent = self.recent_losses
        if len(recent) >= 8:
            median = statistics.median(recent)
            if value > EXPLODE_FACTOR * max(median, EXPLODE_FLOOR):
                self.window.exploded += 1
                if self.main:
                    log.warning("step %d: loss %.4g is %.0fx the running median %.4g of the last %d: training "
                                "is diverging (lower train.lr or set train.max_grad_norm)", self.step + 1, value,
                                value / max(median, 1e-12), median, len(recent))
        recent.append(value)

    # ---- logging / eval / checkpoints --------------------------------------------------------------

    def _flush_window(self) -> None:
        w = self.window
        keys = sorted(w.metrics)
        local = torch.tensor([w.loss, w.count, w.tokens, w.grad_norm, w.updates, *[w.metrics[k] for k in keys]],
                             dtype=torch.float64, device=self.acc.device)
        tot = self.acc.reduce(local, reduction="sum") if self.world > 1 else local
        tot = tot.tolist()
        elapsed = max(time.perf_counter() - w.t0, 1e-9)
        if tot[1] > 0:
            count = tot[1]
            means = {"loss": tot[0] / count, **{k: v / count for k, v in zip(keys, tot[5:])}}
        else:  # every step of the window was skipped: there is no loss to report (not 0.0)
            means = {"loss": None}
        record = {"type": "train", "step": self.step, **means,
                  "grad_norm": tot[3] / tot[4] if tot[4] else None,
                  "lr": self.optimizer.param_groups[0]["lr"], "tokens_per_s": tot[2] / elapsed,
                  "nonfinite_steps": self.nonfinite_total}
        if w.skipped:
            record["skipped_steps"] = w.skipped
        if w.empty:
            record["empty_batches"] = w.empty
        if w.exploded:
            record["exploding_losses"] = w.exploded
        self.tokens_total += int(tot[2])
        self.last_train = {f"train/{k}": v for k, v in record.items()
                           if k not in ("type", "step", "tokens_per_s") and v is not None}
        self.logger.log(record)
        w.reset()
        if self.bar is not None:
            shown = "skipped" if record["loss"] is None else f"{record['loss']:.4f}"
            self.bar.set_postfix(loss=shown, tok_s=f"{record['tokens_per_s']:.0f}")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        rows = self.eval_rows
        if rows is None or len(rows) == 0:
            return {}
        cfg, acc = self.cfg, self.acc
        bs = cfg.batch_size
        chunks = [list(range(i, min(i + bs, len(rows)))) for i in range(0, len(rows), bs)]
        per_rank = max(1, len(chunks) // self.world)
        if cfg.eval_batches is not None:
            per_rank = min(per_rank, cfg.eval_batches)
        mine = [chunks[(j * self.world + self.rank) % len(chunks)] for j in range(per_rank)]
        self.model.eval()
        sums: dict[str, float] = {}
        keys: list[str] | None = None
        scored = 0
        for idx in mine:
            batch = _to_device(self.job.collate([rows[i] for i in idx]), acc.device)
            if self.job.learned_tokens(batch) == 0:
                continue  # nothing to score (a non-empty eval batch on another rank keeps the sum right)
            with acc.autocast():
                loss, metrics = self.job.loss(self.model, batch)
            scored += 1
            values = {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
            keys = keys or sorted(values)
            for k in keys:
                sums[k] = sums.get(k, 0.0) + values[k]
        if keys is None:
            self.model.train()
            return {}  # every eval batch was empty: no loss to report
        local = torch.tensor([scored, *[sums[k] for k in keys]], dtype=torch.float64, device=acc.device)
        tot = (acc.reduce(local, reduction="sum") if self.world > 1 else local).tolist()
        out = {f"eval/{k}": v / tot[0] for k, v in zip(keys, tot[1:])}
        self.logger.log({"type": "eval", "step": self.step, **{k[5:]: v for k, v in out.items()}})
        self.last_eval = out
        self.model.train()
        return out

    def _gather_rng(self) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        mine = ckpt.capture_rng()
        if self.world == 1:
            return [mine]
        from accelerate.utils import gather_object

        return gather_object([mine])

    def _loop_state(self) -> dict:
        return {"micro": self.micro, "epoch": self.micro // self.micro_per_epoch,
                "batch_in_epoch": self.micro % self.micro_per_epoch, "sampler_seed": self.cfg.seed,
                "micro_per_epoch": self.micro_per_epoch, "world_size": self.world,
                "batch_size": self.cfg.batch_size, "nonfinite_total": self.nonfinite_total,
                "nonfinite_in_row": self.nonfinite_in_row, "tokens_total": self.tokens_total,
                "empty_total": self.empty_total, "updates_total": self.updates_total,
                "train_seconds": self._train_seconds(),
                "data": self._data_identity(), "length_group": self.length_group,
                "last_eval": self.last_eval, "last_train": self.last_train, "config": to_dict(self.cfg),
                "job_config": self._job_config(), "trackers": self.logger.state if self.main else {}}

    def _train_seconds(self) -> float | None:
        """The loop's seconds over every run that took the steps so far (None when an earlier run's are unknown)."""
        if self.seconds_before is None:
            return None
        return self.seconds_before + time.perf_counter() - self.run_t0

    def _job_train_seconds(self) -> float | None:
        """The job's train seconds: the slowest rank's, so every rank reports the one value (a collective)."""
        secs = self._train_seconds()
        if self.world == 1 or secs is None:  # None on every rank alike: they resumed from one checkpoint
            return secs
        import torch.distributed as dist

        t = torch.tensor([secs], dtype=torch.float64, device=self.acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def _job_config(self) -> dict:
        """The job's own settings (loss weights, lengths, head shape ...) as dotted keys, JSON values; its
        train settings are compared on their own (RESUMABLE_CHANGES)."""
        import json

        cfg = to_dict(self.job.config())
        flat: dict = {}

        def walk(d: dict, prefix: str) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}.")
                else:
                    flat[prefix + k] = json.loads(json.dumps(v, default=str))

        if isinstance(cfg, dict):
            walk({k: v for k, v in cfg.items() if k != "train"}, "")
        return flat

    def _nonfinite_shard(self) -> str | None:
        """The first parameter whose local shard holds a non-finite value on any rank (a collective: every
        rank gets the same answer, so all of them skip or all of them write the sharded checkpoint)."""
        from accelerate.utils import gather_object

        mine = None
        for name, p in self.model.named_parameters():
            # FSDP2: a DTensor's local shard; ZeRO-3: the partition in ds_tensor (the parameter is a placeholder)
            local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
            if local.is_floating_point() and not bool(torch.isfinite(local.detach()).all()):
                mine = name
                break
        return next((n for n in gather_object([mine]) if n is not None), None)

    def save(self) -> None:
        acc = self.acc
        if self.sharded and self.world > 1:  # each rank writes its own shard (training/sharded.py)
            bad = self._nonfinite_shard()
            if bad is not None:
                if self.main:
                    log.warning("step %d: not saving a checkpoint: tensor '%s' holds non-finite values (the last "
                                "good checkpoint stays %s)", self.step, bad, ckpt.latest_intact(self.out) or "none")
                return
            args = (self._loop_state(), self._gather_rng(), self.logger.text if self.main else "", self.cfg.keep_last)
            if self.fsdp:
                sharded.save_sharded(acc, self.out, self.step, self.model, self.optimizer, *args)
            else:  # DeepSpeed ZeRO: its own per-rank partition files
                sharded.save_deepspeed(acc, self.out, self.step, self.model, *args)
            return
        model_state = acc.get_state_dict(self.model)
        opt_state = self.optimizer.state_dict()
        rng = self._gather_rng()
        bad = _finite_state(model_state) if self.main else None
        if bad is not None:  # a checkpoint is a promise of good weights: keep the last one that is
            log.warning("step %d: not saving a checkpoint: tensor '%s' holds non-finite values (the last good "
                        "checkpoint stays %s)", self.step, bad, ckpt.latest_intact(self.out) or "none")
        elif self.main:
            state = self._loop_state()
            ckpt.save_checkpoint(self.out, self.step, model_state, opt_state, state, rng, self.logger.text,
                                 self.cfg.keep_last)
        acc.wait_for_everyone()

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.setup()
        self.bar = None
        if self.main and cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.job.kind}",
                            unit="step", dynamic_ncols=True)
        batches = self._micro_batches()
        self.run_t0 = time.perf_counter()
        start_step = self.step
        try:
            while self.step < self.total_steps:
                self._train_step(batches)
                if self.bar is not None:
                    self.bar.update(1)
                at_save = cfg.save_every > 0 and self.step % cfg.save_every == 0
                last = self.step == self.total_steps
                if self.step % cfg.log_every == 0 or at_save or last:
                    self._flush_window()
                if cfg.eval_every > 0 and self.step % cfg.eval_every == 0 and not last:
                    self.evaluate()
                if at_save:
                    self.save()
        finally:
            if self.bar is not None:
                self.bar.close()
        final_eval = self.evaluate()
        elapsed = time.perf_counter() - self.run_t0
        metrics = {**final_eval, **self.last_train, "steps": self.step, "nonfinite_steps": self.nonfinite_total,
                   "empty_batches": self.empty_total, "tokens": self.tokens_total,
                   "train_seconds": self._job_train_seconds(), "steps_this_run": self.step - start_step}
        if self.resume_changes:  # the manifest says which values held before the resume and which after
            metrics["resume_changes"] = self.resume_changes
        summary = {"type": "summary", "step": self.step, **metrics, "wall_s": elapsed,
                   "resumed_from": str(self.resume_path or "")}
        self.logger.log(summary)
        if self.updates_total == 0:
            self.logger.close()
            raise TrainingError(
                f"no optimizer step was taken in {self.step} steps ({self.empty_total} batches had no learned "
                f"token, {self.nonfinite_total} steps were non-finite): check the data's loss masks; no artifact "
                f"was written")
        self.job.before_artifact()  # every rank: work on a target that may be sharded across them
        artifact, module = self._save_artifact(metrics)
        self.logger.close()
        if self.main:
            print(_summary_text(self.job.kind, summary, artifact))
        return TrainResult(self.out, artifact, self.step, metrics, self.resume_path, cfg.warm_start,
                           self.logger.path if self.main else None,
                           ckpt.read_log(self.logger.path) if self.main else [], module)

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The FSDP module's whole state dict, gathered onto rank 0's CPU (a collective; empty elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _save_artifact(self, metrics: dict[str, float]) -> tuple[Path | None, nn.Module | None]:
        acc = self.acc
        if self.sharded:  # gather full weights (collective), then rebuild a plain module on rank 0
            state = self._full_state() if self.fsdp else acc.get_state_dict(self.model)
            module = None
            if self.main:
                module = self.job.build_module()
                module.load_state_dict(state)
        else:
            module = acc.unwrap_model(self.model)
        path = None
        bad = _finite_state(module.state_dict()) if module is not None else None
        if self._any_rank(bad is not None):  # every rank stops (a rank raising alone would leave the rest waiting)
            raise TrainingError(f"not writing the artifact: tensor '{bad or '?'}' holds non-finite values; last "
                                f"good checkpoint: {ckpt.latest_intact(self.out) or 'none'}")
        if self.main:
            path = Path(self.job.save_artifact(module, self.out / ARTIFACT_DIR, metrics))
        acc.wait_for_everyone()
        return path, module


def _summary_text(kind: str, summary: dict, artifact: Path | None) -> str:
    parts = [f"trained {kind}: {summary['step']} steps in {summary['wall_s']:.1f}s"]
    for k in sorted(summary):
        if k.startswith("eval/") or k in ("train/loss", "nonfinite_steps"):
            v = summary[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    if artifact is not None:
        parts.append(f"artifact: {artifact}")
    return "  ".join(parts)


def _make_folder(out: Path) -> None:
    """Create train.output_dir; a file where it (or a folder above it) must be is one line naming it."""
    from draftsmith.errors import OutputError

    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), out)
        raise OutputError(f"train.output_dir {out}: cannot be written, {blocker} is a file, not a folder") from None


def train(job: Job, cfg: TrainConfig, accelerator=None) -> TrainResult:
    """Train `job` with `cfg` (see module docstring); resumes from a checkpoint when cfg.resume says so."""
    from draftsmith.locks import output_lock

    trainer = Trainer(job, cfg, accelerator)
    # one training per train.output_dir at a time (its checkpoints and log); held by the main rank
    with output_lock(trainer.out, "training output", enabled=trainer.main):
        return trainer.run()

