"""Train Medusa heads: `accelerate launch scripts/train_medusa.py --config configs/smollm2-135m/medusa.yaml [key=value ...]`.

A thin entry point over `draftsmith.medusa.job.run_train_medusa`; it works the same under `python`, `torchrun` and
`accelerate launch` (the training loop reads the launcher's environment).
"""

import sys

from draftsmith.cli import script_main
from draftsmith.medusa.job import run_train_medusa

if __name__ == "__main__":
    sys.exit(script_main(run_train_medusa, "configs/smollm2-135m/medusa.yaml", __doc__))
