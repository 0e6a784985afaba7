"""Train any registered method: the one file `accelerate launch` and `torchrun` start.

    accelerate launch scripts/train.py eagle --config smollm2-135m/eagle3 [key=value ...]
    torchrun --nproc-per-node 2 scripts/train.py medusa --config configs/smollm2-135m/medusa.yaml
    python scripts/train.py draft train.max_steps=50

It is `draftsmith train METHOD ...` (runner/commands.py), the same arguments, job and output: a launcher
starts a file, not a console entry point, so this file passes its arguments to that command and holds
nothing of its own. Under `python`, `torchrun` and `accelerate launch` alike the loop reads the launcher's
environment.
"""

import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
