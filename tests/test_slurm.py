"""launcher=slurm (mega/launch/slurm.py) without a cluster: the sbatch script (bash, shellcheck,
its directives and wiring, run by bash with stand-ins for srun/scontrol), config checks, the Hydra
sweep preset up to its ``sbatch`` call. The stand-ins are a few lines each, named as such:
``sbatch`` records the script it was given and refuses it; ``srun`` starts its tasks the way srun
does (one per node, SLURM_NODEID set) as local processes; ``scontrol show hostnames`` prints the
allocation's hosts. Runs on a real Slurm cluster: tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega import ports
from mega.config import ConfigError, compose
from mega.launch import slurm
from mega.launch.backend import JobSpec
from mega.launch.watch import NODE_LOST

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-pw-not-in-any-file"


def _cfg(tmp_path, *extra):
    return compose(["launcher=slurm", f"train.run_dir={tmp_path}/run", *extra])


def _job(cfg, name="train-attempt0", **env):
    return JobSpec(
        "mega.train",
        ["--config", "/shared/run/config.json", "--data-index", "/shared/data/index.json"],
        {**cfg.cluster.env, "MEGA_ATTEMPT": "0", **env},
        Path(cfg.train.run_dir),
        name,
    )


SCRIPTS = {
    "h100-8x-4nodes": [
        "cluster=h100-8x",
        "cluster.nodes=4",
        "parallelism.dp=8",
        "parallelism.global_batch_size=64",
        "launcher.slurm.partition=gpu",
        "launcher.slurm.account=proj",
        "launcher.slurm.qos=high",
        "launcher.slurm.cpus_per_task=96",
        "launcher.slurm.setup=[module load cuda/12.4,source /shared/venv/bin/activate]",
    ],
    "a100-8x-2nodes-container": [
        "cluster=a100-8x",
        "cluster.nodes=2",
        "parallelism.dp=4",
        "parallelism.global_batch_size=32",
        "launcher.slurm.container_image=nvcr.io/x/mega:1",
        "launcher.slurm.driver=host",  # the driver in the allocation runs outside any container
        "launcher.slurm.exclusive=false",
        "launcher.rdzv_port=0",
        "launcher.slurm.mem=null",
    ],
    "cpu-2nodes": [
        "cluster=local-cpu",
        "cluster.launchers=[local,slurm]",
        "cluster.nodes=2",
        "cluster.procs_per_node=4",
        "launcher.slurm.time=1-00:00:00",
    ],
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_sbatch_script_is_valid_and_wires_every_node(name, tmp_path):
    cfg = _cfg(tmp_path, *SCRIPTS[name])
    script = slurm.render_sbatch(cfg, _job(cfg))
    path = tmp_path / "job.sbatch"
    path.write_text(script)

    bash = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    # SC1091: the setup lines source files that exist only on the cluster
    check = subprocess.run(["shellcheck", "--exclude=SC1091", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    node_cmd = (
        script.split("bash -c ", 1)[1].rsplit(") &\n", 1)[0].strip()
    )  # srun's command, in its ( ... ) &
    inner = subprocess.run(["bash", "-c", f"bash -n -c {node_cmd}"], capture_output=True, text=True)
    assert inner.returncode == 0, inner.stderr  # the per-node command parses too

    c, s = cfg.cluster, cfg.launcher.slurm
    directives = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert f"--nodes={c.nodes}" in directives and "--ntasks-per-node=1" in directives
    assert (f"--gpus-per-node={c.procs_per_node}" in directives) == (c.device == "cuda")
    assert ("--exclusive" in directives) == s.exclusive
    assert f"--time={s.time}" in directives
    for key in ("partition", "account", "qos"):
        assert (f"--{key}={getattr(s, key)}" in directives) == (getattr(s, key) is not None)
    srun = next(line for line in script.splitlines() if line.startswith("(trap '' USR1; exec srun "))
    assert f"--ntasks={c.nodes}" in srun and "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    assert ("--container-image=" in srun) == (s.container_image is not None)
    assert f"--nnodes={c.nodes}" in node_cmd and f"--nproc-per-node={c.procs_per_node}" in node_cmd
    assert '--node-rank="${SLURM_NODEID}"' in node_cmd and '--master-addr="${MASTER_ADDR}"' in node_cmd
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in script
    for key, value in c.env.items():
        assert f"export {key}={value}" in script
    assert all(line in script for line in s.setup)


def test_secrets_and_bad_settings_never_reach_a_script(tmp_path):
    cfg = _cfg(
        tmp_path,
        "cluster=h100-8x",
        "store.kind=redis",
        f"store.redis_url=redis://:{PASSWORD}@10.0.0.5:6379/0",
        "launcher.slurm.driver=host",  # in the allocation a password in the URL is refused (below)
    )
    script = slurm.render_sbatch(cfg, _job(cfg, MEGA_REDIS_URL="redis://10.0.0.5:6379/0"))
    assert PASSWORD not in script and "MEGA_REDIS_URL=redis://10.0.0.5:6379/0" in script
    for secret in (
        "MEGA_REDIS_PASSWORD",
        "MEGA_HEARTBEAT_PASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ):
        with pytest.raises(
            ValueError, match=secret
        ):  # a secret handed to the renderer is refused, not written
            slurm.render_sbatch(cfg, _job(cfg, **{secret: PASSWORD}))

    for override, key in [
        ("launcher.slurm.time=4h", "launcher.slurm.time"),
        ("launcher.slurm.time=0", "launcher.slurm.time"),
        ("launcher.slurm.cpus_per_task=0", "launcher.slurm.cpus_per_task"),
        ("launcher.slurm.signal_grace_s=14400", "launcher.slurm.signal_grace_s"),  # = the limit
        ("launcher.slurm.max_requeues=-1", "launcher.slurm.max_requeues"),
        ("launcher.slurm.numa_binding=nearest", "launcher.slurm.numa_binding"),
    ]:
        cfg = _cfg(tmp_path, "cluster=h100-8x", override)
        with pytest.raises(ConfigError) as err:
            slurm.render_sbatch(cfg, _job(cfg))
        assert err.value.key == key
    assert [slurm.slurm_minutes(t) for t in ("30", "90:30", "04:00:00", "2-00:00:00", "1-12")] == [
        30,
        91,
        240,
        2880,
        2160,
    ]


def test_each_attempt_is_named_for_its_run_signals_and_excludes(tmp_path):
    cfg = _cfg(
        tmp_path,
        "cluster=h100-8x",
        "cluster.nodes=2",
        "parallelism.dp=4",
        "parallelism.global_batch_size=32",
        "launcher.slurm.signal_grace_s=300",
        "launcher.slurm.exclude=[bad7]",
    )
    script = slurm.render_sbatch(cfg, _job(cfg, name="train-attempt3"), exclude=["gpu12", "bad7"])
    directives = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert "--job-name=mega-run-train-attempt3" in directives
    assert (
        "--exclude=bad7,gpu12" in directives
        and "--signal=B:USR1@300" in directives
        and "--no-requeue" in directives
    )
    assert "export MEGA_EXIT_SIGNAL=USR1" in script
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in script  # cpus_per_task=null: every core of the node
    # rdzv_port=0: the batch shell picks a port free on the first node, below the ephemeral range
    lines = script.splitlines()
    first = lines.index("MASTER_PORT=$(python - <<'MEGA_PORTS'")
    snippet = "\n".join(lines[first : lines.index(")", first) + 1]).replace(
        "$(python ", f"$({sys.executable} "
    )
    out = subprocess.run(["bash", "-c", snippet + '\necho "$MASTER_PORT"'], capture_output=True, text=True)
    port = int(out.stdout)
    assert 10_000 <= port < 65_536 and port not in ports.ephemeral_range(), out


def test_numa_binding_is_a_torchrun_flag_for_gpu_ranks_only(tmp_path):
    cfg = _cfg(tmp_path, "cluster=h100-8x", "launcher.slurm.numa_binding=node")
    agent = next(
        line for line in slurm.render_sbatch(cfg, _job(cfg)).splitlines() if "torch.distributed.run" in line
    )
    assert "python -m torch.distributed.run --numa-binding=node --nnodes=1" in agent
    assert "--numa-binding" not in slurm.render_sbatch(
        _cfg(tmp_path, "cluster=h100-8x"), _job(cfg)
    )  # null: none
    cpu = _cfg(
        tmp_path, "cluster=local-cpu", "cluster.launchers=[local,slurm]", "launcher.slurm.numa_binding=node"
    )
    with pytest.raises(ConfigError, match="needs cluster.device=cuda"):
        slurm.render_sbatch(cpu, _job(cpu))
    assert set(slurm.numa_modes()) >= {"node", "socket"}  # this torch has the flag


def test_a_driver_without_prefect_api_url_says_once_what_that_means(tmp_path, monkeypatch):
    said: list[str] = []
    cfg = _cfg(tmp_path, "cluster=h100-8x")
    monkeypatch.setattr(slurm, "_said_prefect", False)
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    slurm.SlurmBackend(cfg, tmp_path / "a", log=said.append)
    assert said == []  # set: Prefect uses it, nothing to say
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_HOME", "/home/me/.prefect")
    for run in ("b", "c"):
        slurm.SlurmBackend(cfg, tmp_path / run, log=said.append)
    [note] = said  # once per driver process, not once per backend
    assert (
        "PREFECT_API_URL is not set" in note
        and "temporary Prefect server" in note
        and "/home/me/.prefect" in note
    )


def test_a_step_that_could_not_start_on_a_node_blames_that_node_alone(tmp_path):
    """srun's "Task launch ... failed on node X" (this Slurm's form and the one before 20.11): of the
    nodes that reported nothing, X alone is lost (the others' tasks were killed by the step's abort,
    silent or reporting SIGKILL's code: STOPPED); without such a line in this attempt's part of the
    output every silent node is, and a SIGKILL's code is the node's own."""
    cfg = _cfg(
        tmp_path, "cluster=h100-8x", "cluster.nodes=3", "parallelism.dp=6", "parallelism.global_batch_size=48"
    )
    backend = slurm.SlurmBackend(cfg, tmp_path / "a", log=lambda _: None)
    backend.job_id, backend._hosts = "8", ["n0", "n1", "n2"]
    backend._output = tmp_path / "slurm-8.out"
    backend._output.write_text("srun: error: n0: task 0: Killed\n")
    codes = {0: None, 1: 0, 2: None}
    assert backend.unreported_lost(codes) == [0, 2]
    for step in ("StepId=8.0", "8.0"):
        backend._output.write_text(
            f"srun: error: Task launch for {step} failed on node n2: Communication connection failure\n"
            "srun: error: Application launch failed: Communication connection failure\n"
            "srun: error: n0: task 0: Killed\n"
        )
        assert backend.unreported_lost(codes) == [2], step
        # node 0's agent was SIGKILLed by the abort before its shell was: it reports 137, the abort's
        assert backend.ended_codes({0: slurm.KILLED, 1: 0, 2: None}) == {
            0: slurm.STOPPED,
            1: 0,
            2: NODE_LOST,
        }, step
    backend._output_from = backend._output.stat().st_size  # an earlier step's lines: not this one's
    assert backend.unreported_lost(codes) == [0, 2]
    # without srun's abort a SIGKILLed agent is the node's own failure (the OOM killer), its code kept
    assert backend.ended_codes({0: slurm.KILLED, 1: 0, 2: None}) == {0: slurm.KILLED, 1: 0, 2: NODE_LOST}


def test_render_cli_writes_config_and_script_or_names_the_bad_key(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.launch.slurm",
            "render",
            "cluster=a100-8x",
            "launcher=slurm",
            "cluster.nodes=2",
            "parallelism.dp=4",
            "parallelism.global_batch_size=32",
            f"train.run_dir={tmp_path}/run",
            "--data-index",
            "/shared/index.json",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "o" / "train-attempt0.sbatch").read_text()
    assert f"--config {tmp_path}/o/config.json --data-index /shared/index.json" in script
    assert json.loads((tmp_path / "o" / "config.json").read_text())["cluster"]["nodes"] == 2
    assert (tmp_path / "run").is_dir()  # sbatch opens --output there before the script runs

    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.launch.slurm",
            "render",
            "cluster=a100-8x",
            "launcher=slurm",
            "cluster.nodes=2",
            "--data-index",
            "x",
            "--out",
            str(tmp_path / "bad"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert bad.returncode == 2 and "invalid config: cluster.procs_per_node" in bad.stderr
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# Stand-ins for Slurm's binaries


@pytest.fixture
def slurm_bin(tmp_path, monkeypatch):
    """A directory of stand-in Slurm binaries, first on PATH."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\n# stand-in: keep the script sbatch was given, then refuse it\n"
        f'cp "${{@: -1}}" {bin_dir}/submitted.sh\necho "sbatch: error: stand-in, not a Slurm cluster" >&2\nexit 1\n'
    )
    # stand-in: `scontrol show hostnames`, the first host this machine; as on a large allocation
    # the list is long, so a script that stops reading after one line gets scontrol killed by SIGPIPE
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\necho 127.0.0.1\nfor ((i = 2; i <= 20000; i++)); do echo "node$i"; done\n'
    )
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n# stand-in: start --ntasks copies of the command, task k with SLURM_NODEID=k, as srun\n"
        "# does with one task per node; exit with the first failure\n"
        "n=1; while [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n"
        'pids=(); for ((k = 0; k < n; k++)); do SLURM_NODEID=$k SLURM_PROCID=$k "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || { c=$?; [[ $rc == 0 ]] && rc=$c; }; done; exit $rc\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def _probe_cfg(tmp_path, port, *extra):
    return _cfg(
        tmp_path,
        "cluster=local-cpu",
        "cluster.launchers=[local,slurm]",
        "cluster.nodes=2",
        "cluster.procs_per_node=2",
        "parallelism=dp2",
        "parallelism.dp=4",
        f"launcher.rdzv_port={port}",
        *extra,
    )


def _ranks(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out_dir.glob("rank-*.json")}


def _assert_two_nodes_of_two(ranks: dict[int, dict], master: str):
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r: (x["node_rank"], x["local_rank"]) for r, x in ranks.items()} == {
        0: (0, 0),
        1: (0, 1),
        2: (1, 0),
        3: (1, 1),
    }
    assert {x["master"] for x in ranks.values()} == {master}
    assert all(
        x["world_size"] == 4 and x["nnodes"] == 2 and x["local_world_size"] == 2 for x in ranks.values()
    )
    assert ranks[0]["peers"] == ranks[3]["peers"]  # one process group over both nodes


@pytest.mark.slow
def test_the_sbatch_script_runs_one_agent_per_node(tmp_path, slurm_bin, free_port):
    """The rendered script itself, run by bash with srun/scontrol stand-ins: every node's agent gets
    its node rank from SLURM_NODEID and meets the others at the first host."""
    port = free_port()
    cfg = _probe_cfg(tmp_path, port)
    job = JobSpec(
        "mega.launch.probe",
        ["--out", str(tmp_path / "probe")],
        {"MEGA_ATTEMPT": "0"},
        tmp_path / "run",
        "probe",
    )
    script = tmp_path / "probe.sbatch"
    script.write_text(slurm.render_sbatch(cfg, job, python=sys.executable))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_ON_NODE": "2",
    }
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr + "".join(
        p.read_text() for p in (tmp_path / "run" / "nodes").rglob("*.log")
    )
    _assert_two_nodes_of_two(_ranks(tmp_path / "probe"), f"127.0.0.1:{port}")
    assert sorted(p.parent.name for p in (tmp_path / "run" / "nodes").glob("*/probe.log")) == ["0", "1"]


@pytest.mark.parametrize("driver", ["host", "allocation"])
def test_a_warning_as_the_job_starts_is_taken_not_fatal(tmp_path, slurm_bin, driver):
    """Slurm's warning can reach the batch shell the moment the job starts (a requeued run with a
    short limit, a preemption): here it comes during the setup lines (``kill -USR1 $$``). The
    rendered script, run by bash with the stand-ins (and ``true`` for python: nothing to train),
    survives it and leaves the warning's file for the node tasks; a shell that had not trapped USR1
    yet would die of it, the job FAILED with nothing run."""
    from mega.launch import slurm_driver, slurm_steps

    grace = ["launcher.slurm.signal_grace_s=300", f"launcher.slurm.driver={driver}"]
    cfg = _probe_cfg(tmp_path, 0, *grace, "launcher.slurm.setup=[kill -USR1 $$]")
    if driver == "host":
        script = slurm.render_sbatch(cfg, _job(cfg), python="true")
        warned = Path(cfg.train.run_dir) / "slurm" / "exit" / "signalled"
    else:
        job = slurm_driver.driver_job(cfg, tmp_path / "index.json", recovery=False, flow_run_id=None)
        (tmp_path / "secrets.env").write_text("")
        job.env["MEGA_PRIVATE_ENV_FILE"] = str(tmp_path / "secrets.env")
        script = slurm_driver.render_driver_sbatch(cfg, job, "true")
        warned = slurm_steps.warning_file(cfg.train.run_dir)
    warned.parent.mkdir(parents=True, exist_ok=True)
    warned.write_text("")  # an earlier run's: removed before this run's warning is written
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "2"}
    run = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert warned.exists() and warned.stat().st_mtime_ns > path.stat().st_mtime_ns


def test_the_hydra_sweep_preset_submits_through_the_plugin(tmp_path, slurm_bin):
    """`-m hydra/launcher=slurm-sweep`: each sweep job (a driver) goes to Slurm through
    hydra-submitit-launcher, in launcher.slurm.driver_partition (not the GPU partition) with the
    account of launcher.slurm, asking for no GPU."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.pretrain",
            "-m",
            "hydra/launcher=slurm-sweep",
            "launcher.slurm.partition=gpu",
            "launcher.slurm.driver_partition=cpu-long",
            "launcher.slurm.account=proj",
            "optimizer.lr=1e-4,3e-4",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode != 0 and "stand-in, not a Slurm cluster" in out.stderr, out.stderr[-2000:]
    submitted = (slurm_bin / "submitted.sh").read_text()
    for directive in (
        "--partition=cpu-long",
        "--account=proj",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--array=0-1%2",
    ):  # two sweep jobs
        assert f"#SBATCH {directive}\n" in submitted, directive
    assert "--partition=gpu" not in submitted and "--gpus" not in submitted and "--gres" not in submitted


def test_the_driver_in_the_allocation_is_one_batch_script_or_a_named_refusal(tmp_path):
    """launcher.slurm.driver=allocation: one script for the run -- its nodes and spares, --no-kill,
    --requeue with its log appended to, the secrets file read, Slurm's warning turned into the file
    the steps' node tasks watch, then the driver's module in the background; what this mode does not
    do (a container) is refused naming the key."""
    from mega.launch import slurm_driver, slurm_steps

    base, alloc = SCRIPTS["cpu-2nodes"], "launcher.slurm.driver=allocation"
    cfg = _cfg(tmp_path, *base, alloc, "launcher.slurm.signal_grace_s=300", "restart.spare_nodes=1")
    job = slurm_driver.driver_job(cfg, tmp_path / "index.json", recovery=True, flow_run_id="f-1")
    job.env["MEGA_PRIVATE_ENV_FILE"] = str(tmp_path / "secrets.env")
    script = slurm_driver.render_driver_sbatch(cfg, job, "/venv/bin/python")
    path = tmp_path / "driver.sbatch"
    path.write_text(script)
    check = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    directives = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    expected = {"--nodes=3", "--no-kill", "--requeue", "--open-mode=append", "--signal=B:USR1@300"}
    assert expected | {"--job-name=mega-run-driver"} <= set(directives) and "--no-requeue" not in directives
    [driver] = [line for line in script.splitlines() if "-m mega.launch.in_allocation" in line]
    assert driver.startswith("(trap '' USR1; exec /venv/bin/python -m mega.launch.in_allocation --config ")
    assert driver.endswith(f"--data-index {tmp_path}/index.json --recovery --flow-run-id f-1) &")
    assert script.index(slurm.READ_PRIVATE_ENV) < script.index(driver)  # the driver reads the secrets too
    warned = slurm_steps.warning_file(cfg.train.run_dir)
    assert f"trap 'touch {warned}' USR1" in script and script.index(f"rm -f {warned}") < script.index(driver)
    assert json.loads(Path(job.args[1]).read_text())["launcher"]["slurm"]["driver"] == "allocation"

    with pytest.raises(ConfigError, match="container_image"):
        slurm.check(_cfg(tmp_path, *base, alloc, "launcher.slurm.container_image=x:1"))


def test_the_submitter_notices_when_the_driver_job_lost_its_first_node(monkeypatch):
    """--no-kill: Slurm takes a lost first node out of the running job and the job lives on without
    its driver; the submitter names that node (and stops waiting) instead of waiting for the limit."""
    from mega.launch import slurm_driver

    monkeypatch.setattr(slurm_driver, "hostnames", lambda nodelist: {"n[1-2]": ["n1", "n2"]}[nodelist])
    lost = {"JobState": "RUNNING", "BatchHost": "n0", "NodeList": "n[1-2]"}
    assert slurm_driver.driver_lost(lost) == "n0"
    assert slurm_driver.driver_lost({**lost, "BatchHost": "n1"}) is None
    assert slurm_driver.driver_lost({**lost, "JobState": "PENDING"}) is None  # requeued: no host yet
    assert slurm_driver.driver_lost({}) is None  # forgotten by Slurm


def test_the_allocations_self_check_excludes_unhealthy_hosts_onto_spares_or_fewer_nodes(tmp_path):
    """The verdict of the self-check step in the allocation (mega.launch.slurm_preflight): an
    unhealthy host is excluded and the run keeps its size on a spare, or shrinks to
    restart.min_nodes (DP shrinks), or cannot go on (the reasons named); a host the check could
    not judge stays; a check that judged none unhealthy yet failed ends the run, unless Slurm's
    warning ended it."""
    from mega.launch import slurm_preflight as pre
    from mega.stability.membership import CannotContinue

    hosts = ["n0", "n1", "n2"]

    def result(*healthy):
        reasons = [f"node {k}: slow" for k, h in enumerate(healthy) if h is False]
        rows = [
            {"node": k, "healthy": h, "reasons": ["slow"] if h is False else []}
            for k, h in enumerate(healthy)
        ]
        return {"healthy": all(healthy), "reasons": reasons or ["no verdict"], "nodes": rows}

    assert pre.judged(result(True, False, None), hosts) == (["n1"], {"n1": ["slow"]})
    with pytest.raises(CannotContinue, match="no verdict"):
        pre.judged(result(None, None, None), hosts)
    assert pre.judged(result(None, None, None), hosts, warned=True) == ([], {})

    base = [*SCRIPTS["cpu-2nodes"], "parallelism=tp2-pp2-dp2", "fault.bad_node=1"]
    spare = _cfg(tmp_path, *base, "restart.spare_nodes=1")
    cfg, note = pre._next_config(spare, 2, ["n1"], result(True, False, True))
    assert cfg.cluster.nodes == 2 and cfg.fault.bad_node is None and "spares take their places" in note
    shrink = _cfg(tmp_path, *base, "restart.min_nodes=1")
    cfg, note = pre._next_config(shrink, 1, ["n1"], result(True, False))
    assert (cfg.cluster.nodes, cfg.parallelism.dp) == (1, 1) and "dp 1" in note
    with pytest.raises(CannotContinue, match=r"n1 excluded .* restart.min_nodes=None\): node 1: slow"):
        pre._next_config(_cfg(tmp_path, *base), 1, ["n1"], result(True, False))
    assert pre._node_of(hosts, ["n0", "n2"], 2) == 1 and pre._node_of(hosts, ["n0", "n2"], 1) is None


def test_a_self_check_that_ends_the_run_leaves_its_verdict_for_the_submitter(tmp_path, monkeypatch):
    """The allocation's check finds a host unhealthy and no spare or restart.min_nodes to go on:
    the run fails (CannotContinue), and the verdict, with why the run cannot go on, is in the
    file the submitter passes on to the flow (its only report of the check)."""
    from mega.launch import slurm_preflight as pre
    from mega.launch import slurm_steps
    from mega.stability.membership import CannotContinue

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-1]")
    monkeypatch.setattr(slurm_steps, "hostnames", lambda nodelist: ["n0", "n1"])
    cfg = _cfg(tmp_path, *SCRIPTS["cpu-2nodes"], "launcher.slurm.driver=allocation")
    run_dir = Path(cfg.train.run_dir)

    def run_selfcheck(cfg, out, **kwargs):  # the check's verdict: node 1 slow
        out.mkdir(parents=True, exist_ok=True)
        rows = [
            {"node": 0, "healthy": True, "reasons": []},
            {"node": 1, "healthy": False, "reasons": ["slow"]},
        ]
        return {"healthy": False, "reasons": ["node 1: slow"], "nodes": rows, "elapsed_s": 1.0}

    monkeypatch.setattr(pre, "run_selfcheck", run_selfcheck)
    backend = slurm_steps.SlurmStepBackend(cfg, run_dir)
    with pytest.raises(CannotContinue, match="restart.min_nodes=None"):
        pre.check_allocation(cfg, backend, run_dir, print)
    verdict = json.loads(pre.verdict_path(run_dir).read_text())
    assert verdict["healthy"] is False and verdict["excluded_hosts"] == ["n1"]
    assert verdict["note"].startswith("the run cannot go on: n1 excluded")


def test_an_excluded_hosts_reasons_name_the_jobs_nodes_not_the_checks(tmp_path, monkeypatch):
    """With a host of the job left out of the check (launcher.slurm.exclude), the check's node k
    is not the job's node k: the evicted row names a link's other end as the job's node, as the
    row itself does."""
    from mega.launch import slurm_preflight as pre
    from mega.launch import slurm_steps

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-3]")
    monkeypatch.setattr(slurm_steps, "hostnames", lambda nodelist: ["n0", "n1", "n2", "n3"])
    over = [*SCRIPTS["cpu-2nodes"], "launcher.slurm.driver=allocation", "restart.spare_nodes=1"]
    cfg = _cfg(tmp_path, *over, "launcher.slurm.exclude=[n0]")
    run_dir = Path(cfg.train.run_dir)

    def run_selfcheck(cfg, out, **kwargs):  # checked n1, n2, n3: its node 1 (n2) slow towards node 2 (n3)
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"node": k, "healthy": k != 1, "reasons": []} for k in range(3)]
        rows[1]["reasons"] = ["link to node 2: 5 MB/s"]
        return {"healthy": False, "reasons": ["node 1: link to node 2"], "nodes": rows, "elapsed_s": 1.0}

    monkeypatch.setattr(pre, "run_selfcheck", run_selfcheck)
    _, rows = pre.check_allocation(cfg, slurm_steps.SlurmStepBackend(cfg, run_dir), run_dir, print)
    assert [(r["node"], r["host"], r["reasons"]) for r in rows] == [(2, "n2", ["link to node 3: 5 MB/s"])]


def test_the_submitter_passes_each_new_self_check_verdict_on_once(tmp_path):
    """The driver in the allocation writes its self-check verdict to the run directory; the
    submitter's wait passes each new version on once (the flow publishes it), a half-written
    file never."""
    from mega.launch import slurm_driver

    path, seen = tmp_path / "preflight.json", []
    verdicts = slurm_driver._Verdicts(path, seen.append)
    verdicts.poll()
    path.write_text('{"healthy": tr')
    verdicts.poll()
    path.write_text('{"healthy": true}')
    verdicts.poll()
    verdicts.poll()
    os.utime(path, ns=(1, 1))  # the requeued job's driver checked its nodes again
    verdicts.poll()
    assert seen == [{"healthy": True}, {"healthy": True}]


def test_the_submitter_passes_on_a_verdict_written_just_before_the_job_ended(tmp_path, monkeypatch):
    """A check that fails ends the job within seconds of its verdict: the wait that sees the job
    ended still passes that verdict on (the flow publishes why the run did not train)."""
    from mega.launch import slurm_driver

    path, seen = tmp_path / "preflight.json", []

    def job_info(job_id):  # the driver wrote its verdict, then its job ended, since the last poll
        path.write_text('{"healthy": false}')
        return {"JobState": "FAILED"}

    monkeypatch.setattr(slurm_driver, "job_info", job_info)
    slurm_driver._wait("7", tmp_path, print, 0.01, slurm_driver._Verdicts(path, seen.append))
    assert seen == [{"healthy": False}]


def test_a_verdict_that_cannot_be_published_does_not_end_the_wait(tmp_path):
    """Publishing the verdict (Prefect's API) failing is logged; the submitter goes on waiting for
    the job instead of cancelling it, as an incident's publication failing does not stop a run."""
    from mega.launch import slurm_driver

    path, said = tmp_path / "preflight.json", []
    path.write_text('{"healthy": true}')

    def publish(verdict):
        raise ConnectionError("Prefect API unreachable")

    slurm_driver._Verdicts(path, publish, said.append).poll()
    assert len(said) == 1 and "on_selfcheck failed: ConnectionError: Prefect API unreachable" in said[0]


def test_a_job_that_lost_its_drivers_node_is_resubmitted_without_it_with_its_budgets(tmp_path):
    """The submitter after the job lost its first node: the next job excludes every host the run
    lost, is one node smaller (a spare of the job used) or, with no spare left, shrinks the run to
    restart.min_nodes (DP shrinks); its driver continues from the lost driver's last loop state
    with that attempt counted as a failure. Without a spare or min_nodes, or with no restart left,
    the run fails for a recovery (the reason named)."""
    from mega.config import to_dict
    from mega.launch import slurm_driver, slurm_steps

    base = [*SCRIPTS["cpu-2nodes"], "launcher.slurm.driver=allocation", "restart.max_restarts=1"]
    cfg = _cfg(tmp_path, *base, "restart.spare_nodes=1")
    run_dir = Path(cfg.train.run_dir)
    folder = slurm_steps.driver_dir(run_dir)
    folder.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"attempts": 3}))

    def lost_driver(failures, excluded):
        loop = {"config": to_dict(cfg), "failures": failures, "requeues": 2, "history": [{"attempt": 1}]}
        (folder / slurm_steps.LOOP_FILE).write_text(
            json.dumps({**loop, "env": {}, "excluded_hosts": excluded})
        )
        (folder / slurm_steps.CARRIED_FILE).unlink(missing_ok=True)

    said = []
    lost_driver(0, [])
    assert slurm_driver._resubmission(cfg, run_dir, "n0", "job 7 lost n0", said.append) == (2, ["n0"])
    carried = json.loads((folder / slurm_steps.CARRIED_FILE).read_text())
    assert (carried["failures"], carried["requeues"], carried["excluded_hosts"]) == (1, 2, ["n0"])
    assert carried["history"][-1] == {"attempt": 2, "reason": "job 7 lost n0", "excluded_hosts": ["n0"]}
    assert carried["config"]["cluster"]["nodes"] == 2 and "resubmitted without n0 (failure 1)" in said[-1]
    job = slurm_driver.driver_job(cfg, tmp_path / "index.json", recovery=False, flow_run_id=None)
    script = slurm_driver.render_driver_sbatch(cfg, job, nodes=2, exclude=["n0"])
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --exclude=n0\n" in script

    lost_driver(0, ["n2"])  # the spare was used in the job already
    with pytest.raises(
        slurm_driver.DriverJobFailed, match=r"no spare of the job left, restart.min_nodes=None"
    ):
        slurm_driver._resubmission(cfg, run_dir, "n0", "lost n0", said.append)
    shrink = _cfg(tmp_path, *base, "restart.spare_nodes=1", "restart.min_nodes=1")
    assert slurm_driver._resubmission(shrink, run_dir, "n0", "lost n0", said.append) == (1, ["n0", "n2"])
    carried = json.loads((folder / slurm_steps.CARRIED_FILE).read_text())
    assert (carried["config"]["cluster"]["nodes"], carried["config"]["parallelism"]["dp"]) == (1, 1)
    assert "continuing on 1 node(s)" in said[-1]
    lost_driver(1, [])
    with pytest.raises(slurm_driver.DriverJobFailed, match=r"restart.max_restarts=1\): a recovery"):
        slurm_driver._resubmission(cfg, run_dir, "n0", "lost n0", said.append)


def test_a_driver_lost_before_its_first_attempt_hands_on_what_it_was_carried(tmp_path):
    """The replacement job's driver takes the carried state at its start and writes its own loop
    state only before its first attempt (after its nodes' self-check): a job that loses its first
    node in between is resubmitted with the carried failures and excluded hosts, not afresh."""
    from mega.launch import in_allocation, slurm_driver, slurm_steps

    base = [*SCRIPTS["cpu-2nodes"], "launcher.slurm.driver=allocation", "restart.max_restarts=3"]
    cfg = _cfg(tmp_path, *base, "restart.spare_nodes=2")
    run_dir = Path(cfg.train.run_dir)
    slurm_steps.driver_dir(run_dir).mkdir(parents=True)
    assert slurm_driver._resubmission(cfg, run_dir, "n0", "job 7 lost n0", print) == (3, ["n0"])
    carried = in_allocation._take_carried(run_dir, print)  # job 8's driver starts, then loses n1
    assert (carried["failures"], carried["excluded_hosts"]) == (1, ["n0"])
    assert slurm_driver._resubmission(cfg, run_dir, "n1", "job 8 lost n1", print) == (2, ["n0", "n1"])
    again = in_allocation._take_carried(run_dir, print)
    assert (again["failures"], again["excluded_hosts"]) == (2, ["n0", "n1"])
