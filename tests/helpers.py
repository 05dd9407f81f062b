"""Helpers shared by the test files: a tiny training run, a free TCP port, a free subnet for
network-namespace nodes, the same-curve check."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mega.ports import free_ports

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="network namespaces need root (CI runs as root)")


def tiny_run(run_dir, data_index, data_cache, overrides=(), *, steps: int, log=print):
    """Train the tiny model (``tiny_config``); returns what ``run_training`` returns."""
    from mega.launch import run_training

    return run_training(tiny_config(run_dir, data_cache, overrides, steps=steps), data_index, log=log)


def tiny_run_logged(run_dir, data_index, data_cache, overrides=(), *, steps: int):
    """``tiny_run``, and the driver's log lines."""
    logs: list[str] = []
    return tiny_run(run_dir, data_index, data_cache, overrides, steps=steps, log=logs.append), logs


def tiny_config(run_dir, data_cache, overrides=(), *, steps: int):
    """The tiny model trained ``steps`` steps under ``run_dir`` (no TensorBoard, a 1-step warm-up,
    no back-off between attempts), ``overrides`` on top."""
    from mega.config import compose

    return compose(
        [
            "model=tiny",
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            "restart.backoff_s=0",
            *overrides,
        ]
    )


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for MASTER_PORT and stores), below the
    ephemeral range so no connection of the other test worker takes it meanwhile (mega/ports.py)."""
    return free_ports(1, "127.0.0.1")[0]


def free_subnet() -> str:
    """A /24 no interface here uses (runs of other test sessions may hold theirs)."""
    from mega.launch.netns import addresses_in_use

    for _ in range(50):
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24"
        if not addresses_in_use(net):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


def assert_same_curve(
    metrics, reference, rtol: float, grad_norm_rtol: float | None = None, val_loss: bool = False
) -> None:
    """The same steps with the same losses to ``rtol``; with ``grad_norm_rtol`` the gradient norms
    too, with ``val_loss`` the held-out loss after the last step (where the reference has one)."""
    assert [m["step"] for m in metrics] == [r["step"] for r in reference]
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=rtol), (got, want)
        if grad_norm_rtol is not None:
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=grad_norm_rtol), (got, want)
        if not val_loss:
            continue
        assert ("val_loss" in got) == ("val_loss" in want), (got, want)
        if "val_loss" in want:
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=rtol), (got, want)


def prefect_deploy(prefect_file: str) -> subprocess.CompletedProcess:
    """``prefect deploy --all`` of a deployment file of infra/ against the test's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    return subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", prefect_file, "--all"],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=300,
    )


def predicted(composer, overrides):
    """The performance model's prediction of ``overrides`` (knobs as given, precision settled),
    with the config and the hardware it ran on."""
    from mega.perf.planner import hardware_for, settle_precision
    from mega.perf.step import predict

    plan = composer.plan(list(overrides))
    settle_precision(plan)
    hw, peak = hardware_for(plan.cfg)
    return predict(plan.cfg, hw, peak), plan.cfg, hw
