"""The driver inside its Slurm allocation (launcher.slurm.driver=allocation): ``python -m
mega.launch.in_allocation --config PATH --data-index PATH [--recovery] [--flow-run-id ID]``.

The run's batch job (mega/launch/slurm_driver.py) runs this on its first node: ``run_training``,
whose backend there starts each attempt as an ``srun`` step of the same job
(mega/launch/slurm_steps.py), then the result for the submitting process in
``<run_dir>/slurm/driver/result.json`` (``{"error": ...}`` when training failed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from mega import config as mega_config
from mega.launch.driver import TrainingFailed, run_training
from mega.launch.slurm_driver import result_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mega.launch.in_allocation", description=__doc__)
    p.add_argument("--config", required=True, type=Path, help="the run's config (JSON, without secrets)")
    p.add_argument("--data-index", required=True, type=Path)
    p.add_argument("--recovery", action="store_true", help="a restart by the recovery flow")
    p.add_argument("--flow-run-id", default=None, help="the flow run that submitted the job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = mega_config.load(args.config)
    out = result_path(cfg.train.run_dir)

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"driver on {socket.gethostname()} in Slurm job {os.environ.get('SLURM_JOB_ID')}")
    try:
        result = run_training(
            cfg, args.data_index, log=log, flow_run_id=args.flow_run_id, recovery=args.recovery
        )
    except TrainingFailed as e:
        out.write_text(json.dumps({"error": str(e)}))
        log(f"training failed: {e}")
        return 1
    row = {"attempts": result.attempts, "final_step": result.final_step, "init": result.init}
    out.write_text(json.dumps({**row, "history": result.history}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
