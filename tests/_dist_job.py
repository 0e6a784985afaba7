"""The user's path, run by the multi-process tests: the one runner (`run("medusa" | "eagle" | "dflash" | "dspark",
cfg)`) on a tiny target folder and a tiny self-distilled dataset, as `accelerate launch scripts/train.py medusa`
runs them (under torchrun here).

    python tests/_dist_job.py prepare --root DIR                      # target folder + dataset (once)
    torchrun --nproc_per_node 2 tests/_dist_job.py train --root DIR --job medusa --out OUT [--steps N ...]

`train` writes one record per rank, OUT.dist-rank<r>.json beside OUT: rank, world, the preset, where this rank's target
parameters live, how many times this rank loaded a target, whether any target parameter wants gradients,
and a hash of the final trainable weights. Losses are read from rank 0's training log by the test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from tiny_models import build_tiny_tokenizer, make_target


def prepare(root: Path, n: int = 40, prompt_len: int = 6, new: int = 10) -> None:
    """A tiny Llama saved as an HF folder and rows it wrote itself, saved as a distilled dataset."""
    import datasets

    from draftsmith.data.generate import DATASET_DIR, PROVENANCE
    from draftsmith.outputs import atomic_write_json

    tok = build_tiny_tokenizer()
    target = make_target(tok, seed=0, layers=4, folder=root / "target")  # EAGLE-3 fuses 3 distinct capturable layers
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, target.vocab_size, (n, prompt_len), generator=g)
    out = target.model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    rows = {"input_ids": out.tolist(), "loss_mask": [[0] * prompt_len + [1] * new] * n, "row_id": list(range(n))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(root / "data" / DATASET_DIR))
    atomic_write_json(root / "data" / PROVENANCE, {"target": {"fingerprint": target.fingerprint()}})


def trace_writes(under: Path) -> list[str]:
    """Every path under `under` this process opens for writing, creates, renames or removes (Python's audit
    events: open with a write flag, os.mkdir, os.rename / os.replace, os.remove, shutil.rmtree). Files
    written by native code (safetensors' Rust writer) are seen through the folders and renames around them."""
    root = str(under.resolve())
    seen: list[str] = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            paths = [path] if writing else []
        elif event in ("os.mkdir", "os.remove", "shutil.rmtree"):
            paths = [args[0]]
        elif event == "os.rename":
            paths = [args[0], args[1]]
        else:
            return
        for p in paths:
            if isinstance(p, str | os.PathLike) and os.path.abspath(os.fspath(p)).startswith(root):
                seen.append(os.path.relpath(os.path.abspath(os.fspath(p)), root))

    sys.addaudithook(hook)
    return seen


def job_config(a: argparse.Namespace, tcfg):
    """(method, job config) of the --job the test launches, on the prepared tiny target and dataset."""
    root = a.root
    if a.job == "medusa":
        from draftsmith.medusa.job import MedusaJobConfig

        return "medusa", MedusaJobConfig(
            target=str(root / "target"), data=str(root / "data"), output=str(a.out / "artifact"), num_heads=2,
            num_layers=1, eval_fraction=0.2, calibration_rows=4, tree_budget=6, tree_max_rank=3, max_length=32,
            train=tcfg)
    if a.job == "dflash":
        from draftsmith.dflash.job import DFlashJobConfig

        return "dflash", DFlashJobConfig(
            target=str(root / "target"), data=str(root / "data"), output=str(a.out / "artifact"), num_layers=2,
            block_size=4, target_layers=[0, 1, 2], anchors_per_row=4, eval_fraction=0.2, max_length=32, train=tcfg)
    if a.job == "dspark":  # DFlash's backbone, plus the Markov head, the confidence head and its own lr scale
        from draftsmith.dspark.job import DSparkJobConfig

        return "dspark", DSparkJobConfig(
            target=str(root / "target"), data=str(root / "data"), output=str(a.out / "artifact"), num_layers=1,
            block_size=4, target_layers=[0, 1, 2], anchors_per_row=4, markov_rank=8, eval_fraction=0.2,
            max_length=32, train=tcfg)
    from draftsmith.eagle.job import EagleJobConfig

    return "eagle", EagleJobConfig(
        target=str(root / "target"), data=str(root / "data"), output=str(a.out / "artifact"), version="eagle3",
        ttt_steps=2, draft_vocab_size=64, eval_fraction=0.2, max_length=32, train=tcfg)


def train(a: argparse.Namespace) -> None:
    writes = trace_writes(a.out)
    import draftsmith.targets as targets
    from draftsmith.runner.train import run as run_job
    from draftsmith.training import TrainConfig
    from draftsmith.training.launch import preset_kind

    loaded = []
    real_load = targets.load_target

    def counting_load(*args, **kw):
        t = real_load(*args, **kw)
        loaded.append(t)
        return t

    targets.load_target = counting_load
    seen = {}
    import draftsmith.training.loop as loop

    real_run = loop.Trainer.run

    def run(self):  # keep the Trainer, to look at its model and optimizer after training
        seen["trainer"] = self
        return real_run(self)

    loop.Trainer.run = run
    if a.die_at_step:  # this rank SIGKILLs itself when it starts that step: a rank lost mid-run
        real_step = loop.Trainer._train_step

        def step_or_die(self, batches):
            if self.rank == a.die_rank and self.step + 1 == a.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(self, batches)

        loop.Trainer._train_step = step_or_die

    tcfg = TrainConfig(lr=3e-3, max_steps=a.steps, batch_size=a.batch_size, grad_accum=a.grad_accum,
                       save_every=a.save_every, keep_last=3, warmup_steps=0, schedule="constant", log_every=1,
                       eval_every=0, eval_batches=1, output_dir=str(a.out / "run"), progress=False,
                       mixed_precision="no", max_grad_norm=None)
    method, cfg = job_config(a, tcfg)
    cfg.evaluate.enabled = False
    run_job(method, cfg)

    tr = seen["trainer"]
    target = loaded[0]
    params = list(target.model.parameters())
    from torch.distributed.tensor import DTensor

    def local_part(t):  # FSDP2: a DTensor's own shard; ZeRO-3: the partition behind a placeholder
        return t.to_local() if isinstance(t, DTensor) else getattr(t, "ds_tensor", t)

    def full_numel(t):
        return getattr(t, "ds_numel", t.numel())  # a DTensor's numel is the full tensor's

    def local_numel(t):
        return local_part(t).numel()

    local = [local_part(p) for p in params]

    # what this rank's optimizer really holds (Adam's exp_avg / exp_avg_sq), against the module's full size
    opt_numel = sum(local_numel(v) for s in tr.optimizer.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    trainable_numel = sum(full_numel(p) for p in tr.trainable)
    record = json.dumps({
        "rank": tr.rank, "world": tr.world, "preset": preset_kind(tr.acc), "device": str(tr.acc.device),
        "target_devices": sorted({str(p.device) for p in local}), "loads": len(loaded),
        # cuda:LOCAL_RANK on GPUs; "cpu:0" and "cpu" are one device
        "on_own_device": all(p.device.type == tr.acc.device.type and (p.device.type == "cpu" or
                                                                      p.device.index == tr.acc.device.index)
                             for p in local),
        "target_grad": any(p.requires_grad for p in params),
        "target_sharded": any(local_numel(p) < full_numel(p) for p in params),
        "target_local_numel": sum(p.numel() for p in local), "target_numel": sum(full_numel(p) for p in params),
        "opt_local_numel": opt_numel, "trainable_numel": trainable_numel, "writes": sorted(set(writes)),
        "pid": os.getpid()})
    # one file per rank beside the output folder (two ranks printing at once can interleave their lines)
    (a.out.parent / f"{a.out.name}.dist-rank{tr.rank}.json").write_text(record)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["prepare", "train"])
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path)
    p.add_argument("--job", choices=["medusa", "eagle3", "dflash", "dspark"], default="medusa")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--die-at-step", type=int, default=0)
    p.add_argument("--die-rank", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.mode == "prepare":
        prepare(a.root)
    else:
        train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
