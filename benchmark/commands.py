"""`draftsmith bench --config configs/bench/<target>.yaml [--quick] [--prompts FILE ...] [key=value ...]`."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="train every artifact, evaluate everything, regenerate BENCHMARKS.md")
    p.add_argument("--config", default="configs/bench/smollm2-135m.yaml", help="a bench preset (kind: bench)")
    p.add_argument("--quick", action="store_true", help="the smoke budget (minutes, not hours)")
    p.add_argument("--out", default=None, help="results folder (default <out>/<date>[-quick]; reuse it to resume)")
    p.add_argument("--prompts", nargs="+", default=None, help="extra prompt files, evaluated with the shared sets")
    p.add_argument("--no-update", action="store_true", help="do not touch BENCHMARKS.md")
    p.add_argument("--redo", nargs="+", default=None, metavar="STAGE",
                   help="run these finished stages again when resuming (e.g. eval/medusa after a decoder change)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the bench config")
    p.set_defaults(func=run)


def run(args) -> int:
    from draftsmith.benchmark.run import run_bench

    summary = run_bench(args.config, args.overrides, args.quick, args.out, args.prompts, not args.no_update,
                        redo=args.redo)
    print(f"results: {summary['results']}/summary.md")
    return 0
