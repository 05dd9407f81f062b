"""Run registry: each run directory says what its run should be doing, in ``run.json``.

The launcher (``mega.launch.run_training``) owns the record of the run it drives::

    state         training | completed | failed | stopped
    config        the resolved config (``<run_dir>/config.json``), data_index: the data index
    pid, host     the launcher process; heartbeat: unix time, refreshed while it watches its ranks
    attempts      torchrun attempts over the run's whole life (the next attempt's number)
    final_step    the last step logged when the record was last written
    recoveries    how many times recovery restarted the run
    flow_run_ids  the Prefect flow runs that drove it, first the pretrain one (opaque strings here)
    skipped_steps, evicted_nodes, membership  rollbacks and evictions (mega/stability)

A run **should be training but is not** when its state says ``training`` (or ``failed`` with
steps left, when recovery of failed runs is allowed) while its launcher is gone — its process
is dead on this host, or its heartbeat is older than ``stale_after_s`` — and ``train.steps`` is
not reached. ``find_runs_to_recover`` lists them; ``hold`` is the exclusive claim a launcher or a
recovery keeps on a run directory while it drives it (an ``flock`` on ``run.lock``, released by
the kernel when the holder dies, so a dead claimer never blocks a run).

Every write is atomic (temporary file, fsync, rename): a reader sees the old record or the new.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mega import procstat

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
STATES = ("training", "completed", "failed", "stopped")
HEARTBEAT_S = 5.0  # the launcher rewrites run.json at most this often while its ranks run


class RunRecordError(ValueError):
    """run.json is missing, torn or not a run record; the message names the file and the problem."""


class RunBusy(RuntimeError):
    """Another process holds the run directory (a live launcher or another recovery)."""


@dataclass
class RunRecord:
    run_dir: str
    state: str
    config: str
    data_index: str
    target_steps: int
    cwd: str  # relative paths in the config are relative to this directory
    pid: int
    host: str
    heartbeat: float
    started: float
    attempts: int = 0
    final_step: int = 0
    recoveries: int = 0
    flow_run_ids: list[str] = field(default_factory=list)
    error: str | None = None
    incidents: list[dict] = field(default_factory=list)  # mega.stability: every fault of the run (briefs)
    # mega/stability: steps rolled back from and skipped ({step, attempt, what, restored}), nodes
    # evicted ({node, attempt, reasons, replaced_by}) and the nodes of the last attempt
    skipped_steps: list[dict] = field(default_factory=list)
    evicted_nodes: list[dict] = field(default_factory=list)
    membership: dict | None = None

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / RUN_FILE


_FIELD_TYPES = {
    "run_dir": str,
    "state": str,
    "config": str,
    "data_index": str,
    "target_steps": int,
    "cwd": str,
    "pid": int,
    "host": str,
    "heartbeat": (int, float),
    "started": (int, float),
    "attempts": int,
    "final_step": int,
    "recoveries": int,
    "flow_run_ids": list,
}


def read_record(run_dir: str | Path) -> RunRecord:
    """The record of ``run_dir``; RunRecordError naming the file when it is absent or malformed."""
    path = Path(run_dir) / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunRecordError(f"{path}: no run record") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunRecordError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunRecordError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key, kind in _FIELD_TYPES.items():
        if key not in data:
            raise RunRecordError(f"{path}: missing field {key!r}")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise RunRecordError(f"{path}: field {key!r} has the wrong type ({data[key]!r})")
    if data["state"] not in STATES:
        raise RunRecordError(f"{path}: state {data['state']!r} is not one of {', '.join(STATES)}")
    known = {k: v for k, v in data.items() if k in RunRecord.__dataclass_fields__}
    # run.json may have been copied along with its directory: where it lies now is the truth
    known["run_dir"] = str(Path(run_dir).absolute())
    return RunRecord(**known)


def write_record(record: RunRecord) -> None:
    """Atomically replace ``run.json`` (a crash leaves the old record or the new, never a torn one)."""
    path = record.path
    tmp = path.with_name(f".{RUN_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(asdict(record), indent=2)  # before opening: a bad field leaves no debris
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The claim: one driver per run directory


_held: dict[str, list[int]] = {}  # lock path -> [fd, depth]; re-entrant within this process
_held_guard = threading.Lock()


@contextmanager
def hold(run_dir: str | Path, owner: str) -> Iterator[None]:
    """Exclusive claim on ``run_dir`` for the block; RunBusy when another process holds it.

    Re-entrant in one process: a recovery claims a run, then ``run_training`` (which claims it
    too, as every launcher does) runs inside that claim."""
    lock = str((Path(run_dir) / LOCK_FILE).absolute())
    with _held_guard:
        if lock in _held:
            _held[lock][1] += 1
        else:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunBusy(f"{run_dir} is held by another process ({holder})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{owner} pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            _held[lock] = [fd, 1]
    try:
        yield
    finally:
        with _held_guard:
            entry = _held[lock]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[lock]
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])


def held_elsewhere(run_dir: str | Path) -> bool:
    """Whether another process holds the claim on ``run_dir`` right now (a probe: it may change
    the next moment; ``hold`` is the guard)."""
    lock = Path(run_dir) / LOCK_FILE
    if str(lock.absolute()) in _held:
        return False  # this process holds it
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# The launcher's side


class RunTracker:
    """What ``run_training`` uses to keep its run's record: start, heartbeats, the end state."""

    def __init__(self, record: RunRecord, heartbeat_s: float = HEARTBEAT_S):
        self.record = record
        self.heartbeat_s = heartbeat_s

    def beat(self, final_step: int | None = None, attempts: int | None = None) -> None:
        """Refresh the heartbeat, at most every ``heartbeat_s`` unless a field changes."""
        now = time.time()
        changed = (final_step is not None and final_step != self.record.final_step) or (
            attempts is not None and attempts != self.record.attempts
        )
        if not changed and now - self.record.heartbeat < self.heartbeat_s:
            return
        if final_step is not None:
            self.record.final_step = final_step
        if attempts is not None:
            self.record.attempts = attempts
        self.record.heartbeat = now
        write_record(self.record)

    def save(self) -> None:
        """Write the record as it stands (after a change to its incidents, membership, ...)."""
        write_record(self.record)

    def finish(self, state: str, final_step: int | None = None, error: str | None = None) -> None:
        self.record.state = state
        self.record.error = error
        if final_step is not None:
            self.record.final_step = final_step
        self.record.heartbeat = time.time()
        write_record(self.record)


@contextmanager
def track(
    run_dir: str | Path,
    *,
    config: str | Path,
    data_index: str | Path,
    target_steps: int,
    flow_run_id: str | None = None,
    recovery: bool = False,
    claim: bool = True,
) -> Iterator[RunTracker]:
    """Claim ``run_dir`` and record it as training for the block.

    The previous record (if readable) carries over the attempt count and the flow runs, and the
    recovery count when this is a recovery. Leaving the block: normally the caller has called ``finish``; an ``Exception`` records
    ``failed`` with its message; Ctrl-C records ``stopped`` (an operator's choice, never
    recovered); any other exit (the process being terminated) leaves ``training``, so that
    recovery restarts the run once this process is gone. ``claim=False``: another process holds the
    claim for this one (the submitter of a Slurm job whose driver this is).
    """
    run_dir = Path(run_dir).absolute()
    with hold(run_dir, "recovery" if recovery else "launcher") if claim else contextlib.nullcontext():
        try:
            previous = read_record(run_dir)
        except RunRecordError:
            previous = None
        now = time.time()
        flow_runs = list(previous.flow_run_ids) if previous else []
        if flow_run_id and str(flow_run_id) not in flow_runs:
            flow_runs.append(str(flow_run_id))
        record = RunRecord(
            run_dir=str(run_dir),
            state="training",
            config=str(Path(config).absolute()),
            data_index=str(Path(data_index).absolute()),
            target_steps=target_steps,
            cwd=os.getcwd(),
            pid=os.getpid(),
            host=socket.gethostname(),
            heartbeat=now,
            started=now,
            attempts=previous.attempts if previous else 0,
            final_step=previous.final_step if previous else 0,
            # a launch by a person (not a recovery) gives the run a fresh recovery budget
            recoveries=(previous.recoveries if previous else 0) + 1 if recovery else 0,
            flow_run_ids=flow_runs,
            skipped_steps=previous.skipped_steps if previous else [],  # a recovery skips them too
            evicted_nodes=previous.evicted_nodes if previous else [],
            incidents=previous.incidents if previous else [],  # a recovery adds to the run's incidents
        )
        write_record(record)
        tracker = RunTracker(record)
        try:
            yield tracker
        except Exception as e:
            if record.state == "training":
                tracker.finish("failed", error=f"{type(e).__name__}: {e}")
            raise
        except KeyboardInterrupt:
            tracker.finish("stopped", error="interrupted")
            raise


# ---------------------------------------------------------------------------------------------
# Recovery's side


@dataclass
class RunStatus:
    """One run directory as recovery sees it."""

    run_dir: str
    verdict: str  # recover | alive | completed | stopped | finished | failed | exhausted | error
    reason: str
    record: RunRecord | None = None
    checkpoint: str | None = None  # the durable checkpoint `latest` names (None: none yet)
    checkpoint_step: int = 0
    orphans: list[int] = field(default_factory=list)  # pids of ranks left running by a dead launcher

    @property
    def recover(self) -> bool:
        return self.verdict == "recover"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = procstat.read(pid)
    return stat is None or stat.state != "Z"  # no stat to read (no /proc): kill(0) answered


def processes_of(config_path: str | Path) -> list[int]:
    """Pids on this host whose command line names ``config_path`` (torchrun and its ranks).

    Linux /proc only; elsewhere an empty list, and recovery relies on the heartbeat."""
    target = os.path.abspath(config_path)
    name = os.path.basename(target).encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = [a for a in (proc / "cmdline").read_bytes().split(b"\0") if a.endswith(name)]
            # a relative path on a command line is relative to that process's working directory
            if args and int(proc.name) != os.getpid():
                cwd = os.readlink(proc / "cwd")
                if any(os.path.abspath(os.path.join(cwd, a.decode())) == target for a in args) and pid_alive(
                    int(proc.name)
                ):
                    pids.append(int(proc.name))
        except (OSError, UnicodeDecodeError):
            continue
    return sorted(pids)


def stop_processes(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(pid_alive(p) for p in pids):
            return


def run_config(record: RunRecord):
    """The run's config with its relative paths anchored where the launcher ran."""
    from mega import config as mega_config

    cfg = mega_config.load(record.config)
    base = Path(record.cwd)

    def anchored(p: str | None) -> str | None:
        return p if p is None or "://" in p or Path(p).is_absolute() else str(base / p)

    cfg.train.run_dir = anchored(cfg.train.run_dir)
    cfg.checkpoint.dir = anchored(cfg.checkpoint.dir)
    cfg.checkpoint.staging_dir = anchored(cfg.checkpoint.staging_dir)
    cfg.checkpoint.storage_uri = anchored(cfg.checkpoint.storage_uri)
    cfg.data.cache_dir = anchored(cfg.data.cache_dir)
    return cfg


def checkpoint_step(name: str | None) -> int:
    """``iter_0000025`` -> 25 (0 for no checkpoint)."""
    return int(name.rsplit("_", 1)[1]) if name else 0


def inspect_run(
    run_dir: str | Path,
    stale_after_s: float,
    *,
    include_failed: bool = True,
    max_recoveries: int = 3,
    now: float | None = None,
) -> RunStatus:
    """Decide whether one run directory should be training but is not. Never raises for a bad
    record or config: those come back as verdict ``error`` with the reason."""
    from mega.checkpoint import latest_durable
    from mega.metrics import read_metrics

    run_dir = str(Path(run_dir).absolute())
    now = time.time() if now is None else now
    try:
        record = read_record(run_dir)
    except RunRecordError as e:
        return RunStatus(run_dir, "error", str(e))
    if record.state in ("completed", "stopped"):
        return RunStatus(run_dir, record.state, f"state {record.state}", record)
    if record.state == "failed" and not include_failed:
        return RunStatus(
            run_dir, "failed", f"failed ({record.error}); recovery of failed runs is off", record
        )
    if record.recoveries >= max_recoveries:
        return RunStatus(
            run_dir,
            "exhausted",
            f"already recovered {record.recoveries} times (max_recoveries={max_recoveries})",
            record,
        )

    here = record.host == socket.gethostname()
    age = now - record.heartbeat
    launcher_alive = age < stale_after_s and (not here or pid_alive(record.pid))
    if record.state == "training" and (launcher_alive or held_elsewhere(run_dir)):
        return RunStatus(
            run_dir, "alive", f"launcher pid {record.pid} on {record.host}, heartbeat {age:.0f} s ago", record
        )

    try:
        cfg = run_config(record)
        name = latest_durable(cfg) if cfg.checkpoint.load else None
    except Exception as e:  # a config or store that cannot be read: report it, scan on
        return RunStatus(run_dir, "error", f"{type(e).__name__}: {e}", record)
    step = checkpoint_step(name)
    metrics = read_metrics(run_dir) if cfg.checkpoint.interval == 0 else []
    # With checkpoints on, done means the final checkpoint is durable (the ranks save one at
    # train.steps); without them, that the last step was logged.
    done = (step if cfg.checkpoint.interval else (metrics[-1]["step"] if metrics else 0)) >= cfg.train.steps
    status = RunStatus(run_dir, "recover", "", record, name, step)
    if done:
        status.verdict, status.reason = (
            "finished",
            f"train.steps={cfg.train.steps} reached ({name or 'no checkpoint'})",
        )
        return status
    if record.state == "failed":
        status.reason = f"failed at step {record.final_step} ({record.error})"
    elif here and not pid_alive(record.pid):
        status.reason = f"launcher pid {record.pid} is gone"
    else:
        status.reason = f"heartbeat {age:.0f} s old (stale after {stale_after_s:.0f} s)"
    if here:
        status.orphans = processes_of(record.config)
        if status.orphans:
            status.reason += f"; {len(status.orphans)} rank process(es) left running will be stopped"
    return status


def mark_finished(run_dir: str | Path) -> None:
    """Record ``completed`` for a run whose launcher died after its final checkpoint was durable."""
    with hold(run_dir, "recovery"):
        record = read_record(run_dir)
        record.state, record.error = "completed", None
        record.final_step = max(record.final_step, record.target_steps)
        write_record(record)


def run_dirs(runs_root: str | Path) -> list[Path]:
    """Every directory at or under ``runs_root`` that holds a run record."""
    root = Path(runs_root)
    if not root.exists():
        return []
    found = [root] if (root / RUN_FILE).exists() else []
    found += sorted(p.parent for p in root.rglob(RUN_FILE) if p.parent != root)
    return found


def scan_runs(runs_root: str | Path, stale_after_s: float, **kwargs) -> list[RunStatus]:
    """The verdict on every run under ``runs_root`` (see ``inspect_run``)."""
    return [inspect_run(d, stale_after_s, **kwargs) for d in run_dirs(runs_root)]


def find_runs_to_recover(runs_root: str | Path, stale_after_s: float, **kwargs) -> list[RunStatus]:
    """Runs that should be training but are not (state training or failed with steps left,
    launcher gone or heartbeat stale, ``train.steps`` not reached)."""
    return [s for s in scan_runs(runs_root, stale_after_s, **kwargs) if s.recover]


def find_run_of_flow_run(runs_root: str | Path, flow_run_id: str) -> Path | None:
    """The run directory a (pretrain) flow run drove, from the flow run ids in the records."""
    for d in run_dirs(runs_root):
        try:
            if flow_run_id in read_record(d).flow_run_ids:
                return d
        except RunRecordError:
            continue
    return None
