"""Launching: the driver loop that owns a run's membership and restarts (``driver``), torchrun
jobs (``torchrun``) and the run registry (``runs``)."""

from mega.launch.driver import TrainingFailed, TrainingResult, run_training
from mega.launch.torchrun import TIMEOUT_EXIT, torchrun

__all__ = ["TIMEOUT_EXIT", "TrainingFailed", "TrainingResult", "run_training", "torchrun"]
