"""launcher=slurm (mega/launch/slurm.py): the sbatch script, the submitit backend, the Hydra sweep
preset.

Slurm itself cannot run on this machine. What is real: bash and shellcheck on the rendered
script; submitit (its LocalExecutor runs one task per "node" as local processes, exactly the
``run_node`` a Slurm node runs, with real torchrun agents and ranks); submitit's Slurm executor
and the hydra-submitit-launcher plugin up to the ``sbatch`` call. Where a Slurm binary is needed,
a stand-in of a few lines takes its place, named as such: ``sbatch`` records the script it was
given and refuses it; ``srun`` starts its tasks the way srun does (one per node, SLURM_NODEID set)
as local processes; ``scontrol show hostnames`` prints the allocation's hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mega.config import ConfigError, compose
from mega.launch import slurm
from mega.launch.backend import JobSpec

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-pw-not-in-any-file"


def _cfg(tmp_path, *extra):
    return compose(["launcher=slurm", f"train.run_dir={tmp_path}/run", *extra])


def _job(cfg, name="train-attempt0", **env):
    return JobSpec("mega.train", ["--config", "/shared/run/config.json", "--data-index", "/shared/data/index.json"],
                   {**cfg.cluster.env, "MEGA_ATTEMPT": "0", **env}, Path(cfg.train.run_dir), name)


SCRIPTS = {
    "h100-8x-4nodes": ["cluster=h100-8x", "cluster.nodes=4", "parallelism.dp=8", "parallelism.global_batch_size=64",
                       "launcher.slurm.partition=gpu", "launcher.slurm.account=proj", "launcher.slurm.qos=high",
                       "launcher.slurm.cpus_per_task=96",
                       "launcher.slurm.setup=[module load cuda/12.4,source /shared/venv/bin/activate]"],
    "a100-8x-2nodes-container": ["cluster=a100-8x", "cluster.nodes=2", "parallelism.dp=4",
                                 "parallelism.global_batch_size=32", "launcher.slurm.container_image=nvcr.io/x/mega:1",
                                 "launcher.slurm.exclusive=false", "launcher.rdzv_port=0", "launcher.slurm.mem=null"],
    "cpu-2nodes": ["cluster=local-cpu", "cluster.launchers=[local,slurm]", "cluster.nodes=2",
                   "cluster.procs_per_node=4", "launcher.slurm.time=1-00:00:00"],
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
    node_cmd = script.split("bash -c ", 1)[1].strip()
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
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert f"--ntasks={c.nodes}" in srun and "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    assert ("--container-image=" in srun) == (s.container_image is not None)
    assert f"--nnodes={c.nodes}" in node_cmd and f"--nproc-per-node={c.procs_per_node}" in node_cmd
    assert '--node-rank="${SLURM_NODEID}"' in node_cmd and '--master-addr="${MASTER_ADDR}"' in node_cmd
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in script
    for key, value in c.env.items():
        assert f"export {key}={value}" in script
    assert all(line in script for line in s.setup)


def test_secrets_and_bad_settings_never_reach_a_script(tmp_path):
    cfg = _cfg(tmp_path, "cluster=h100-8x", "cluster.store=redis", f"cluster.redis_url=redis://:{PASSWORD}@10.0.0.5:6379/0")
    script = slurm.render_sbatch(cfg, _job(cfg, MEGA_REDIS_URL="redis://10.0.0.5:6379/0", MEGA_REDIS_PASSWORD=PASSWORD))
    assert PASSWORD not in script and "MEGA_REDIS_URL=redis://10.0.0.5:6379/0" in script

    for override, key in [("launcher.slurm.time=4h", "launcher.slurm.time"),
                          ("launcher.slurm.time=0", "launcher.slurm.time"),
                          ("launcher.slurm.cpus_per_task=0", "launcher.slurm.cpus_per_task"),
                          ("cluster.store=redis", "cluster.redis_url")]:  # no server the nodes can reach
        cfg = _cfg(tmp_path, "cluster=h100-8x", override)
        with pytest.raises(ConfigError) as err:
            slurm.render_sbatch(cfg, _job(cfg))
        assert err.value.key == key
    assert [slurm.slurm_minutes(t) for t in ("30", "90:30", "04:00:00", "2-00:00:00", "1-12")] == [30, 91, 240, 2880, 2160]


def test_render_cli_writes_config_and_script_or_names_the_bad_key(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "mega.launch.slurm", "render", "cluster=a100-8x", "launcher=slurm",
                          "cluster.nodes=2", "parallelism.dp=4", "parallelism.global_batch_size=32",
                          f"train.run_dir={tmp_path}/run", "--data-index", "/shared/index.json", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "o" / "train-attempt0.sbatch").read_text()
    assert f"--config {tmp_path}/o/config.json --data-index /shared/index.json" in script
    assert json.loads((tmp_path / "o" / "config.json").read_text())["cluster"]["nodes"] == 2
    assert (tmp_path / "run").is_dir()  # sbatch opens --output there before the script runs

    bad = subprocess.run([sys.executable, "-m", "mega.launch.slurm", "render", "cluster=a100-8x", "launcher=slurm",
                          "cluster.nodes=2", "--data-index", "x", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
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
        '#!/bin/bash\n# stand-in: keep the script sbatch was given, then refuse it\n'
        f'cp "${{@: -1}}" {bin_dir}/submitted.sh\necho "sbatch: error: stand-in, not a Slurm cluster" >&2\nexit 1\n')
    # stand-in: `scontrol show hostnames`, the first host this machine; as on a large allocation
    # the list is long, so a script that stops reading after one line gets scontrol killed by SIGPIPE
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho 127.0.0.1\nfor ((i = 2; i <= 20000; i++)); do echo "node$i"; done\n')
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n# stand-in: start --ntasks copies of the command, task k with SLURM_NODEID=k, as srun\n"
        "# does with one task per node; exit with the first failure\n"
        'n=1; while [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n'
        'pids=(); for ((k = 0; k < n; k++)); do SLURM_NODEID=$k SLURM_PROCID=$k "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || { c=$?; [[ $rc == 0 ]] && rc=$c; }; done; exit $rc\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def _probe_cfg(tmp_path, port, *extra):
    return _cfg(tmp_path, "cluster=local-cpu", "cluster.launchers=[local,slurm]", "cluster.nodes=2",
                "cluster.procs_per_node=2", "parallelism=dp2", "parallelism.dp=4", f"launcher.rdzv_port={port}", *extra)


def _ranks(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out_dir.glob("rank-*.json")}


def _assert_two_nodes_of_two(ranks: dict[int, dict], master: str):
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r: (x["node_rank"], x["local_rank"]) for r, x in ranks.items()} == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert {x["master"] for x in ranks.values()} == {master}
    assert all(x["world_size"] == 4 and x["nnodes"] == 2 and x["local_world_size"] == 2 for x in ranks.values())
    assert ranks[0]["peers"] == ranks[3]["peers"]  # one process group over both nodes


@pytest.mark.slow
def test_the_sbatch_script_runs_one_agent_per_node(tmp_path, slurm_bin, free_port):
    """The rendered script itself, run by bash with srun/scontrol stand-ins: every node's agent gets
    its node rank from SLURM_NODEID and meets the others at the first host."""
    port = free_port()
    cfg = _probe_cfg(tmp_path, port)
    job = JobSpec("mega.launch.probe", ["--out", str(tmp_path / "probe")], {"MEGA_ATTEMPT": "0"}, tmp_path / "run", "probe")
    script = tmp_path / "probe.sbatch"
    script.write_text(slurm.render_sbatch(cfg, job, python=sys.executable))
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242"}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr + "".join(p.read_text() for p in (tmp_path / "run" / "nodes").rglob("*.log"))
    _assert_two_nodes_of_two(_ranks(tmp_path / "probe"), f"127.0.0.1:{port}")
    assert sorted(p.parent.name for p in (tmp_path / "run" / "nodes").glob("*/probe.log")) == ["0", "1"]


def test_the_backend_submits_through_submitits_slurm_executor(tmp_path, slurm_bin):
    """SlurmBackend on Slurm: submitit's own sbatch script carries the config's resources (the
    stand-in sbatch keeps it and refuses the job)."""
    cfg = _cfg(tmp_path, *SCRIPTS["h100-8x-4nodes"])
    backend = slurm.SlurmBackend(cfg, tmp_path / "run")
    with pytest.raises(Exception, match="stand-in"):
        backend.start(_job(cfg))
    submitted = (slurm_bin / "submitted.sh").read_text()
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=96",
                      "--partition=gpu", "--account=proj", "--qos=high", "--exclusive", "--mem=0", "--time=240",
                      "--job-name=train-attempt0"):
        assert f"#SBATCH {directive}\n" in submitted, directive
    assert "module load cuda/12.4" in submitted and "submitit.core._submit" in submitted


def test_the_hydra_sweep_preset_submits_through_the_plugin(tmp_path, slurm_bin):
    """`-m hydra/launcher=slurm-sweep`: each sweep job (a driver) goes to Slurm through
    hydra-submitit-launcher with the partition and account of launcher.slurm."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "flows.pretrain", "-m", "hydra/launcher=slurm-sweep",
                          "launcher.slurm.partition=cpu-long", "launcher.slurm.account=proj", "optimizer.lr=1e-4,3e-4",
                          f"hydra.sweep.dir={tmp_path}/sweep"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode != 0 and "stand-in, not a Slurm cluster" in out.stderr, out.stderr[-2000:]
    submitted = (slurm_bin / "submitted.sh").read_text()
    for directive in ("--partition=cpu-long", "--account=proj", "--nodes=1", "--ntasks-per-node=1",
                      "--cpus-per-task=4", "--array=0-1%2"):  # two sweep jobs
        assert f"#SBATCH {directive}\n" in submitted, directive


# ---------------------------------------------------------------------------------------------
# The backend through submitit's LocalExecutor: two attempts, as the driver runs them


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "cmdline").read_bytes() and int(proc.name) != os.getpid():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def two_attempts(tmp_path_factory):
    """Attempt 0: node 1's ranks fail at once while node 0's wait for them; the backend reports
    it and stop() ends node 0. Attempt 1: both nodes run to the end."""
    import socket

    tmp = tmp_path_factory.mktemp("slurm-local")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _probe_cfg(tmp, port)
    backend = slurm.SlurmBackend(cfg, tmp / "run", cluster="local", stop_timeout_s=60)
    seen = {}
    try:
        out0 = tmp / "probe0"
        backend.start(JobSpec("mega.launch.probe", ["--out", str(out0), "--fail-node", "1", "--exit-code", "7",
                                                    "--timeout-s", "120"],
                              {"MEGA_ATTEMPT": "0"}, tmp / "run", "probe-attempt0"))
        _wait_for(lambda: backend.poll().get(1) is not None, 180, "node 1 to fail")
        seen["failed"] = backend.poll()
        seen["alive_before_stop"] = _processes_mentioning(str(out0))
        t0 = time.monotonic()
        backend.stop()
        seen["stop_s"] = time.monotonic() - t0
        seen["after_stop"] = backend.poll()
        seen["alive_after_stop"] = _processes_mentioning(str(out0))

        backend.start(JobSpec("mega.launch.probe", ["--out", str(tmp / "probe1")],
                              {"MEGA_ATTEMPT": "1", "MEGA_REDIS_PASSWORD": PASSWORD}, tmp / "run", "probe-attempt1"))
        _wait_for(lambda: all(c is not None for c in backend.poll().values()), 180, "attempt 1 to end")
        seen["done"] = backend.poll()
    finally:
        backend.close()
    return {"tmp": tmp, "port": port, **seen}


@pytest.mark.slow
def test_a_failed_node_is_reported_and_stop_leaves_no_process(two_attempts):
    # node 1's agent failed (torchrun exits 1 when a rank fails); node 0 still waits for its ranks
    assert two_attempts["failed"] == {0: None, 1: 1}
    log = (two_attempts["tmp"] / "run" / "nodes" / "1" / "probe-attempt0.log").read_text()
    assert "exitcode  : 7" in log  # the rank's own code, in the node's log
    assert two_attempts["alive_before_stop"], "node 0's agent and ranks should be running before stop()"
    assert two_attempts["after_stop"][1] == 1 and two_attempts["after_stop"][0] not in (None, 0)
    assert two_attempts["alive_after_stop"] == []  # no agent, no rank of either node outlives stop()


@pytest.mark.slow
def test_each_task_is_a_node_with_the_master_of_the_first(two_attempts):
    tmp = two_attempts["tmp"]
    assert two_attempts["done"] == {0: 0, 1: 0}
    _assert_two_nodes_of_two(_ranks(tmp / "probe1"), f"127.0.0.1:{two_attempts['port']}")
    for k in (0, 1):  # one log per node and attempt
        log = (tmp / "run" / "nodes" / str(k) / "probe-attempt1.log").read_text()
        assert f"[mega] node {k}/2" in log and f"--node-rank={k}" in log


@pytest.mark.slow
def test_a_secret_reaches_the_nodes_but_no_file(two_attempts):
    tmp = two_attempts["tmp"]
    ranks = _ranks(tmp / "probe1")
    assert all("MEGA_REDIS_PASSWORD" in r["mega_env"] for r in ranks.values())
    for path in tmp.rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
