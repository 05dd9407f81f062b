"""The driver: train to ``train.steps`` on a set of nodes, relaunching every node from the
newest in-memory copies or ``latest`` when any fails.

A run is ``cluster.nodes`` torchrun agents started by the launch backend (mega/launch/backend.py);
ranks are processes, never in-process work. The driver owns membership: it starts every node's
agent for an attempt, watches them (a node's agent exiting, a stall of ``metrics.jsonl`` for
``stability.hang_timeout_s``), and on any failure stops every node's agent and ranks and relaunches
all nodes, with bounded attempts and exponential backoff: the ranks restore the newest complete
in-memory copies (mega/checkpoint/memory.py), else the durable ``latest``.

The restart loop is a recipe of four steps, each a function of its own: ``launch_attempt`` (save
the attempt's config, start its job), ``watch_attempt`` (until it ends), ``collect_outcome`` (what
it reached, what its ranks restored) and then, by ``verdict``, ``finish``, ``requeue`` or
``prepare_restart`` (the next membership: lost hosts, a rollback, a diagnosis). ``LoopState`` is
what one attempt hands the next: its number, the config it runs, the failure and requeue budgets
spent and the history; ``Launch`` is what stays the same over a launch's attempts.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mega import config as mega_config
from mega import rank_env
from mega.checkpoint import describe_source, latest_durable, restore_source
from mega.cluster import rendezvous
from mega.config import MegaConfig
from mega.goodput.marks import driver_mark
from mega.launch import incidents, runs, slurm_driver, slurm_preflight, slurm_steps
from mega.launch.backend import JobSpec, server_host, training_job
from mega.launch.nodes import Nodes
from mega.launch.slurm import PREEMPTED
from mega.launch.watch import JobOutcome, run_job
from mega.metrics import METRICS_FILE, ProgressLog, read_metrics
from mega.stability import heartbeat_redis as heartbeats
from mega.stability import membership, rollback
from mega.stability.detect import Watcher
from mega.storage import StorageError


class TrainingFailed(RuntimeError):
    pass


class JobRequeued(BaseException):
    """Raised by the driver in its Slurm allocation when Slurm's warning ended an attempt: the whole
    job goes back to the queue for a new time limit (mega.launch.in_allocation requeues it once this
    driver has let go of its servers) and its next run continues from ``carried``. Not an
    Exception: the run record stays ``training``."""

    def __init__(self, carried: dict):
        super().__init__("requeue the driver's Slurm job")
        self.carried = carried


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
    carried: dict | None = None,
    on_selfcheck: Callable[[dict], None] | None = None,
) -> TrainingResult:
    """Train to ``train.steps``; when any node's ranks die or hang, restart all from ``latest``.

    While it runs, the run's record (``<run_dir>/run.json``, mega.launch.runs) says training, with a
    heartbeat; after, completed or failed. ``flow_run_id`` names the flow run driving it and
    ``recovery`` marks a restart by the recovery flow; attempt numbers continue the run's own
    (so a fault drill of attempt 0 does not strike again, and no attempt log is overwritten).
    ``on_incident``: called with each incident (mega.launch.incidents) when it is
    filed and again when the next attempt's first step recovers it (``stage``). ``carried``: what
    the driver of a requeued Slurm job handed on (``JobRequeued``): its config and budgets.
    ``on_selfcheck``: called with the verdict of the self-check the driver runs in its Slurm
    allocation (mega.launch.slurm_preflight) once it is in.
    """
    from mega import heldout

    entered = time.time()
    heldout.check_held_out(cfg, index_path)  # a dataset without held-out text fails here, not in every rank
    if slurm_steps.drives_in_allocation(cfg) and not slurm_steps.inside_allocation(cfg):
        return _in_allocation(
            cfg, index_path, log, flow_run_id=flow_run_id, recovery=recovery, on_selfcheck=on_selfcheck
        )
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = mega_config.from_dict(carried["config"]) if carried else cfg  # after a shrink: fewer nodes
    with (
        runs.track(
            run_dir,
            config=run_dir / "config.json",
            data_index=index_path,
            target_steps=cfg.train.steps,
            flow_run_id=flow_run_id,
            recovery=recovery,
            claim=not slurm_steps.inside_allocation(cfg),  # the submitting process holds it
        ) as run,
        contextlib.closing(Nodes(cfg, run_dir)) as nodes,
        rendezvous.rendezvous_env(cfg, host=server_host(nodes.backend)) as store_env,
        heartbeats.heartbeat_env(cfg, store_env, host=server_host(nodes.backend)) as hb_env,
    ):  # docs/stability.md
        if recovery and hasattr(nodes.backend, "cancel_run_jobs"):  # Slurm: the dead driver's job may live on
            if cancelled := nodes.backend.cancel_run_jobs():
                log(f"recovery: cancelled this run's Slurm job(s) {', '.join(cancelled)} before resubmitting")
        book = incidents.IncidentFiler(run, on_incident, log)  # every fault an incident, docs/stability.md
        driver_mark(run_dir, "start", hb_env, t_entered=entered)  # the goodput ledger (docs/goodput.md)
        launch = Launch(run_dir, index_path, log, run, nodes, {**store_env, **hb_env}, book)
        try:
            result = train_with_restarts(launch, _first_state(cfg, run.record.attempts, nodes, carried))
        finally:
            driver_mark(run_dir, "end")
        run.finish("completed", result.final_step)
        return result


def _first_state(cfg: MegaConfig, attempt: int, nodes: Nodes, carried: dict | None) -> LoopState:
    """The loop's state before its first attempt: fresh, or as a requeued job's driver left it."""
    state = LoopState(cfg, attempt=attempt)
    if not carried:
        return state
    for host in carried["excluded_hosts"]:
        nodes.backend.exclude(host)
    return replace(
        state,
        failures=carried["failures"],
        requeues=carried["requeues"],
        history=tuple(carried["history"]),
        carried=tuple(carried["env"].items()),
    )


def _carried(state: LoopState, nodes: Nodes) -> dict:
    """What the next run of a requeued driver job continues with (``_first_state``)."""
    return {
        "config": mega_config.to_dict(rendezvous.without_secrets(state.cfg)),
        "failures": state.failures,
        "requeues": state.requeues,
        "history": list(state.history),
        "env": dict(state.carried),
        "excluded_hosts": list(getattr(nodes.backend, "excluded", [])),
    }


def _in_allocation(cfg: MegaConfig, index_path: Path, log: Callable[[str], None], **kwargs) -> TrainingResult:
    """launcher.slurm.driver=allocation: this loop runs in the run's own batch job, on its first
    node (mega.launch.slurm_driver); here, its result once the job ended."""
    try:
        r = slurm_driver.run_driver_job(cfg, index_path, log, **kwargs)
    except slurm_driver.DriverJobFailed as e:
        raise TrainingFailed(str(e)) from None
    if "error" in r:
        raise TrainingFailed(r["error"])
    run_dir = Path(cfg.train.run_dir)
    return TrainingResult(
        run_dir, r["attempts"], r["final_step"], read_metrics(run_dir), r["init"], r["history"]
    )


@dataclass(frozen=True)
class Launch:
    """What stays the same over one launch's attempts: the run, its nodes, the store's environment
    for the ranks, the incident book and where messages go."""

    run_dir: Path
    index_path: Path
    log: Callable[[str], None]
    run: runs.RunTracker
    nodes: Nodes  # the membership and the backend that starts it
    store_env: dict[str, str]  # rendezvous and heartbeat servers (mega.cluster.rendezvous, heartbeat_redis)
    book: incidents.IncidentFiler

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"


@dataclass(frozen=True)
class LoopState:
    """Where the restart loop stands before its next attempt: what each step hands the next."""

    cfg: MegaConfig  # the next attempt's config (after an eviction or a lost host: other or fewer nodes)
    attempt: int  # the next attempt's number over the run's life (its logs, store keys, MEGA_ATTEMPT)
    failures: int = 0  # attempts that ended short of train.steps: restart.max_restarts bounds them
    requeues: int = 0  # attempts ended by Slurm's signal: launcher.slurm.max_requeues bounds them
    history: tuple[dict, ...] = ()  # one row per attempt of this launch (TrainingResult.history)
    carried: tuple[tuple[str, str], ...] = ()  # environment the last attempt hands the next (its CPU peak)

    def noted(self, **fields) -> LoopState:
        """This state with ``fields`` added to the last attempt's history row."""
        return replace(self, history=(*self.history[:-1], {**self.history[-1], **fields}))


@dataclass
class Attempt:
    """One launched attempt: its number, config, job and heartbeat watcher."""

    number: int
    cfg: MegaConfig
    job: JobSpec
    watcher: Watcher
    progress: ProgressLog  # its steps in the driver's log, every train.log_interval


@dataclass
class Ended:
    """How an attempt ended: its outcome (narrowed to the culprits' nodes), the step it reached,
    the run's metrics and what its ranks restored (``init.json``)."""

    outcome: JobOutcome
    final_step: int
    metrics: list[dict]
    init: dict

    @property
    def restored(self) -> str | None:
        return self.init.get("restore", {}).get("checkpoint")


DONE, REQUEUE, RESTART = "done", "requeue", "restart"


def train_with_restarts(launch: Launch, state: LoopState) -> TrainingResult:
    """The restart loop: launch, watch, collect, then finish, requeue or restart (backoff first).
    Raises TrainingFailed when a budget is spent or the nodes cannot go on."""
    launch.nodes.check_spares(launch.log)  # beside the first attempt: a spare is checked before it trains
    state = check_allocation(launch, state)  # Slurm, the driver in its job: every node checked first
    while True:
        _keep_loop_state(launch, state)
        attempt = launch_attempt(launch, state)
        ended = collect_outcome(launch, attempt, watch_attempt(launch, attempt))
        state = counted(state, attempt, ended)
        step = verdict(ended, attempt.cfg)
        if step == DONE:
            return finish(launch, state, ended)
        if step == REQUEUE:
            state = requeue(launch, state, attempt, ended)
            continue
        state = prepare_restart(launch, state, attempt, ended)
        backoff(launch, state, attempt.number)


def _keep_loop_state(launch: Launch, state: LoopState) -> None:
    """In the run's Slurm allocation: the loop's state before each attempt, for the submitter to
    carry into a new job if this one loses the driver's node (mega.launch.slurm_driver)."""
    if slurm_steps.inside_allocation(state.cfg):
        path = slurm_steps.driver_dir(launch.run_dir) / slurm_steps.LOOP_FILE
        path.with_suffix(".tmp").write_text(json.dumps(_carried(state, launch.nodes), default=str))
        path.with_suffix(".tmp").replace(path)


def check_allocation(launch: Launch, state: LoopState) -> LoopState:
    """In the run's Slurm allocation (``launcher.slurm.selfcheck``): self-check every node of the
    job in a step of its own and go on without the unhealthy (mega.launch.slurm_preflight)."""
    cfg = state.cfg
    if not (slurm_steps.inside_allocation(cfg) and cfg.launcher.slurm.selfcheck):
        return state
    t0 = time.time()
    try:
        cfg, rows = slurm_preflight.check_allocation(cfg, launch.nodes.backend, launch.run_dir, launch.log)
    except membership.CannotContinue as e:  # the run keeps its last step (a requeued job's is not 0)
        launch.run.finish("failed", error=str(e))
        raise TrainingFailed(str(e)) from None
    finally:  # the goodput ledger's "selfcheck"
        driver_mark(launch.run_dir, "diagnose", seconds=time.time() - t0)
    if rows:
        launch.nodes.cfg = cfg
        launch.nodes.backend.resize(cfg)
        launch.run.record.evicted_nodes += rows
        launch.run.save()
    return replace(state, cfg=cfg)


def launch_attempt(launch: Launch, state: LoopState) -> Attempt:
    """Save the attempt's config (without secrets: the ranks get them by environment), note what
    they will restore, and build its job and watcher. The ranks restore ``latest`` of the durable
    store themselves (mega.checkpoint.restore) and write what they restored into init.json."""
    n, cfg, run, log = state.attempt, state.cfg, launch.run, launch.log
    c = cfg.cluster
    run.beat(attempts=n + 1)
    mega_config.save(rendezvous.without_secrets(cfg), launch.config_path)
    where = f" on {c.nodes} nodes ({c.procs_per_node} per node)" if c.nodes > 1 else ""
    try:
        latest = latest_durable(cfg) if cfg.checkpoint.load else None
    except StorageError as e:
        latest = None
        log(f"attempt {n}: checkpoint store: {e}")
    log(
        f"attempt {n}: launching {cfg.parallelism.world_size} ranks{where}"
        + (f"; `latest` is {latest}" if latest else "")
    )
    (launch.run_dir / "init.json").unlink(missing_ok=True)  # written anew by this attempt's rank 0
    env = {
        **launch.store_env,
        **dict(state.carried),
        rollback.SKIP_ENV: rollback.skip_env(run.record.skipped_steps),
    }
    job = training_job(cfg, launch.config_path, launch.index_path, n, env)
    watcher = Watcher(cfg, job.env, n, log)  # heartbeats: hang (ends the attempt) and straggler incidents
    driver_mark(launch.run_dir, "launch", attempt=n)
    launch.book.begin(n, job, cfg, watcher, lambda: _resume_step(cfg))
    progress = ProgressLog(launch.run_dir, cfg.train.log_interval, cfg.train.steps, log)
    return Attempt(n, cfg, job, watcher, progress)


def watch_attempt(launch: Launch, attempt: Attempt) -> JobOutcome:
    """Run the attempt's job on the nodes until it ends (mega.launch.watch.run_job): a node's agent
    exits, the metrics stall for ``stability.hang_timeout_s``, or the watcher sees a hang."""
    n = attempt.number
    return run_job(
        launch.nodes.backend,
        attempt.job,
        progress_file=launch.run_dir / METRICS_FILE,
        stall_timeout_s=attempt.cfg.stability.hang_timeout_s,
        on_poll=lambda: (
            launch.run.beat() or launch.book.poll() or attempt.progress.poll() or attempt.watcher.poll()
        ),
        on_failure=lambda o: launch.log(f"attempt {n}: {o.reason}; stopping every node"),
    )


def collect_outcome(launch: Launch, attempt: Attempt, outcome: JobOutcome) -> Ended:
    """After the nodes stopped: blame the culprit's node, drop the attempt's store keys, read what
    the ranks restored and reached, and close the watcher (its incidents go to the run record)."""
    n, nodes, log = attempt.number, attempt.cfg.cluster.nodes, launch.log
    # agents of a dead rank's peers may fail in the same poll: blame the culprit's node
    logs = {k: attempt.job.log_path(k, nodes) for k in range(nodes)}
    outcome = incidents.narrow_to_culprits(outcome, logs)
    driver_mark(
        launch.run_dir, "stopped", attempt=n, ok=outcome.ok, reason=outcome.reason, stop_s=outcome.stop_s
    )
    try:
        dropped = rendezvous.drop_attempt_keys(launch.store_env, n)
    except Exception as e:
        log(f"attempt {n}: could not drop its store keys ({type(e).__name__}); they expire by TTL")
    else:
        if dropped is not None:
            log(f"attempt {n}: dropped its {dropped} store keys")
    attempt.progress.poll()  # the rows written since the last poll: the last step's among them
    init = _read_init(launch.run_dir / "init.json")
    if (r := init.get("restore", {})).get("checkpoint"):
        refused = f" (refused {', '.join(x['name'] for x in r['refused'])})" if r.get("refused") else ""
        log(f"attempt {n}: resumed from {r['checkpoint']}, from {describe_source(r)}{refused}")
    metrics = read_metrics(launch.run_dir)
    final_step = metrics[-1]["step"] if metrics else 0
    launch.run.beat(final_step=final_step)
    attempt.watcher.close(launch.run, final_step, outcome.reason, lambda: _resume_step(attempt.cfg))
    return Ended(outcome, final_step, metrics, init)


def counted(state: LoopState, attempt: Attempt, ended: Ended) -> LoopState:
    """The state after ``attempt``: the next number, its history row, and the attempt counted
    against the failure budget unless Slurm's signal ended it (a requeue has a budget of its own)."""
    o = ended.outcome
    row = {
        "attempt": attempt.number,
        "code": o.code,
        "reason": o.reason,
        "failed_nodes": o.failed_nodes,
        "final_step": ended.final_step,
        "restored": ended.restored,
        "restored_from": restore_source(ended.init.get("restore", {})),  # memory-own/-peer, durable
        "elapsed_s": round(o.elapsed_s, 3),
        "stop_s": round(o.stop_s, 3),
    }
    done = ended.final_step >= attempt.cfg.train.steps
    failed = not (_preempted(o) or (o.ok and done))
    peak = rank_env.peak_flops_env(ended.init.get("peak_flops"), ended.init.get("world_size"))
    return replace(
        state,
        attempt=attempt.number + 1,
        failures=state.failures + failed,
        history=(*state.history, row),
        carried=tuple(peak.items()) or state.carried,  # an attempt that died before measuring: the last one's
    )


def verdict(ended: Ended, cfg: MegaConfig) -> str:
    """DONE: ``train.steps`` reached (also when Slurm's signal came late); REQUEUE: Slurm's signal
    ended it short (the ranks saved on the way out); RESTART: anything else."""
    if (ended.outcome.ok or _preempted(ended.outcome)) and ended.final_step >= cfg.train.steps:
        return DONE
    if _preempted(ended.outcome):
        return REQUEUE
    return RESTART


def finish(launch: Launch, state: LoopState, ended: Ended) -> TrainingResult:
    """``train.steps`` reached: file what is left (an incident the attempt recovered) and report;
    ``attempts`` counts every attempt but those Slurm's signal ended. The checks beside the run
    end first: a node set aside is evicted or a spare again in the record."""
    launch.book.end(ended.outcome, ended.final_step)
    state = settle_checks(launch, state)
    return TrainingResult(
        launch.run_dir, state.failures + 1, ended.final_step, ended.metrics, ended.init, list(state.history)
    )


def requeue(launch: Launch, state: LoopState, attempt: Attempt, ended: Ended) -> LoopState:
    """Slurm ended the attempt (time limit or preemption) after its ranks saved: resubmit (in the
    allocation: requeue the driver's job), up to ``launcher.slurm.max_requeues`` times. No incident:
    a scheduled end, not a fault."""
    state = replace(state, requeues=state.requeues + 1).noted(requeued=True)
    launch.run.save()
    limit = attempt.cfg.launcher.slurm.max_requeues
    launch.log(
        f"attempt {attempt.number}: signalled by Slurm (time limit or preemption); the ranks saved step "
        f"{ended.final_step}; requeue {state.requeues} of at most {limit}"
    )
    if state.requeues > limit:
        failed = TrainingFailed(f"requeued {state.requeues} times (launcher.slurm.max_requeues={limit})")
        launch.run.finish("failed", ended.final_step, error=str(failed))
        raise failed
    if slurm_steps.inside_allocation(attempt.cfg):  # the job itself goes back to the queue
        raise JobRequeued(_carried(state, launch.nodes))
    return state


def _roll_back_further(cfg: MegaConfig, run, request: dict, log, n: int) -> None:
    """A bad step right after the attempt's restore: `latest` holds the damage. Point `latest`
    at the checkpoint before it (the ranks remove the newer ones as they restore) and skip the
    batches in between (rollback.further_back)."""
    from mega.checkpoint.common import open_store

    store = open_store(cfg)
    try:
        target, steps = rollback.further_back(request, store.list_checkpoints())
        if target is not None:
            store.write_latest(target)
    except StorageError as e:
        log(f"attempt {n}: could not roll back past `latest` ({e}); relaunching from it")
        return
    if target is None:
        return
    why = f"rolled back past step {request['restored_step']}: {request['what']} right after restoring it"
    known = {row["step"] for row in run.record.skipped_steps}
    run.record.skipped_steps += [{**request, "step": s, "what": why} for s in steps if s not in known]
    log(f"attempt {n}: {why}; `latest` is now {target}, skipping steps {steps[0]}-{steps[-1]}")


def prepare_restart(launch: Launch, state: LoopState, attempt: Attempt, ended: Ended) -> LoopState:
    """After a failed attempt: the next membership (hosts Slurm lost, else a rollback's skipped
    batch, else a diagnosis that may evict nodes), the incidents filed, the run record written.
    Raises TrainingFailed once ``restart.max_restarts`` restarts are spent."""
    n, cfg, nodes, run, log = attempt.number, attempt.cfg, launch.nodes, launch.run, launch.log
    outcome, final_step = ended.outcome, ended.final_step
    if outcome.ok:  # every agent exited 0 short of train.steps: not a success
        outcome = JobOutcome(1, f"ended at step {final_step} of {cfg.train.steps}", [], outcome.exit_codes)
    log(
        f"attempt {n}: training {_short(outcome)} at step {final_step}; "
        f"logs: {_logs(attempt.job, cfg.cluster.nodes, outcome)}"
    )
    restarts_left = state.failures <= cfg.restart.max_restarts
    diagnosed = None
    lost = _exclude_lost_hosts(nodes, log, n)  # Slurm: hosts it holds down never come back in this run
    if lost:
        state = state.noted(excluded_hosts=lost)
    if (request := rollback.take(launch.run_dir, n)) is not None:  # a NaN/Inf step: skip its batch
        run.record.skipped_steps.append(request)
        state = state.noted(skipped_step=request["step"])
        log(
            f"attempt {n}: step {request['step']}: {request['what']}; rolling back to `latest` "
            "and skipping the step's batch"
        )
        _roll_back_further(cfg, run, request, log, n)
    elif not lost and restarts_left:  # lost hosts: Slurm gives other nodes (spares) or fewer, no check
        suspects = incidents.suspect_nodes(outcome, attempt.watcher.incidents)  # failed, hung
        if suspects and membership.diagnosis_enabled(cfg):
            state, diagnosed = diagnose(launch, state, n, suspects, outcome, final_step)
    launch.book.end(
        outcome, final_step, rollback=request, diagnosed=diagnosed, restarts_left=restarts_left
    )  # incidents/, run.json, on_incident
    run.record.membership = nodes.as_record()
    run.save()
    if not restarts_left:
        where = f"{launch.run_dir}/{'nodes/*/' if cfg.cluster.nodes > 1 else ''}train-attempt*.log"
        failed = TrainingFailed(
            f"training failed {state.failures} times (last: {outcome.reason}); see {where}"
        )
        run.finish("failed", final_step, error=str(failed))
        raise failed
    return replace(state, cfg=nodes.cfg)


def diagnose(
    launch: Launch, state: LoopState, n: int, suspects: list[int], outcome: JobOutcome, final_step: int
) -> tuple[LoopState, incidents.Diagnosed]:
    """A spare that passed its self-check in each suspected node's place at once, the suspects
    checked beside the next attempt (local backends, spares free: no verdict awaited, so no
    diagnosis now); else self-check the nodes now and evict the unhealthy (mega.launch.nodes).
    Raises TrainingFailed when the run cannot go on without them."""
    nodes, run = launch.nodes, launch.run
    t_diagnose = time.time()
    state = settle_checks(launch, state)
    if (
        swapped := nodes.swap_out(n, suspects, launch.log, lambda: _trained_after(launch.run_dir, n))
    ) is not None:
        driver_mark(launch.run_dir, "diagnose", attempt=n, seconds=time.time() - t_diagnose)
        return state.noted(set_aside=sorted(swapped.replaced)), None
    diagnosed = incidents.Diagnosed(list(suspects), list(nodes.members.nodes), nodes.cfg.parallelism.dp)
    try:
        evicted = nodes.diagnose(n, suspects, launch.log)
        driver_mark(launch.run_dir, "diagnose", attempt=n, seconds=time.time() - t_diagnose)
    except membership.CannotContinue as e:
        launch.book.end(outcome, final_step, diagnosed=diagnosed.failed(e), restarts_left=False)
        run.finish("failed", final_step, error=str(e))
        raise TrainingFailed(f"attempt {n}: {e}") from None
    run.record.evicted_nodes += evicted
    diagnosed.after(evicted, nodes.members.nodes, nodes.cfg.parallelism.dp)
    excluded = [e["host"] for e in evicted if e.get("host")]  # Slurm: their hosts, as for lost hosts
    return state.noted(
        evicted=[e["node"] for e in evicted], **({"excluded_hosts": excluded} if excluded else {})
    ), diagnosed


def settle_checks(launch: Launch, state: LoopState) -> LoopState:
    """The verdicts of the self-checks beside the run (mega.launch.aside_checks): evicted nodes
    into the run record, each an incident, and into the history row of the attempt that set
    them aside."""
    rows = launch.nodes.settle(launch.log)
    if not rows:
        return state
    launch.run.record.evicted_nodes += rows
    launch.run.record.membership = launch.nodes.as_record()
    launch.book.evicted_aside(rows)
    history = [
        {**h, "evicted": [r["node"] for r in rows if r["attempt"] == h["attempt"]]}
        if any(r["attempt"] == h["attempt"] for r in rows)
        else h
        for h in state.history
    ]
    launch.run.save()
    return replace(state, history=tuple(history))


def _trained_after(run_dir: Path, attempt: int) -> bool:
    """Whether an attempt after ``attempt`` logged a step (the tail of metrics.jsonl)."""
    from mega.stability.logscan import read_tail

    for line in read_tail(run_dir / METRICS_FILE, 16384).splitlines()[-8:]:
        with contextlib.suppress(ValueError):
            if json.loads(line).get("attempt", 0) > attempt:
                return True
    return False


def backoff(launch: Launch, state: LoopState, attempt: int) -> None:
    """Wait before the next attempt: ``restart.backoff_s``, doubling per failure."""
    seconds = state.cfg.restart.backoff_s * 2 ** (state.failures - 1)
    driver_mark(launch.run_dir, "backoff", attempt=attempt, seconds=seconds)
    time.sleep(seconds)


def _read_init(path: Path) -> dict:
    """What the attempt's rank 0 restored ({} before it wrote it, or when it died writing it)."""
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return {}


def _preempted(outcome: JobOutcome) -> bool:
    """Every node's ranks saved and exited on Slurm's signal (mega.launch.slurm.PREEMPTED)."""
    codes = outcome.exit_codes.values()
    return bool(codes) and all(c == PREEMPTED for c in codes)


def _exclude_lost_hosts(nodes: Nodes, log: Callable[[str], None], attempt: int) -> list[str]:
    """On Slurm: the attempt's hosts Slurm holds down go into ``--exclude`` of every later attempt;
    with fewer usable nodes than the run needs it shrinks to ``restart.min_nodes`` or more (DP
    shrinks), else the same size lands on a spare. Other backends: nothing ([])."""
    backend = nodes.backend
    if not hasattr(backend, "lost_hosts"):
        return []
    lost = backend.lost_hosts()
    for host in lost:
        backend.exclude(host)
    if not lost:
        return []
    c, min_nodes = nodes.cfg.cluster, nodes.cfg.restart.min_nodes
    usable = backend.usable_nodes()
    note = f"attempt {attempt}: Slurm holds {', '.join(lost)} down; excluded from every later attempt"
    if usable < c.nodes and min_nodes is not None and usable >= min_nodes:
        nodes.cfg = membership.resize(nodes.cfg, usable)
        backend.resize(nodes.cfg)
        note += f"; continuing on {usable} node(s), dp {nodes.cfg.parallelism.dp}"
    elif usable >= c.nodes:
        note += f"; {usable} usable node(s): the next attempt runs on a spare"
    log(note)
    return lost


def _durable_step(cfg: MegaConfig) -> int | None:
    """The step of the durable ``latest``, None when unknown."""
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
