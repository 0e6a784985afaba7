"""Distil a draft model from a target's logits: a thin entry point over `draftsmith train draft`
(runner/commands.py; `draftsmith distill` is its alias).

    accelerate launch scripts/distill_draft.py --config configs/smollm2-135m/distill.yaml [key=value ...]
    python scripts/distill_draft.py --config configs/smollm2-135m/distill.yaml train.max_steps=50

Works the same under `python`, `torchrun` and `accelerate launch` (the loop reads the launcher's env).
"""

import argparse
import sys

from draftsmith import methods
from draftsmith.cli import run_entry_point
from draftsmith.runner.commands import run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=methods.get("draft").default_config)
    parser.add_argument("--init-only", action="store_true", help="save and evaluate the untrained draft")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.job = "draft"
    return run_entry_point(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
