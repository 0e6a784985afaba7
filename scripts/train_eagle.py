"""Train an EAGLE head: `accelerate launch scripts/train_eagle.py --config configs/smollm2-135m/eagle3.yaml [key=value ...]`.

A thin entry point over the one runner (`draftsmith.runner.train.train_method("eagle", ...)`); it works the same under `python`, `torchrun` and
`accelerate launch` (the training loop reads the launcher's environment).
"""

import sys

from draftsmith.cli import script_main
from draftsmith.runner.train import train_method

if __name__ == "__main__":
    sys.exit(script_main(lambda config, overrides: train_method("eagle", config, overrides),
                         "configs/smollm2-135m/eagle3.yaml", __doc__))
