"""launcher.slurm.driver=allocation: the self-check of the job's nodes, its first step.

Before the first training step (and again in each run of a requeued job: Slurm may give it other
nodes) the driver inside the allocation runs the node self-check (mega/cluster/selfcheck.py) as
one ``srun`` step on every host of its job, the run's nodes and its spares, so the nodes checked
are exactly the nodes that train, with no second job and no second queue wait. A host whose
verdict is unhealthy is excluded from every later step of the job: a spare of the job takes its
place, or, with too few left, the run shrinks to ``restart.min_nodes`` or more (DP shrinks), else
it fails naming the reasons (``CannotContinue``). A host the check could not judge (its job died
of another node) is not excluded; a check that judged no host fails the run.

The verdict, with what the driver did about it, goes to ``<run_dir>/selfcheck/preflight.json``;
the submitting side passes it on as it appears (mega/launch/slurm_driver.py), so the flow
publishes the same report as its own self-check task (tasks/selfcheck.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mega import faults
from mega.cluster.selfcheck import on_physical_nodes
from mega.launch.node_jobs import run_selfcheck
from mega.launch.slurm_steps import SlurmStepBackend, warning_file
from mega.stability.membership import CannotContinue, resize

if TYPE_CHECKING:
    from mega.config import MegaConfig

VERDICT_FILE = "preflight.json"


def verdict_path(run_dir: str | Path) -> Path:
    """``<run_dir>/selfcheck/preflight.json``: the check's result, ``hosts`` (node k on the k-th)
    and ``excluded_hosts``."""
    return Path(run_dir).absolute() / "selfcheck" / VERDICT_FILE


def check_allocation(
    cfg: MegaConfig, backend: SlurmStepBackend, run_dir: str | Path, log: Callable[[str], None]
) -> tuple[MegaConfig, list[dict]]:
    """Self-check every host of the job that ``backend`` (the driver's) has not excluded; exclude
    the unhealthy ones from its later steps. Returns the config to train (fewer nodes after a
    shrink; the drills of the old layout ended once a host is out) and one row per excluded host
    for the run record. Raises CannotContinue when the run cannot go on without them."""
    excluded = {*backend.excluded, *cfg.launcher.slurm.exclude}
    hosts = [h for h in backend.allocated if h not in excluded]
    every = copy.deepcopy(cfg)
    every.cluster.nodes = len(hosts)  # a job of every host: the run's nodes and the spares
    checker = SlurmStepBackend(every, run_dir, log=log)
    for host in backend.excluded:
        checker.exclude(host)
    out = Path(run_dir) / "selfcheck"
    log(f"self-check of the job's {len(hosts)} node(s) ({', '.join(hosts)}) before the first training step")
    bad_node = faults.selfcheck_bad_node(cfg, lambda p: _node_of(backend.allocated, hosts, p))
    result = run_selfcheck(every, out, backend=checker, bad_node=bad_node)  # run_job stops the step
    bad: list[str] = []
    try:
        bad, reasons = judged(result, hosts, warned=warning_file(run_dir).exists())
        for host in bad:
            backend.exclude(host)
        cfg, note = _next_config(cfg, len(hosts) - len(bad), bad, result)
    except CannotContinue as e:  # the verdict that ends the run is published too
        _write_verdict(run_dir, result, hosts, bad, f"the run cannot go on: {e}")
        raise
    log(f"self-check {'passed' if result['healthy'] else 'failed'} in {result['elapsed_s']:.1f} s; {note}")
    _write_verdict(run_dir, result, hosts, bad, note)
    physical = [backend.allocated.index(h) for h in hosts]  # the check's node k: the job's host hosts[k]
    rows = [
        {
            "node": backend.allocated.index(h),
            "host": h,
            "attempt": None,
            "reasons": on_physical_nodes(reasons[h], physical),
            "replaced_by": None,
            "selfcheck": str(verdict_path(run_dir)),
        }
        for h in bad
    ]
    return cfg, rows


def _write_verdict(run_dir: str | Path, result: dict, hosts: list[str], bad: list[str], note: str) -> None:
    tmp = verdict_path(run_dir).with_suffix(".tmp")  # whole or not at all for the submitter's reads
    tmp.write_text(json.dumps({**result, "hosts": hosts, "excluded_hosts": bad, "note": note}))
    tmp.replace(verdict_path(run_dir))


def _node_of(allocated: list[str], hosts: list[str], physical: int) -> int | None:
    """The check's node rank of the job's ``physical``-th host (None: excluded, not checked)."""
    if physical >= len(allocated) or allocated[physical] not in hosts:
        return None
    return hosts.index(allocated[physical])


def judged(result: dict, hosts: list[str], *, warned: bool = False) -> tuple[list[str], dict[str, list[str]]]:
    """The hosts the check found unhealthy and each one's reasons. A host it could not judge
    (None) stays; a check that judged none unhealthy yet failed raises CannotContinue, unless
    Slurm's warning (``warned``) ended it: the first training step then saves and requeues."""
    rows = {row["node"]: row for row in result["nodes"]}
    bad = [h for k, h in enumerate(hosts) if rows.get(k, {}).get("healthy") is False]
    if not bad and not result["healthy"] and not warned:
        raise CannotContinue("self-check of the job's nodes failed: " + "; ".join(result["reasons"]))
    return bad, {h: rows[hosts.index(h)]["reasons"] for h in bad}


def _next_config(cfg: MegaConfig, healthy: int, bad: list[str], result: dict) -> tuple[MegaConfig, str]:
    """The config on the healthy hosts: the same size on spares, or shrunk to ``restart.min_nodes``
    or more; CannotContinue when neither fits."""
    if not bad:
        return cfg, "every node trains" if result["healthy"] else "no node judged unhealthy"
    need, floor = cfg.cluster.nodes, cfg.restart.min_nodes
    note = f"{', '.join(bad)} excluded from every step of this job"
    if healthy >= need:
        new = copy.deepcopy(cfg)
        faults.disarm(new)  # the drills were aimed at the old nodes
        return new, note + f"; {healthy} healthy node(s): spares take their places"
    if floor is None or healthy < floor:
        raise CannotContinue(
            f"{note}; {healthy} healthy node(s) left for cluster.nodes={need} "
            f"(restart.spare_nodes={cfg.restart.spare_nodes}, restart.min_nodes={floor}): "
            + "; ".join(result["reasons"])
        )
    new = resize(cfg, healthy)
    return new, note + f"; continuing on {healthy} node(s), dp {new.parallelism.dp}"
