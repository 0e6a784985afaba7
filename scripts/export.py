"""Export an artifact for a serving stack: `python scripts/export.py --artifact DIR --to vllm --out DIR`.

A thin entry point over `draftsmith.export.commands` (same flags as `draftsmith export`)."""

import argparse
import sys

from draftsmith.cli import run_entry_point
from draftsmith.export import commands


def main() -> int:
    parser = argparse.ArgumentParser(prog="export.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands.register(sub)
    args = parser.parse_args(["export", *sys.argv[1:]])
    return run_entry_point(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
