"""The driver: train to ``train.steps`` on a set of nodes, relaunching every node from the
newest in-memory copies or ``latest`` when any fails.

A run is ``cluster.nodes`` torchrun agents started by the launch backend (mega/launch/backend.py);
ranks are processes, never in-process work. The driver owns membership: it starts every node's
agent for an attempt, watches them (a node's agent exiting, a stall of ``metrics.jsonl`` for
``cluster.hang_timeout_s``), and on any failure stops every node's agent and ranks and relaunches
all nodes, with bounded attempts and exponential backoff: the ranks restore the newest complete
in-memory copies (mega/checkpoint/memory.py), else the durable ``latest``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mega import config as mega_config
from mega.cluster import rendezvous
from mega.config import MegaConfig
from mega.goodput.marks import driver_mark
from mega.launch import runs
from mega.launch.backend import JobSpec, server_host
from mega.launch.watch import JobOutcome, run_job
from mega.metrics import METRICS_FILE, read_metrics
from mega.stability import channel as heartbeats
from mega.stability import incidents_of_attempt, membership, rollback
from mega.stability.detect import Watcher


class TrainingFailed(RuntimeError):
    pass


@dataclass
class TrainingResult:
    run_dir: Path
    attempts: int
    final_step: int
    metrics: list[dict] = field(default_factory=list)
    init: dict = field(default_factory=dict)
    # one row per attempt of this launch: attempt, outcome, failed_nodes, final_step, restored
    # (the checkpoint its ranks restored, from their init.json; None = started from scratch)
    history: list[dict] = field(default_factory=list)

    @property
    def restored(self) -> str | None:
        """The checkpoint the last attempt's ranks actually restored (None: started fresh)."""
        return self.init.get("restore", {}).get("checkpoint")


def run_training(
    cfg: MegaConfig,
    index_path: Path,
    log: Callable[[str], None] = print,
    *,
    flow_run_id: str | None = None,
    recovery: bool = False,
    on_incident: Callable[[dict], None] | None = None,
) -> TrainingResult:
    """Train to ``train.steps``; when any node's ranks die or hang, restart all from ``latest``.

    While it runs, the run's record (``<run_dir>/run.json``, mega.launch.runs) says training, with a
    heartbeat; after, completed or failed. ``flow_run_id`` names the flow run driving it and
    ``recovery`` marks a restart by the recovery flow; attempt numbers continue the run's own
    (so a fault drill of attempt 0 does not strike again, and no attempt log is overwritten).
    ``on_incident``: called with each incident (mega.stability.incidents_of_attempt) when it is
    filed and again when the next attempt's first step recovers it (``stage``).
    """
    from mega import validation

    entered = time.time()
    validation.check_held_out(
        cfg, index_path
    )  # a dataset without held-out text fails here, not in every rank
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (
        runs.track(
            run_dir,
            config=run_dir / "config.json",
            data_index=index_path,
            target_steps=cfg.train.steps,
            flow_run_id=flow_run_id,
            recovery=recovery,
        ) as run,
        contextlib.closing(membership.Nodes(cfg, run_dir)) as nodes,
        rendezvous.rendezvous_env(cfg, host=server_host(nodes.backend)) as store_env,
        heartbeats.heartbeat_env(cfg, store_env, host=server_host(nodes.backend)) as hb_env,
    ):  # docs/stability.md
        if recovery and hasattr(nodes.backend, "cancel_run_jobs"):  # Slurm: the dead driver's job may live on
            if cancelled := nodes.backend.cancel_run_jobs():
                log(f"recovery: cancelled this run's Slurm job(s) {', '.join(cancelled)} before resubmitting")
        book = incidents_of_attempt.Book(run, on_incident, log)  # every fault an incident, docs/stability.md
        driver_mark(run_dir, "start", hb_env, t_entered=entered)  # the goodput ledger (docs/goodput.md)
        try:
            result = _train_with_restarts(cfg, index_path, log, run, nodes, {**store_env, **hb_env}, book)
        finally:
            driver_mark(run_dir, "end")
        run.finish("completed", result.final_step)
        return result


def _train_with_restarts(
    cfg: MegaConfig,
    index_path: Path,
    log: Callable[[str], None],
    run: runs.RunTracker,
    nodes: membership.Nodes,
    store_env: dict[str, str],
    book: incidents_of_attempt.Book,
) -> TrainingResult:
    from mega.checkpoint import describe_source, latest_durable, restore_source
    from mega.storage import StorageError

    run_dir = Path(cfg.train.run_dir)
    config_path = run_dir / "config.json"
    args = ["--config", str(config_path), "--data-index", str(index_path)]
    env = {**cfg.cluster.env, **store_env, "PYTHONUNBUFFERED": "1"}

    first = run.record.attempts
    attempts = 0  # attempts launched; those ended by Slurm's signal (requeues) do not count as failures
    requeues = 0
    history: list[dict] = []
    while True:
        n = first + attempts  # this attempt's number over the run's life
        run.beat(attempts=n + 1)
        env["MEGA_ATTEMPT"] = str(n)
        # the nodes (after an eviction: other or fewer) and the steps rolled back from (mega/stability)
        cfg, backend, c = nodes.cfg, nodes.backend, nodes.cfg.cluster
        mega_config.save(rendezvous.without_secrets(cfg), config_path)  # ranks get the password by env
        env[rollback.SKIP_ENV] = rollback.skip_env(run.record.skipped_steps)
        where = f" on {c.nodes} nodes ({c.procs_per_node} per node)" if c.nodes > 1 else ""
        # The ranks restore the in-memory copies or `latest` of the durable store themselves
        # (mega.checkpoint.restore, falling back past a corrupt one) and write what they restored
        # (and from where) into init.json.
        try:
            latest = latest_durable(cfg) if cfg.checkpoint.load else None
        except StorageError as e:
            latest = None
            log(f"attempt {n}: checkpoint store: {e}")
        log(
            f"attempt {n}: launching {cfg.parallelism.world_size} ranks{where}"
            + (f"; `latest` is {latest}" if latest else "")
        )
        init_file = run_dir / "init.json"
        init_file.unlink(missing_ok=True)  # written anew by this attempt's rank 0
        job = JobSpec("mega.train", args, dict(env), run_dir, f"train-attempt{n}")
        watcher = Watcher(cfg, env, n, log)  # heartbeats: hang (ends the attempt) and straggler incidents
        driver_mark(run_dir, "launch", attempt=n)
        book.begin(n, job, cfg, watcher, lambda: _resume_step(nodes.cfg))
        outcome = run_job(
            backend,
            job,
            progress_file=run_dir / METRICS_FILE,
            stall_timeout_s=c.hang_timeout_s,
            on_poll=lambda: run.beat() or book.poll() or watcher.poll(),
            on_failure=lambda o, n=n: log(f"attempt {n}: {o.reason}; stopping every node"),
        )
        # agents of a dead rank's peers may fail in the same poll: blame the culprit's node
        logs = {k: job.log_path(k, c.nodes) for k in range(c.nodes)}
        outcome = incidents_of_attempt.narrow_to_culprits(outcome, logs)
        driver_mark(
            run_dir, "stopped", attempt=n, ok=outcome.ok, reason=outcome.reason, stop_s=outcome.stop_s
        )
        attempts += 1
        try:
            dropped = rendezvous.drop_attempt_keys(store_env, n)
        except Exception as e:
            log(f"attempt {n}: could not drop its store keys ({type(e).__name__}); they expire by TTL")
        else:
            if dropped is not None:
                log(f"attempt {n}: dropped its {dropped} store keys")
        try:
            init = json.loads(init_file.read_text()) if init_file.exists() else {}
        except ValueError:  # rank 0 died while writing it
            init = {}
        if init.get("restore", {}).get("checkpoint"):
            r = init["restore"]
            log(
                f"attempt {n}: resumed from {r['checkpoint']}, from {describe_source(r)}"
                + (f" (refused {', '.join(x['name'] for x in r['refused'])})" if r.get("refused") else "")
            )
        metrics = read_metrics(run_dir)
        final_step = metrics[-1]["step"] if metrics else 0
        run.beat(final_step=final_step)
        watcher.close(
            run, final_step, outcome.reason, lambda: _resume_step(nodes.cfg)
        )  # incidents/, run.json
        history.append(
            {
                "attempt": n,
                "code": outcome.code,
                "reason": outcome.reason,
                "failed_nodes": outcome.failed_nodes,
                "final_step": final_step,
                "restored": init.get("restore", {}).get("checkpoint"),
                "restored_from": restore_source(init.get("restore", {})),  # memory-own/-peer, durable
                "elapsed_s": round(outcome.elapsed_s, 3),
                "stop_s": round(outcome.stop_s, 3),
            }
        )
        if (
            outcome.ok or _preempted(outcome)
        ) and final_step >= cfg.train.steps:  # a late signal: done anyway
            book.end(outcome, final_step)
            return TrainingResult(run_dir, attempts, final_step, metrics, init, history)
        if (
            _preempted(outcome) and final_step < cfg.train.steps
        ):  # Slurm's signal: saved at final_step; resubmit
            requeues += 1
            attempts -= 1
            history[-1]["requeued"] = True  # no incident: a scheduled end, not a fault
            runs.write_record(run.record)
            limit = cfg.launcher.slurm.max_requeues
            log(
                f"attempt {n}: signalled by Slurm (time limit or preemption); the ranks saved step {final_step}; "
                f"requeue {requeues} of at most {limit}"
            )
            if requeues > limit:
                failed = TrainingFailed(f"requeued {requeues} times (launcher.slurm.max_requeues={limit})")
                run.finish("failed", final_step, error=str(failed))
                raise failed
            first += 1  # the next attempt still gets a number (and a store namespace) of its own
            continue
        if outcome.ok:  # every agent exited 0 short of train.steps: not a success
            outcome = JobOutcome(
                1, f"ended at step {final_step} of {cfg.train.steps}", [], outcome.exit_codes
            )
        log(
            f"attempt {n}: training {_short(outcome)} at step {final_step}; "
            f"logs: {_logs(job, c.nodes, outcome)}"
        )
        diagnosed = None
        lost = _exclude_lost_hosts(nodes, log, n)  # Slurm: hosts it holds down never come back in this run
        if lost:
            history[-1]["excluded_hosts"] = lost
        if (request := rollback.take(run_dir, n)) is not None:  # a NaN/Inf step: skip its batch
            run.record.skipped_steps.append(request)
            history[-1]["skipped_step"] = request["step"]
            log(
                f"attempt {n}: step {request['step']}: {request['what']}; rolling back to `latest` "
                "and skipping the step's batch"
            )
        elif lost:
            pass  # Slurm gives the next attempt other nodes (spares) or fewer (min_nodes): no self-check
        elif (
            (
                suspects := incidents_of_attempt.suspect_nodes(outcome, watcher.incidents)
            )  # failed or hung nodes
            and membership.diagnosis_enabled(cfg)
            and attempts <= cfg.checkpoint.max_restarts
        ):
            diagnosed = incidents_of_attempt.Diagnosed.before(nodes, suspects)
            try:
                t_diagnose = time.time()
                evicted = nodes.diagnose(n, suspects, log)
                driver_mark(run_dir, "diagnose", attempt=n, seconds=time.time() - t_diagnose)
            except membership.CannotContinue as e:
                book.end(outcome, final_step, diagnosed=diagnosed.failed(e), restarts_left=False)
                run.finish("failed", final_step, error=str(e))
                raise TrainingFailed(f"attempt {n}: {e}") from None
            run.record.evicted_nodes += evicted
            history[-1]["evicted"] = [e["node"] for e in evicted]
            diagnosed.after(nodes, evicted)
        book.end(
            outcome,
            final_step,
            rollback=request,
            diagnosed=diagnosed,
            restarts_left=attempts <= cfg.checkpoint.max_restarts,
        )  # incidents/, run.json, on_incident
        run.record.membership = nodes.as_record()
        runs.write_record(run.record)
        if attempts > cfg.checkpoint.max_restarts:
            failed = TrainingFailed(
                f"training failed {attempts} times (last: {outcome.reason}); "
                f"see {run_dir}/{'nodes/*/' if c.nodes > 1 else ''}train-attempt*.log"
            )
            run.finish("failed", final_step, error=str(failed))
            raise failed
        driver_mark(
            run_dir, "backoff", attempt=n, seconds=cfg.checkpoint.restart_backoff_s * 2 ** (attempts - 1)
        )
        time.sleep(cfg.checkpoint.restart_backoff_s * 2 ** (attempts - 1))


def _preempted(outcome: JobOutcome) -> bool:
    """Every node's ranks saved and exited on Slurm's signal (mega.launch.slurm.PREEMPTED)."""
    from mega.launch.slurm import PREEMPTED

    codes = outcome.exit_codes.values()
    return bool(codes) and all(c == PREEMPTED for c in codes)


def _exclude_lost_hosts(nodes: membership.Nodes, log: Callable[[str], None], attempt: int) -> list[str]:
    """On Slurm: the attempt's hosts Slurm holds down go into ``--exclude`` of every later attempt;
    with fewer usable nodes than the run needs it shrinks to ``cluster.min_nodes`` or more (DP
    shrinks), else the same size lands on a spare. Other backends: nothing ([])."""
    backend = nodes.backend
    if not hasattr(backend, "lost_hosts"):
        return []
    lost = backend.lost_hosts()
    for host in lost:
        backend.exclude(host)
    if not lost:
        return []
    c = nodes.cfg.cluster
    usable = backend.usable_nodes()
    note = f"attempt {attempt}: Slurm holds {', '.join(lost)} down; excluded from every later attempt"
    if usable < c.nodes and c.min_nodes is not None and usable >= c.min_nodes:
        nodes.cfg = membership.resize(nodes.cfg, usable)
        backend.resize(nodes.cfg)
        note += f"; continuing on {usable} node(s), dp {nodes.cfg.parallelism.dp}"
    elif usable >= c.nodes:
        note += f"; {usable} usable node(s): the next attempt runs on a spare"
    log(note)
    return lost


def _durable_step(cfg: MegaConfig) -> int | None:
    """The step of the durable ``latest``, None when unknown."""
    from mega.checkpoint import latest_durable
    from mega.storage import StorageError

    try:
        latest = latest_durable(cfg) if cfg.checkpoint.load else None
    except StorageError:
        return None
    return runs.checkpoint_step(latest) if latest else 0


def _resume_step(cfg: MegaConfig) -> int | None:
    """The step a relaunch resumes from (steps lost): the newest step of the in-memory copies this
    machine holds of every rank (local nodes) when newer than the durable ``latest``'s."""
    from mega.checkpoint.memory import newest_copy_step

    durable = _durable_step(cfg)
    memory = newest_copy_step(cfg) if cfg.checkpoint.load else None
    return durable if memory is None or (durable is not None and durable > memory) else memory


def _short(outcome: JobOutcome) -> str:
    if outcome.failed_nodes and len(outcome.exit_codes) == 1:  # one node: as single-node runs always said
        return f"exited with code {outcome.code}"
    return outcome.reason


def _logs(job: JobSpec, nodes: int, outcome: JobOutcome) -> str:
    show = outcome.failed_nodes or range(nodes)
    return ", ".join(str(job.log_path(k, nodes)) for k in show)
