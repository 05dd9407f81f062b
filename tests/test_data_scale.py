"""Data at scale: a corpus streamed from a real S3 server (SeaweedFS), a killed preparation that
resumes, blends, megatron-core .bin/.idx in and out, and the per-node loader (shared memory ring,
a dying or stalled loader, bit-exact losses against per-rank loading)."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mega.config import DataConfig
from mega.data import DataError, TokenDataset, prepare_dataset
from mega.data.shards import read_shard
from tests.test_data import make_documents, read_index, split_stream, write_jsonl


def config(source, cache, **overrides) -> DataConfig:
    return DataConfig(
        **{
            "source": str(source),
            "cache_dir": str(cache),
            "shard_tokens": 1024,
            "val_fraction": 0.1,
            **overrides,
        }
    )


def write_corpus(root: Path) -> Path:
    """Several files of every kind the reader takes, compressed and not."""
    docs = make_documents(60, seed=11)
    root.mkdir(parents=True)
    for i, doc in enumerate(docs[:10]):
        (root / "books" / f"b{i:02d}.txt").parent.mkdir(exist_ok=True)
        (root / "books" / f"b{i:02d}.txt").write_text(doc)
    write_jsonl(root / "web-0.jsonl", docs[10:25])
    with gzip.open(root / "web-1.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[25:40]))
    pq.write_table(pa.table({"text": docs[40:50]}), root / "wiki.parquet", row_group_size=4)
    with pa.CompressedOutputStream(str(root / "web-2.jsonl.zst"), "zstd") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[50:]).encode())
    return root


# ---------------------------------------------------------------------------------------------
# S3


def test_a_corpus_streamed_from_s3_gives_the_same_shards_as_read_locally(seaweed, tmp_path, monkeypatch):
    import boto3

    root = write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    s3 = boto3.client("s3", endpoint_url=seaweed.endpoint_url)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.upload_file(str(path), seaweed.bucket, f"corpus-a/{path.relative_to(root).as_posix()}")

    local = prepare_dataset(config(root, tmp_path / "c-local"), 300, progress=False)
    remote = prepare_dataset(config(seaweed.uri("corpus-a"), tmp_path / "c-s3"), 300, progress=False)
    a, b = read_index(local), read_index(remote)
    assert a["content_hash"] == b["content_hash"]
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert (local.parent / "tokenizer.json").read_bytes() == (remote.parent / "tokenizer.json").read_bytes()
    assert sum(a["num_documents"].values()) == 60 and b["source"]["files"] == 14

    with pytest.raises(DataError, match="corpus-nothing.*no files"):
        prepare_dataset(config(seaweed.uri("corpus-nothing"), tmp_path / "c-none"), 300, progress=False)


# ---------------------------------------------------------------------------------------------
# A killed preparation resumes from its finished shards


def test_a_killed_preparation_resumes_where_it_was(tmp_path):
    root = write_corpus(tmp_path / "corpus")
    cfg = config(root, tmp_path / "cache", workers=1)
    code = (
        "import sys; from mega.config import DataConfig; from mega.data import prepare_dataset; "
        f"prepare_dataset(DataConfig(**{cfg.__dict__!r}), 300, progress=False)"
    )
    env = {**os.environ, "MEGA_DATA_KILL_AFTER_COMMITS": "2", "PYTHONPATH": os.getcwd()}
    killed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    work = next((tmp_path / "cache").glob(".tmp-*"))
    journal = json.loads((work / "journal.json").read_text())
    finished = [s for w in journal["writers"].values() for s in w["shards"]]
    assert finished and not list((tmp_path / "cache").glob("[0-9a-f]" * 16))  # nothing published

    resumed = prepare_dataset(cfg, 300, progress=False)
    reference = prepare_dataset(config(root, tmp_path / "reference", workers=1), 300, progress=False)
    got, want = read_index(resumed), read_index(reference)
    assert got["prepared"]["resumed_at"] == journal["position"]
    assert got["prepared"]["tokens_read_now"] < sum(want["num_tokens"].values())  # it did not start over
    assert got["content_hash"] == want["content_hash"]
    assert [(s["path"], s["sha256"]) for s in got["shards"]] == [
        (s["path"], s["sha256"]) for s in want["shards"]
    ]
    assert not work.exists()


def test_a_dataset_without_held_out_text_is_refused_before_launch(tmp_path):
    from mega.config import ConfigError, compose
    from mega.launch.driver import run_training

    corpus = write_jsonl(tmp_path / "few.jsonl", make_documents(4, seed=3))
    index = prepare_dataset(config(corpus, tmp_path / "cache", val_fraction=0.01), 300, progress=False)
    assert read_index(index)["num_tokens"]["val"] == 0  # 4 documents at 1%: none held out
    run_dir = tmp_path / "run"
    cfg = compose(
        [
            "model=tiny",
            "model.vocab_size=300",
            f"data.source={corpus}",
            "data.val_fraction=0.01",
            f"train.run_dir={run_dir}",
            "train.steps=2",
            "optimizer.warmup_steps=1",
        ]
    )
    with pytest.raises(ConfigError, match="held-out") as err:
        run_training(cfg, index)
    assert err.value.key == "data.val_fraction"
    assert not run_dir.exists()  # refused before the run record, before any rank


# ---------------------------------------------------------------------------------------------
# Blends


@pytest.fixture(scope="module")
def blend_index(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    alpha = write_jsonl(tmp / "alpha.jsonl", make_documents(40, seed=1))
    beta = write_jsonl(tmp / "beta.jsonl", [d.upper() for d in make_documents(20, seed=2)])
    cfg = config(
        "unused",
        tmp / "cache",
        val_fraction=0.0,
        blend=[{"source": str(alpha), "weight": 3.0}, {"source": str(beta), "weight": 1.0}],
    )
    from mega.config import from_dict

    data = from_dict({"data": cfg.__dict__, "train": {"eval_batches": 0}}).data  # no held-out split
    return prepare_dataset(data, 300, progress=False)


def test_blends_follow_their_weights(blend_index):
    from mega.data.blend import BlendSchedule

    ds = TokenDataset(blend_index, seq_length=16, seed=5)
    assert len(ds.streams) == 2 and ds.blend is not None
    counts = np.zeros(2, dtype=int)
    for step in range(200):  # 200 steps x 16 samples, cut 2 ways: every position is some source's
        for r in range(2):
            for m in range(2):
                sources, _ = ds.locate(ds.positions(step, m, r, 2, 4, 2))
                counts += np.bincount(sources, minlength=2)
    assert abs(counts[0] - 0.75 * 3200) <= 2 and counts.sum() == 3200

    # the samples are the sources' own windows, and the batch does not depend on the DP size
    batch = ds.microbatch_samples(7, 1, 1, 2, 4, 2)
    sources, ids = ds.locate(ds.positions(7, 1, 1, 2, 4, 2))
    for row, j, i in zip(batch, sources, ids):
        stream = split_stream(
            blend_index.parent / json.loads(blend_index.read_text())["sources"][j]["index"], "train"
        )
        assert np.array_equal(row, stream[i * 17 : (i + 1) * 17])
    whole = np.concatenate([ds.microbatch_samples(7, m, 0, 1, 4, 4) for m in range(4)])
    halves = np.concatenate([ds.microbatch_samples(7, m, r, 2, 4, 2) for r in range(2) for m in range(2)])
    assert np.array_equal(whole, halves)

    # any window of positions holds each source's share, give or take 2
    sched = BlendSchedule([0.5, 0.3, 0.2])
    src, _ = sched.locate(np.arange(10 * sched.period + 12345))
    for lo, n in [(0, 1000), (777, 5000), (sched.period - 300, 900), (3 * sched.period + 5, 70_000)]:
        share = np.bincount(src[lo : lo + n], minlength=3) / n
        assert np.all(np.abs(share * n - np.array([0.5, 0.3, 0.2]) * n) <= 2), (lo, n, share)
    # the k-th draw of a source is its k-th sample of the walk: no repeats, none skipped
    sources, draws = sched.locate(np.arange(3 * sched.period))
    for j in range(3):
        assert np.array_equal(np.sort(draws[sources == j]), np.arange(3 * sched.counts[j]))


# ---------------------------------------------------------------------------------------------
# megatron-core IndexedDataset


def test_megatron_bin_idx_written_by_mega_read_back_by_megatron_core(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    source = write_jsonl(tmp_path / "docs.jsonl", make_documents(30, seed=4))
    index_path = prepare_dataset(config(source, tmp_path / "cache", format="both"), 300, progress=False)
    index = read_index(index_path)
    for split in ("train", "val"):
        shards = [s for s in index["shards"] if s["split"] == split]
        from_megatron = []
        for s in shards:
            ds = IndexedDataset(str(index_path.parent / s["megatron"]["prefix"]))
            sequences = [ds[i] for i in range(len(ds))]
            # a sequence per document piece: each ends with EOS, except where a shard cuts a document
            assert all(seq[-1] == index["eos_id"] for seq in sequences[:-1])
            from_megatron.append(np.concatenate(sequences))
        arrow = [read_shard(index_path.parent / s["path"]) for s in shards]
        assert np.array_equal(np.concatenate(from_megatron), np.concatenate(arrow))
    assert index["num_tokens"]["val"] > 0


@pytest.fixture(scope="module")
def megatron_source(tmp_path_factory, data_index):
    """The Shakespeare train documents as a megatron prefix written by megatron-core's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp = tmp_path_factory.mktemp("megatron-source")
    stream = split_stream(data_index, "train").astype(np.uint16)
    ends = np.flatnonzero(stream == read_index(data_index)["eos_id"]) + 1
    builder = IndexedDatasetBuilder(str(tmp / "shakespeare_text_document.bin"), dtype=np.uint16)
    for lo, hi in zip([0, *ends[:-1]], ends):
        builder.add_document(stream[lo:hi], [hi - lo])
    builder.finalize(str(tmp / "shakespeare_text_document.idx"))
    return tmp / "shakespeare_text_document", stream


def test_a_megatron_prefix_is_a_source(megatron_source, tmp_path):
    prefix, stream = megatron_source
    index_path = prepare_dataset(config(prefix, tmp_path / "cache", val_fraction=0.0), 512, progress=False)
    index = read_index(index_path)
    assert index["kind"] == "megatron" and index["vocab_size"] <= 512
    ds = TokenDataset(index_path, seq_length=32, seed=1)
    assert ds.num_tokens == len(stream) and np.array_equal(ds.sample(5), stream[5 * 33 : 6 * 33])
    split = prepare_dataset(
        config(f"{prefix}.idx", tmp_path / "cache", val_fraction=0.1), 512, progress=False
    )
    documents = index["num_documents"]["train"]  # data_index's train plays, all of them here (val_fraction=0)
    assert documents >= 39
    held = round(documents * 0.1)
    assert read_index(split)["num_documents"] == {"train": documents - held, "val": held}  # the last 10%
    assert TokenDataset(split, 32, 1).num_tokens + TokenDataset(split, 32, 1, split="val").num_tokens == len(
        stream
    )


# ---------------------------------------------------------------------------------------------
# The per-node loader


class _Cfg:
    """The few config fields the batch sources read, for driving them without torchrun."""

    def __init__(self, run_dir, dp, mbs=2, nmb=3, timeout=20.0, steps=50):
        from mega.config import MegaConfig

        self.cfg = MegaConfig()
        self.cfg.train.run_dir = str(run_dir)
        self.cfg.train.steps = steps
        self.cfg.model.seq_length = 16
        self.cfg.parallelism.dp = dp
        self.cfg.parallelism.micro_batch_size = mbs
        self.cfg.parallelism.global_batch_size = mbs * nmb * dp
        self.cfg.data.loader = "node"
        self.cfg.data.loader_timeout_s = timeout


def _start_node(monkeypatch, cfg, index, ranks_dp: list[int], dp_size: int):
    """One NodeBatches per local rank (threads of this process), as torchrun's workers would be."""
    from mega.data.loader import NodeBatches

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(ranks_dp)))
    clients = []
    for local_rank, dp_rank in enumerate(ranks_dp):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        clients.append(
            NodeBatches(
                cfg, TokenDataset(index, cfg.model.seq_length, cfg.train.seed), str(index), dp_rank, dp_size
            )
        )
    return clients


def _all_get(clients, step):
    out, errors = [None] * len(clients), [None] * len(clients)

    def get(i):
        try:
            out[i] = clients[i].step_microbatches(step, torch.device("cpu"))
        except Exception as err:
            errors[i] = err

    threads = [threading.Thread(target=get, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, errors


def test_node_loader_serves_every_rank_its_own_batches(monkeypatch, tmp_path, data_index):
    cfg = _Cfg(tmp_path, dp=2).cfg
    clients = _start_node(monkeypatch, cfg, data_index, [0, 0, 1, 1], 2)  # TP=2 x DP=2 on one node
    reference = TokenDataset(data_index, 16, cfg.train.seed)
    try:
        for step in range(3, 9):  # a resumed run starts anywhere
            out, errors = _all_get(clients, step)
            assert errors == [None] * 4, errors
            for batches, dp in zip(out, [0, 0, 1, 1]):
                for m, batch in enumerate(batches):
                    want = reference.microbatch(step, m, dp, 2, 2, 3)
                    assert all(torch.equal(batch[k], want[k]) for k in want), (step, dp, m)
    finally:
        for c in clients:
            c.sock.close()
        clients[0].proc.wait(30)
    assert clients[0].proc.returncode == 0  # the ranks left: the loader exits by itself, cleaning up
    assert not Path(clients[0].sock_path).exists()


def test_a_dead_or_stalled_node_loader_is_reported_not_waited_for(monkeypatch, tmp_path, data_index):
    from mega.data.loader import DataLoaderError

    cfg = _Cfg(tmp_path, dp=1, timeout=5.0).cfg
    clients = _start_node(monkeypatch, cfg, data_index, [0, 0], 1)
    loader = clients[0].proc
    try:
        _, errors = _all_get(clients, 0)
        assert errors == [None, None]
        os.kill(loader.pid, signal.SIGSTOP)  # alive but stuck: the ranks time out, naming it
        started = time.monotonic()
        # step 4 needs slot 1 back, which the ranks never returned: the loader cannot run ahead of them
        out, errors = _all_get(clients, 2 + cfg.data.loader_prefetch)
        assert 5.0 <= time.monotonic() - started < 5.0 + 20
        for err in errors:
            assert isinstance(err, DataLoaderError)
            assert f"data loader of node 0 (pid {loader.pid}" in str(err) and "fell behind or hangs" in str(
                err
            )
            assert re.search(
                r"its last status: '(preparing step \d|delivering step \d|step \d+ prepared)", str(err)
            ), err
        os.kill(loader.pid, signal.SIGKILL)  # dead: seen at once
        started = time.monotonic()
        _, errors = _all_get(clients, 2 + cfg.data.loader_prefetch)
        assert time.monotonic() - started < 5.0  # before the timeout: the closed socket says it
        assert all(isinstance(e, DataLoaderError) and "exited" in str(e) for e in errors), errors
        assert "exited with code -9" in str(errors[0])  # local rank 0 started it: it knows how it ended
    finally:
        for c in clients:
            c.sock.close()
        loader.kill()
        loader.wait(30)


@pytest.mark.slow
def test_node_loader_training_matches_per_rank_loading_on_a_megatron_source(
    tmp_path, data_index, data_cache, megatron_source
):
    """TP=2 x DP=2: per-rank loading of the Arrow shards, and the node loader over the same
    tokens as a megatron .bin/.idx prefix, give bit-identical losses."""
    from mega.config import compose
    from mega.launch import run_training

    prefix, _ = megatron_source
    megatron_index = prepare_dataset(
        config(prefix, tmp_path / "cache", val_fraction=0.0), 512, progress=False
    )

    def train(run_dir, index, loader):
        cfg = compose(
            [
                "model=tiny",
                "parallelism=tp2",
                "parallelism.dp=2",
                "parallelism.name=tp2-dp2",
                "train.steps=3",
                f"train.run_dir={run_dir}",
                f"data.cache_dir={data_cache}",
                "train.tensorboard=false",
                "checkpoint.interval=0",
                "optimizer.warmup_steps=1",
                f"data.loader={loader}",
                "train.eval_batches=0",
            ]
        )  # the .bin/.idx copy has no val
        return run_training(cfg, index, log=print).metrics

    per_rank = train(tmp_path / "rank", data_index, "rank")
    node = train(tmp_path / "node", megatron_index, "node")
    assert [m["loss"] for m in node] == [m["loss"] for m in per_rank]
    assert [m["grad_norm"] for m in node] == [m["grad_norm"] for m in per_rank]
    waits = [json.loads(p.read_text()) for p in sorted((tmp_path / "node" / "data-wait").glob("*.json"))]
    assert len(waits) == 4 and all(w["mode"] == "node" and w["steps"] == 2 for w in waits)


def test_preparation_pins_glibcs_mmap_threshold():
    """Big buffers stay on mmap in the preparation's processes (flat peak memory, docs/data.md):
    after a 4 MB block is freed, a fresh 1 MB block is still mmapped (glibc's default would have
    raised its threshold to 4 MB and served it from the heap)."""
    import subprocess
    import sys

    code = """
import ctypes, sys
from mega.data.encode import fixed_mmap_threshold
pin = sys.argv[1] == "pin"
if pin:
    assert fixed_mmap_threshold()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))
p = libc.malloc(1 << 20)
maps = open("/proc/self/maps").read().splitlines()
mapped = any(int(a, 16) <= p < int(b, 16) and "[heap]" not in line
             for line in maps for a, b in [line.split()[0].split("-")])
print("mmap" if mapped else "heap")
"""
    got = {
        mode: subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, check=True
        ).stdout.strip()
        for mode in ("pin", "default")
    }
    assert got == {"pin": "mmap", "default": "heap"}, got
