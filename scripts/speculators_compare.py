"""Peer comparison: the `speculators` package's own EAGLE-3 trainer against draftsmith's, on the same rows and
the same captured target states, judged by draftsmith's speculative decoder.

    python scripts/speculators_compare.py train --like runs/b31/eagle3 --seconds 600 --out runs/peer/speculators
    python scripts/speculators_compare.py compare runs/b31/eagle3 runs/peer/speculators --out runs/peer/compare

`train` trains speculators' `Eagle3DraftModel` with speculators' code: the model it builds
(`create_transformer_layer_config` + `Eagle3DraftModel.from_training_args`: the verifier's embedding,
draft-vocabulary lm_head rows and final norm), its training-time-test forward and loss (`compute_metrics`:
per step KL(p̃_target || q_draft) over the draft vocabulary, weighted decay**j), its data path (a
`BaseDataset`, `_setup_dataloader`: the multipack sampler packing rows into one sequence of
`total_seq_len` tokens with document masks, `CollateFn`, `shift_batch`) and its `Trainer` (optimizer,
scheduler, clipping at 1.0, autocast, `train_epoch` / `val_epoch`). What it is fed is draftsmith's: the
rows of `load_distilled`, the training split of `split_rows`, each row's `window` (max_length,
prompt_context), the draft vocabulary of `draft_vocabulary` over the training split's target-written
tokens, and the capture cache's layer outputs and last hidden states. It stops when the wall-clock
budget is spent (or its epochs / max_steps end), then imports the head into a draftsmith EAGLE-3 artifact
(eagle/export.py's speculators mapping read backwards; the manifest's `trained_by` holds the version, steps,
seconds, throughput, every patch and what still differs from our trainer). `--like ARTIFACT` copies one of
our runs' settings (target, data, capture, layers, TTT depth and decay, vocabulary size, max_length,
prompt_context, lr, weight decay, warmup, schedule, epochs, batch rows, seed, precision); flags override.
Settings speculators' CLI would default otherwise and that are set to ours: AdamW (not Muon), weight decay
0, cosine with 20 warmup steps, decay 0.8 over 6 TTT steps, norm_before_residual false; the packed length
is `batch_rows` x the mean window length (~ the tokens of one of our 8-row batches). Forced, since an
EagleHead (and draftsmith's decoder) has no place for them: norm_before_fc, fc_norm and norm_output off,
one full-attention draft layer (speculators' CLI default is a 2048-token sliding window).

Alignment. speculators' `shift_batch` pairs, at index t, the token x_{t+1}, the features g_t and the
verifier state y_{t+1}; step j of its forward at index t reads x_{t+1+j}, predicts x_{t+2+j} against
lm_head(y_{t+1+j}) and is weighted by loss_mask[t+1+j] (speculators' own masks mark the assistant tokens,
so it trains predictions whose PREVIOUS token is the assistant's). draftsmith's step j at base t reads the
same tokens and teacher and is weighted by loss_mask[t+2+j] (the PREDICTED token is target-written). With
`mask: draftsmith` (default) each row's mask is shifted left by one before speculators sees it, so both
trainers learn the same (base, step) pairs; `mask: speculators` hands it over unshifted.
Features: our capture ids are decoder-layer OUTPUTS; speculators/vLLM ids count the residual stream
entering a layer, so the config records ours + 1 (eagle/export.py). The capture's `last_hidden` is
post-norm, so the model's verifier norm is replaced by the identity: the teacher is the target's own
lm_head rows times the state the lm_head read, as in eagle/job.py.

Run-time patches (applied here, inside the run; nothing in site-packages changes), see `cpu_patches`:
  * `httpx` -> `httpx2` where only the latter is installed: `speculators.train.trainer` imports the vLLM
    render client (data generation, never called in training), which imports httpx; openai here uses httpx2.
  * `speculators.train.trainer.get_local_rank` -> "cpu": the Trainer moves the model and each batch to
    the local rank, a CUDA device index.
  * `torch.accelerator.synchronize` -> no-op while there is no accelerator: the Trainer's step timer
    synchronises on logged steps and raises on CPU; CPU work has finished when a call returns.
  * `trainer.device_type = "cpu"` after construction (it falls back to "cuda" autocast without an
    accelerator) and `model.verifier_norm = Identity()` (above).
  * with `--no-progress` only: `speculators.train.trainer.tqdm` -> the plain loader (its rich progress bar).
Configured, not patched: attention "sdpa" (flex attention is a GPU kernel; speculators offers sdpa for
such hardware), loss implementation "eager" (the fused losses are Triton kernels), no distributed setup
(single process: speculators' topology getters answer rank 0 of 1), num_workers 0.

`compare` decodes the eval prompts of `--split` (dev unless told; `--domains` picks some) once with both heads
side by side (`evaluate --proposer eagle:OURS --compare eagle:THEIRS ...`): each head's EAGLE-2 tree cut by
this machine's cost model, each head's uncut GPU-sized tree, and a chain of `--chain` tokens for each, and
writes report.json / report.md plus comparison.md / .json: τ, α and per-position acceptance per head and
decoding (overall and per domain). `--repeats 1` where only τ and α are compared.
The same decoding by hand: `draftsmith evaluate --target smollm2-135m --proposer eagle:OURS --tree auto
--limit-per-domain 4 --max-new-tokens 64 --compare eagle:THEIRS eagle:OURS@chain=5
eagle:THEIRS@chain=5 --out DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal
from unittest import mock

import torch
from torch import nn

log = logging.getLogger("speculators_compare")

SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "none", "none": "none"}
# EagleJobConfig fields (`--like` an artifact of ours) -> PeerConfig fields
LIKE_FIELDS = {"target": "target", "data": "data", "capture_cache": "capture", "ttt_steps": "ttt_steps",
               "step_decay": "step_decay", "norm_before_residual": "norm_before_residual",
               "draft_vocab_size": "draft_vocab_size", "max_length": "max_length",
               "prompt_context": "prompt_context", "eval_fraction": "eval_fraction", "target_layers": "target_layers"}
LIKE_TRAIN_FIELDS = {"lr": "lr", "weight_decay": "weight_decay", "warmup_steps": "warmup_steps", "epochs": "epochs",
                     "batch_size": "batch_rows", "seed": "seed", "train_rows": "train_rows",
                     "mixed_precision": "precision", "max_steps": "max_steps"}


@dataclass
class PeerConfig:
    """Settings of a speculators training run; the defaults are configs/smollm2-135m/eagle3.yaml's."""

    target: str = "smollm2-135m"
    data: str = "runs/data/smollm2-135m"
    capture: str | None = None  # the capture cache; None = <data>/capture
    out: str = "runs/peer/speculators"
    seconds: float = 600.0  # wall-clock budget of the training steps (data reading included; validation not)
    # the LR schedule's horizon (speculators: epochs x batches per epoch); the budget may end sooner
    epochs: float = 2.0
    max_steps: int | None = None  # overrides epochs as the horizon, as in both trainers
    train_rows: int | None = None
    eval_fraction: float = 0.05
    seed: int = 0
    target_layers: list[int] | None = None  # draftsmith ids (decoder-layer outputs); None = default_eagle3_layers
    draft_vocab_size: int = 8192
    ttt_steps: int = 6
    step_decay: float = 0.8
    norm_before_residual: bool = False  # ours; speculators' CLI default is true
    max_length: int = 384
    prompt_context: int | None = None
    batch_rows: int = 8  # packed length = batch_rows x mean window length: the tokens of one of our batches
    total_seq_len: int | None = None  # the packed length itself (overrides batch_rows)
    lr: float = 5e-4
    weight_decay: float = 0.0
    optimizer: Literal["adamw", "muon"] = "adamw"  # ours is AdamW; speculators' CLI default is muon
    scheduler: Literal["cosine", "linear", "none"] = "cosine"
    warmup_steps: int = 20
    loss: str = "kl_div"
    precision: Literal["auto", "no", "bf16"] = "auto"  # draftsmith's rule: bf16 on a CPU with native bf16
    mask: Literal["draftsmith", "speculators"] = "draftsmith"  # module docstring, "Alignment"
    threads: int | None = None
    progress: bool = True
    like: str | None = None  # the artifact of ours whose settings these are (recorded)

    def __post_init__(self):
        if self.seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds}")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if not 1 <= self.ttt_steps <= 16:
            raise ValueError(f"ttt_steps must be in 1..16, got {self.ttt_steps}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("lr must be > 0, weight_decay and warmup_steps >= 0")
        if self.batch_rows < 1 or (self.total_seq_len is not None and self.total_seq_len < 8):
            raise ValueError("batch_rows must be >= 1 and total_seq_len >= 8")
        if self.scheduler not in ("cosine", "linear", "none"):
            raise ValueError(f"scheduler must be cosine, linear or none, got {self.scheduler!r}")
        if self.mask not in ("draftsmith", "speculators"):
            raise ValueError(f"mask must be draftsmith or speculators, got {self.mask!r}")
        if self.precision not in ("auto", "no", "bf16"):
            raise ValueError(f"precision must be auto, no or bf16, got {self.precision!r}")


def like_artifact(path: str | Path) -> dict:
    """PeerConfig fields from the manifest of one of our EAGLE-3 artifacts (its training settings)."""
    from draftsmith.reading import read_json

    manifest = read_json(Path(path) / "manifest.json")
    cfg, train = manifest.get("config") or {}, (manifest.get("config") or {}).get("train") or {}
    if manifest.get("kind") != "eagle" or cfg.get("version") != "eagle3":
        raise SystemExit(f"{path}: --like takes an EAGLE-3 artifact trained by draftsmith")
    out = {mine: cfg[theirs] for theirs, mine in LIKE_FIELDS.items() if theirs in cfg}
    out.update({mine: train[theirs] for theirs, mine in LIKE_TRAIN_FIELDS.items() if theirs in train})
    if "schedule" in train:
        out["scheduler"] = SCHEDULES[train["schedule"]]
    if out.get("precision") == "fp16":
        out["precision"] = "no"
    return {**out, "like": str(path)}


# --------------------------------------------------------------------------------------------------------
# Run-time patches
# --------------------------------------------------------------------------------------------------------


def _alias_httpx() -> str | None:
    """`httpx2` under the name `httpx` where only it is installed (module docstring). Returns what it did."""
    try:
        importlib.import_module("httpx")
        return None
    except ImportError:
        sys.modules["httpx"] = importlib.import_module("httpx2")
        return "httpx -> httpx2 (speculators.train.utils imports the vLLM render client, unused in training)"


@functools.cache
def speculators_modules():
    """speculators' training modules, imported once (after the httpx alias)."""
    patch = _alias_httpx()
    if patch:
        log.info("run-time patch: %s", patch)
    names = {"trainer": "speculators.train.trainer", "data": "speculators.train.data",
             "dataloader": "speculators.train.dataloader", "cli": "speculators.train.cli",
             "eagle3": "speculators.models.eagle3"}
    return {key: importlib.import_module(name) for key, name in names.items()}


PATCHES = [
    "httpx -> httpx2 where only httpx2 is installed (the vLLM render client's import; unused in training)",
    "speculators.train.trainer.get_local_rank -> 'cpu' (the Trainer moves model and batches to a CUDA index)",
    "torch.accelerator.synchronize -> no-op without an accelerator (the step timer's sync raises on CPU)",
    "Trainer.device_type = 'cpu' (autocast falls back to 'cuda' without an accelerator)",
    "Eagle3DraftModel.verifier_norm -> Identity (the capture's last_hidden is already post-norm)",
    "with --no-progress only: speculators.train.trainer.tqdm -> the plain loader (no rich progress bar)",
]


@contextlib.contextmanager
def cpu_patches(progress: bool = True):
    """The patches a speculators Trainer needs on a CPU-only machine, for the duration of the run (and, with
    progress false, its progress bar swapped for the plain loader)."""
    trainer_mod = speculators_modules()["trainer"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(trainer_mod, "get_local_rank", lambda: "cpu"))
        if not torch.accelerator.is_available():
            stack.enter_context(mock.patch.object(torch.accelerator, "synchronize", lambda *a, **k: None))
        if not progress:
            stack.enter_context(mock.patch.object(trainer_mod, "tqdm", lambda iterable, **_: iterable))
        yield


# --------------------------------------------------------------------------------------------------------
# Data: our rows and capture, as speculators' samples
# --------------------------------------------------------------------------------------------------------


def sample(row: dict, states: dict[str, torch.Tensor], layers: list[int], span: tuple[int, int], mask: str,
           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One row's window [s, e) as speculators' raw sample (before `shift_batch`): hidden_states [n, 3H] (the
    fused layers, ours), input_ids [n], verifier_last_hidden_states [n, H] (post-norm), loss_mask [n]
    (mask "draftsmith": shifted left by one, module docstring)."""
    s, e = span
    stored = states["last_hidden"].shape[0]
    if stored < e:
        raise SystemExit(f"capture row {row.get('row_id')} has {stored} tokens, the row's window needs {e}: the "
                         "capture was made from other data")
    lm = torch.as_tensor(list(row["loss_mask"])[s:e], dtype=torch.long)
    if mask == "draftsmith":
        lm = torch.cat([lm[1:], lm.new_zeros(1)])
    return {"hidden_states": torch.cat([states[f"layer.{i}"][s:e] for i in layers], dim=-1).to(dtype),
            "input_ids": torch.as_tensor(list(row["input_ids"])[s:e], dtype=torch.long),
            "verifier_last_hidden_states": states["last_hidden"][s:e].to(dtype),
            "loss_mask": lm}


def captured_rows_dataset(rows, reader, layers: list[int], cfg: PeerConfig, dtype: torch.dtype):
    """A speculators `BaseDataset` over our rows: each row's `window`, its capture states, token counters."""
    from draftsmith.data.batching import window

    base = speculators_modules()["data"].BaseDataset

    class CapturedRows(base):
        def __init__(self):
            self.rows = rows
            self.spans = [window(list(r["loss_mask"]), cfg.max_length, prompt_context=cfg.prompt_context) for r in rows]
            self.tokens = self.learned = 0  # what the trainer was served (every fetched batch is trained)
            super().__init__(max_len=cfg.max_length, hidden_states_dtype=dtype)

        def __len__(self):
            return len(self.rows)

        def _compute_approx_lengths(self):
            return [e - s for s, e in self.spans]

        def _get_raw_data(self, index):
            row = self.rows[index]
            out = sample(row, reader.get(int(row["row_id"])), layers, self.spans[index], cfg.mask, dtype)
            self.tokens += out["input_ids"].numel()
            self.learned += int(out["loss_mask"].sum())
            return out

    return CapturedRows()


# --------------------------------------------------------------------------------------------------------
# Model: speculators' draft, and the import into our EagleHead
# --------------------------------------------------------------------------------------------------------


def build_speculators_model(target, layers: list[int], d2t: torch.Tensor, t2d: torch.Tensor, cfg: PeerConfig):
    """speculators' Eagle3DraftModel as `speculators train` builds it (one Llama draft layer shaped from the
    verifier), with the settings our EagleHead can hold: full attention, no norm before fc, no per-layer fc
    norms, TTT steps reading the layer output (norm_output false)."""
    mods = speculators_modules()
    if target.folder is None:
        raise SystemExit(f"target {target.name} has no HF folder: speculators reads the verifier's weights from one")
    layer_config = mods["cli"].create_transformer_layer_config(
        str(target.folder), num_layers=1, draft_arch="llama", hidden_act="silu", sliding_window=2048,
        full_attention_indices=[0])
    model = mods["eagle3"].Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target.folder),
        target_layer_ids=[i + 1 for i in layers], draft_attn_impl="sdpa", draft_vocab_size=int(d2t.numel()),
        norm_before_residual=cfg.norm_before_residual, norm_before_fc=False, fc_norm=False, norm_output=False,
        embed_requires_grad=False, ttt_steps=cfg.ttt_steps)
    model.verifier_norm = nn.Identity()  # our last_hidden is post-norm (module docstring)
    return model


SKIP = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")  # the verifier's, not the head's


def import_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators Eagle3 state dict under our EagleHead's names: eagle/export.py's mapping read backwards
    (layers.0.* -> layer.*; fc, norm, lm_head, d2t, t2d as they are), the verifier's tensors dropped."""
    from draftsmith.eagle.export import canonical_name

    out = {}
    for name, tensor in state.items():
        if name.startswith(SKIP):
            continue
        ours = canonical_name(name)
        if ours is None or ours.startswith("?"):
            raise SystemExit(f"speculators tensor '{name}' has no place in an EagleHead (mapping in eagle/export.py)")
        tensor = tensor.detach().to("cpu")
        out[ours] = (tensor.float() if tensor.is_floating_point() else tensor).clone()
    return out


def import_head(model, target, layers: list[int], cfg: PeerConfig):
    """Our EagleHead holding a speculators Eagle3DraftModel's weights (loaded strictly: every tensor of ours
    comes from theirs and nothing is left over)."""
    from draftsmith.eagle.model import EagleHead

    state = import_state(model.state_dict())
    c = model.config  # EAGLE-3.1's norms (speculators' trainer turns norm_before_fc and norm_output on for eagle3)
    head = EagleHead.from_target(target.model, "eagle3", layers, draft_vocab=(state["d2t"], state["t2d"]),
                                 ttt_steps=cfg.ttt_steps, norm_before_residual=bool(c.norm_before_residual),
                                 draft_layer="llama", norm_before_fc=bool(getattr(c, "norm_before_fc", False)),
                                 fc_norm=bool(getattr(c, "fc_norm", False)),
                                 norm_output=bool(getattr(c, "norm_output", False)))
    head.load_state_dict(state, strict=True)
    head.attach_target(target.model)
    return head.eval()


# --------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------


class MetricRecords(logging.Handler):
    """Collects the dicts speculators' Trainer logs to `speculators.metrics`."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


@contextlib.contextmanager
def collected_metrics():
    logger = logging.getLogger("speculators.metrics")
    handler, level, propagate = MetricRecords(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def resolved_precision(cfg: PeerConfig) -> str:
    from draftsmith.training import TrainConfig

    return TrainConfig(mixed_precision=cfg.precision).resolved_mixed_precision()


def differences(cfg: PeerConfig, total_seq_len: int, precision: str) -> list[str]:
    """What still differs from a draftsmith run with the same settings (recorded in the manifest)."""
    out = [
        "lm_head: speculators keeps it frozen at the target's draft-vocabulary rows; draftsmith trains it",
        "loss: KL(p~_target || q) per step (speculators, eager), draftsmith soft cross-entropy: equal gradients",
        "gradient clipping: 1.0 (fixed in speculators' Trainer); draftsmith's configs use 0.5",
        f"batches: one packed sequence of {total_seq_len} tokens with document masks (multipack) instead of "
        f"{cfg.batch_rows} right-padded rows",
        "schedule horizon: counted in packed batches (epochs x batches per epoch, or max_steps); a run stopped "
        "by the wall-clock budget ends before its schedule does",
        "accuracy proxies: speculators' full_acc compares with the target's argmax over the draft vocabulary, "
        "draftsmith's step acc with its argmax over the full vocabulary",
        "positions: speculators' step-0 position ids start at 1 (ours at 0); RoPE is relative, scores are equal",
    ]
    if cfg.mask == "speculators":
        out.append("loss mask: speculators' convention (the previous token is target-written), one position "
                   "off draftsmith's at each answer's edges")
    if cfg.optimizer != "adamw":
        out.append(f"optimizer: {cfg.optimizer} (draftsmith: AdamW)")
    if precision == "bf16":
        out.append("precision: bf16 autocast in both; speculators also collates the features in bf16")
    return out


def train_peer(cfg: PeerConfig, target=None, rows=None) -> Path:
    """Train speculators' EAGLE-3 on our rows and capture for `cfg.seconds` and save it as our artifact.

    `target` / `rows` (a Dataset or a list of dicts with row_id, input_ids, loss_mask) may be given, else
    they are loaded from cfg.target / cfg.data. Returns the artifact directory."""
    from draftsmith import artifact
    from draftsmith.capture.cache import ShardReader
    from draftsmith.capture.layers import default_eagle3_layers, resolve_layers
    from draftsmith.data import load_distilled
    from draftsmith.data.batching import split_rows
    from draftsmith.heads.vocab import draft_vocabulary, token_counts
    from draftsmith.targets import load_target
    from draftsmith.targets.fingerprint import check_compatible

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mods = speculators_modules()
    target = target if target is not None else load_target(cfg.target)
    rows = rows if rows is not None else load_distilled(cfg.data, target)
    capture = Path(cfg.capture or Path(cfg.data) / "capture")
    reader = ShardReader(capture)
    if reader.fingerprint is not None:
        check_compatible(reader.fingerprint, target.fingerprint(), what=f"capture cache {capture}")
    L = target.num_layers
    layers = resolve_layers(list(cfg.target_layers or default_eagle3_layers(L)), L)
    missing = [i for i in layers if i not in reader.layers]
    if missing or not reader.index.get("last_hidden"):
        raise SystemExit(f"capture cache {capture} has layers {reader.layers} (last_hidden: "
                         f"{bool(reader.index.get('last_hidden'))}); the head needs layers {layers} and last_hidden")
    train_rows, held_rows = split_rows(rows, cfg.eval_fraction, cfg.seed, cfg.train_rows)
    counts = token_counts(train_rows, target.vocab_size)
    d2t, t2d, coverage = draft_vocabulary(counts, cfg.draft_vocab_size)

    precision = resolved_precision(cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    train_set = captured_rows_dataset(train_rows, reader, layers, cfg, dtype)
    held_set = captured_rows_dataset(held_rows, reader, layers, cfg, dtype) if len(held_rows) else None
    lengths = train_set.approx_lengths
    total_seq_len = cfg.total_seq_len or max(max(lengths), math.ceil(cfg.batch_rows * sum(lengths) / len(lengths)))

    model = build_speculators_model(target, layers, d2t, t2d, cfg)
    H = target.hidden_size
    setup_loader = mods["dataloader"]._setup_dataloader  # noqa: SLF001 (speculators' own loader assembly)
    loader_kw = dict(hidden_size=H, num_workers=0, num_target_layers=len(layers), prefetch_factor=None,
                     preprocess=mods["eagle3"].shift_batch)
    train_loader = setup_loader(train_set, total_seq_len, seed=cfg.seed, **loader_kw)
    val_loader = setup_loader(held_set, total_seq_len, **loader_kw) if held_set is not None else None
    Eagle3 = mods["eagle3"].Eagle3DraftModel
    train_kw, val_kw = Eagle3.get_trainer_kwargs(loss_fn=cfg.loss, loss_implementation="eager",
                                                 ttt_steps=cfg.ttt_steps, ttt_step_loss_decay=cfg.step_decay)
    horizon = cfg.max_steps or max(1, round(cfg.epochs * len(train_loader)))
    log.info("speculators %s: %d train rows (%d held out), packed length %d, %d batches/epoch, horizon %d steps, "
             "budget %.0f s, precision %s", importlib.metadata.version("speculators"), len(train_rows),
             len(held_rows), total_seq_len, len(train_loader), horizon, cfg.seconds, precision)
    run = run_budgeted(model, train_loader, val_loader, cfg, horizon, dtype)
    log.info("speculators trained %d steps in %.1f s (%d tokens served)", run["steps"], run["seconds"],
             train_set.tokens)

    head = import_head(model, target, layers, cfg)
    metrics = {"steps": run["steps"], "seconds": run["seconds"], "tokens": train_set.tokens,
               "learned_tokens": train_set.learned,
               **{f"speculators/train/{k}": v for k, v in run["train"].items()},
               **{f"speculators/val/{k.removesuffix('_epoch')}": v for k, v in (run["val"] or {}).items()}}
    trained_by = {
        "package": "speculators", "version": importlib.metadata.version("speculators"),
        "steps": run["steps"], "seconds": run["seconds"], "budget_seconds": cfg.seconds, "horizon_steps": horizon,
        "epochs_done": run["steps"] / len(train_loader), "stopped_by_budget": run["seconds"] >= cfg.seconds,
        "median_step_ms": run["speed"].get("step_ms"), "median_tokens_per_s": run["speed"].get("tokens_per_s"),
        "total_seq_len": total_seq_len, "batches_per_epoch": len(train_loader), "precision": precision,
        "attention": "sdpa", "loss": f"{cfg.loss} (eager)", "clip_grad_norm": 1.0,
        "aux_layer_ids_speculators": [i + 1 for i in layers],
        "patches": PATCHES, "differences": differences(cfg, total_seq_len, precision),
    }
    config = {**asdict(head.config), "architecture": head.config.model_type, "embeddings": "target",
              "feature_convention": "pre-norm decoder layer outputs (capture/layers.py)",
              "draft_vocab_coverage": coverage}
    manifest = artifact.make_manifest(
        "eagle", target.fingerprint(), {**asdict(cfg), "version": "eagle3", "trainer": "speculators"},
        data={"path": cfg.data, "capture": str(capture), "train_rows": len(train_rows), "eval_rows": len(held_rows),
              "target_written_tokens": int(counts.sum()), "draft_vocab_coverage": coverage},
        metrics=metrics, trained_by=trained_by)
    return artifact.save_artifact(Path(cfg.out), manifest, head.state_dict(), config)


def run_budgeted(model, train_loader, val_loader, cfg: PeerConfig, horizon: int, dtype: torch.dtype) -> dict:
    """speculators' Trainer over its epochs until `horizon` steps or until `cfg.seconds` are spent (checked
    after every step: the step that runs out is the last), then one validation pass over the held-out rows.
    Returns steps, seconds, the last logged training metrics, the validation metrics and the median step's
    timing profile."""
    mods = speculators_modules()
    Eagle3 = mods["eagle3"].Eagle3DraftModel
    train_kw, val_kw = Eagle3.get_trainer_kwargs(loss_fn=cfg.loss, loss_implementation="eager",
                                                 ttt_steps=cfg.ttt_steps, ttt_step_loss_decay=cfg.step_decay)
    with (tempfile.TemporaryDirectory(prefix="speculators-peer-") as work, cpu_patches(cfg.progress),
          collected_metrics() as records, warnings.catch_warnings()):
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported.*")
        tcfg = mods["trainer"].TrainerConfig(
            lr=cfg.lr, num_epochs=math.ceil(horizon / len(train_loader)), save_path=work,
            resume_from_checkpoint=False, train_call_kwargs=train_kw, val_call_kwargs=val_kw,
            optimizer=cfg.optimizer, weight_decay=cfg.weight_decay, muon_lr=cfg.lr, scheduler_type=cfg.scheduler,
            scheduler_warmup_steps=cfg.warmup_steps, scheduler_total_steps=horizon, checkpoint_freq=1,
            hidden_states_dtype=dtype, log_freq=1, max_steps=horizon)
        trainer = mods["trainer"].Trainer(model, tcfg, train_loader, val_loader)  # checkpoints: none (work is empty)
        trainer.device_type = "cpu"
        start = time.perf_counter()

        def out_of_time():
            if time.perf_counter() - start >= cfg.seconds:  # the loop breaks at its own max_steps check
                trainer.config = trainer.config._replace(max_steps=trainer.global_step)

        epoch = 0
        while trainer.global_step < trainer.config.max_steps:  # the horizon, or the step the budget ran out in
            trainer.train_epoch(epoch, step_callback=out_of_time)
            epoch += 1
        seconds = time.perf_counter() - start
        val = trainer.val_epoch(epoch - 1) if val_loader is not None else None
    profiles = sorted((r["profile"] for r in records if r.get("profile")), key=lambda p: p["step_ms"])
    return {"steps": trainer.global_step, "seconds": seconds, "val": val,
            "train": next((r["train"] for r in reversed(records) if "train" in r), {}),
            "speed": profiles[len(profiles) // 2] if profiles else {}}


# --------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------


def provenance(path: str | Path) -> dict:
    """Who trained an EAGLE artifact and how long: trainer label, steps, tokens, seconds (where recorded)."""
    from draftsmith.reading import read_json

    manifest = read_json(Path(path) / "manifest.json")
    by, metrics = manifest.get("trained_by") or {}, manifest.get("metrics") or {}
    return {"path": str(path), "trainer": f"{by['package']} {by.get('version', '')}".strip() if by else "draftsmith",
            "steps": metrics.get("steps"), "tokens": metrics.get("tokens"), "seconds": by.get("seconds")}


def compare(ours: str | Path, theirs: str | Path, out: str | Path, target="smollm2-135m",
            limit_per_domain: int | None = 4, max_new_tokens: int = 64, chain: int = 5,
            prompts: list[str] | None = None, cost_model: bool = True, split: str = "dev",
            domains: list[str] | None = None, repeats: int = 3) -> dict:
    """Both heads decoding the same prompts in one run (module docstring); returns the comparison. `target`: a
    target spec or a loaded Target; `split` / `domains`: which shipped eval prompts (prompts/README.md);
    `repeats`: timed runs per prompt (1 where only τ and α are compared)."""
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    entries = {"tree": [f"eagle:{theirs}"],
               "chain": [f"eagle:{ours}@chain={chain}", f"eagle:{theirs}@chain={chain}"] if chain else []}
    cfg = EvalConfig(target=target if isinstance(target, str) else target.spec, proposer=f"eagle:{ours}",
                     prompts=list(prompts or []), max_new_tokens=max_new_tokens, limit_per_domain=limit_per_domain,
                     tree_from_proposer=True, cost_model=cost_model, split=split, domains=list(domains or []),
                     repeats=repeats,
                     compare=entries["tree"] + entries["chain"])
    command = (f"scripts/speculators_compare.py compare {ours} {theirs} --out {out} --split {split}"
               + (f" --domains {' '.join(domains)}" if domains else "")
               + (f" --limit-per-domain {limit_per_domain}" if limit_per_domain else "")
               + f" --max-new-tokens {max_new_tokens} --chain {chain} --repeats {repeats}"
               + (f" --prompts {' '.join(map(str, prompts))}" if prompts else ""))
    report = evaluate(target, cfg.proposer, config=cfg, command=command)
    out = Path(out)
    write_report(report, out)
    table = comparison(report, ours, theirs, chain)
    (out / "comparison.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "comparison.md").write_text(comparison_md(table))
    return table


def comparison(report: dict, ours, theirs, chain: int) -> dict:
    """Per head and decoding shape: τ, α, per-position acceptance, lossless (overall and per domain)."""
    keep = ("tau", "alpha", "per_position_acceptance", "conditional_acceptance", "lossless")

    def pick(summary: dict) -> dict:
        return {k: summary.get(k) for k in keep}

    heads = {"ours": provenance(ours), "theirs": provenance(theirs)}
    a, b = (f"{k} ({v['trainer']})" for k, v in heads.items())

    def runs(part: dict) -> dict:
        c = part.get("compare") or {}
        out = {f"{a} / tree": pick(part), f"{b} / tree": pick(c[f"eagle:{theirs}"])}
        if chain:
            out[f"{a} / chain {chain}"] = pick(c[f"eagle:{ours}@chain={chain}"])
            out[f"{b} / chain {chain}"] = pick(c[f"eagle:{theirs}@chain={chain}"])
        if part.get("gpu_tree"):
            out[f"{a} / GPU tree, uncut"] = pick(part["gpu_tree"])
        if c[f"eagle:{theirs}"].get("gpu_tree"):
            out[f"{b} / GPU tree, uncut"] = pick(c[f"eagle:{theirs}"]["gpu_tree"])
        return out

    return {"heads": heads, "settings": report.get("settings"),
            "overall": runs(report["overall"]), "domains": {d: runs(r) for d, r in report["domains"].items()}}


def comparison_md(table: dict) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    def block(title: str, runs: dict) -> list[str]:
        depth = max((len(r["per_position_acceptance"] or []) for r in runs.values()), default=0)
        head = "| head / decoding | τ | α | lossless | " + " | ".join(f"acc@{i + 1}" for i in range(depth)) + " |"
        lines = [f"### {title}", "", head, "|" + "---|" * (4 + depth)]
        for name, r in runs.items():
            ppa = list(r["per_position_acceptance"] or []) + [None] * depth
            lines.append(f"| {name} | {fmt(r['tau'])} | {fmt(r['alpha'])} | {fmt(r['lossless'])} | "
                         + " | ".join(fmt(v) for v in ppa[:depth]) + " |")
        return lines + [""]

    lines = ["# draftsmith vs speculators EAGLE-3 heads", ""]
    for who, h in table["heads"].items():
        took = f" in {h['seconds']:.0f} s" if h["seconds"] is not None else ""
        lines.append(f"- {who}: `{h['path']}`, trained by {h['trainer']}: {fmt(h['steps'])} steps, "
                     f"{fmt(h['tokens'])} tokens{took}")
    lines += ["", "τ: tokens per target forward; acc@i: per-position acceptance. tree: each head's EAGLE-2 tree cut "
              "by this machine's cost model; chain: a chain of that many drafts; GPU tree: the uncut EAGLE-2 "
              "budget (depth 6, top-10, 60 nodes), each head its own.", "",
              *block("overall", table["overall"])]
    for d, runs in table["domains"].items():
        lines += block(d, runs)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def _config_from_args(args) -> PeerConfig:
    fields = {f.name for f in dataclasses.fields(PeerConfig)}
    values = like_artifact(args.like) if args.like else {}
    values.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    return PeerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train speculators' EAGLE-3 on our data and capture; save our artifact")
    t.add_argument("--like", help="one of our EAGLE-3 artifacts: take its target, data, capture and settings")
    for name, typ in (("target", str), ("data", str), ("capture", str), ("out", str), ("seconds", float),
                      ("epochs", float), ("max-steps", int), ("train-rows", int), ("eval-fraction", float),
                      ("seed", int), ("draft-vocab-size", int), ("ttt-steps", int), ("step-decay", float),
                      ("max-length", int), ("prompt-context", int), ("batch-rows", int), ("total-seq-len", int),
                      ("lr", float), ("weight-decay", float), ("warmup-steps", int), ("loss", str), ("threads", int)):
        t.add_argument(f"--{name}", type=typ)
    t.add_argument("--optimizer", choices=["adamw", "muon"])
    t.add_argument("--scheduler", choices=["cosine", "linear", "none"])
    t.add_argument("--precision", choices=["auto", "no", "bf16"])
    t.add_argument("--mask", choices=["draftsmith", "speculators"])
    t.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, default=None)
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    c = sub.add_parser("compare", help="decode the same prompts with both heads; write the table")
    c.add_argument("ours")
    c.add_argument("theirs")
    c.add_argument("--out", required=True)
    c.add_argument("--target", default="smollm2-135m")
    c.add_argument("--limit-per-domain", type=int, default=4)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--chain", type=int, default=5, help="also decode a chain of this many tokens per head (0: no)")
    c.add_argument("--prompts", nargs="+")
    c.add_argument("--split", choices=["dev", "test"], default="dev", help="which shipped eval prompts")
    c.add_argument("--domains", nargs="+", help="only these domains of the split (default: all)")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per prompt (1: τ and α only)")
    c.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "train":
        print(train_peer(_config_from_args(args)))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    table = compare(args.ours, args.theirs, args.out, args.target, args.limit_per_domain, args.max_new_tokens,
                    args.chain, args.prompts, split=args.split, domains=args.domains, repeats=args.repeats)
    print(comparison_md(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
