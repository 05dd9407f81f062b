"""A training rank's observability for one run: recorder, clocks, wrappers, GC control, profiler.

``Session.start(cfg)`` runs once per rank after the process groups and the model exist (the
wrappers classify collectives by megatron's groups); the loop then calls ``begin_step``,
``end_step`` (the metrics row's fields), ``after_step`` (controlled GC, profiler window) and
``close``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from mega import faults, rank_env
from mega.obs import clock as obs_clock
from mega.obs import gc_control
from mega.obs.recorder import Recorder


def rank_identity() -> dict:
    """Where this rank sits: node (torchrun's GROUP_RANK), global/local rank, TP/PP/DP/VPP
    coordinates from megatron's parallel_state, host and pid; ``label`` names its trace process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank, node = dist.get_rank(), int(os.environ.get("GROUP_RANK", "0"))
    tp, pp, dp = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "node": node,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_size": ps.get_data_parallel_world_size(),
        "vpp_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "label": f"node {node} / rank {rank} (tp {tp}, pp {pp}, dp {dp})",
    }


class PostExchange:
    """The pipeline group's p2p post times of a step: one all-gather of a fixed-size int64 table
    ``(op, sender, receiver, seq, aligned post ns)`` over the PP group (CPU tensors on gloo; the
    group's device on NCCL). ``post`` issues it asynchronously as soon as the schedule is done
    (the p2p of the step are over), ``collect`` waits for it at the end of the step, when it has
    long completed behind the optimizer step."""

    OPS = {"send": 1, "recv": 2}

    def __init__(self, group, capacity: int, device):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.group = group
        self.capacity = capacity
        self.device = device
        # the bare collective: this exchange is the recorder's own traffic, not training's
        fn = dist.all_gather
        self.all_gather = getattr(fn, "__wrapped__", fn)
        self.size = group.size()
        self.warned = False

    def post(self, mine: list):
        torch = self.torch
        rows = [[self.OPS[op], sender, receiver, seq, post] for (op, sender, receiver, seq), post in mine]
        if len(rows) > self.capacity and not self.warned:
            # cannot happen with megatron's schedules (4 per microbatch and chunk): say so if it does
            self.warned = True
            print(
                f"[mega.obs] {len(rows)} p2p operations in a step, more than {self.capacity}: the rest "
                "count as whole waits",
                file=sys.stderr,
            )
        rows = rows[: self.capacity] + [[0] * 5] * (self.capacity - len(rows))
        table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        tables = [torch.empty_like(table) for _ in range(self.size)]
        return tables, self.all_gather(tables, table, group=self.group, async_op=True)

    def collect(self, pending) -> dict:
        tables, work = pending
        work.wait()
        names = {v: k for k, v in self.OPS.items()}
        return {
            (names[row[0]], row[1], row[2], row[3]): row[4]
            for row in self.torch.cat(tables).cpu().tolist()
            if row[0]
        }


class StepProfiler:
    """``train.profile_steps = [first, last]``: torch.profiler over those steps (1-based, as the
    metrics count them), one Chrome trace per rank in ``<run_dir>/profile/``."""

    def __init__(self, steps: list[int] | None, run_dir: Path, rank: int, cuda: bool):
        self.first, self.last = steps or (0, -1)
        self.path = Path(run_dir) / "profile" / f"rank-{rank:05d}.json"
        self.cuda = cuda
        self._prof = None

    def begin(self, done_before: int) -> None:
        if self.first and done_before + 1 == self.first:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def end(self, done: int) -> None:
        if self._prof is not None and done == self.last:
            self._prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.path))
            self._prof = None


class Session:
    def __init__(self, rec: Recorder, gc: gc_control.GarbageCollection, profiler: StepProfiler):
        self.rec, self.gc, self.profiler = rec, gc, profiler

    @classmethod
    def start(cls, cfg) -> Session:
        import torch.distributed as dist

        cpu0 = time.thread_time_ns()
        identity = rank_identity()
        rank, run_dir = identity["rank"], Path(cfg.train.run_dir)
        cuda = cfg.cluster.device == "cuda"
        attempt = rank_env.attempt()
        skew_ns = faults.clock_skew_ns(cfg, rank)  # a drill's skewed clock (0: none)
        clock = time.perf_counter_ns if not skew_ns else (lambda: time.perf_counter_ns() + skew_ns)
        if not cfg.obs.enabled:
            rec = Recorder(None, identity, enabled=False)
        else:
            # clock domains: the node, or the rank itself when a drill skews its clock
            domain = f"node{identity['node']}" + (f"/skewed-rank{rank}" if skew_ns else "")
            domains: list = [None] * identity["world"]
            dist.all_gather_object(domains, domain)
            store = dist.PrefixStore(f"mega-obs/{attempt}", dist.distributed_c10d._get_default_store())
            est = obs_clock.estimate(store, rank, domains, cfg.obs.clock_sync_rounds, clock)
            exchange = None
            if identity["pp_size"] > 1 and cfg.obs.pp_exchange:
                from megatron.core import parallel_state as ps

                group = ps.get_pipeline_model_parallel_group()
                p = cfg.parallelism
                capacity = 4 * p.num_microbatches * p.chunks_per_stage + 8
                device = "cuda" if "nccl" in dist.get_backend(group) else "cpu"  # also "cpu:gloo,cuda:nccl"
                exchange = PostExchange(group, capacity, device)
            device_timer = None
            if cuda:
                from mega.obs.cuda import DeviceTimer

                device_timer = DeviceTimer(clock)
            rec = Recorder(
                run_dir,
                {**identity, **est.as_dict()},
                clock=clock,
                clock_offset_ns=est.offset_ns,
                exchange=exchange,
                device_timer=device_timer,
                attempt=attempt,
            )
            from mega.obs import megatron_hooks

            megatron_hooks.install(rec, in_forward=faults.slow_forward(cfg, rank))
        rec.setup_cpu_ns = time.thread_time_ns() - cpu0
        # not the recorder's cost: the GC policy's (its first full collection and freeze)
        gc = gc_control.GarbageCollection(cfg.train.gc_interval, rec)
        gc.start()
        _set_current(rec)
        return cls(rec, gc, StepProfiler(cfg.train.profile_steps, run_dir, rank, cuda))

    def begin_step(self, step: int) -> None:
        self.profiler.begin(step)
        self.rec.begin_step(step)

    def end_step(self) -> dict:
        return self.rec.end_step()

    def after_step(self, done: int) -> None:
        self.gc.after_step(done)
        self.profiler.end(done)

    def close(self) -> dict | None:
        from mega.obs import overhead

        self.gc.stop()
        accounting = self.rec.close(overhead.account)
        if self.rec.enabled:
            from mega.obs import megatron_hooks

            megatron_hooks.uninstall()
        _set_current(None)
        return accounting


def _set_current(rec: Recorder | None) -> None:
    import mega.obs as obs

    obs._current = rec if rec is not None else obs.NULL_RECORDER
