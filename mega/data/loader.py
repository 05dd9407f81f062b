"""Getting each step's microbatches to the training ranks (``data.loader``).

``rank``: every rank reads its own microbatches from the memory-mapped shards (TokenDataset).

``node``: one loader process per node (MegaScale section 3.4) prepares the microbatches of the
node's data-parallel ranks into a shared-memory ring of ``data.loader_prefetch + 1`` step slots.
Local rank 0 starts it; every rank of the node registers over a Unix socket, and for each step
receives "step t is in slot k", copies its rows (the ranks of one TP group and of every pipeline
stage read the same rows: the data is read from disk once per node) and answers "done". The loader
fills step t+1 (and beyond) while the ranks train on step t. A rank that waits longer than
``data.loader_timeout_s`` fails with an error naming the loader and what it last reported doing;
a loader that exits is seen at once (its socket closes). The batches are exactly
TokenDataset.microbatch's, so losses are bit-identical to ``rank`` loading.

Either way the time each rank waits for data is recorded in
``<train.run_dir>/data-wait/attempt<a>-rank<r>.json`` (``wait_s`` over ``step_s``, both summed
over the steps after the first).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mega import rank_env
from mega.data.corpus import DataError
from mega.data.encode import die_with_parent

HEADER_BYTES = 4096  # status text of the loader (what it is doing), then the slots


class DataLoaderError(RuntimeError):
    """The node's data loader died, or did not deliver a step in time."""


class WaitStats:
    """Time this rank waits for its batches, written to the run dir."""

    def __init__(self, run_dir: str, mode: str, rank: int):
        attempt = os.environ.get(rank_env.ATTEMPT_ENV, "0")
        self.path = Path(run_dir) / "data-wait" / f"attempt{attempt}-rank{rank}.json"
        self.mode = mode
        self.steps, self.wait_s, self.step_s, self.first_wait_s = 0, 0.0, 0.0, None
        self._last_call: float | None = None
        atexit.register(self.write)

    def record(self, called: float, waited: float) -> None:
        if self._last_call is None:
            self.first_wait_s = waited
        else:  # from the second step on: one whole step since the last call
            self.steps += 1
            self.wait_s += waited
            self.step_s += called - self._last_call
        self._last_call = called
        if self.steps and self.steps % 20 == 0:
            self.write()

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(
                json.dumps(
                    {
                        "mode": self.mode,
                        "steps": self.steps,
                        "wait_s": self.wait_s,
                        "step_s": self.step_s,
                        "first_wait_s": self.first_wait_s,
                    }
                )
            )
        except OSError:
            pass


def open_batches(cfg, data_index: str):
    """This rank's batch source (call after megatron's parallel state is initialised)."""
    from megatron.core import parallel_state as ps

    from mega.data.dataset import TokenDataset

    dataset = TokenDataset(data_index, seq_length=cfg.model.seq_length, seed=cfg.train.seed)
    layout = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    if cfg.data.loader == "node":
        return NodeBatches(cfg, dataset, data_index, *layout)
    return RankBatches(cfg, dataset, *layout)


def _to_device(batch: dict, device) -> dict:
    if device.type == "cuda":  # pinned host memory: the copy to the GPU overlaps with compute
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return batch


class RankBatches:
    def __init__(self, cfg, dataset, dp_rank: int, dp_size: int):
        import torch.distributed as dist

        p = cfg.parallelism
        self.dataset, self.vocab_size = dataset, dataset.vocab_size
        self.layout = (dp_rank, dp_size, p.micro_batch_size, p.num_microbatches)
        self.stats = WaitStats(cfg.train.run_dir, "rank", dist.get_rank() if dist.is_initialized() else 0)

    def step_microbatches(self, step: int, device) -> list[dict]:
        from mega.data.dataset import as_batch

        called = time.perf_counter()
        dp_rank, dp_size, mbs, nmb = self.layout
        samples = [self.dataset.microbatch_samples(step, m, dp_rank, dp_size, mbs, nmb) for m in range(nmb)]
        self.stats.record(called, time.perf_counter() - called)
        return [_to_device(as_batch(s), device) for s in samples]


# ---------------------------------------------------------------------------------------------
# The node loader: the ranks' side


def _node_names(run_dir: str) -> tuple[str, str, int]:
    """Socket path and shared-memory name of this node's loader in this attempt, and the node."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    job = "|".join(
        [
            str(Path(run_dir).resolve()),
            os.environ.get(rank_env.ATTEMPT_ENV, "0"),
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
            os.environ.get("MASTER_PORT", ""),
        ]
    )
    token = hashlib.sha256(job.encode()).hexdigest()[:12]
    return (
        str(Path(tempfile.gettempdir()) / f"mega-loader-{token}-n{node}.sock"),
        f"mega-ld-{token}-n{node}",
        node,
    )


class NodeBatches:
    def __init__(self, cfg, dataset, data_index: str, dp_rank: int, dp_size: int):
        import torch.distributed as dist

        p = cfg.parallelism
        self.vocab_size = dataset.vocab_size
        self.dp_rank, self.mbs, self.nmb, self.seq = (
            dp_rank,
            p.micro_batch_size,
            p.num_microbatches,
            cfg.model.seq_length,
        )
        self.timeout = cfg.data.loader_timeout_s
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.sock_path, self.shm_name, self.node = _node_names(cfg.train.run_dir)
        self.stats = WaitStats(cfg.train.run_dir, "node", dist.get_rank() if dist.is_initialized() else 0)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        if (
            self.local_rank == 0
        ):  # one loader per node, started before the model is built: its start-up overlaps
            spec = {
                "index": str(data_index),
                "seq_length": cfg.model.seq_length,
                "seed": cfg.train.seed,
                "dp_size": dp_size,
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "slots": cfg.data.loader_prefetch + 1,
                "end_step": cfg.train.steps,
                "local_world_size": self.local_world,
                "socket": self.sock_path,
                "shm": self.shm_name,
                "timeout_s": cfg.data.loader_timeout_s,
                "parent": os.getpid(),
                "node": self.node,
            }
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mega.data.loader", json.dumps(spec)], stdin=subprocess.DEVNULL
            )
            self.pid = self.proc.pid
        self.sock = None
        self.shm = None
        self.slots = None

    # -- what the errors say
    def _describe(self) -> str:
        who = f"the data loader of node {self.node} (pid {self.pid or '?'}"
        if self.proc is not None:
            try:  # its socket closes a moment before it can be reaped
                who += f", exited with code {self.proc.wait(timeout=1.0)}"
            except subprocess.TimeoutExpired:
                pass
        status = "unknown"
        if self.shm is not None:
            status = (
                bytes(self.shm.buf[:HEADER_BYTES]).split(b"\0", 1)[0].decode(errors="replace") or "unknown"
            )
        return f"{who}); its last status: {status!r}"

    def _connect(self, start_step: int) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise DataLoaderError(f"{self._describe()}: exited before this rank could connect")
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(self.sock_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise DataLoaderError(
                        f"no data loader listening at {self.sock_path} after {self.timeout:.0f}s "
                        f"(data.loader_timeout_s): {self._describe()}"
                    ) from None
                time.sleep(0.05)
        self.sock = sock
        self._buf = b""
        self._send({"hello": self.local_rank, "dp_rank": self.dp_rank, "start": start_step})
        reply = self._receive(deadline, f"registering with {self.sock_path}")
        self.pid = reply["pid"]
        from multiprocessing import resource_tracker, shared_memory

        self.shm = shared_memory.SharedMemory(name=reply["shm"])
        # This rank only reads the segment; the loader owns it (and unlinks it).
        resource_tracker.unregister(self.shm._name, "shared_memory")
        self.slots = np.ndarray(
            tuple(reply["shape"]), dtype=np.int64, buffer=self.shm.buf, offset=HEADER_BYTES
        )
        self.row = reply["row"]

    def _send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def _receive(self, deadline: float, doing: str) -> dict:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataLoaderError(
                    f"{self._describe()}: nothing received in {self.timeout:.0f}s "
                    f"(data.loader_timeout_s) while {doing}; the loader fell behind or hangs"
                )
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as err:  # a reset: it died with messages of ours unread
                raise DataLoaderError(
                    f"{self._describe()}: the loader exited while this rank was {doing} "
                    f"({err.strerror or err})"
                ) from None
            if not data:
                raise DataLoaderError(f"{self._describe()}: the loader exited while this rank was {doing}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def step_microbatches(self, step: int, device) -> list[dict]:
        import torch

        from mega.data.dataset import as_batch

        called = time.perf_counter()
        if self.sock is None:
            self._connect(step)
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._receive(deadline, f"waiting for step {step}")
            if message.get("error"):
                raise DataLoaderError(f"{self._describe()}: {message['error']}")
            if message.get("ready") == step:
                break
        samples = torch.from_numpy(self.slots[message["slot"], self.row].copy())  # [nmb, mbs, L+1]
        self._send({"done": step})
        self.stats.record(called, time.perf_counter() - called)
        return [_to_device(as_batch(samples[m]), device) for m in range(self.nmb)]


# ---------------------------------------------------------------------------------------------
# The node loader: its own process (python -m mega.data.loader SPEC)


class _Loader:
    def __init__(self, spec: dict):
        self.spec = spec
        self.status_buf = None

    def status(self, text: str) -> None:
        if self.status_buf is not None:
            raw = text.encode()[: HEADER_BYTES - 1] + b"\0"
            self.status_buf[: len(raw)] = raw

    def run(self) -> int:
        from multiprocessing import shared_memory

        from mega.data.dataset import TokenDataset

        s = self.spec
        die_with_parent(s["parent"])
        dataset = TokenDataset(s["index"], s["seq_length"], s["seed"])
        Path(s["socket"]).unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(s["socket"])
        server.listen(s["local_world_size"])
        server.settimeout(s["timeout_s"])
        clients: dict[socket.socket, dict] = {}
        try:
            while len(clients) < s["local_world_size"]:  # every local rank registers
                conn, _ = server.accept()
                conn.settimeout(s["timeout_s"])
                hello = json.loads(_read_line(conn))
                clients[conn] = {
                    "local_rank": hello["hello"],
                    "dp_rank": hello["dp_rank"],
                    "start": hello["start"],
                    "done": hello["start"] - 1,
                    "buf": b"",
                }
        except TimeoutError:
            print(
                f"[data loader] only {len(clients)} of {s['local_world_size']} local ranks registered in "
                f"{s['timeout_s']:.0f}s; exiting",
                file=sys.stderr,
                flush=True,
            )
            return 1
        finally:
            server.close()
            Path(s["socket"]).unlink(missing_ok=True)
        dp_rows = sorted({c["dp_rank"] for c in clients.values()})
        row_of = {dp: i for i, dp in enumerate(dp_rows)}
        shape = (s["slots"], len(dp_rows), s["num_microbatches"], s["micro_batch_size"], s["seq_length"] + 1)
        shm = shared_memory.SharedMemory(
            name=s["shm"], create=True, size=HEADER_BYTES + 8 * int(np.prod(shape))
        )
        try:
            self.status_buf = shm.buf[:HEADER_BYTES]
            slots = np.ndarray(shape, dtype=np.int64, buffer=shm.buf, offset=HEADER_BYTES)
            for conn, c in clients.items():
                conn.sendall(
                    json.dumps(
                        {"pid": os.getpid(), "shm": s["shm"], "shape": shape, "row": row_of[c["dp_rank"]]}
                    ).encode()
                    + b"\n"
                )
            return self._serve(dataset, clients, slots, dp_rows)
        finally:
            self.status_buf = None
            del slots
            shm.close()
            shm.unlink()

    def _serve(self, dataset, clients: dict, slots: np.ndarray, dp_rows: list[int]) -> int:
        s = self.spec
        step = min(c["start"] for c in clients.values())
        sel = selectors.DefaultSelector()
        for conn in clients:
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
        last_heard = time.monotonic()
        while clients:
            # Fill every slot the ranks have finished with, up to `slots` steps ahead of the slowest.
            slowest = min(c["done"] for c in clients.values())
            # (slot t % slots last held step t - slots: every rank must have copied it)
            while step < s["end_step"] and step - s["slots"] <= slowest:
                k = step % s["slots"]
                self.status(f"preparing step {step} into slot {k}")
                for row, dp in enumerate(dp_rows):
                    for m in range(s["num_microbatches"]):
                        slots[k, row, m] = dataset.microbatch_samples(
                            step, m, dp, s["dp_size"], s["micro_batch_size"], s["num_microbatches"]
                        )
                self.status(f"delivering step {step} (slot {k})")
                ready = json.dumps({"ready": step, "slot": k}).encode() + b"\n"
                for conn in list(clients):
                    try:
                        conn.settimeout(s["timeout_s"])
                        conn.sendall(ready)
                        conn.setblocking(False)
                    except OSError:
                        sel.unregister(conn)
                        clients.pop(conn)
                step += 1
            self.status(f"step {step - 1} prepared; waiting for the ranks to finish step {slowest + 1}")
            events = sel.select(timeout=1.0)
            if not events and time.monotonic() - last_heard > 2 * s["timeout_s"]:
                print(
                    f"[data loader] no rank has answered for {2 * s['timeout_s']:.0f}s; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            for key, _ in events:
                conn, c = key.fileobj, clients[key.fileobj]
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:  # the rank exited (the job ends, or it died)
                    sel.unregister(conn)
                    conn.close()
                    clients.pop(conn)
                    continue
                last_heard = time.monotonic()
                c["buf"] += data
                while b"\n" in c["buf"]:
                    line, c["buf"] = c["buf"].split(b"\n", 1)
                    c["done"] = max(c["done"], json.loads(line)["done"])
        return 0


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while b"\n" not in buf:
        data = conn.recv(4096)
        if not data:
            raise ConnectionError("closed before a full message")
        buf += data
    return buf.split(b"\n", 1)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _Loader(spec).run()
    except DataError as err:
        print(f"[data loader] {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
