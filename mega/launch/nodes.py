"""The run's nodes as the driver holds them: the membership (mega.stability.membership), the
config it implies, and the launch backend that starts them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from mega import faults
from mega.launch.backends import backend_for
from mega.launch.node_jobs import run_selfcheck
from mega.stability.membership import Membership, decide, selfcheck_verdicts

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
        rows = [
            {
                "node": k,
                "attempt": attempt,
                "reasons": verdicts[k]["reasons"],
                "replaced_by": decision.replaced.get(k),
                "selfcheck": str(out / "result.json"),
            }
            for k in decision.evicted
        ]
        if decision.cfg.cluster.nodes != self.cfg.cluster.nodes:
            self.backend.close()
            self.backend = backend_for(decision.cfg, self.run_dir)
        self.cfg, self.members = decision.cfg, decision.membership
        return rows

    def as_record(self) -> dict:
        return asdict(self.members)

    def close(self) -> None:
        self.backend.close()
