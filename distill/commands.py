"""`draftsmith distill --config PATH [key=value ...]`: distil a draft model from a target's logits."""

from __future__ import annotations

import json

from draftsmith.config import load_config

DEFAULT_CONFIG = "configs/smollm2-135m/distill.yaml"


def register(subparsers) -> None:
    p = subparsers.add_parser("distill", help="train a draft model on the target's next-token distribution")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML preset (kind: distill; default {DEFAULT_CONFIG})")
    p.add_argument("--init-only", action="store_true",
                   help="save and evaluate the draft as built, untrained: the no-distillation baseline")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. kd.divergence=tvd train.max_steps=100")
    p.set_defaults(func=run)


def run(args) -> int:
    from draftsmith.distill.config import DistillConfig
    from draftsmith.distill.job import run_distill

    cfg = load_config(args.config, args.overrides, cls=DistillConfig)
    out = run_distill(cfg, init_only=getattr(args, "init_only", False))
    if out["artifact"] is not None:  # rank 0 only
        print(f"artifact: {out['artifact']}")
        print(f"train_seconds: {out['train_seconds']:.1f}")
        if out["eval"] is not None:
            print("eval: " + json.dumps(out["eval"], default=str)[:2000])
    return 0


def train(config_path: str | None, overrides: list[str]):
    """`Method.train` of draft models: load the preset, distil, return the artifact folder (None off rank 0)."""
    from pathlib import Path

    from draftsmith.distill.config import DistillConfig
    from draftsmith.distill.job import run_distill

    artifact = run_distill(load_config(config_path or DEFAULT_CONFIG, overrides, cls=DistillConfig))["artifact"]
    return Path(artifact) if artifact is not None else None
