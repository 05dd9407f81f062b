"""One rank of tests/test_gpu_path.py's stage-2 check (run by torchrun): train a step, then an
asynchronous save of the distributed optimizer, recording every collective issued from the
checkpointer's stage-2 thread and the group it ran on.

    torchrun --nproc-per-node 2 tests/stage2_collectives.py CONFIG DATA_INDEX OUT_DIR
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def record_stage2_collectives() -> list[dict]:
    """Wrap torch.distributed's collectives (the package names megatron and torch DCP call, and
    the module globals c10d's own object collectives call) to record, for calls made from the
    ``ckpt-stage2`` thread, the collective and whether its group is the default one."""
    seen: list[dict] = []

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            if threading.current_thread().name == "ckpt-stage2":
                if name == "batch_isend_irecv":
                    group = args[0][0].group if args and args[0] else None
                else:
                    group = signature.bind(*args, **kwargs).arguments.get("group")
                default = group is None or group is c10d._get_default_group()
                seen.append({"op": name, "default_group": default, "stack": _caller()})
            return fn(*args, **kwargs)

        recorded.__wrapped__ = fn
        return recorded

    for name in COLLECTIVES:
        fn = getattr(c10d, name)
        wrapped = wrap(name, fn)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    return seen


def _caller() -> str:
    """The innermost frame outside torch.distributed: who issued the collective."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if (
            "torch/distributed/distributed_c10d" not in frame.filename
            and "stage2_collectives" not in frame.filename
        ):
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


def main(config: str, data_index: str, out_dir: str) -> None:
    from mega import checkpoint, megatron_cpu, megatron_fixes
    from mega import config as mega_config
    from mega.train import build, train_step

    cfg = mega_config.load(config)
    megatron_fixes.apply()
    megatron_cpu.apply()
    trainer = build(cfg, data_index)
    train_step(trainer, 0)
    seen = record_stage2_collectives()
    chunks = [m.module for m in trainer.model]
    saver = checkpoint.Checkpointer(
        cfg, chunks, trainer.optimizer, trainer.scheduler, mega_config.to_dict(cfg)
    )
    saver.save(1)
    saver.close()
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
