"""``python -m flows.pretrain [hydra overrides]``: Hydra composes ``conf/``, the config is validated
before anything launches (exit 2 naming the key), and each job calls the ``pretrain`` flow with the
resolved dict. ``--cfg job``, ``--help`` and ``--info`` only compose and print: nothing here imports
Prefect, torch or megatron-core until a job runs (flows/pretrain.py hands its ``__main__`` here,
with the flow to run, before its own imports).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from mega.config import (
    ConfigError,
    MegaConfig,
    compose,
    from_container,
    run_hydra_main,
    sweep_jobs,
    to_dict,
)


def _resolved(dcfg: DictConfig) -> dict[str, Any]:
    """The job's config as a resolved dict; a bad one exits 2 with one line naming the key, before
    any process is launched."""
    try:
        cfg = from_container(dcfg)
    except ConfigError as err:
        print(f"pretrain: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    # Hydra's job logging puts the root logger at INFO: every HTTP call to the Prefect server and
    # megatron-core's import notes would flood the console. Prefect's own loggers keep INFO.
    for chatty in ("httpx", "httpcore", "megatron"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    return to_dict(cfg)


def check_args(argv: list[str]) -> list[MegaConfig]:
    """Parse ``argv`` as ``python -m flows.pretrain`` does (Hydra's own flags) and validate the
    config of every job it would run (each point of a ``-m`` sweep), launching nothing. A bad flag
    exits (argparse); a bad config raises ConfigError naming the key."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return []
    jobs = sweep_jobs(args.overrides) if args.multirun else [args.overrides]
    return [compose(job) for job in jobs]


def main(run_job: Callable[[dict[str, Any]], Any]) -> None:
    """Run Hydra over ``sys.argv``; each job calls ``run_job`` with its resolved config (the caller
    passes the flow, so that this module imports neither it nor Prefect)."""
    run_hydra_main(lambda dcfg: run_job(_resolved(dcfg)), "pretrain")
