"""Train Medusa heads: `accelerate launch scripts/train_medusa.py --config configs/smollm2-135m/medusa.yaml [k=v ...]`.

A thin entry point: it parses the config and calls `draftsmith.heads.medusa_job.run_train_medusa`.
Works the same under `python`, `torchrun` and `accelerate launch` (the loop reads the launcher's env).
"""

import argparse
import sys

from draftsmith.cli import run_entry_point
from draftsmith.heads.medusa_job import run_train_medusa


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/smollm2-135m/medusa.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    return run_entry_point(lambda: print(f"artifact: {run_train_medusa(args.config, args.overrides)}"))


if __name__ == "__main__":
    sys.exit(main())
