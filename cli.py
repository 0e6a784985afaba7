"""The `draftsmith` command, the one entry point of every job. Each subsystem registers its own subcommands
from `<folder>/commands.py` (`register(subparsers)`), and a method folder may add its own jobs
(`Method.commands`); a subsystem that is not built has no subcommand, rather than a stub.

User errors (DraftsmithError) print one line and exit 2; anything else prints one line naming the
exception and exits 1 (DRAFTSMITH_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from draftsmith import __version__, methods
from draftsmith.errors import DraftsmithError

COMMAND_MODULES = [
    "draftsmith.targets.commands",
    "draftsmith.checks",
    "draftsmith.data.commands",
    "draftsmith.runner.commands",
    "draftsmith.evaluation.commands",
    "draftsmith.export.commands",
    "draftsmith.retrain.commands",
    "draftsmith.planning.commands",
    "draftsmith.benchmark.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train, evaluate and export draft models, Medusa heads and EAGLE heads for speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # that subsystem is not built yet: no subcommand
            raise
        module.register(subparsers)
    for method in methods.all_methods():  # a method's own jobs come with its folder (Method.commands)
        if method.commands is not None:
            method.get("commands")(subparsers)
    return parser


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("transformers", "accelerate", "datasets", "urllib3", "matplotlib", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_entry_point(fn, verbose: bool = False) -> int:
    """Run `fn()` with draftsmith's logging and one-line error reporting (for scripts/*.py too)."""
    from draftsmith.targets.device import tune_cpu_allocator

    setup_logging(verbose)
    tune_cpu_allocator()  # CPU jobs reuse freed memory instead of page-faulting it in again (targets/device.py)
    try:
        return int(fn() or 0)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an environment failure: still one line, traceback on request
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"draftsmith: error: {type(e).__name__}: {first} (set DRAFTSMITH_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """parse_args, except that trailing key=value overrides may follow an option (`train medusa --config X
    a=1 b=2`): argparse assigns a subcommand's positionals in one go before its options, so overrides after
    an option would otherwise be refused as unrecognized."""
    args, rest = parser.parse_known_args(argv)
    if rest:
        if hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
            args.overrides = list(args.overrides or []) + rest
        else:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def script_main(train_fn, default_config: str, doc: str | None) -> int:
    """The body of a thin training script: `--config PATH [key=value ...]` → `train_fn(config, overrides)`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    args = parse_with_overrides(parser)
    return run_entry_point(lambda: print(f"artifact: {train_fn(args.config, args.overrides)}"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_with_overrides(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_entry_point(lambda: args.func(args), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
