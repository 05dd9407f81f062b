"""A controlled pipeline edge for tests/test_obs.py: rank 0 computes DELAY seconds, then sends an
activation through megatron's P2PCommunicator; rank 1 posts its receive at once and waits.

    torchrun --standalone --nproc-per-node=2 tests/obs_p2p_drill.py RUN_DIR DELAY SKEW STEPS

Both ranks run mega.obs.session.Session (clock offsets, the megatron wrappers, the PP exchange) as
a training rank does; rank 1's clock is skewed by SKEW seconds (fault.clock_skew_*), so booking
the wait correctly needs the clock alignment. While rank 1 waits, a watcher thread reads its
``snapshot()`` (the heartbeat API) and writes it to RUN_DIR/snapshot.json.
"""

import json
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(run_dir: str, delay: float, skew: float, steps: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mega import megatron_cpu, megatron_fixes, obs
    from mega.config import from_dict
    from mega.obs.session import Session

    megatron_fixes.apply()

    megatron_cpu.apply()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = from_dict(
        {
            "parallelism": {"pp": 2, "global_batch_size": 2, "micro_batch_size": 1},
            "cluster": {"procs_per_node": 2},
            "train": {"run_dir": run_dir, "steps": steps, "gc_interval": 0},
            "optimizer": {"warmup_steps": 0},
            "fault": {"clock_skew_rank": 1, "clock_skew_s": skew},
        }
    )
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, batch_p2p_comm=False
    )
    comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
    shape = (4, 1, 8)
    rank = dist.get_rank()
    session = Session.start(cfg)
    rows = []
    for step in range(steps):
        dist.barrier()  # both start the step together: rank 1's wait is rank 0's DELAY
        session.begin_step(step)
        if rank == 0:
            with obs.span("forward"):
                time.sleep(delay)  # the peer's compute
            comm.send_forward(torch.full(shape, float(step)), is_last_stage=False)
        else:
            if step == 0:
                threading.Thread(target=_watch, args=(run_dir, delay / 2), daemon=True).start()
            received = comm.recv_forward(shape, is_first_stage=False)
            assert float(received[0, 0, 0]) == step
            with obs.span("forward"):
                time.sleep(0.01)
        rows.append(session.end_step())
        session.after_step(step + 1)
    session.close()
    with open(f"{run_dir}/rows-{rank}.json", "w") as f:
        json.dump(rows, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _watch(run_dir: str, after: float) -> None:
    from mega import obs

    time.sleep(after)
    snapshot = obs.current().snapshot()
    with open(f"{run_dir}/snapshot.json", "w") as f:
        json.dump(snapshot, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
