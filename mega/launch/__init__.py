"""Launching: the driver loop that owns a run's membership and restarts (``driver``), the launch
backends that start one torchrun agent per node (``backend``, ``local_nodes``, ``netns``), the
job watch (``watch``) and the run registry (``runs``)."""

from mega.launch.driver import TrainingFailed, TrainingResult, run_training
from mega.launch.watch import TIMEOUT_EXIT, JobOutcome, run_job

__all__ = ["TIMEOUT_EXIT", "JobOutcome", "TrainingFailed", "TrainingResult", "run_job", "run_training"]
