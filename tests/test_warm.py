"""Warm processes (mega/warm): the zygote's fork-server contract with its client (exit status,
signals, a SIGKILLed client, an unsafe import refused), and a rank killed mid-run recovering on
warm processes to the same final weights, bit for bit, as an uninterrupted run of cold processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import tiny_run
from waiting import wait_for

from mega.checkpoint import iteration_dir
from mega.warm import client

STEPS = 4

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    what = sys.argv[1]
    env = os.environ
    if what == "term":  # before the pid line: the test signals as soon as it reads it
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    print(f"pid {os.getpid()} cwd {os.getcwd()} env {env.get('WARM_TEST')} agent {env.get('MEGA_AGENT_PID')}", flush=True)
    if what == "threads":
        import torch
        print(f"threads {torch.get_num_threads()}", flush=True)
        sys.exit(0)
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)
    while what == "spin":
        pass
    while what == "term":  # short sleeps: a handler runs between bytecodes, so a signal landing
        time.sleep(0.05)  # just before one long sleep would wait out the sleep
    time.sleep(120)
""")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A zygote preloading torch (not megatron-core nor mega: the contract does not need them)."""
    d = tmp_path_factory.mktemp("zygote")
    (d / "warmchild.py").write_text(CHILD)
    sock = str(d / "z.sock")
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "mega.warm.zygote", "--socket", sock, "--preload", "json,torch"],
        stdin=subprocess.PIPE,
        stdout=open(d / "zygote.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    env = {
        **os.environ,
        client.SOCKET_ENV: sock,
        client.PID_ENV: str(proc.pid),
        "WARM_TEST": "yes",
        "PYTHONPATH": f"{d}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    yield d, env, proc
    proc.stdin.close()  # the lifeline: the zygote ends, and with it whatever it forked
    assert proc.wait(timeout=15) == 0
    assert not os.path.exists(sock)


def _run(zygote, *args, env: dict | None = None, **kw) -> subprocess.Popen:
    d, zygote_env, _ = zygote
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "mega.warm.client", "warmchild", *args],
        env={**zygote_env, **(env or {})},
        cwd=d,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat: R, S, T, Z, ...), "gone" once reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _alive(pid: int) -> bool:
    return _state(pid) not in ("Z", "gone")


def test_client_exits_as_its_fork_did(zygote):
    d = zygote[0]
    p = _run(zygote, "exit", "7")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 7
    pid = int(out.split()[1])
    assert pid != p.pid and f"cwd {d} env yes agent {os.getpid()}" in out  # its fds, cwd, environment
    p = _run(zygote, "kill-self")
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL  # killed by a signal: so is its client, as torchrun reads it


def test_fork_takes_its_own_thread_count(zygote):
    """OpenMP reads OMP_NUM_THREADS when it loads, in the zygote: a fork applies its own, as a cold
    process started with it would have it."""
    d, env, _ = zygote
    for value in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-m", "mega.warm.client", "warmchild", "threads"],
            cwd=d,
            env={**env, "OMP_NUM_THREADS": value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and f"threads {value}" in out.stdout, out.stdout + out.stderr


def test_signals_are_relayed_and_a_killed_client_takes_its_fork_along(zygote):
    p = _run(zygote, "term")
    pid = int(p.stdout.readline().split()[1])
    p.send_signal(signal.SIGTERM)
    try:
        assert p.wait(timeout=30) == 42  # the fork's own handler ran
    except subprocess.TimeoutExpired:  # which side waited: the fork (alive?), the zygote (reaped it?)
        log = (zygote[0] / "zygote.log").read_text()[-2000:]
        pytest.fail(f"client {p.pid} still {_state(p.pid)}; its fork {pid} {_state(pid)}; zygote log:\n{log}")
    p = _run(zygote, "sleep")
    pid = int(p.stdout.readline().split()[1])
    assert os.getsid(pid) == pid  # a session of its own, as torchrun's workers
    p.kill()
    p.wait(timeout=30)
    wait_for(lambda: not _alive(pid), 10, "the fork of a SIGKILLed client to die")


def test_a_ranks_client_reports_whether_its_fork_runs(zygote, redis_url):
    """mega.stability.liveness: the client of a torchrun worker (RANK, LOCAL_RANK) writes its fork's
    process state to the heartbeat Redis every interval: a computing fork's CPU time moves, a
    stopped one's stands still, and the watcher's rule reads it as not running. The agent's client
    (no RANK) writes nothing."""
    import redis

    from mega import rank_env
    from mega.config import compose
    from mega.stability import heartbeat_redis, liveness

    cfg = compose([f"store.redis_url={redis_url}", "stability.heartbeat_s=0.2"])
    with heartbeat_redis.heartbeat_env(cfg, {}) as hb:  # what the launcher hands the ranks
        prefix = hb[heartbeat_redis.PREFIX_ENV]
    worker = {**hb, "RANK": "3", "LOCAL_RANK": "1", rank_env.ATTEMPT_ENV: "2"}
    r = redis.Redis.from_url(redis_url)
    key = heartbeat_redis.proc_key(prefix, 2, 3)

    def report() -> dict:
        value = r.get(key)
        return json.loads(value) if value else {}

    agent = _run(zygote, "sleep", env=hb)
    p = _run(zygote, "spin", env=worker)
    pid = int(p.stdout.readline().split()[1])
    try:
        wait_for(lambda: report().get("cpu_s", 0) > 0.3, 30, "the spinning fork's CPU time to be reported")
        running = report()
        assert running["pid"] == pid and running["state"] == "R" and running["still_s"] < 0.2
        assert not liveness.not_running(running, time.time(), 0.2)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: report().get("still_s", 0) >= 0.5, 30, "the stopped fork's CPU to stand still")
        stopped = report()
        assert stopped["state"] == "T" and liveness.not_running(stopped, time.time(), 0.2)
        assert [k.decode() for k in r.keys(prefix + "*")] == [key]  # the agent's client wrote nothing
    finally:
        for client_proc in (p, agent):
            client_proc.kill()
            client_proc.wait(timeout=30)


def test_zygote_refuses_an_import_that_starts_a_thread_and_its_clients_start_cold(tmp_path):
    (tmp_path / "spins.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    sock = str(tmp_path / "z.sock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    z = subprocess.run(
        [sys.executable, "-m", "mega.warm.zygote", "--socket", sock, "--preload", "spins"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    assert z.returncode == 1
    c = subprocess.run(  # no zygote to fork from: the client becomes the process, cold
        [sys.executable, "-m", "mega.warm.client", "platform"],
        capture_output=True,
        text=True,
        env={**env, client.SOCKET_ENV: sock},
        timeout=60,
    )
    assert c.returncode == 0 and "Linux" in c.stdout, c.stdout + c.stderr
    assert "NotForkSafe: importing started 1 native thread(s)" in c.stderr
    assert "starting python -m platform cold" in c.stderr


def test_pool_reuses_a_zygote_for_the_same_environment_only(tmp_path):
    """A zygote given back is leased again for the same environment (its output now to the new
    log), never for another; past ``idle_max`` the least recently used ends, and so does one given
    back with ``keep=False`` or at ``close()``."""
    from mega.warm.pool import ZygotePool

    pool = ZygotePool(idle_max=1, preload="json")
    env = {**os.environ, "WARM_TEST": "a"}
    first = pool.lease(env, tmp_path / "first.log")
    pool.give_back([first], keep=True)
    again = pool.lease(env, tmp_path / "again.log")
    other = pool.lease({**env, "WARM_TEST": "b"}, tmp_path / "other.log")
    assert again is first and other.proc.pid != first.proc.pid
    log = tmp_path / "again.log"
    wait_for(lambda: log.exists() and "serving again" in log.read_text(), 30, "the log to move")
    pool.give_back([again, other], keep=True)  # idle_max 1: `again` was used first, it ends
    assert again.proc.wait(timeout=15) == 0 and other.proc.poll() is None and pool.idle == [other]
    pool.close()
    assert other.proc.wait(timeout=15) == 0 and pool.idle == []
    last = pool.lease(env, tmp_path / "last.log")
    pool.give_back([last], keep=False)
    assert last.proc.poll() == 0 and pool.idle == []
    pool.close()


def test_closing_the_pool_leaves_a_leased_zygote_that_is_still_starting_its_socket(tmp_path):
    """``close()`` ends the idle zygotes only: one leased a moment ago, that has not bound its
    socket yet, still gets the directory its socket goes in, and serves."""
    from mega.warm.pool import ZygotePool

    pool = ZygotePool(preload="json")
    leased = pool.lease(dict(os.environ), tmp_path / "zygote.log")
    pool.close()
    wait_for(lambda: os.path.exists(leased.sock) or leased.proc.poll() is not None, 60, "its socket")
    assert leased.proc.poll() is None and os.path.exists(leased.sock)
    directory = os.path.dirname(leased.sock)
    pool.give_back([leased], keep=False)
    pool.close()
    assert leased.proc.poll() == 0 and not os.path.exists(directory)


# ---------------------------------------------------------------------------------------------
# A rank killed mid-run, recovered on warm processes


def _train(run_dir, data_index, data_cache, overrides):
    extra = [
        "train.eval_batches=0",
        "checkpoint.async_save=false",
        "checkpoint.interval=2",
        "parallelism=dp2",
    ]
    return tiny_run(run_dir, data_index, data_cache, [*extra, *overrides], steps=STEPS)


def _final_state(run_dir) -> dict:
    """Every tensor of the last checkpoint (model and optimizer), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / "final-state.pt"
    dcp_to_torch_save(str(iteration_dir(run_dir / "checkpoints", STEPS)), str(out))
    return torch.load(out, weights_only=True)


def _forked_ranks(run_dir, attempt: int) -> set[int]:
    """The pids the ranks of ``attempt`` recorded (mega.cluster.node.record_process)."""
    return {
        json.loads(line)["pid"]
        for d in (run_dir / "nodes").glob("*")
        for line in (d / f"procs-attempt{attempt}.jsonl").read_text().splitlines()
    }


def _kept_zygotes() -> dict[int, set[int]]:
    """pid -> live descendants of each zygote this process keeps idle (mega/warm/pool.py)."""
    from mega.launch.local_nodes import descendants
    from mega.warm.pool import POOL

    return {z.proc.pid: descendants([z.proc.pid]) for z in POOL.idle if z.proc.poll() is None}


def _zygote_pids(run_dir) -> set[int]:
    """The zygotes that served a two-node run, from their log lines (``zygote <pid>: ...``)."""
    logs = [(run_dir / "nodes" / str(k) / "zygote.log").read_text() for k in (0, 1)]
    return {int(pid) for log in logs for pid in re.findall(r"^zygote (\d+):", log, re.M)}


def test_rank_killed_recovers_on_warm_processes_bitwise(tmp_path, data_index, data_cache):
    """Two local nodes, warm, on the zygotes an earlier run of this process kept: rank 1 SIGKILLs
    itself at step 3, the driver relaunches every node on forks of the same zygotes, which restore
    their in-memory copies. The final weights and optimizer state equal, bit for bit, those of the
    same run uninterrupted on cold processes (launcher.warm_processes=false): neither a fork nor a
    zygote that served another run carries anything that changes the result."""
    cold = _train(tmp_path / "cold", data_index, data_cache, ["launcher.warm_processes=false"])
    assert cold.attempts == 1 and not list((tmp_path / "cold").rglob("zygote.log"))
    nodes = ["launcher=local-nodes", "cluster.nodes=2", "cluster.procs_per_node=1"]
    tiny_run(
        tmp_path / "earlier",
        data_index,
        data_cache,
        [*nodes, "parallelism=dp2", "train.eval_batches=0"],
        steps=2,
    )
    earlier, kept = _zygote_pids(tmp_path / "earlier"), _kept_zygotes()
    assert len(earlier) == 2 and earlier <= set(kept)
    assert not any(kept[pid] for pid in earlier), "a process of the earlier run outlived it"
    warm_dir = tmp_path / "warm"
    # launcher.keep_zygotes=false: this run's zygotes end with it
    faults = ["fault.kill_rank=1", "fault.kill_at_step=3", "launcher.keep_zygotes=false"]
    warm = _train(warm_dir, data_index, data_cache, [*nodes, *faults])
    served = _zygote_pids(warm_dir)  # kept ones: the earlier run's, or another earlier test's of this key
    assert len(served) == 2 and served <= set(kept) and not served & set(_kept_zygotes())
    assert not [pid for pid in served if _alive(pid)]
    assert "serving again" in (warm_dir / "nodes" / "1" / "zygote.log").read_text()
    assert warm.attempts == 2 and warm.history[1]["restored"] in ("iter_0000002", "iter_0000003")
    assert warm.history[1]["restored_from"] == "memory-own", warm.history
    forks = [
        int(line.split()[2].rstrip(":"))
        for k in (0, 1)  # "zygote: forked <pid>: python -m mega.train"
        for line in (warm_dir / "nodes" / str(k) / "zygote.log").read_text().splitlines()
        if line.endswith("-m mega.train")
    ]
    assert len(forks) == 4 and set(forks) == _forked_ranks(warm_dir, 0) | _forked_ranks(warm_dir, 1)
    got, want = _final_state(warm_dir), _final_state(tmp_path / "cold")
    assert got.keys() == want.keys() and len(want) > 10
    assert [k for k in want if isinstance(want[k], torch.Tensor) and not torch.equal(got[k], want[k])] == []
    assert [m["loss"] for m in warm.metrics] == [m["loss"] for m in cold.metrics]


def test_the_zygotes_imports_leave_torch_compile_to_the_forks():
    """megatron-core decorates its fused kernels with ``torch.compile`` at import; the decoration
    imports ``torch._inductor.runtime.benchmarking``, which starts the CUDA driver on a GPU node (an
    H200, torch 2.11): the zygote could then fork no CUDA rank. Its imports defer each such compile
    to the function's first call (``deferred_compile``) and leave ``torch.compile`` as it was; and
    none asks for the device count (``torch.cuda.is_available()`` started the driver there too).
    This fails when megatron-core, torch or mega reach either at import another way."""
    probe = textwrap.dedent("""
        import json, sys
        import torch
        probes = []
        for name in ("is_available", "device_count"):  # each may start the driver (cudaGetDeviceCount)
            real = getattr(torch.cuda, name)
            setattr(torch.cuda, name, lambda *a, _n=name, _r=real: probes.append(_n) or _r(*a))
        from mega.warm import zygote
        zygote.preload()
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_gelu
        print(json.dumps({
            "benchmarking": "torch._inductor.runtime.benchmarking" in sys.modules,
            "jit_fuser_deferred": jit.jit_fuser.__name__ == "compile_",
            "bias_gelu_deferred": getattr(fused_bias_gelu.bias_gelu, "deferred_compile", False),
            "torch_compile_restored": torch.compile.__module__ == "torch",
            "device_probes": probes,
        }))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "benchmarking": False,
        "jit_fuser_deferred": True,
        "bias_gelu_deferred": True,
        "torch_compile_restored": True,
        "device_probes": [],
    }


def test_a_deferred_compile_compiles_at_the_first_call_with_the_given_arguments():
    from mega.warm.zygote import deferred_compile

    calls = []

    def real_compile(model, **kwargs):
        calls.append(kwargs)
        return torch.compile(model, **{"backend": "eager", **kwargs})  # eager: no code generation here

    @deferred_compile(real_compile)
    def double(x):
        return 2 * x

    fused = deferred_compile(real_compile)(backend="eager")(lambda x: x + 1)  # @torch.compile(...) form
    assert calls == [] and double.__name__ == "double"
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(fused(torch.zeros(2)), torch.ones(2))
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == [{}, {"backend": "eager"}]  # once each, at the first call
    module = torch.nn.Linear(2, 2)
    assert isinstance(deferred_compile(real_compile)(module), torch._dynamo.eval_frame.OptimizedModule)
