"""The pretrain flow under a real Prefect server, its Hydra CLI, and its deployment file.

Every run here launches real torchrun jobs (self-check, process-group timing, training), so the
model is tiny, the world small and the runs a few steps long.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prefect_deploy
from prefect_pool import ensure_work_pool

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small_run(run_dir: Path, data_cache: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        "train.steps=6",
        "checkpoint.interval=3",
        "optimizer.warmup_steps=1",
        "restart.backoff_s=0",
        f"train.run_dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *extra,
    ]


def flow_run_records(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=runs), client.read_artifacts(flow_run_filter=runs)


def test_pretrain_flow_end_to_end(prefect_harness, tmp_path, data_cache):
    from flows.pretrain import pretrain

    run_dir = tmp_path / "run"
    state = pretrain(overrides=small_run(run_dir, data_cache, "parallelism=dp2"), return_state=True)

    assert state.is_completed(), state
    summary = state.result()
    assert json.loads(json.dumps(summary)) == summary  # JSON-able
    assert summary["world_size"] == 2 and summary["parallelism"] == "dp2"
    assert summary["selfcheck"]["healthy"]
    assert summary["store"]["ok"] and summary["store"]["roundtrip_ms"] > 0
    assert summary["process_group_init"]["world_size"] == 2
    assert summary["process_group_init"]["pg_init_s"] > 0
    assert summary["training"] == {"attempts": 1, "final_step": 6, "init": summary["training"]["init"]}
    report = summary["report"]
    assert report["total_steps"] == 6 and report["restarts"] == 0
    assert report["final_loss"] < 10 and report["mean_tokens_per_s"] > 0 and 0 < report["mean_mfu"] < 1
    assert 0 < report["val_loss"] < 10  # the held-out evaluation after the last step

    assert Path(report["loss_curve"]).read_bytes()[:8] == PNG_MAGIC
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 6
    assert (run_dir / "selfcheck" / "result.json").exists()
    assert not (run_dir / "bootstrap").exists()  # group creation timed by the training job's start-up
    assert any((run_dir / "tb").iterdir())

    task_runs, artifacts = flow_run_records(state.state_details.flow_run_id)
    assert sorted(t.name.rsplit("-", 1)[0] for t in task_runs) == sorted(
        ["prepare-data", "node-selfcheck", "verify-store", "train", "report", "observability"]
    )
    assert all(t.state.is_completed() for t in task_runs)
    by_key = {a.key: a for a in artifacts}
    assert {
        "node-selfcheck",
        "rendezvous-store",
        "training-run",
        "goodput",
        "goodput-ledger",
        "training-report",
        "observability",
        "stragglers",
    } <= set(by_key)
    assert "healthy" in by_key["node-selfcheck"].description
    assert "data:image/png;base64," in by_key["training-report"].data
    assert "| steps | 6 |" in by_key["training-report"].data
    obs = summary["observability"]  # merged trace and heat map of both ranks (docs/observability.md)
    assert obs["enabled"] and obs["ranks"] == 2 and obs["steps"] == 6
    assert Path(obs["trace"]).exists() and Path(obs["heatmap"]).read_bytes()[:8] == PNG_MAGIC
    assert "data:image/png;base64," in by_key["observability"].data
    # the goodput ledger over the whole flow (docs/goodput.md): every second attributed
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert goodput["wall_s"] == summary["goodput"]["wall_s"] and 0 < summary["goodput"]["ettr"] < 1
    assert goodput["unattributed_fraction"] < 0.005, goodput["unattributed_parts"]
    assert goodput["ledger_s"]["selfcheck"] > 0 and goodput["ledger_s"]["reporting"] > 0
    assert "data:image/png;base64," in by_key["goodput-ledger"].data


def test_unhealthy_node_fails_the_flow_before_training(prefect_harness, tmp_path, data_cache):
    from flows.pretrain import pretrain
    from tasks.selfcheck import NodeUnhealthy

    run_dir = tmp_path / "run"
    overrides = small_run(run_dir, data_cache, "parallelism=single", "selfcheck.min_gemm_gflops=1e9")
    state = pretrain(overrides=overrides, return_state=True)

    assert state.is_failed()
    with pytest.raises(NodeUnhealthy, match="selfcheck.min_gemm_gflops"):
        state.result()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "bootstrap").exists()
    task_runs, _ = flow_run_records(state.state_details.flow_run_id)
    assert {t.name.rsplit("-", 1)[0] for t in task_runs} == {"prepare-data", "node-selfcheck"}


def test_flow_takes_overrides_or_a_resolved_config_not_both(prefect_harness):
    from flows.pretrain import pretrain

    state = pretrain(overrides=["train.steps=2"], config={"train": {"steps": 2}}, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="either overrides or a resolved config"):
        state.result()


# ---------------------------------------------------------------------------------------------
# CLI: python -m flows.pretrain [hydra overrides]


def cli(
    *args: str, cwd: Path, timeout: float = 120, env: dict | None = None, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    # The Prefect settings of conftest (a throwaway PREFECT_HOME, no API URL) are inherited, so
    # the CLI runs against its own temporary server, as it would on a fresh machine.
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "flows.pretrain", *args],
        cwd=cwd,
        env=dict(os.environ) if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def first_run_env(tmp_path: Path) -> dict:
    """A user's first run: an empty Prefect home, and Prefect's own settings left as the project
    sets them (conftest turns the server's telemetry off for every test; a user has not)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    }
    env["PREFECT_HOME"] = str(tmp_path / "fresh-prefect-home")
    return env


def assert_clean_console(text: str) -> None:
    """No traceback, no error, and no warning line printed twice."""
    assert "Traceback" not in text and "ERROR" not in text, text[-5000:]
    warning_lines = [line.strip() for line in text.splitlines() if "warn" in line.lower()]
    repeated = {line for line in warning_lines if warning_lines.count(line) > 1}
    assert not repeated, repeated


def test_cli_rejects_a_bad_config_before_launching(tmp_path):
    run_dir = tmp_path / "run"
    out = cli("parallelism.tp=3", f"train.run_dir={run_dir}", cwd=tmp_path)

    assert out.returncode == 2, out.stderr
    error_lines = [line for line in out.stderr.splitlines() if "invalid config" in line]
    assert len(error_lines) == 1 and "parallelism.tp" in error_lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (run_dir / "selfcheck").exists() and not (run_dir / "config.json").exists()


def test_cli_prints_the_resolved_config(tmp_path):
    out = cli(
        "--cfg",
        "job",
        "--resolve",
        "parallelism=dp2",
        "train.steps=7",
        cwd=tmp_path,
        python_flags=("-X", "importtime"),
    )

    assert out.returncode == 0, out.stderr
    assert "dp: 2" in out.stdout and "steps: 7" in out.stdout
    assert "procs_per_node: 2" in out.stdout  # ${mega.mul:tp,pp,dp} resolved
    assert "run_dir: runs/tiny-dp2" in out.stdout
    assert not (tmp_path / "runs").exists()  # nothing ran
    # showing a config imports Hydra and mega.config, nothing heavy (-X importtime lists every import)
    imported = {
        line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
    }
    assert {"hydra", "mega.config"} <= imported, sorted(imported)[:50]
    heavy = {name for name in imported if name.split(".")[0] in ("torch", "megatron", "prefect", "numpy")}
    assert not heavy, sorted(heavy)[:20]


@pytest.mark.slow
def test_cli_multirun_sweeps_the_ablation_features(tmp_path, data_cache):
    """`-m features=...`: the paper's ablation as a Hydra sweep, one flow run per preset (one
    process each: the layouts are tests/test_training.py's). Run as a user's first run (a fresh
    Prefect home, Prefect's settings as the project leaves them), its console shows no traceback
    and no warning twice, and the ranks' logs none of megatron's warnings about absent GPU
    packages (one notice per flow run instead) or its "Overwriting ..." at each save."""
    out = cli(
        "-m",
        "features=megatron-baseline,ptb",
        "parallelism=single",
        "train.steps=2",
        "optimizer.warmup_steps=1",
        "checkpoint.interval=2",
        "train.tensorboard=false",
        f"data.cache_dir={data_cache}",
        f"train.run_dir={tmp_path}/runs/${{model.block}}",
        f"hydra.sweep.dir={tmp_path}/multirun",
        cwd=tmp_path,
        timeout=600,
        env=first_run_env(tmp_path),
    )

    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert_clean_console(console)
    from mega.optional_packages import missing

    assert console.count("optional GPU packages not installed") == (
        2 if missing() else 0
    )  # once per flow run
    losses = {}
    for block in ("sequential", "parallel"):
        run_dir = tmp_path / "runs" / block
        rank_log = (run_dir / "train-attempt0.log").read_text()
        assert "checkpoint iter_0000002" in rank_log  # a save happened
        for noise in (
            "Transformer Engine and Apex are not installed",
            "Apex is not installed",
            "Overwriting old incomplete",
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "full scope is deprecated",
        ):
            assert noise not in rank_log, (noise, rank_log[-3000:])
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2], block
        assert json.loads((run_dir / "config.json").read_text())["model"]["block"] == block
        assert (run_dir / "loss.png").read_bytes()[:8] == PNG_MAGIC
        losses[block] = [m["loss"] for m in metrics]
    assert losses["sequential"] != losses["parallel"]  # two models, not one run twice
    assert sorted(p.name for p in (tmp_path / "multirun").iterdir() if p.is_dir()) == ["0", "1"]


# ---------------------------------------------------------------------------------------------
# Deployment


def test_prefect_yaml_deploys(prefect_harness):
    from prefect.client.orchestration import get_client

    ensure_work_pool()
    before = (REPO / "infra" / "prefect.yaml").read_text()

    out = prefect_deploy("infra/prefect.yaml")

    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (REPO / "infra" / "prefect.yaml").read_text() == before  # --no-prompt never rewrites it
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pretrain/pretrain-local")
    assert deployment.entrypoint == "flows/pretrain.py:pretrain"
    assert deployment.work_pool_name == "mega-process"
    assert deployment.parameters == {"overrides": []}
    assert set(deployment.parameter_openapi_schema["properties"]) == {"overrides", "config"}
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
