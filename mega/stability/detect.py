"""The driver's watcher: reads every rank's heartbeat each poll of the job and turns them into
incidents (mega.stability.incident).

* **hang**: no rank's step advanced, and no rank computed, for ``stability.progress_factor`` x
  the median step time, at least ``stability.min_hang_s`` (plus the store's wait bound,
  ``CheckpointConfig.store_wait_bound_s``, while a rank saves), at most
  ``stability.hang_timeout_s``; or, sooner, no step for ``silent_after_s`` when one rank's
  heartbeat stopped while a peer still beats (a stopped or dead process: its heartbeat thread
  cannot run). "Computed": a rank trained on CPU whose training thread used CPU between two
  beats (``train_cpu_s``) is slow, not hung, however long its step takes on a loaded machine; a
  hung rank (deadlocked, sleeping, stopped) and the peers waiting on it in a collective use
  none. On a GPU a synchronisation may spin the CPU while the device is stuck, so there only
  steps count.
  Counted from the first step seen. Before it (the ranks beat from the end of group creation,
  through the restore) only a stopped or dead rank is a hang: one silent, or one that never beat,
  while its peers beat (``_startup_hang``): for ``silent_after_s`` when its node's warm client
  reports its process not running (mega.stability.liveness), else for ``stability.min_hang_s``;
  a slow restore is bounded by the ranks' own timeouts. ``localise`` names the culprit; ``poll``
  returns the reason, and the driver stops the attempt and relaunches from ``latest``.
* **straggler**: a rank whose compute time per step is above ``stability.straggler_factor`` x its
  peers' median for ``stability.straggler_beats`` steps in a row: reported once per rank and
  attempt, no restart.

* **store**: the heartbeat Redis does not answer for longer than ``2 x stability.heartbeat_s``
  (at least 4 socket timeouts). While it is out, and until every rank seen before has beaten
  again, the watcher is blind: no hang is declared from stale heartbeats and they are no straggler
  evidence (``stability.hang_timeout_s``'s stall check on metrics.jsonl still bounds a real hang).
  Once Redis answers, a rank has beaten again when a beat stamped after the watcher's last failed
  read is read. When every rank has (or ``resume_after_s`` after Redis answered without some: then
  those are silent and hang detection takes over), or when the attempt ends, the outage is one
  incident, action "reported", with each rank's delay: training never waits on Redis.

At ``close`` the watcher writes ``heartbeats-attempt<n>.json`` (per rank: heartbeats sent and
dropped, the heartbeat thread's CPU and wall time: the heartbeat's overhead).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from mega.stability import heartbeat_redis, liveness
from mega.stability.incident import Incident
from mega.stability.localise import localise

SUMMARY = "heartbeats-attempt{attempt}.json"  # <run_dir>/..., written by Watcher.close
# Training-thread CPU per wall second that counts as computing: a thread blocked in a collective or
# a sleep uses ~0; a computing one gets its share of the cores (2% on 2 cores at load 100).
BUSY_FRACTION = 0.005


def hang_threshold_s(step_times: list[float], progress_factor: float, min_s: float, max_s: float) -> float:
    """How long without any step before a hang: k x the median step time, within [min_s, max_s]."""
    k = progress_factor * statistics.median(step_times) if step_times else 0.0
    return min(max(k, min_s), max_s)


def stragglers(
    compute: dict[int, dict[int, float]], factor: float, beats: int, stage: dict[int, int] | None = None
) -> dict[int, list[float]]:
    """Ranks slow in each of the last ``beats`` steps seen: rank -> its ratio to the peers' median
    per step. ``compute``: step -> rank -> compute seconds of that step. ``stage``: rank -> pipeline
    stage; peers are the ranks of the same stage (same layers, same work) when any was seen."""
    stage = stage or {}
    steps = sorted(s for s, row in compute.items() if len(row) >= 2)[-beats:]
    if len(steps) < beats:
        return {}
    ratios: dict[int, list[float]] = {}
    for s in steps:
        row = compute[s]
        for r, t in row.items():
            others = {q: v for q, v in row.items() if q != r}
            same = [v for q, v in others.items() if stage.get(q) == stage.get(r)]
            peers = statistics.median(same or others.values())
            ratios.setdefault(r, []).append(t / peers if peers > 0 else 0.0)
    return {r: v for r, v in ratios.items() if len(v) == beats and min(v) > factor}


class Watcher:
    """One attempt's watcher. ``poll()`` each poll of the job: the reason to stop it, or None."""

    def __init__(
        self,
        cfg,
        hb_env: dict[str, str],
        attempt: int,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg, self.attempt, self.log, self.clock = cfg, attempt, log, clock
        self.s = cfg.stability
        self.world = cfg.parallelism.world_size
        self.client, self.prefix = heartbeat_redis.client_from_env(hb_env)
        self.client_url = hb_env.get(heartbeat_redis.URL_ENV, "")
        self.identities: dict[int, dict] = {}
        self.beats: dict[int, dict] = {}  # latest heartbeat seen per rank (kept after its key expires)
        self.procs: dict[int, dict] = {}  # latest process state per rank from its node (liveness)
        self.step_times: list[float] = []
        self.compute: dict[int, dict[int, float]] = {}  # step -> rank -> compute_s
        self.max_step: int | None = None
        self.last_progress: float | None = None  # when the step last advanced
        self.first_beat: float | None = None  # when a beat of this attempt was first seen
        self.last_work: float | None = None  # when a rank was last seen computing (train_cpu_s)
        self.cpu_seen: dict[int, tuple[float, float]] = {}  # rank -> (beat time, train_cpu_s)
        self.next_read = 0.0
        self.read_errors = 0
        self.incidents: list[Incident] = []
        self.straggling: set[int] = set()
        self.silent_after_s = max(3 * self.s.heartbeat_s, 2 * heartbeat_redis.TIMEOUT_S + self.s.heartbeat_s)
        # the store: reads failing for outage_after_s is an outage (a single slow read is not)
        self.outage_after_s = max(2 * self.s.heartbeat_s, 4 * heartbeat_redis.TIMEOUT_S)
        # ...and once it answers again, a rank's beat is due within resume_after_s: a punctual rank
        # learns it at its next tick (a heartbeat after its timed-out call) and gets its identity and
        # its beat through (a timeout each at most); any rank may be silent_after_s later than that
        self.resume_after_s = self.s.heartbeat_s + 3 * heartbeat_redis.TIMEOUT_S + self.silent_after_s
        self.failing_since: float | None = None  # first failed read of the current run of failures
        self.failing_errors = 0  # read_errors before it
        self.outage: dict | None = None  # open: started, answered (first good read), ranks, errors0

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def poll(self) -> str | None:
        if not self.enabled:
            return None
        now = self.clock()
        if now < self.next_read:
            return None
        self.next_read = now + self.s.heartbeat_s / 2
        ok = self._read()
        self._store(now, ok)
        if not ok:
            return None
        self._progress(now)
        if self.outage is not None:  # blind until every rank beats again: stale beats prove nothing
            return None
        self._stragglers(now)
        return self._hang(now)

    def _read(self) -> bool:
        import redis

        ranks = range(self.world)
        try:
            if len(self.identities) < self.world:
                ids = self.client.mget([heartbeat_redis.id_key(self.prefix, self.attempt, r) for r in ranks])
                self.identities.update({r: json.loads(v) for r, v in zip(ranks, ids) if v})
            values = self.client.mget([heartbeat_redis.beat_key(self.prefix, self.attempt, r) for r in ranks])
            procs = self.client.mget([heartbeat_redis.proc_key(self.prefix, self.attempt, r) for r in ranks])
        except (redis.RedisError, OSError):
            self.read_errors += 1
            return False
        for r, v, p in zip(ranks, values, procs):
            if v:
                self.beats[r] = json.loads(v)
            if p:
                self.procs[r] = json.loads(p)
        return True

    # -- the store ------------------------------------------------------------------------------

    def _store(self, now: float, ok: bool) -> None:
        """Opens, follows and ends a heartbeat Redis outage from this read's outcome."""
        o = self.outage
        if not ok:
            if self.failing_since is None:
                self.failing_since, self.failing_errors = now, self.read_errors - 1
            if o is None and now - self.failing_since >= self.outage_after_s:
                self.outage = {
                    "started": self.failing_since,
                    "answered": None,
                    "failed": now,  # the last failed read: a beat stamped after it was sent after the outage
                    "ranks": sorted(self.beats),
                    "errors0": self.failing_errors,
                    # rank -> its first fresh beat's stamp from Redis answering the watcher, in
                    # seconds (negative: it got through before the watcher's first good read)
                    "back": {},
                }
                self.log(
                    f"attempt {self.attempt}: heartbeat Redis {self._url()} not answering for "
                    f"{now - self.failing_since:.1f} s: store outage; hang detection suspended, "
                    "training goes on"
                )
            elif o is not None:
                # failing again before the ranks were back: the same outage
                o["answered"], o["failed"], o["back"] = None, now, {}
            return
        self.failing_since = None
        if o is None:
            return
        if o["answered"] is None:
            o["answered"] = now
            self.log(
                f"attempt {self.attempt}: heartbeat Redis answers again after "
                f"{now - o['started']:.1f} s; waiting for every rank's heartbeat"
            )
        for r in self._fresh(o):
            o["back"].setdefault(r, round(self.beats[r]["time"] - o["answered"], 3))
        if not self._stale(o):
            self._end_outage(now, resumed=True)
        elif now - o["answered"] > self.resume_after_s:  # those still quiet are silent: hang detection's
            self._end_outage(now, resumed=False)

    def _fresh(self, o: dict) -> list[int]:
        """Ranks with a heartbeat stamped after the watcher's last failed read, read since Redis answered.
        Not before: a write sent to a stopped Redis may still land when it resumes, with its stale stamp."""
        if o["answered"] is None:
            return []
        return sorted(r for r in o["ranks"] if self.beats.get(r, {}).get("time", float("-inf")) > o["failed"])

    def _stale(self, o: dict) -> list[int]:
        return sorted(set(o["ranks"]) - set(self._fresh(o)))

    def _url(self) -> str:
        from mega.store.redis_server import redact_url

        return redact_url(self.client_url)

    def _end_outage(self, now: float, resumed: bool) -> None:
        o, self.outage = self.outage, None
        outage_s = (o["answered"] if o["answered"] is not None else now) - o["started"]
        fresh, stale = self._fresh(o), self._stale(o)
        evidence = {
            "outage_s": round(outage_s, 3),
            "read_errors": self.read_errors - o["errors0"],
            "resumed": resumed,
            "ranks_resumed": fresh,
            "ranks_not_resumed": stale,
            "resumed_after_s": {r: o["back"][r] for r in sorted(o["back"])},
            "answering": o["answered"] is not None,
            "dropped": {r: b.get("dropped") for r, b in sorted(self.beats.items())},
        }
        if resumed:
            last = max(o["back"].values(), default=0.0)
            how = f"heartbeats resumed from all {len(fresh)} rank(s), the last at {last:+.1f} s from it answering"
        elif o["answered"] is None:
            how = "still not answering when the attempt ended"
        else:
            how = f"no heartbeat since from rank(s) {stale}"
        summary = (
            f"heartbeat Redis {self._url()} did not answer for {outage_s:.1f} s "
            f"({evidence['read_errors']} failed reads); {how}; training went on"
        )
        self.incidents.append(
            Incident(
                "store",
                self.attempt,
                now,
                summary,
                {"store": self._url()},
                evidence,
                "reported",
                time_to_detect_s=self.outage_after_s,
            )
        )
        self.log(f"attempt {self.attempt}: store: {summary}")

    # -- progress, hangs, stragglers -------------------------------------------------------------

    def _progress(self, now: float) -> None:
        if self.first_beat is None and self.beats:
            self.first_beat = now
        for r, b in self.beats.items():
            step = b.get("step")
            if step is None:
                continue
            if b.get("compute_s") is not None:
                self.compute.setdefault(step, {})[r] = b["compute_s"]
            if self.max_step is None or step > self.max_step:
                if self.max_step is not None and b.get("step_s"):
                    self.step_times.append(b["step_s"])
                self.max_step, self.last_progress = step, now
        if self._computing():
            self.last_work = now

    def _computing(self) -> list[int]:
        """CPU-trained ranks whose training thread used at least ``BUSY_FRACTION`` of a core
        between their last two beats seen (each pair of beats counted once)."""
        out = []
        for r, b in self.beats.items():
            t, cpu = b.get("time"), b.get("train_cpu_s")
            if t is None or cpu is None or b.get("device_mb") is not None:
                continue
            prev = self.cpu_seen.get(r)
            if prev is not None and t <= prev[0]:
                continue  # no new beat since the last read
            self.cpu_seen[r] = (t, cpu)
            if prev is not None and cpu - prev[1] >= BUSY_FRACTION * (t - prev[0]):
                out.append(r)
        return out

    def threshold_s(self) -> float:
        limit = hang_threshold_s(
            self.step_times[-50:],
            self.s.progress_factor,
            self.s.min_hang_s,
            self.s.hang_timeout_s,
        )
        if any(b.get("phase") == "checkpoint" for b in self.beats.values()):
            # a save blocks the step while it waits for a store that does not answer, by design
            # (synchronous saves, the wait for the previous upload): up to upload_timeout_s and the
            # S3 request under way then (store_wait_bound_s); not a hang until that is over too
            limit = min(limit + self.cfg.checkpoint.store_wait_bound_s(), self.s.hang_timeout_s)
        return limit

    def _hang(self, now: float) -> str | None:
        if any(i.kind == "hang" for i in self.incidents):
            return None
        if self.last_progress is None:
            return self._startup_hang(now)
        if any(b.get("closed") for b in self.beats.values()):
            # a rank finished its training loop (its last beat): no more steps will come; the
            # teardown is bounded by the launcher (stability.hang_timeout_s, the job's exit)
            return None
        stalled = now - self.last_progress
        limit = self.threshold_s()
        if self._silent_amid_beating(now):  # a frozen or dead rank: no need to wait out the step-time rule
            limit, idle = min(limit, self.silent_after_s), stalled
        else:  # a rank still computing is slow, not hung
            idle = now - max(self.last_progress, self.last_work or self.last_progress)
        # at the cap, stability.hang_timeout_s's own stall check (metrics.jsonl) ends the attempt, and
        # close() localises it then: one verdict per hang, never two racing
        if idle <= limit or limit >= self.s.hang_timeout_s:
            return None
        return self._declare_hang(now, stalled, limit)

    def _startup_hang(self, now: float) -> str | None:
        """Before the first step: a rank stopped or dead while its peers beat (they wait for it in
        a collective of the set-up or the restore until their process group's timeout, minutes):
        silent, or never beaten, while its peers beat. For ``silent_after_s`` when its node reports
        its process not running (mega.stability.liveness: no CPU at all, stopped or dead);
        otherwise for ``min_hang_s``: a rank's first seconds (its heartbeat's first connection, the
        set-up's work holding the GIL on a loaded host) may leave a gap of a few beats that is no
        hang."""
        if self.first_beat is None:
            return None
        stalled = now - self.first_beat
        peers_beat = any(now - b.get("time", now) <= self.s.heartbeat_s for b in self.beats.values())
        never = [r for r in range(self.world) if r not in self.beats]
        stopped = [
            r for r in self._silent(now) if liveness.not_running(self.procs.get(r), now, self.s.heartbeat_s)
        ]
        if stopped and peers_beat and stalled > self.silent_after_s:
            limit = self.silent_after_s
            return self._declare_hang(now, stalled, limit, never=[r for r in never if r in stopped] or None)
        if self._silent_amid_beating(now, after_s=self.s.min_hang_s):
            return self._declare_hang(now, stalled, self.s.min_hang_s)
        if never and stalled > self.s.min_hang_s and peers_beat:
            return self._declare_hang(now, stalled, self.s.min_hang_s, never=never)
        return None

    def _silent(self, now: float) -> list[int]:
        """Ranks not beaten within ``silent_after_s``, or never, whose training loop is not done."""
        last = self.cfg.train.steps
        done = {r for r, b in self.beats.items() if b.get("closed") or (b.get("step") or 0) >= last}
        return [
            r
            for r in range(self.world)
            if r not in done and now - self.beats.get(r, {}).get("time", float("-inf")) > self.silent_after_s
        ]

    def _silent_amid_beating(self, now: float, after_s: float | None = None) -> bool:
        """Some rank's heartbeat stopped (none for ``silent_after_s``) while another beat within
        ``heartbeat_s``: that process is stopped or gone (its heartbeat thread cannot run), not
        slow; the machine and the store are fine (its peers beat). A rank whose last beat shows
        its training loop done (``closed``, or the last step) may end before its peers (closing
        phase): its silence is no hang."""
        last = self.cfg.train.steps
        live = [b for b in self.beats.values() if not b.get("closed") and (b.get("step") or 0) < last]
        ages = [now - b.get("time", now) for b in live]
        after_s = self.silent_after_s if after_s is None else max(after_s, self.silent_after_s)
        return len(ages) > 1 and max(ages) > after_s and min(ages) <= self.s.heartbeat_s

    def _declare_hang(
        self,
        now: float,
        stalled: float,
        limit: float,
        silence_ref: float | None = None,
        never: list[int] | None = None,
    ) -> str:
        """``never``: ranks that never beat (before the first step; no identity to localise)."""
        culprit = localise(self.identities, self.beats, silence_ref or now, self.silent_after_s)
        evidence = {
            "last_step": self.max_step,
            "never_beat": never or [],
            "stalled_s": round(stalled, 3),
            "threshold_s": round(limit, 3),
            "median_step_s": statistics.median(self.step_times) if self.step_times else None,
            "silent_after_s": self.silent_after_s,
            "computed_s_ago": None if self.last_work is None else round(now - self.last_work, 3),
            "read_errors": self.read_errors,
            # the silent ranks' process state as their nodes saw it (mega.stability.liveness)
            "processes": {r: self.procs[r] for r in self._silent(now) if r in self.procs},
            "ranks": {
                r: {
                    "age_s": round(now - b["time"], 3),
                    "step": b.get("step"),
                    "phase": b.get("phase"),
                    "doing": b.get("doing"),
                    "seq": b.get("seq"),
                    "train_cpu_s": b.get("train_cpu_s"),
                }
                for r, b in sorted(self.beats.items())
            },
        }
        where = f"after step {self.max_step}" if self.max_step is not None else "before the first step"
        summary = f"no step for {stalled:.1f} s {where} (threshold {limit:.1f} s); " + (
            f"rank(s) {', '.join(map(str, never))} never beat"
            if never
            else culprit.describe()
            if culprit
            else "culprit not found"
        )
        self.incidents.append(
            Incident(
                "hang",
                self.attempt,
                now,
                summary,
                culprit.to_dict() if culprit else None,
                evidence,
                "relaunch from latest",
                time_to_detect_s=stalled,
            )
        )
        self.log(f"attempt {self.attempt}: hang: {summary}")
        return f"hung: {summary}"

    def _stragglers(self, now: float) -> None:
        slow = stragglers(
            self.compute,
            self.s.straggler_factor,
            self.s.straggler_beats,
            {r: i.get("pp") for r, i in self.identities.items()},
        )
        for r, ratios in sorted(slow.items()):
            if r in self.straggling or r not in self.identities:
                continue
            self.straggling.add(r)
            ident = self.identities[r]
            culprit = {
                "rank": r,
                "node": ident.get("node"),
                "host": ident.get("host"),
                "coords": {k: ident.get(k) for k in ("tp", "pp", "dp")},
                "reason": "slow",
                "group": None,
                "group_ranks": [],
            }
            summary = (
                f"rank {r} (node {ident.get('node')}) computes {min(ratios):.1f}-{max(ratios):.1f}x "
                f"its peers' median over {len(ratios)} steps"
            )
            steps = sorted(self.compute)[-len(ratios) :]
            self.incidents.append(
                Incident(
                    "straggler",
                    self.attempt,
                    now,
                    summary,
                    culprit,
                    {"ratios": ratios, "steps": steps, "compute_s": {s: self.compute[s] for s in steps}},
                    "reported",
                )
            )
            self.log(f"attempt {self.attempt}: straggler: {summary}")

    def close(self, run, final_step: int, reason: str, resumed_step: Callable[[], int | None]) -> list:
        """Write this attempt's incidents to the run directory and the run record; drop the
        attempt's keys. ``reason``: how the attempt ended (a hang seen by the launcher's own stall
        check is localised here); ``resumed_step()``: the step a relaunch resumes from (steps lost)."""
        now = self.clock()
        if self.enabled:  # the ranks are stopped by now: their last beats (heartbeat.close sends one)
            self._store(now, self._read())
            if self.outage is not None:
                self._end_outage(now, resumed=False)
        if reason.startswith("hung") and self.enabled and not any(i.kind == "hang" for i in self.incidents):
            # silence counts against the freshest heartbeat
            fresh = max((b.get("time", 0) for b in self.beats.values()), default=now)
            self._declare_hang(now, now - (self.last_progress or now), self.threshold_s(), silence_ref=fresh)
        resumed = resumed_step() if self.incidents else None
        for inc in self.incidents:
            if inc.kind == "hang" and resumed is not None:
                inc.steps_lost = max(0, final_step - resumed)
            path = inc.write(run.record.run_dir)
            run.record.incidents.append(inc.brief(path))
        if self.incidents:
            run.save()
        if self.enabled:
            self.write_summary(run.record.run_dir)
            try:
                keys = list(self.client.scan_iter(f"{self.prefix}:{self.attempt}:*", count=1000))
                if keys:
                    self.client.delete(*keys)
            except Exception:
                pass
            self.client.close()
        return self.incidents

    def summary(self) -> dict:
        """Per rank, from its last heartbeat read: beats sent and dropped, the heartbeat thread's
        CPU time and how long it ran (``cpu_s / wall_s``: the heartbeat's overhead)."""
        return {
            "attempt": self.attempt,
            "heartbeat_s": float(self.s.heartbeat_s),
            "read_errors": self.read_errors,
            "ranks": {
                str(r): {
                    "sent": b.get("sent", 0),
                    "dropped": b.get("dropped", 0),
                    "cpu_s": b.get("cpu_s", 0.0),
                    "wall_s": b.get("up_s", 0.0),
                }
                for r, b in sorted(self.beats.items())
            },
        }

    def write_summary(self, run_dir) -> Path:
        path = Path(run_dir) / SUMMARY.format(attempt=self.attempt)
        path.write_text(json.dumps(self.summary(), indent=1))
        return path
