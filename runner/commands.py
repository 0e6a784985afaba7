"""`draftsmith train METHOD --config PATH [key=value ...]`: run any registered method's training job
(methods.py) through the one runner (runner/train.py). A method may declare a one-word alias of the same
job (`Method.alias`: `draftsmith distill` is `draftsmith train draft`), with the same arguments and the same
output; `train METHOD` is the documented form.

`draftsmith trust RUN`: a run's checkpoints resume in full only when its record of them is signed with this
user's key (training/trust.py); this signs a run folder received whole, after showing what it accepts."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith import methods


def _add_job_arguments(p, default_help: str) -> None:
    p.add_argument("--config", default=None, help="the job's YAML preset: a shipped preset's name "
                   f"(smollm2-135m/eagle3) or a file's path (default: {default_help})")
    p.add_argument("--init-only", action="store_true",
                   help="save and evaluate the module as built, untrained: the baseline a trained one is compared with")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the preset, e.g. "
                                                "train.max_steps=100")


def register(subparsers) -> None:
    known = methods.all_methods()
    p = subparsers.add_parser("train", help="train a drafter on a frozen target: "
                              + ", ".join(m.name for m in known))
    p.add_argument("job", choices=[m.name for m in known],
                   help="; ".join(f"{m.name}: {m.summary}" for m in known))
    _add_job_arguments(p, "the method's own: " + ", ".join(f"{m.name} {m.default_config}" for m in known))
    p.set_defaults(func=run)
    for m in known:  # a method's declared alias (a top-level command) runs `train NAME` as it is
        if m.alias:
            own = subparsers.add_parser(m.alias, help=f"alias of `train {m.name}`: {m.summary}")
            _add_job_arguments(own, m.default_config or "the method's preset")
            own.set_defaults(func=run, job=m.name)
    t = subparsers.add_parser("trust", help="accept a run folder received whole (a colleague's, a download) "
                              "as yours: its checkpoints then resume in full, pickles included")
    t.add_argument("run", help="the run's train.output_dir (its checkpoints/ are listed, checked and signed)")
    t.set_defaults(func=run_trust)


def run(args) -> int:
    method = methods.get(args.job)
    init_only = getattr(args, "init_only", False)
    from draftsmith.config import load_config
    from draftsmith.runner.train import run as run_job

    cfg = load_config(args.config or method.default_config, args.overrides, cls=method.get("config"))
    out = run_job(method, cfg, init_only=init_only)
    artifact = out.artifact
    if artifact is None and method.output_key is not None:  # off the main process: where rank 0 writes it
        artifact = Path(getattr(cfg, method.output_key))
    if artifact is not None:
        print(f"artifact: {artifact}")
    if out.artifact is not None:  # rank 0 only
        print(f"train_seconds: {out.train_seconds:.1f}")
        if out.eval is not None:
            print("eval: " + json.dumps(out.eval, default=str)[:2000])
    return 0


def run_trust(args) -> int:
    """Print what is accepted (each checkpoint and its state.json sha256), then sign the run's record of
    exactly that with this user's key (training/checkpoint.py trust_run)."""
    from draftsmith.training.checkpoint import trust_run

    for line in trust_run(args.run):
        print(line)
    return 0
