"""The one training loop (accelerate), its config, checkpoints and the job protocol.

    from draftsmith.training import Job, TrainConfig, train
    result = train(my_job, TrainConfig(lr=3e-4, max_steps=1000, save_every=200))

See `training/job.py` for what a job supplies and `training/loop.py` for what the loop does.
"""

from draftsmith.training.config import TrainConfig
from draftsmith.training.job import Job
from draftsmith.training.loop import TrainResult, train

__all__ = ["Job", "TrainConfig", "TrainResult", "train"]
