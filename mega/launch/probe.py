"""``torchrun ... -m mega.launch.probe --out DIR``: a rank that checks how a launch wired it up.

Every rank joins the process group (gloo), gathers every rank's identity (host, node rank from
torchrun's GROUP_RANK, local rank, pid) and writes ``DIR/rank-<r>.json`` with what it saw: a
multi-node launch (Slurm, Kubernetes, local nodes) is right when every node rank appears with
``procs_per_node`` ranks and every rank agrees on the master. Seconds instead of a training
run's minutes; the launch backends' tests use it, and so can a person checking an allocation.

``--hold-s S`` keeps the ranks alive after the check (to stop them from outside);
``--fail-node K`` makes node K's ranks exit with ``--exit-code`` before joining.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--fail-node", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    args = parser.parse_args(argv)

    node = int(os.environ["GROUP_RANK"])
    if args.fail_node == node:
        print(f"[probe] node {node}: failing on purpose with exit code {args.exit_code}", flush=True)
        return args.exit_code

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    me = {
        "rank": dist.get_rank(),
        "node_rank": node,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        **me,
        "world_size": dist.get_world_size(),
        "nnodes": int(os.environ["GROUP_WORLD_SIZE"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "peers": everyone,
        # names only: which of mega's variables reached the rank (values may be secret)
        "mega_env": sorted(k for k in os.environ if k.startswith("MEGA_")),
    }
    tmp = args.out / f".rank-{me['rank']}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.out / f"rank-{me['rank']}.json")
    deadline = time.monotonic() + args.hold_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
