"""In-memory checkpoints on a peer node (mega/checkpoint/memory.py), with real torchrun agents.

launcher=local-nodes, 2 nodes x 1 rank, DP 2, the tiny model, 6 steps; durable (synchronous)
saves at steps 3 and 6 to a file store, in-memory copies after every step. Each node's copies
live in its own directory under a tmpfs directory of this module. Four launches:

* ``reference``: no fault, no in-memory copies: the uninterrupted run (on one node of 2 ranks).
* ``rank``: rank 1 is killed at the start of step 6 (5 done): the restart restores step 5 (or 4,
  when the kill beat the copy of step 5) from the copies, not the durable step 3.
* ``node``: node 1 dies at the start of step 6 and fails its self-check; its directory is
  deleted before the restart (a dead node's memory is gone), and the spare node in its place
  gets rank 1's copy from node 0, which holds it.
* ``torn``: as ``rank``, but one byte of each of rank 0's own copies is flipped before the restart:
  every rank falls back to the durable step 3, and init.json says why.
* ``one_node``: as ``rank`` on one node of 2 ranks with the default ``checkpoint.memory_interval``
  (copies on, no peer): each rank restores its own copy; the driver's log, the run history, the
  incident's steps lost and the goodput ledger say so.

Every run's final weights equal the reference's bit for bit.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from helpers import tiny_config

from mega.checkpoint.memory import run_dir_id
from mega.config import compose
from mega.launch import run_training

STEPS = 6
KILL_AT = 5  # steps done when the fault strikes


_ONE_NODE_BASE = (
    "model=tiny",
    "parallelism=dp2",
    f"train.steps={STEPS}",
    "train.tensorboard=false",
    "train.eval_batches=0",
    "optimizer.warmup_steps=1",
    "restart.backoff_s=0",
    "checkpoint.async_save=false",
    "checkpoint.interval=3",
)


def _cfg(run_dir: Path, data_cache: Path, memory_dir: Path, extra=()):
    return tiny_config(
        run_dir,
        data_cache,
        [
            "parallelism=dp2",
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=1",
            "train.eval_batches=0",
            "checkpoint.async_save=false",
            f"checkpoint.dir={run_dir}/checkpoints",
            "checkpoint.interval=3",
            "checkpoint.memory_interval=1",
            f"checkpoint.memory_dir={memory_dir}",
            *extra,
        ],
        steps=STEPS,
    )


class _BetweenAttempts:
    """The launcher's log callback: runs ``damage`` once, when attempt 0 has died."""

    def __init__(self, damage):
        self.damage, self.messages, self.done = damage, [], None

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        if message.startswith("attempt 0: training") and self.done is None:
            self.done = self.damage()


def _node_dirs(cfg) -> dict[int, Path]:
    run = Path(cfg.checkpoint.memory_dir) / run_dir_id(cfg)
    return {int(d.name.removeprefix("node")): d for d in run.glob("node*")}


def _flip_a_byte_of_rank0s_copies(cfg) -> str:
    """Every copy rank 0's node holds of rank 0 (whichever step the restart picks)."""
    flipped = []
    for data in sorted((_node_dirs(cfg)[0] / "rank00000").glob("slot*.bin")):
        with open(data, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        flipped.append(data.stem)
    return " ".join(flipped)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_index, data_cache):
    root = tmp_path_factory.mktemp("memckpt")
    memory_dir = Path("/dev/shm") / f"mega-test-{uuid.uuid4().hex[:8]}"
    out = {}
    try:
        # one node of two ranks: the losses and weights of 2 nodes x 1 rank, one zygote fewer
        one_node = ["launcher=local", "cluster.nodes=1", "cluster.procs_per_node=2"]
        out["reference"] = run_training(
            _cfg(root / "reference", data_cache, memory_dir, ["checkpoint.memory_interval=0", *one_node]),
            data_index,
        )
        kill_rank = ["fault.kill_rank=1", f"fault.kill_at_step={KILL_AT}"]
        out["rank"] = run_training(_cfg(root / "rank", data_cache, memory_dir, kill_rank), data_index)
        cfg = _cfg(
            root / "node",
            data_cache,
            memory_dir,
            [
                "fault.kill_node=1",
                f"fault.kill_at_step={KILL_AT}",
                "fault.bad_node=1",
                "restart.spare_nodes=1",
                # a loaded machine is slow, not broken
                "selfcheck.min_gemm_gflops=0.01",
            ],
        )
        lost = _BetweenAttempts(lambda: shutil.rmtree(_node_dirs(cfg)[1]) or "node1")
        out["node"] = run_training(cfg, data_index, log=lost)
        out["node_damage"] = lost.done
        cfg = _cfg(root / "torn", data_cache, memory_dir, kill_rank)
        torn = _BetweenAttempts(lambda: _flip_a_byte_of_rank0s_copies(cfg))
        out["torn"] = run_training(cfg, data_index, log=torn)
        out["torn_damage"] = torn.done
        cfg = compose(
            [
                *(o for o in _ONE_NODE_BASE if "memory_interval" not in o),
                f"train.run_dir={root / 'one_node'}",
                f"data.cache_dir={data_cache}",
                f"checkpoint.dir={root / 'one_node'}/checkpoints",
                f"checkpoint.memory_dir={memory_dir}",
                *kill_rank,
            ]
        )
        one = _BetweenAttempts(lambda: "seen")
        out["one_node"] = run_training(cfg, data_index, log=one)
        out["one_node_messages"] = one.messages
        out["memory_left"] = sorted(str(p) for p in memory_dir.rglob("*.bin")) if memory_dir.exists() else []
        yield root, out
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)


def _restore(root: Path, name: str) -> dict:
    return json.loads((root / name / "init.json").read_text())["restore"]


def _same_weights(root: Path, name: str) -> None:
    from mega.bench.soak import weights_equal

    last = f"iter_{STEPS:07d}"
    same = weights_equal(
        root / name / "checkpoints" / last,
        root / "reference" / "checkpoints" / last,
        root / f"weights-{name}",
    )
    assert same["equal"] and same["tensors"] > 10, same


@pytest.mark.slow
def test_killed_rank_recovers_from_the_in_memory_copy(runs):
    root, out = runs
    result = out["rank"]
    assert len(result.history) == 2, result.history
    restored = _restore(root, "rank")
    assert restored["source"] == "memory" and restored["memory"]["used"], restored
    assert KILL_AT - restored["step"] <= 1, restored  # steps lost (the durable `latest` is step 3)
    assert result.history[1]["restored"] == f"iter_{restored['step']:07d}"
    _same_weights(root, "rank")
    assert out["memory_left"] == []  # a finished run removes its copies


@pytest.mark.slow
def test_lost_node_spare_restores_from_the_peers_copy(runs):
    root, out = runs
    assert out["node_damage"] == "node1"
    restored = _restore(root, "node")
    assert restored["source"] == "memory" and KILL_AT - restored["step"] <= 1, restored
    # node 1's directory was gone: rank 1's copy came from rank 0, whose node held it
    assert restored["memory"]["sources"] == {"0": 0, "1": 0}, restored
    _same_weights(root, "node")


@pytest.mark.slow
def test_torn_copy_falls_back_to_the_durable_checkpoint(runs):
    root, out = runs
    assert out["torn_damage"]
    restored = _restore(root, "torn")
    assert restored["source"] == "durable" and restored["checkpoint"] == "iter_0000003", restored
    reason = restored["memory"]["reason"]
    assert "rank 0: in-memory copy of step" in reason and "torn (CRC-32 mismatch" in reason, reason
    _same_weights(root, "torn")


def test_choose_picks_the_newest_step_every_rank_has_and_prefers_the_owners_node():
    from mega.checkpoint.memory import choose

    # rank 0's node holds its own steps 4, 5 and rank 1's step 4; rank 1's node only its own 4
    listings = [
        {0: [{"step": 4, "path": "a4"}, {"step": 5, "path": "a5"}], 1: [{"step": 4, "path": "h4"}]},
        {1: [{"step": 4, "path": "b4"}]},
    ]
    assert choose(listings, 2) == (4, {0: (0, "a4"), 1: (1, "b4")})
    # node 1 lost: rank 1's copy comes from rank 0, which holds it
    assert choose([listings[0], {}], 2) == (4, {0: (0, "a4"), 1: (0, "h4")})
    assert choose([{0: [{"step": 5, "path": "a5"}]}, {}], 2) is None  # no copy of rank 1 anywhere


@pytest.mark.slow
def test_one_node_restores_each_ranks_own_copy_by_default(runs):
    from mega.goodput.ledger import build
    from mega.stability.incident import read_incidents

    root, out = runs
    result = out["one_node"]
    restored = _restore(root, "one_node")
    assert restored["source"] == "memory" and KILL_AT - restored["step"] <= 1, restored
    assert restored["memory"]["sources"] == {"0": 0, "1": 1}, restored  # no peer node: its own
    ckpt = f"iter_{restored['step']:07d}"
    assert result.history[1]["restored"] == ckpt and result.history[1]["restored_from"] == "memory-own"
    assert (
        f"attempt 1: resumed from {ckpt}, from in-memory copies (each node's own)" in out["one_node_messages"]
    )
    [died] = [i for i in read_incidents(root / "one_node") if i["kind"] == "rank-exit"]
    assert died["steps_lost"] == KILL_AT - restored["step"], died  # not counted from the durable step 3
    assert [a["restored_from"] for a in build(root / "one_node")["attempts"]] == [None, "memory-own"]
    _same_weights(root, "one_node")


def test_the_optimizer_step_waits_for_the_copy_in_flight(tmp_path, monkeypatch):
    """The copy thread reads the shard while the next step's forward runs; the optimizer's step
    (a step pre-hook) waits until it has: the copy holds the weights of the step it names."""
    import threading
    import time
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from mega.checkpoint import memory as memory_module
    from mega.checkpoint.memory import MemoryCheckpoints

    monkeypatch.setattr(memory_module, "layout", lambda: {"tp": 1})  # no megatron groups here

    class Optimizer:  # the parts of megatron's DistributedOptimizer a copy reads (no shard of its own)
        def __init__(self, params):
            self.optimizer = torch.optim.SGD(params, lr=1.0)
            self.model_param_group_index_map = {}

        def state_dict(self):
            return {}

    model = torch.nn.Linear(64, 64)
    opt = Optimizer(model.parameters())
    cfg = SimpleNamespace(
        checkpoint=SimpleNamespace(memory_interval=1, memory_dir=str(tmp_path / "shm")),
        train=SimpleNamespace(run_dir=str(tmp_path / "run")),
        cluster=SimpleNamespace(pg_timeout_s=60),
    )
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        memory = MemoryCheckpoints(cfg, [model], opt, SimpleNamespace(state_dict=dict))
        before = model.weight.detach().clone()
        order, fill = [], memory._fill

        def slow_fill(*args):
            time.sleep(0.5)  # a copy thread descheduled on a busy machine
            order.append("copied")
            return fill(*args)

        monkeypatch.setattr(memory, "_fill", slow_fill)
        memory.copy(1)
        model.weight.grad = torch.ones_like(model.weight)
        stepper = threading.Thread(target=lambda: (opt.optimizer.step(), order.append("stepped")))
        stepper.start()
        stepper.join(10)
        assert order == ["copied", "stepped"]
        memory._idle.wait(10)
        rows = {r[0]: r for r in memory._table}
        name, dtype, shape, offset, nbytes = rows["model0/weight"]
        held = memory._slot(0, 0, memory._size)[offset : offset + nbytes].view(torch.float32).view(shape)
        assert torch.equal(held, before) and not torch.equal(model.weight, before)
        memory.close()
    finally:
        dist.destroy_process_group()


COPY_FAILS_PROBE = """
import json, os, shutil, sys, threading, time, types
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def rank_main(rank, root, port, out):
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK=str(rank))
    from mega.checkpoint import memory as m
    from mega.config import compose
    m.layout = lambda: {"tp": 1}  # no megatron groups here
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = compose([f"checkpoint.memory_dir={root}/shm", f"train.run_dir={root}/run",
                   "cluster.pg_timeout_s=60", "checkpoint.load=false"])
    model = torch.nn.Linear(64, 64)
    opt = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), state_dict=dict)
    sched = types.SimpleNamespace(state_dict=dict)
    copies = m.MemoryCheckpoints(cfg, [model], opt, sched)
    ok = copies._setup({n: p.detach() for n, p in model.named_parameters()})
    t0 = time.monotonic()
    for step in (1, 2, 3, 4):
        if step == 3 and rank == 1:  # rank 1's files are removed (tmpfs cleaned) before its copy
            shutil.rmtree(copies.dir)
        copies.copy(step)
        copies._idle.wait()
    held = m.complete_copies(copies.dir, 2)
    out.put((rank, {"ok": ok, "errors": copies.stats.errors, "replicated": copies.stats.replicated,
                    "seconds": time.monotonic() - t0,
                    "held": {o: sorted(c["step"] for c in cs) for o, cs in held.items()}}))
    copies.close(keep=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    root, port = sys.argv[1], int(sys.argv[2])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, root, port, out)) for r in range(2)]
    [p.start() for p in procs]
    results = dict(out.get(timeout=90) for _ in procs)
    [p.join(30) for p in procs]
    print("RESULT", json.dumps(results))
"""


def test_a_copy_that_fails_on_one_rank_does_not_hold_up_its_peer(tmp_path, free_port):
    """Rank 1's copy files are removed before its step-3 copy (an operator cleaning the tmpfs):
    that copy fails on rank 1, which still takes part in the exchange, sending nothing, so that
    rank 0's copy thread (waiting for it) and training go on at once; rank 1's next copy maps its
    files anew and the step-4 copies are complete on both nodes."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(COPY_FAILS_PROBE)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(free_port())],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=Path(__file__).parents[1],
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])
    r0, r1 = results["0"], results["1"]
    assert r0["ok"] and r1["ok"]
    assert (r0["errors"], r1["errors"]) == (0, 1), results
    assert r0["seconds"] < 30 and r1["seconds"] < 30, results  # the side group fails only after 60 s
    # rank 0 kept rank 1's copies of steps 1, 2 and 4 (3 failed); rank 1 lost what it held with its
    # files, and rank 0's step-3 copy with them (received into a removed file: not kept)
    assert (r0["replicated"], r1["replicated"]) == (3, 3), results
    assert r0["held"]["1"] == [1, 4] and r1["held"] == {"0": [4], "1": [4]}, results
