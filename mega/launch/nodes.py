"""The run's nodes as the driver holds them: the membership (mega.stability.membership), the
config it implies, the launch backend that starts them, and the self-checks of nodes beside the
job (mega.launch.aside_checks: the spares, and suspects set aside for a spare)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from mega import faults
from mega.launch.aside_checks import AsideCheck, checks_aside
from mega.launch.backends import backend_for
from mega.launch.node_jobs import run_selfcheck
from mega.stability.membership import Decision, Membership, decide, selfcheck_verdicts, swap

if TYPE_CHECKING:
    from mega.config import MegaConfig
    from mega.launch.backend import Backend


class Nodes:
    """The run's nodes as the driver sees them: the membership, the config it implies, and the
    launch backend that starts them (rebuilt when the node count changes)."""

    def __init__(self, cfg: MegaConfig, run_dir: str | Path, backend: Backend | None = None):
        """``backend``: the one of ``launcher.name`` unless given (a test's scripted backend)."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.members = Membership.initial(cfg)
        self.backend: Backend = backend or backend_for(cfg, self.run_dir)
        self.aside: list[AsideCheck] = []  # checks of nodes outside the job, in flight
        self.aside_backend = backend_for  # makes their jobs' backends (a test's scripted one)
        self._aside_backends: dict[int, Backend] = {}  # by node count, kept: warm zygotes import once

    def check_spares(self, log: Callable[[str], None]) -> None:
        """Self-check the spares beside the first attempt: a spare trains only after it passed
        (``settle``). Local backends only; elsewhere a node failure checks every node first."""
        if self.members.spares and checks_aside(self.cfg):
            spares = list(self.members.spares)
            self.aside.append(
                AsideCheck(
                    self.cfg, spares, self.run_dir / "diagnosis" / "spares", backend=self._aside_backend_of
                )
            )
            log(f"self-check of spare node(s) {spares} beside the run")

    def swap_out(
        self, attempt: int, suspects: list[int], log: Callable[[str], None], trained: Callable[[], bool]
    ) -> Decision | None:
        """Spares that passed their check in the places of job nodes ``suspects`` at once; the
        suspects' own check runs beside the next attempt once ``trained()`` (its first step). None
        when this launcher cannot check nodes aside or too few spares are free."""
        physical = [self.members.nodes[k] for k in suspects]
        decision = swap(self.cfg, self.members, physical) if checks_aside(self.cfg) else None
        if decision is None:
            return None
        out = self.run_dir / "diagnosis" / f"attempt{attempt}"
        check = AsideCheck(
            self.cfg,
            physical,
            out,
            attempt=attempt,
            replaced=decision.replaced,
            ready=trained,
            backend=self._aside_backend_of,
        )
        self.aside.append(check)
        log(f"attempt {attempt}: node(s) {', '.join(map(str, physical))} failed; {decision.note}")
        self.cfg, self.members = decision.cfg, decision.membership
        return decision

    def _aside_backend_of(self, cfg: MegaConfig) -> Backend:
        """The backend of checks beside the run on ``cfg.cluster.nodes`` nodes (one check runs at a
        time: a check starts only after ``settle``)."""
        n = cfg.cluster.nodes
        if n not in self._aside_backends:
            self._aside_backends[n] = self.aside_backend(cfg, self.run_dir / "diagnosis")
        return self._aside_backends[n]

    def settle(self, log: Callable[[str], None]) -> list[dict]:
        """Wait for the checks beside the run (held-back ones start now) and apply their verdicts:
        a node that passed is a spare (again), one that failed is evicted. Returns the evicted
        rows for the run record (``attempt`` None: a spare at start-up)."""
        rows = []
        for check in self.aside:
            check.release()
        for check in self.aside:
            for k, v in check.verdicts().items():
                rows += self._apply(check, k, v, log)
        self.aside = []
        return rows

    def _apply(self, check: AsideCheck, node: int, verdict: dict, log: Callable[[str], None]) -> list[dict]:
        m, spare = self.members, node in self.members.spares
        if verdict["healthy"]:
            if not spare:
                m.spares.append(node)
            log(f"self-check beside the run: node {node} healthy; a spare")
            return []
        if spare:
            m.spares.remove(node)
        m.evicted.append(node)
        log(f"self-check beside the run: node {node} unhealthy, evicted ({'; '.join(verdict['reasons'])})")
        return [
            {
                "node": node,
                "attempt": check.attempt,
                "reasons": verdict["reasons"],
                "replaced_by": check.replaced.get(node),
                "selfcheck": check.result_path,
            }
        ]

    def diagnose(self, attempt: int, suspects: list[int], log: Callable[[str], None]) -> list[dict]:
        """Self-check the nodes after attempt ``attempt`` failed on job nodes ``suspects``; evict
        the unhealthy ones and switch to the next membership. Returns the evicted nodes' rows for
        the run record; raises CannotContinue when the run cannot go on."""
        out = self.run_dir / "diagnosis" / f"attempt{attempt}"
        who = ", ".join(str(self.members.nodes[k]) for k in suspects)
        log(
            f"attempt {attempt}: node(s) {who} failed; self-check of nodes {self.members.nodes} before the restart"
        )
        result = run_selfcheck(
            self.cfg,
            out,
            backend=self.backend,
            bad_node=faults.selfcheck_bad_node(self.cfg, self.members.job_rank),
        )
        verdicts = selfcheck_verdicts(result, self.members)
        bad = [k for k, v in verdicts.items() if v["healthy"] is False]
        decision = decide(self.cfg, self.members, bad)
        log(
            f"attempt {attempt}: self-check {'passed' if result['healthy'] else 'failed'} in "
            f"{result['elapsed_s']:.1f}s; {decision.note}"
        )
        # Slurm picks the hosts of each job: an evicted node is the host the check ran it on, kept
        # out of every later attempt (--exclude, or the step's --nodelist)
        hosts = self.backend.hosts() if hasattr(self.backend, "exclude") else []
        rows = []
        for k in decision.evicted:
            rank = self.members.nodes.index(k)
            host = hosts[rank] if rank < len(hosts) else None
            if host:
                self.backend.exclude(host)
            rows.append(
                {
                    "node": k,
                    "attempt": attempt,
                    "reasons": verdicts[k]["reasons"],
                    "replaced_by": decision.replaced.get(k),
                    "selfcheck": str(out / "result.json"),
                    **({"host": host} if host else {}),
                }
            )
        if decision.cfg.cluster.nodes != self.cfg.cluster.nodes:
            if hasattr(self.backend, "resize"):  # Slurm: the same backend, its exclusions kept
                self.backend.resize(decision.cfg)
            else:
                self.backend.close()
                self.backend = backend_for(decision.cfg, self.run_dir)
        self.cfg, self.members = decision.cfg, decision.membership
        return rows

    def as_record(self) -> dict:
        return asdict(self.members)

    def close(self) -> None:
        for check in self.aside:
            check.cancel()
        for backend in self._aside_backends.values():
            backend.close()
        self.backend.close()
