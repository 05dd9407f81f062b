"""``backend_for``: the launch backend of ``launcher.name`` (mega/launch/backend.py says what a
backend does). The one module that imports every backend, so that none imports another."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mega.config import ConfigError
from mega.launch.local_nodes import LocalNodesBackend
from mega.launch.slurm import SlurmBackend
from mega.launch.slurm_steps import SlurmStepBackend, inside_allocation

if TYPE_CHECKING:
    from mega.config import MegaConfig
    from mega.launch.backend import Backend


def backend_for(cfg: MegaConfig, run_dir: str | Path) -> Backend:
    """The backend of ``launcher.name``; ``run_dir`` is where it may keep files of its own."""
    name = cfg.launcher.name
    if name in ("local", "local-nodes"):
        return LocalNodesBackend(cfg, Path(run_dir))
    if name == "slurm":  # the driver inside the run's allocation starts srun steps of it
        return SlurmStepBackend(cfg, run_dir) if inside_allocation(cfg) else SlurmBackend(cfg, Path(run_dir))
    if name == "kubernetes":
        raise ConfigError(
            "launcher.name",
            "launcher=kubernetes is not driven from this process: render the "
            "JobSet with `python -m mega.launch.kubernetes render` and apply "
            "it; the cluster's controllers restart its pods (docs/cluster.md)",
        )
    raise ConfigError("launcher.name", f"no launch backend {name!r}")
