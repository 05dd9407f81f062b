"""Every fault the driver handles becomes an incident, and every incident reaches its listeners.

The watcher (mega.stability.detect) files hangs and stragglers itself. This module files the
rest, from an attempt's outcome, once the driver has decided what to do about it:

* **rank-exit**: a node's agent exited non-zero. The culprit rank(s) come from torchrun's failure
  table in the agent logs (mega.stability.logscan: a rank killed by a signal other than the
  SIGTERM torchrun stops survivors with, else the root cause that raised no peer error), their
  coordinates from the ranks' heartbeat identities (or the process records of mega.cluster.node).
* **nan** / **spike**: the ranks asked for a rollback (mega.stability.rollback): the step, what was
  not finite or the loss spike, the checkpoint rolled back to.
* **eviction**: the diagnosis (mega.stability.membership) evicted a node: its self-check reasons,
  and the spare in its place or the smaller size the run continues at.

For the fault incidents (rank-exit, hang) the driver adds a **diagnosis**: the error lines of the
logs, the kernel's Xid lines on cuda, and the self-check verdict of the suspected node(s). Every
incident that ended an attempt gets its **time to recovery** once the next attempt logs its first
step (``metrics.jsonl``: each row carries its attempt and time), also across launches (a run
recovered by the recovery flow). ``on_incident`` (the Prefect task's events and artifacts) is
called with each incident when it is filed (``stage: detected``) and again when it recovers
(``stage: recovered``); a listener that fails is logged, never fatal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mega.launch.backend import JobSpec
from mega.launch.runs import RunTracker
from mega.launch.watch import JobOutcome
from mega.metrics import METRICS_FILE
from mega.stability import logscan
from mega.stability.incident import INCIDENTS_DIR, Incident

if TYPE_CHECKING:
    from mega.config import MegaConfig

MAX_LOGS = 16  # agent logs scanned per failed attempt: the failed/suspected nodes first


def narrow_to_culprits(outcome: JobOutcome, logs: dict[int, Path]) -> JobOutcome:
    """Several agents seen failed in one poll of the driver are often one cause and its victims: a
    rank died, and its peers on the other nodes then failed in their collectives, all within the
    poll's half second. The failed nodes are then narrowed to the nodes of the culprit ranks that
    torchrun's failure tables in ``logs`` (node -> agent log) name (mega.stability.logscan: killed
    by a signal, else a root cause that raised no peer error: not merely the first failure each
    agent saw); unchanged when they name none of the failed nodes or all of them. The reason still
    lists every failed node."""
    failed = sorted(outcome.failed_nodes)
    if len(failed) < 2:
        return outcome
    scan = logscan.scan_logs({k: logs[k] for k in failed if k in logs}, every_root=False)
    node_of = {f["rank"]: f["node"] for f in scan["failures"]}
    named = sorted({node_of[r] for r in scan["culprit_ranks"]})
    if not named or named == failed:
        return outcome
    return replace(outcome, code=outcome.exit_codes.get(named[0], outcome.code), failed_nodes=named)


def suspect_nodes(outcome: JobOutcome, incidents: list[Incident]) -> list[int]:
    """The job's nodes to diagnose after a failed attempt: the nodes whose agents failed or, for a
    hang (every node is stopped, none failed), the culprit's node and the nodes gone silent."""
    if outcome.failed_nodes:
        return list(outcome.failed_nodes)
    for inc in incidents:
        if inc.kind == "hang" and inc.culprit:
            c = inc.culprit
            named = ([c["node"]] if c.get("node") is not None else []) + list(c.get("silent_nodes") or [])
            return sorted(set(named))
    return []


@dataclass
class Diagnosed:
    """What the driver's diagnosis of an attempt did: the suspects (job node ranks), the physical
    nodes and DP before, the evicted rows (mega.stability.membership), the nodes and DP after, or
    why the run cannot go on."""

    suspects: list[int]
    nodes_before: list[int]
    dp_before: int
    evicted: list[dict] = field(default_factory=list)
    nodes_after: list[int] = field(default_factory=list)
    dp_after: int | None = None
    error: str | None = None

    def after(self, evicted: list[dict], nodes: list[int], dp: int) -> Diagnosed:
        self.evicted, self.nodes_after, self.dp_after = evicted, list(nodes), dp
        return self

    def failed(self, error: Exception) -> Diagnosed:
        self.error = str(error)
        return self

    def action(self, row: dict) -> str:
        if self.error:
            return f"run failed: {self.error}"
        if row.get("replaced_by") is not None:
            return f"evicted node {row['node']}, spare node {row['replaced_by']} in its place"
        return (
            f"evicted node {row['node']}; continuing on {len(self.nodes_after)} nodes "
            f"(dp {self.dp_before} -> {self.dp_after}, same global batch)"
        )


class IncidentFiler:
    """The run's incidents as the driver files them: one per launch (``run_training``)."""

    def __init__(
        self,
        run: RunTracker,
        on_incident: Callable[[dict], None] | None = None,
        log: Callable[[str], None] = print,
    ):
        self.run, self.on_incident, self.log = run, on_incident, log
        self.run_dir = Path(run.record.run_dir)
        self.published = {b.get("file") for b in run.record.incidents}
        # incidents of earlier launches still waiting for a step (a run the recovery flow restarts)
        self.pending: dict[Path, Incident] = {}
        for p in sorted((self.run_dir / INCIDENTS_DIR).glob("*.json")):
            try:
                inc = Incident.read(p)
            except (OSError, ValueError, TypeError) as e:  # a damaged file never stops a launch
                log(f"incident {p.name}: unreadable ({type(e).__name__}); its recovery is not tracked")
                continue
            if _awaits_recovery(inc):
                self.pending[p] = inc
        self.metrics_mtime: float | None = None
        self.attempt = 0

    def begin(
        self, attempt: int, job: JobSpec, cfg: MegaConfig, watcher, resumed_step: Callable[[], int | None]
    ) -> None:
        self.attempt, self.job, self.cfg, self.watcher, self.resumed_step = (
            attempt,
            job,
            cfg,
            watcher,
            resumed_step,
        )
        self.started = _now()

    # -- recovery ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Each poll of the job: when ``metrics.jsonl`` changed and incidents wait, the first step
        of this attempt recovers them (reads the file's tail only)."""
        if not self.pending:
            return
        path = self.run_dir / METRICS_FILE
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return
        if mtime != self.metrics_mtime:
            self.metrics_mtime = mtime
            self._recover(logscan.read_tail(path, 64 * 1024))

    def _recover(self, metrics_text: str) -> None:
        first: dict[int, float] = {}  # attempt -> time of its first logged step
        for line in metrics_text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("time") is not None:
                first.setdefault(row.get("attempt", 0), row["time"])
        for path, inc in list(self.pending.items()):
            later = [t for a, t in first.items() if a > inc.attempt and t >= inc.detected_at]
            if later:
                inc.time_to_recover_s = round(min(later) - inc.detected_at, 3)
                del self.pending[path]
                self._save(path, inc, "recovered")
                self.log(
                    f"incident {path.stem}: recovered {inc.time_to_recover_s:.1f} s after it was detected"
                )

    # -- filing --------------------------------------------------------------------------------

    def end(
        self,
        outcome: JobOutcome,
        final_step: int,
        *,
        rollback: dict | None = None,
        diagnosed: Diagnosed | None = None,
        restarts_left: bool = True,
    ) -> list[Incident]:
        """After the attempt's outcome is handled: file the driver's incidents, give the watcher's
        the diagnosis, publish every new one. Returns the incidents filed or updated now."""
        if self.pending:  # an attempt too short for poll() to see its first step
            self._recover(_read(self.run_dir / METRICS_FILE))
        watcher_new = [
            (self.run_dir / b["file"], b)
            for b in self.run.record.incidents
            if b.get("file") not in self.published
        ]
        filed: list[tuple[Path | None, Incident]] = [(p, Incident.read(p)) for p, _ in watcher_new]
        if not outcome.ok or final_step < self.cfg.train.steps:
            filed += [
                (None, inc)
                for inc in self._faults(
                    outcome, final_step, rollback, diagnosed, restarts_left, [i for _, i in filed]
                )
            ]
        out = []
        for path, inc in filed:
            if path is None:
                path = inc.write(self.run_dir)
                self.run.record.incidents.append(inc.brief(path))
            if _awaits_recovery(inc):  # also after the last restart: a recovery flow may resume it
                self.pending[path] = inc
            self._save(path, inc, "detected")
            out.append(inc)
        return out

    def evicted_aside(self, rows: list[dict]) -> None:
        """Nodes a self-check beside the run evicted (mega.launch.aside_checks): a spare before
        it trained, or a suspect set aside for a spare. Filed when the verdict comes; the run
        went on without them before it, so nothing is left to recover (0 s)."""
        for row in rows:
            k, spare = row["node"], row["attempt"] is None
            inc = Incident(
                "eviction",
                row["attempt"] if not spare else 0,
                _now(),
                f"{'spare ' if spare else ''}node {k} failed its self-check",
                {"rank": None, "node": k, "host": None, "reason": "self-check"},
                {"row": row, "selfcheck": row["selfcheck"]},
                f"evicted spare node {k} before it trained"
                if spare
                else f"evicted node {k}, spare node {row['replaced_by']} in its place",
                diagnosis="; ".join(row["reasons"]) or None,
                time_to_recover_s=0.0,
            )
            path = inc.write(self.run_dir)
            self.run.record.incidents.append(inc.brief(path))
            self._save(path, inc, "detected")

    def _faults(
        self, outcome, final_step, rollback, diagnosed, restarts_left, watcher_incidents
    ) -> list[Incident]:
        """The driver's incidents of a failed or stopped attempt: the rollback it asked for, else
        its rank exit or hang (or the watcher's hang, completed), then its evictions."""
        now, resumed = _now(), self.resumed_step()
        lost = None if resumed is None else max(0, final_step - resumed)
        relaunch = (
            "relaunch from latest"
            if restarts_left
            else f"none: no restart left (restart.max_restarts={self.cfg.restart.max_restarts}); run failed"
        )
        selfcheck = self._selfcheck(diagnosed)
        if rollback is not None:
            out = [
                self._rollback_incident(
                    rollback, final_step, resumed, lost, relaunch if not restarts_left else None, now
                )
            ]
        else:
            scan = logscan.scan_logs(
                self._logs(outcome, watcher_incidents), device=self.cfg.cluster.device, since=self.started
            )
            diagnosis = "\n".join(x for x in (scan["summary"], selfcheck) if x) or None
            hang = next((i for i in watcher_incidents if i.kind == "hang"), None)
            if hang is not None:  # the watcher's verdict stands; it gains what the logs and checks say
                hang.diagnosis = diagnosis
                hang.evidence["logs"] = _evidence(scan)
                hang.action = hang.action if restarts_left else relaunch
                out = []
            else:  # no failed node: the driver stopped it (a hang without heartbeats, a timeout)
                out = [self._exit_incident(outcome, scan, final_step, lost, relaunch, diagnosis, now)]
        return out + self._eviction_incidents(diagnosed, selfcheck, now)

    def _rollback_incident(self, rollback, final_step, resumed, lost, no_restart, now) -> Incident:
        """The ranks' rollback request (``no_restart``: the action when none is left)."""
        checkpoint = f"iter_{resumed:07d}" if resumed else "the start (no checkpoint)"
        what, step = rollback["what"], rollback["step"]
        spike = "not finite" not in what  # a loss spike alone (mega.stability.rollback's LossWindow)
        return Incident(
            "spike" if spike else "nan",
            self.attempt,
            rollback.get("time", now),
            f"step {step}: {what}",
            None,
            {"request": rollback, "final_step": final_step},
            no_restart or f"rolled back to {checkpoint}, step {step} skipped",
            lost,
            diagnosis=(
                f"{what} at step {step}: the last stage's loss far above its recent "
                "median (robust z-score > stability.spike_z)"
                if spike
                else f"{what} at step {step} (one all-reduce of every rank's verdict)"
            ),
        )

    def _exit_incident(self, outcome, scan, final_step, lost, relaunch, diagnosis, now) -> Incident:
        """A rank exit, or a hang the driver stopped, with its culprit from the logs ``scan``."""
        culprit = self._exit_culprit(outcome, scan)
        who = f"; culprit {_ranks_text(culprit)} (node {culprit.get('node')})" if culprit else ""
        seen_at = self.started + outcome.elapsed_s if outcome.elapsed_s else now  # before the stop
        return Incident(
            "rank-exit" if outcome.failed_nodes else "hang",
            self.attempt,
            seen_at,
            f"{outcome.reason}{who}",
            culprit,
            {
                "code": outcome.code,
                "failed_nodes": outcome.failed_nodes,
                "exit_codes": outcome.exit_codes,
                "final_step": final_step,
                "logs": _evidence(scan),
            },
            relaunch,
            lost,
            diagnosis=diagnosis,
        )

    def _eviction_incidents(
        self, diagnosed: Diagnosed | None, selfcheck: str | None, now: float
    ) -> list[Incident]:
        """The diagnosis's outcome: the run could not continue, or each node it evicted."""
        if diagnosed is None:
            return []
        n, out = self.attempt, []
        if diagnosed.error:
            out.append(
                Incident(
                    "eviction",
                    n,
                    now,
                    f"cannot continue: {diagnosed.error}",
                    None,
                    {
                        "suspects": diagnosed.suspects,
                        "nodes_before": diagnosed.nodes_before,
                        "selfcheck": self._selfcheck_path(),
                    },
                    diagnosed.action({}),
                    diagnosis=selfcheck,
                )
            )
        for row in diagnosed.evicted:
            reasons = "; ".join(row.get("reasons") or []) or None
            out.append(
                Incident(
                    "eviction",
                    n,
                    now,
                    f"node {row['node']} failed its self-check",
                    {"rank": None, "node": row["node"], "host": None, "reason": "self-check"},
                    {
                        "row": row,
                        "nodes_before": diagnosed.nodes_before,
                        "nodes_after": diagnosed.nodes_after,
                        "selfcheck": self._selfcheck_path(),
                    },
                    diagnosed.action(row),
                    diagnosis=reasons,
                )
            )
        return out

    def _exit_culprit(self, outcome, scan) -> dict | None:
        """The failed rank(s) with their node and coordinates; the failed node alone when the logs
        do not say which rank (an agent killed, a log lost)."""
        ranks = scan["culprit_ranks"]
        idents = dict(getattr(self.watcher, "identities", {}) or {})
        if ranks and any(r not in idents for r in ranks):
            from mega.cluster import node

            idents.update(
                {
                    p["rank"]: p
                    for p in node.read_processes(self.run_dir, self.attempt)
                    if p["rank"] not in idents
                }
            )
        fails = {f["rank"]: f for f in scan["failures"]}
        if ranks:
            r = ranks[0]
            ident = idents.get(r, {})
            k = ident.get("node", fails.get(r, {}).get("node"))
            coords = {c: ident[c] for c in ("tp", "pp", "dp") if c in ident}
            how = logscan.Failure(**fails[r]).describe() if r in fails else "failed"
            return {
                "rank": r,
                "ranks": ranks,
                "node": k,
                "host": ident.get("host") or fails.get(r, {}).get("host"),
                "coords": coords,
                "reason": how,
                "group": None,
                "group_ranks": [],
            }
        if outcome.failed_nodes:
            return {
                "rank": None,
                "ranks": [],
                "node": outcome.failed_nodes[0],
                "host": None,
                "coords": {},
                "reason": "its torchrun agent failed",
                "group": None,
                "group_ranks": [],
            }
        return None

    def _logs(self, outcome, watcher_incidents) -> dict[int, Path]:
        nodes = self.cfg.cluster.nodes
        first = list(outcome.failed_nodes) + suspect_nodes(outcome, watcher_incidents)
        order = list(dict.fromkeys(first + list(range(nodes))))[:MAX_LOGS]
        return {k: self.job.log_path(k, nodes) for k in order if k < nodes}

    def _selfcheck_path(self) -> str:
        return str(self.run_dir / "diagnosis" / f"attempt{self.attempt}" / "result.json")

    def _selfcheck(self, diagnosed: Diagnosed | None) -> str | None:
        """The self-check verdict of the suspected nodes, from the diagnosis' result.json."""
        if diagnosed is None:
            return None
        try:
            rows = json.loads(Path(self._selfcheck_path()).read_text())["nodes"]
        except (OSError, ValueError, KeyError):
            return f"self-check of node(s) {diagnosed.suspects}: no verdict ({diagnosed.error or 'result missing'})"
        parts = []
        for row in rows:
            if row.get("node") in diagnosed.suspects:
                k = (
                    diagnosed.nodes_before[row["node"]]
                    if row["node"] < len(diagnosed.nodes_before)
                    else row["node"]
                )
                verdict = {True: "healthy", False: "unhealthy", None: "not judged"}[row.get("healthy")]
                parts.append(
                    f"self-check of node {k}: {verdict}"
                    + (f" ({'; '.join(row['reasons'])})" if row.get("reasons") else "")
                )
        return "\n".join(parts) or None

    def _save(self, path: Path, inc: Incident, stage: str) -> None:
        inc.rewrite(path)
        brief = inc.brief(path)
        records = self.run.record.incidents
        for i, b in enumerate(records):
            if b.get("file") == brief["file"]:
                records[i] = brief
                break
        else:
            records.append(brief)
        self.run.save()
        self.published.add(brief["file"])
        if self.on_incident is None:
            return
        try:
            self.on_incident(
                {
                    **asdict(inc),
                    "stage": stage,
                    "file": brief["file"],
                    "run_dir": str(self.run_dir),
                    "markdown": inc.markdown(),
                    "brief": brief,
                }
            )
        except Exception as e:
            self.log(f"incident {path.stem}: on_incident failed: {type(e).__name__}: {e}")


def _awaits_recovery(inc: Incident) -> bool:
    """An incident that ended its attempt and has no time to recovery yet."""
    return inc.time_to_recover_s is None and inc.kind != "straggler"


def _evidence(scan: dict) -> dict:
    return {k: scan[k] for k in ("matches", "failures", "culprit_ranks", "xid")}


def _ranks_text(c: dict) -> str:
    ranks = c.get("ranks") or ([c["rank"]] if c.get("rank") is not None else [])
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "its agent"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _now() -> float:
    import time

    return time.time()
