"""``python -m mega.launch.slurm|kubernetes render [overrides] --data-index PATH --out DIR``.

Renders what a scheduler runs for one attempt of a training job, without the driver: the
resolved config (``DIR/config.json``, no secrets) and the sbatch script or the manifests. The
config is validated first; a bad one exits 2 naming the key, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mega.cluster import rendezvous
from mega.launch.backend import JobSpec, training_job

if TYPE_CHECKING:
    from mega.config import MegaConfig


def hand_job(cfg: MegaConfig, data_index: str, config_path: str, attempt: int = 0) -> JobSpec:
    """The JobSpec of attempt ``attempt`` as the driver would hand it to a backend; the store's
    namespace is this job's own (no driver hands one out)."""
    env = {}
    if cfg.store.kind == "redis" and cfg.store.redis_url:
        public, _ = rendezvous.split_redis_password(cfg.store.redis_url)
        env = {rendezvous.REDIS_URL_ENV: public, rendezvous.JOB_ID_ENV: rendezvous.new_job_id(cfg)}
    return training_job(
        cfg, config_path, data_index, attempt, env, log_dir=Path(cfg.train.run_dir).absolute()
    )


def _parser(prog: str, what: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=f"Render {what} for one attempt of a training job."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help=f"write the resolved config and {what} into --out")
    render.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=h100-8x cluster.nodes=4")
    render.add_argument("--out", required=True, type=Path, help="directory to write into")
    render.add_argument(
        "--data-index",
        required=True,
        help="index.json of the prepared dataset, as the nodes see it (shared storage)",
    )
    return parser


def check_args(argv: list[str], *, prog: str, what: str) -> MegaConfig:
    """Parse ``argv`` as ``cli`` does and validate the config it would render, writing nothing."""
    from mega import config as mega_config

    return mega_config.compose(_parser(prog, what).parse_args(argv).overrides)


def cli(
    argv: list[str] | None,
    *,
    prog: str,
    what: str,
    write: Callable[[MegaConfig, JobSpec, Path], list[Path]],
    config_path: Callable[[Path], str] = lambda out: str(out / "config.json"),
) -> int:
    from mega import config as mega_config

    args = _parser(prog, what).parse_args(argv)

    try:
        cfg = mega_config.compose(args.overrides)
        out = args.out.absolute()
        job = hand_job(cfg, args.data_index, config_path(out))
        out.mkdir(parents=True, exist_ok=True)
        written = write(cfg, job, out)
    except mega_config.ConfigError as err:
        print(f"{prog}: invalid config: {err}", file=sys.stderr)
        return 2
    mega_config.save(rendezvous.without_secrets(cfg), out / "config.json")
    for path in [out / "config.json", *written]:
        print(path)
    return 0
