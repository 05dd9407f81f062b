"""Launching: the driver loop that owns a run's membership and restarts (``driver``; its nodes
``nodes``, its incidents ``incidents``), the launch backends that start one torchrun agent per node
(``backend``; chosen by ``backends``: ``local_nodes``, ``netns``, ``slurm``), the job watch
(``watch``), the self-check and timing jobs (``node_jobs``), the run registry (``runs``) and the
recovery of runs whose launcher died (``recovery``)."""

from mega.launch.driver import TrainingFailed, TrainingResult, run_training
from mega.launch.watch import TIMEOUT_EXIT, JobOutcome, run_job

__all__ = ["TIMEOUT_EXIT", "JobOutcome", "TrainingFailed", "TrainingResult", "run_job", "run_training"]
