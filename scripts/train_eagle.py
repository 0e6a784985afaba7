"""Train an EAGLE head: `accelerate launch scripts/train_eagle.py --config configs/smollm2-135m/eagle3.yaml [k=v ...]`.

A thin entry point: it parses the config and calls `draftsmith.heads.eagle_job.run_train_eagle`.
Works the same under `python`, `torchrun` and `accelerate launch` (the loop reads the launcher's env).
"""

import argparse
import sys

from draftsmith.cli import run_entry_point
from draftsmith.heads.eagle_job import run_train_eagle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/smollm2-135m/eagle3.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    return run_entry_point(lambda: print(f"artifact: {run_train_eagle(args.config, args.overrides)}"))


if __name__ == "__main__":
    sys.exit(main())
