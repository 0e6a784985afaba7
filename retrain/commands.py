"""`draftsmith retrain --config configs/retrain.yaml [--init ARTIFACT] [key=value ...]` — cron-safe."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "retrain", help="measure the current draft on recent traffic; retrain, gate and promote when stale",
        description="Exit codes: 0 fresh or promoted, 10 stale but candidate rejected, 11 stale without "
                    "traffic to train on, 12 another run holds the registry's lock (nothing done), 1 error, "
                    "2 bad configuration.")
    p.add_argument("--config", default="configs/retrain.yaml",
                   help="a retraining preset (kind: retrain): the registry, the traffic, the staleness threshold, "
                        "the training job and the promotion gate (default: %(default)s)")
    p.add_argument("--init", default=None, metavar="ARTIFACT",
                   help="publish ARTIFACT as the registry's first version, make it current and stop (default: "
                        "none: measure the registry's current version and retrain it if stale)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the preset, e.g. budget.max_steps=400")
    p.set_defaults(func=run)


def run(args) -> int:
    from draftsmith.retrain.run import run_retrain

    return run_retrain(args.config, args.overrides, init=args.init)
