"""Train an EAGLE head: `accelerate launch scripts/train_eagle.py --config configs/smollm2-135m/eagle3.yaml [key=value ...]`.

A thin entry point over `draftsmith.eagle.job.run_train_eagle`; it works the same under `python`, `torchrun` and
`accelerate launch` (the training loop reads the launcher's environment).
"""

import sys

from draftsmith.cli import script_main
from draftsmith.eagle.job import run_train_eagle

if __name__ == "__main__":
    sys.exit(script_main(run_train_eagle, "configs/smollm2-135m/eagle3.yaml", __doc__))
