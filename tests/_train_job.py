"""A tiny real job for the training-loop tests, importable and runnable as a script (also under torchrun).

The job trains a small MLP head on the tiny target's last pre-norm layer output to predict the next token
(a Medusa-like head, k = 1), reading the features through `CaptureSource` — online (target forward in
the step) or offline (a capture cache). Rows are random token sequences from a fixed seed.

    python tests/_train_job.py --out DIR [--max-steps N --save-every K ...]        # one process
    torchrun --nproc_per_node 2 tests/_train_job.py --out DIR --audit AUDIT_DIR       # DDP over gloo

With --audit AUDIT_DIR, every rank writes the files it created/renamed/opened for writing under DIR and a hash
of its final weights to AUDIT_DIR/rank-<N>.json (a file of its own: the ranks' stdout lines interleave), so the
test can check "only rank 0 writes" and "same weights".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from tiny_models import build_tiny_tokenizer, make_target  # noqa: E402
from torch import nn

from draftsmith.artifact import make_manifest, save_artifact  # noqa: E402
from draftsmith.capture.online import CaptureSource  # noqa: E402
from draftsmith.training import TrainConfig, train  # noqa: E402
from draftsmith.training.job import Job
from draftsmith.training.launch import leave_process_group, make_accelerator


def make_rows(n: int, vocab: int, length: int = 12, seed: int = 123) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"row_id": i, "input_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for i in range(n)]


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h + torch.nn.functional.silu(self.fc(h)))


class NextTokenJob(Job):
    """Head on layer -1 of the frozen target -> next token. `nan_calls`: loss-call indices that return NaN."""

    kind = "medusa"

    def __init__(self, target, n_train: int = 32, n_eval: int = 8, cache_dir: str | None = None,
                 nan_calls: set[int] | None = None, sleep: float = 0.0) -> None:
        self.target = target
        self.layer = target.num_layers - 1
        self.features = CaptureSource(target, layers=[self.layer], cache_dir=cache_dir)
        rows = make_rows(n_train + n_eval, target.vocab_size)
        self._train, self._eval = rows[:n_train], rows[n_train:]
        self.nan_calls = nan_calls or set()
        self.calls = 0
        self.sleep = sleep

    def setup(self, accelerator) -> None:
        self.features.place(accelerator)

    def build_module(self) -> nn.Module:
        return Head(self.target.hidden_size, self.target.vocab_size)

    def train_rows(self):
        return self._train

    def eval_rows(self):
        return self._eval

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "row_id": torch.tensor([r["row_id"] for r in rows])}

    def loss(self, module, batch):
        h = self.features(batch)[f"layer.{self.layer}"]  # [B, T, H]
        logits = module(h[:, :-1])  # position t predicts token t+1
        labels = batch["input_ids"][:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if module.training:
            if self.calls in self.nan_calls:
                loss = loss * float("nan")
            self.calls += 1
            if self.sleep:
                time.sleep(self.sleep)
        top1 = (logits.argmax(-1) == labels).float().mean().item()
        return loss, {"top1": top1}

    def save_artifact(self, module, out_dir, metrics):
        manifest = make_manifest("medusa", self.target.fingerprint(), config={"layer": self.layer}, metrics=metrics)
        return save_artifact(out_dir, manifest, module.state_dict())


def tiny_target():
    return make_target(build_tiny_tokenizer(), seed=0)


def state_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _audit(out: Path, events: list[str]):
    root = str(out.resolve())

    def hook(name, args):
        if name == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
            path, mode, flags = (list(args) + [None, None])[:3]
            writing = ((isinstance(mode, str) and any(c in mode for c in "wax+")) or
                (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
            if writing and os.path.abspath(os.fsdecode(path)).startswith(root):
                events.append(f"open:{os.fsdecode(path)}")
        elif name in ("os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree") and args:
            if os.path.abspath(os.fsdecode(args[0])).startswith(root):
                events.append(f"{name}:{os.fsdecode(args[0])}")

    sys.addaudithook(hook)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--audit", default=None, metavar="AUDIT_DIR", help="write each rank's record here")
    p.add_argument("--loggers", default="jsonl,tensorboard", help="train.loggers, comma-separated")
    p.add_argument("--log-every", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    events: list[str] = []
    if a.audit:
        out.mkdir(parents=True, exist_ok=True)
        _audit(out, events)
    job = NextTokenJob(tiny_target(), sleep=a.sleep)
    cfg = TrainConfig(lr=3e-3, max_steps=a.max_steps, save_every=a.save_every, batch_size=a.batch_size,
                      grad_accum=a.grad_accum, log_every=a.log_every, eval_every=4, keep_last=2, output_dir=str(out),
                      warmup_steps=2, progress=False, loggers=a.loggers.split(","))
    accelerator = make_accelerator(cfg)  # as the job runners do: one accelerator for training and leaving
    result = train(job, cfg, accelerator)
    if a.audit:
        from accelerate import PartialState

        state = PartialState()
        record = {"rank": state.process_index, "world": state.num_processes, "events": list(events),
                  "weights": state_hash(result.module), "metrics": result.metrics}
        audit_dir = Path(a.audit)
        audit_dir.mkdir(parents=True, exist_ok=True)
        (audit_dir / f"rank-{state.process_index}.json").write_text(json.dumps(record))
    # as the job runners do after train(): ranks meet and leave the gloo group together (a rank that exits
    # with it open can abort in gloo's threads at exit, seen under load)
    leave_process_group(accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
