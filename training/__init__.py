"""The one training loop (accelerate), its config, checkpoints and the job protocol.

    from draftsmith.training import Job, TrainConfig, train
    result = train(my_job, TrainConfig(lr=3e-4, max_steps=1000, save_every=200))

See `training/job.py` for what a job supplies and `training/loop.py` for what the loop does.

Its names are imported on first use (lazy.py).
"""

from __future__ import annotations

from draftsmith import lazy

__getattr__ = lazy.names(__name__, {
    "Job": "draftsmith.training.job",
    "TrainConfig": "draftsmith.training.config",
    "TrainResult": "draftsmith.training.loop",
    "train": "draftsmith.training.loop",
})
__all__ = ["Job", "TrainConfig", "TrainResult", "train"]
