"""Recovery: restart runs that should be training but are not, from their latest durable checkpoint.

Three ways in (docs/recovery.md):

* the ``recover-runs`` deployment's schedule (infra/prefect.yaml) scans ``runs_root``;
* its automation passes ``flow_run_id`` when a ``pretrain`` flow run ends Failed or Crashed;
* by hand: ``python -m flows.recover [--runs-root runs] [--run-dir DIR] [--flow-run-id ID]``.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefect import flow, get_run_logger

from tasks.recover import find_runs, recovery_report, restart_run


class RecoveryFailed(RuntimeError):
    """A restarted run failed again; it stays ``failed`` in its record for the next recovery."""


@flow(name="recover", log_prints=True)
def recover(
    runs_root: str = "runs",
    run_dir: str | None = None,
    flow_run_id: str | None = None,
    stale_after_s: float = 120.0,
    include_failed: bool = True,
    max_recoveries: int = 3,
) -> dict[str, Any]:
    """Find runs whose record says training (or failed with steps left) while their launcher is
    gone or silent for ``stale_after_s``, and train each on from its latest durable checkpoint.

    ``run_dir``: look at this run only; ``flow_run_id``: only the run that flow run drove (what
    the automation passes); neither: every run under ``runs_root``. ``include_failed``: restart
    runs whose launcher gave up (``restart.max_restarts`` spent) too, at most
    ``max_recoveries`` times per run."""
    logger = get_run_logger()
    scope = run_dir or (f"the run of flow run {flow_run_id}" if flow_run_id else runs_root)
    opts = dict(stale_after_s=stale_after_s, include_failed=include_failed, max_recoveries=max_recoveries)
    statuses = find_runs(runs_root, run_dir, flow_run_id, **opts)

    rows = []
    for status in statuses:  # one at a time: restarted runs share this machine's cores
        if status.verdict in ("recover", "finished"):
            rows.append(restart_run(status, **opts))
        else:
            rows.append(
                {
                    "run_dir": status.run_dir,
                    "found": status.verdict,
                    "reason": status.reason,
                    "checkpoint": status.checkpoint or "",
                    "action": "none",
                    "result": "",
                }
            )
    recovery_report(rows, scope)

    restarted = [r for r in rows if r["action"] == "restarted"]
    logger.info("%d run(s) looked at under %s, %d restarted", len(rows), scope, len(restarted))
    failed = [r["run_dir"] for r in rows if r.get("failed")]
    if failed:
        raise RecoveryFailed(f"restarted run(s) failed again: {', '.join(failed)}")
    return {"scope": scope, "runs": rows, "restarted": [r["run_dir"] for r in restarted]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.recover",
        description="Restart runs that should be training but are not, from their latest durable "
        "checkpoint (docs/recovery.md).",
    )
    parser.add_argument("--runs-root", default="runs", help="scan every run directory under this one")
    parser.add_argument("--run-dir", help="look at this run directory only")
    parser.add_argument("--flow-run-id", help="only the run this (pretrain) flow run drove")
    parser.add_argument(
        "--stale-after-s",
        type=float,
        default=120.0,
        help="a heartbeat older than this means the launcher is gone (default 120)",
    )
    parser.add_argument("--no-failed", action="store_true", help="leave runs whose launcher gave up alone")
    parser.add_argument("--max-recoveries", type=int, default=3)
    return parser


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``main`` does, recovering nothing (a bad flag exits, as argparse does)."""
    _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    recover(
        runs_root=args.runs_root,
        run_dir=args.run_dir,
        flow_run_id=args.flow_run_id,
        stale_after_s=args.stale_after_s,
        include_failed=not args.no_failed,
        max_recoveries=args.max_recoveries,
    )


if __name__ == "__main__":
    main()
