"""The session's real Slurm cluster (mega.launch.slurm_local): 3 nodes, each slurmd in its own
network and UTS namespace, started once for the test file that imports this fixture."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from mega.launch import slurm_local

# apart from the launcher's defaults and `slurm_local up`'s own; another pair lets two sessions on
# one machine each run a cluster of their own
SUBNET = os.environ.get("MEGA_TEST_SLURM_SUBNET", "10.216.0.0/24")
NET_ID = os.environ.get("MEGA_TEST_SLURM_NET_ID", "slurmt")


def host(k: int) -> str:
    """Node k's hostname in the session's cluster."""
    return f"mega-{NET_ID}-n{k}"


needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("slurmctld") is None or shutil.which("munged") is None,
    reason="the local Slurm cluster needs root and slurm-wlm + munge (infra/install.sh installs them as root)",
)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running 3-node cluster; SLURM_CONF points this process (and so the driver) at it. Its
    daemons' logs are kept in pytest's base temporary directory (``slurm-logs``; pytest keeps the
    last three sessions'): the cluster's own directory goes with the cluster, and a failed drill is
    read from slurmctld's and each slurmd's view of its jobs."""
    root = Path(tempfile.mkdtemp(prefix="mega-slurm-"))  # short: unix socket paths are limited
    atexit.register(slurm_local.down, root)  # also when the session dies between here and finally
    state = slurm_local.up(3, root, SUBNET, timeout_s=180, net_id=NET_ID)
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(state.env())
    try:
        yield state
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        kept = tmp_path_factory.mktemp("slurm-logs")
        for log in root.glob("*.log"):
            shutil.copy(log, kept / log.name)
        slurm_local.down(root)
