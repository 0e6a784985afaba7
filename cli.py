"""The `draftsmith` command, the one entry point of every job. Each subsystem registers its own subcommands
from `<folder>/commands.py` (`register(subparsers)`), and a method folder may add its own jobs
(`Method.commands`). A name in COMMAND_MODULES that does not import is an error, never a quietly missing command.

User errors (DraftsmithError) print one line and exit 2; anything else prints one line naming the
exception and exits 1 (DRAFTSMITH_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import argparse
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

# The pipeline stages `draftsmith --help` lists the commands under, in the order the data flows: (stage, what
# it does, its commands). A command a method adds (its alias of `train NAME`, `Method.commands`) joins
# METHOD_STAGE; a command in no stage is listed after them all, and tests/test_cli_help.py fails until it has one.
STAGES: list[tuple[str, str, tuple[str, ...]]] = [
    ("targets", "the frozen models drafters are made for", ("targets",)),
    ("data", "prompts -> the target's own answers, a self-distilled dataset", ("data",)),
    ("train", "a drafter on a frozen target; each method's own jobs", ("train", "trust")),
    ("evaluate", "acceptance, tau, speedup and losslessness per domain", ("evaluate",)),
    ("export / serve", "an artifact in a serving stack's layout, run there",
     ("export", "serve-check", "import-export", "serve-bench")),
    ("plan / route", "memory per GPU, routing per domain, production acceptance", ("plan", "route", "alpha")),
    ("retrain", "a new drafter when acceptance on live traffic drifts", ("retrain", "promote")),
    ("bench / check", "the whole benchmark and its timing jobs; artifacts vs a target", ("bench", "check")),
]
METHOD_STAGE = "train"


class StagedHelpFormatter(argparse.HelpFormatter):
    """Lists the commands of `draftsmith --help` under their pipeline stage (STAGES, through the `stage_of`
    that build_parser gives the subcommand action) instead of in the order the folders register them."""

    def _format_action(self, action):
        stage_of = getattr(action, "stage_of", None)
        if stage_of is None:
            return super()._format_action(action)
        subs = {sub.dest: sub for sub in action._get_subactions()}
        groups = [(f"{stage}: {what}", [n for n, s in stage_of.items() if s == stage and n in subs])
                  for stage, what, _ in STAGES]
        groups.append(("in no stage:", [n for n in subs if n not in stage_of]))
        parts = []
        for heading, names in groups:
            if names:
                parts.append(" " * self._current_indent + heading + "\n")
                self._indent()
                parts += [super(StagedHelpFormatter, self)._format_action(subs[n]) for n in names]
                self._dedent()
        return "".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith", formatter_class=StagedHelpFormatter,
        description="Train drafters for speculative decoding on a frozen target ("
                    + ", ".join(m.name for m in methods.all_methods())
                    + "), measure them per domain, and export them for serving stacks.",
    )
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: info)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands, by pipeline stage",
                                       description="`draftsmith COMMAND --help` describes a command's flags")
    for name in COMMAND_MODULES:
        methods.import_listed(name, "cli.COMMAND_MODULES").register(subparsers)
    registered = set(subparsers.choices)
    for method in methods.all_methods():  # a method's own jobs come with its folder (Method.commands)
        if method.commands is not None:
            method.get("commands")(subparsers)
    by_methods = (set(subparsers.choices) - registered) | {m.alias for m in methods.all_methods() if m.alias}
    subparsers.stage_of = {name: stage for stage, _, names in STAGES for name in names}
    subparsers.stage_of.update({name: METHOD_STAGE for name in subparsers.choices if name in by_methods})
    return parser


def unstaged(parser: argparse.ArgumentParser) -> list[str]:
    """The commands of build_parser's `parser` that no stage lists (tests/test_cli_help.py keeps it empty)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [name for name in commands.choices if name not in commands.stage_of]


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
    from draftsmith import net
    from draftsmith.targets.device import tune_cpu_allocator

    setup_logging(verbose)
    net.guard_logging("")  # every console line of this process, a library's too, redacted (net.redact)
    tune_cpu_allocator()  # CPU jobs reuse freed memory instead of page-faulting it in again (targets/device.py)
    try:
        return int(fn() or 0)
    except DraftsmithError as e:
        print(f"draftsmith: error: {net.redact(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an environment failure: still one line, traceback on request
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"draftsmith: error: {type(e).__name__}: {net.redact(first)} (set DRAFTSMITH_DEBUG=1 for the "
              "traceback)",
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_with_overrides(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_entry_point(lambda: args.func(args), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
