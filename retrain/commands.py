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
    q = subparsers.add_parser(
        "promote", help="swap a registry version into running vLLM servers without a restart, watch it with a "
                        "canary, roll it back on its own (or by hand: --rollback)",
        description="The servers run draftsmith's worker extension and route (docs/retraining.md, \"Promotion in "
                    "place\"); their bearer token is read from $DRAFTSMITH_PROMOTE_TOKEN (promote.token_env). Exit "
                    "codes: 0 swapped and kept (or rolled back by hand), 10 rolled back by the canary, 1 the swap "
                    "failed (the old drafter serves on), 2 bad configuration.")
    q.add_argument("--config", default="configs/retrain.yaml",
                   help="the retraining preset whose registry, target and promote section are used (default: "
                        "%(default)s)")
    q.add_argument("--version", default=None, help="the registry version to promote (default: current)")
    q.add_argument("--servers", nargs="+", default=None, metavar="URL",
                   help="the servers' base URLs (default: the preset's promote.servers)")
    q.add_argument("--rollback", action="store_true",
                   help="undo the last kept promotion: its servers back to what they served, current back")
    q.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. promote.canary.requests=64")
    q.set_defaults(func=run_promote)


def run_promote(args) -> int:
    from draftsmith.retrain.run import promote_command

    return promote_command(args.config, args.overrides, args.version, args.servers, args.rollback)


def run(args) -> int:
    from draftsmith.retrain.run import run_retrain

    return run_retrain(args.config, args.overrides, init=args.init)
