"""Draft-model distillation through the one training loop (`training/`): `DistillJob`.

The job differs from its siblings only by its module (a small causal LM sharing the target's tokenizer,
`distill/builders.py`), its batches (self-distilled rows, optionally regenerated on-policy) and its loss
(`heads/losses.py`). Alignment: the draft's logits at position t predict token t+1, and so do the
target's; a position counts when token t+1 is an assistant token (`loss_mask[t+1] = 1`).

Where the target's distribution comes from:
    online   the frozen target runs on the batch inside the step: full logits (or its top-k, kd.topk)
    offline  the target's top-k logits were captured once into a cache (`capture/cache.py`,
             k = data.capture_topk, disk estimate printed) and are read back by row_id, with the full
             logits' logsumexp (exact top-k tail mass) when the cache holds it
    on-policy (GKD, Agarwal et al. 2024; DistillSpec, Zhou et al. 2024): with probability λ =
             on_policy.fraction a training batch keeps only its prompts, the DRAFT samples continuations
             (no grad), and the target scores those tokens in the step (always online). The draft then
             learns on the states it visits itself at decode time — the states that decide acceptance.

The artifact (`save_artifact`) is a plain HF causal-LM folder — save_pretrained (LoRA merged first), the
target's tokenizer files, and `manifest.json` (kind "draft", target fingerprint, config, data, metrics) —
loadable with `AutoModelForCausalLM.from_pretrained` and usable as `assistant_model` in `generate`.
The one runner (`runner.train.run("draft", cfg)`) trains it, then evaluates the draft as a proposer and
writes the report into the artifact.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from draftsmith import artifact
from draftsmith.capture.forward import topk_with_logsumexp
from draftsmith.config import to_dict
from draftsmith.data.batching import next_token_learned, pad_rows, row_lengths, split_rows, window
from draftsmith.distill.builders import build_draft, size_report
from draftsmith.distill.config import DistillConfig
from draftsmith.errors import DataError
from draftsmith.heads.lora import apply_lora, plain_model
from draftsmith.heads.losses import distill_loss
from draftsmith.targets.families import family, pad_token_id
from draftsmith.training.job import Job

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


# ---- data ----------------------------------------------------------------------------------------

def load_rows(path: str | Path, target, max_rows: int | None = None):
    """The self-distilled dataset at `path` (rows with input_ids, loss_mask, domain, row_id)."""
    try:
        from draftsmith.data import load_distilled
    except ImportError:
        load_distilled = None
    path = Path(path)
    if load_distilled is not None:
        ds = load_distilled(path, target)
    else:
        if not path.exists():
            raise DataError(f"self-distilled dataset not found: {path} (run `draftsmith data generate` first)")
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
    if hasattr(ds, "keys") and "train" in ds:  # a DatasetDict
        ds = ds["train"]
    columns = ds.column_names if hasattr(ds, "column_names") else list(ds[0])
    for col in ("input_ids", "loss_mask"):
        if col not in columns:
            raise DataError(f"{path}: rows need '{col}' (a self-distilled dataset from `draftsmith data`)")
    if max_rows is not None and len(ds) > max_rows:
        ds = ds.select(range(max_rows)) if hasattr(ds, "select") else ds[:max_rows]
    if len(ds) < 2:
        raise DataError(f"{path}: {len(ds)} rows; need at least 2 (one to train, one to hold out)")
    return ds


def prompt_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """Tokens before each row's first learned token (the prompt part)."""
    out = []
    for m, a in zip(batch["loss_mask"], batch["attention_mask"]):
        on = m.nonzero()
        out.append(int(on[0]) if len(on) else int(a.sum()))
    return out


# ---- the job -------------------------------------------------------------------------------------

class DistillJob(Job):
    """The job (training/job.py) of a draft LM distilled from a frozen target."""

    kind = "draft"

    def data_path(self) -> str | None:
        return self.cfg.data.path

    def __init__(self, cfg: DistillConfig, target, rows=None) -> None:
        family(target.config)  # a family outside targets/families.py: one line, before any work
        self.cfg, self.target = cfg, target
        rows = rows if rows is not None else load_rows(cfg.data.path, target, cfg.data.max_rows)
        self.train_set, self.eval_set = split_rows(rows, cfg.data.eval_fraction, cfg.train.seed, cfg.train.train_rows)
        self.pad_id = pad_token_id(target)
        self.eos = set(target.eos_token_ids)
        self.teacher_model = target.model
        self.features = None  # CaptureSource for offline top-k
        self.uses_teacher = cfg.kd.ce_weight < 1.0
        self.topk = cfg.kd.topk
        if cfg.data.mode == "offline" and self.uses_teacher:
            self.topk = cfg.kd.topk or cfg.data.capture_topk
            self.features = self._offline_source(rows)

    def announce(self) -> None:
        d = size_report(self.build_module())  # cheap at this size; logged so the run says what it trains
        t = size_report(self.target.model)
        log.info("draft: %d layers, %.2fM params (%.2fM non-embedding, %.1f MFLOPs/token) vs target %.2fM "
                 "(%.2fM non-embedding, %.1f MFLOPs/token)", d["num_layers"], d["params"] / 1e6,
                 d["non_embedding_params"] / 1e6, d["flops_per_token"] / 1e6, t["params"] / 1e6,
                 t["non_embedding_params"] / 1e6, t["flops_per_token"] / 1e6)

    def _offline_source(self, rows):
        from draftsmith.capture.cache import capture_dataset
        from draftsmith.capture.online import CaptureSource

        cache = Path(self.cfg.data.capture_cache or Path(self.cfg.train.output_dir) / "capture")
        # each row up to the end of the window it is trained on (data/batching.py)
        need = [{"row_id": int(r["row_id"]),
                 "input_ids": list(r["input_ids"])[: window(list(r["loss_mask"]), self.cfg.data.max_length)[1]]}
                for r in rows]
        reader = capture_dataset(self.target, need, cache, layers=[], topk=self.cfg.data.capture_topk,
                                 progress=self.cfg.train.progress)  # prints rows / tokens / estimated disk
        # caches written since the logsumexp was stored give top-k KD its exact tail mass
        return CaptureSource(self.target, topk=self.topk, cache_dir=cache,
                             logsumexp=bool(reader.index.get("logsumexp")))

    # --- protocol ---
    def build_module(self) -> torch.nn.Module:
        model = build_draft(self.cfg.draft, self.target)
        if self.cfg.lora.enabled:
            lc = self.cfg.lora
            model = apply_lora(model, lc.r, lc.alpha, lc.dropout, lc.target_modules)
        return model

    def setup(self, accelerator) -> None:
        # offline KD never runs the target, except for on-policy batches (scored online)
        if self.features is None or self.cfg.on_policy.fraction > 0:
            from draftsmith.targets.frozen import place_frozen

            self.teacher_model = place_frozen(self.target.model, accelerator)

    def train_rows(self):
        return self.train_set

    def eval_rows(self):
        return self.eval_set

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return pad_rows(rows, self.pad_id, self.cfg.data.max_length)

    def row_lengths(self) -> list[int]:
        return row_lengths(self.train_set, self.cfg.data.max_length)

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    @torch.no_grad()
    def teacher(self, batch: dict[str, torch.Tensor], online: bool,
                select: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The target at the positions `select` [B, T] (bool; None = all): {"logits": [N, V]} online with full
        logits, else {"topk_values", "topk_indices"} [N, k] and "topk_logsumexp" [N] (online top-k, or the
        offline cache when it holds the logsumexp)."""
        if select is None:
            select = batch["attention_mask"].bool()
        if not online and self.features is not None:
            f = self.features(batch)
            return {k: v[select] for k, v in f.items()}
        logits = vocab_logits(self.teacher_model, batch, select)
        if self.topk:
            v, i, lse = topk_with_logsumexp(logits, self.topk)
            return {"topk_values": v, "topk_indices": i, "topk_logsumexp": lse}
        return {"logits": logits}

    @torch.no_grad()
    def on_policy_batch(self, module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep each row's prompt, let the draft SAMPLE a continuation, mark the sampled tokens as learned."""
        op = self.cfg.on_policy
        model = getattr(module, "module", module)  # DDP-wrapped or not
        was_training = model.training
        model.eval()
        plens = prompt_lengths(batch)
        B = len(plens)
        P = max(plens)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long, device=batch["input_ids"].device)
        attn = torch.zeros_like(ids)
        for b, n in enumerate(plens):  # left padding for generation
            ids[b, P - n:] = batch["input_ids"][b, :n]
            attn[b, P - n:] = 1
        room = max(1, self.cfg.data.max_length - P)
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=op.temperature,
                             top_k=0, top_p=1.0, max_new_tokens=min(op.max_new_tokens, room),
                             pad_token_id=self.pad_id, eos_token_id=sorted(self.eos))
        model.train(was_training)
        rows = []
        for b, n in enumerate(plens):
            gen = out[b, P:].tolist()
            cut = next((j + 1 for j, t in enumerate(gen) if t in self.eos), len(gen))
            gen = gen[:cut]
            prompt = batch["input_ids"][b, :n].tolist()
            rows.append({"input_ids": prompt + gen, "loss_mask": [0] * n + [1] * len(gen)})
        new = pad_rows(rows, self.pad_id, self.cfg.data.max_length)
        return {k: v.to(batch["input_ids"].device) for k, v in new.items()}

    def loss(self, module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        on_policy = 0.0
        if module.training and self.cfg.on_policy.fraction > 0 and \
                float(torch.rand(())) < self.cfg.on_policy.fraction:  # torch RNG: checkpointed by the loop
            batch = self.on_policy_batch(module, batch)
            on_policy = 1.0
        # position t predicts token t+1; only positions whose next token is learned go through the
        # vocab head (at 49k vocab the lm_head is most of a small draft's FLOPs)
        select = next_token_learned(batch["loss_mask"])
        student = vocab_logits(module, batch, select)  # [N, V]
        labels = batch["input_ids"][:, 1:][select[:, :-1]]  # [N]
        mask = None  # every selected position counts
        kd = self.cfg.kd
        teacher_logits = teacher_topk = teacher_lse = None
        if self.uses_teacher or not module.training:  # eval always measures the gap to the target
            t = self.teacher(batch, online=bool(on_policy), select=select)
            if "logits" in t:
                teacher_logits = t["logits"]
            else:
                teacher_topk = (t["topk_values"], t["topk_indices"])
                if kd.tail == "bucket" and kd.temperature == 1.0:  # the exact tail (heads/losses.py)
                    teacher_lse = t.get("topk_logsumexp")
        if self.uses_teacher:
            loss, metrics = distill_loss(student, labels, mask, teacher_logits, teacher_topk, kd.divergence,
                                         kd.temperature, kd.beta, kd.ce_weight, kd.tail, teacher_lse)
        else:
            loss, metrics = distill_loss(student, labels, mask, ce_weight=1.0)
            if teacher_logits is not None or teacher_topk is not None:  # eval: report the same gap metrics
                _, gap = distill_loss(student.detach(), labels, mask, teacher_logits, teacher_topk, kd.divergence,
                                      kd.temperature, kd.beta, 0.0, kd.tail, teacher_lse)
                metrics.update(kd=gap["kd"], tvd=gap["tvd"], top1=gap["top1"])
            else:
                metrics.pop("tvd")
        metrics["on_policy"] = on_policy
        return loss, metrics

    def save_artifact(self, module, out_dir: Path, metrics: dict[str, float]) -> Path:
        model = plain_model(module)
        fp = self.target.fingerprint()
        data = {"path": self.cfg.data.path, "mode": self.cfg.data.mode, "train_rows": len(self.train_set),
                "eval_rows": len(self.eval_set), "on_policy_fraction": self.cfg.on_policy.fraction}
        manifest = artifact.make_manifest("draft", fp, to_dict(self.cfg), data=data, metrics=dict(metrics),
                                          size=size_report(model), target_size=size_report(self.target.model))

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            copy_tokenizer(self.target, tmp)

        return artifact.save_artifact(out_dir, manifest, writer=write)


def vocab_logits(model, batch: dict[str, torch.Tensor], select: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of `model` at the N positions where select [B, T] is true.

    The forward runs through `model` itself (a DDP / peft wrapper stays in the graph) with the vocab
    projection cut to one position (`logits_to_keep=1`); the post-norm last hidden state (transformers 5
    `hidden_states[-1]`) is then projected only where needed.
    """
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                logits_to_keep=1)
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings()
    return head(out.hidden_states[-1][select])


def copy_tokenizer(target, dest: Path) -> None:
    """The target's tokenizer files (its folder's, else save_pretrained): vocab, specials, chat template."""
    src = Path(target.folder) if target.folder is not None else None
    copied = False
    if src is not None and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dest / name)
                copied = True
    if not copied:
        target.tokenizer.save_pretrained(dest)
