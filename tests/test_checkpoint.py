"""Two-stage checkpoints to a real S3 server (local SeaweedFS) with real torchrun ranks.

One module-scoped SeaweedFS; each run works under its own prefix. Three torchrun launches
(DP=2, two ranks each), shared by the tests:

* ``reference``: asynchronous saves every 2 steps; the store is stopped right after start-up and
  stays down longer than ``checkpoint.upload_timeout_s``, so the step-2 save fails while training
  goes on; it is started again when that failure is logged. The periodic step-4 save comes due
  while step 2's upload retries (or, waited for, starts to): skipped. The step-5 save is the
  last: it waits for step 2's to give up, retries while the store comes back, and is durable.
  Never restarted: its loss curve is the uninterrupted one.
* ``killed``: asynchronous saves every step (each waits for the previous one's commit, so steps
  1-3 are durable when step 4's is made); rank 0 is SIGKILLed while stage 2 uploads the step-4
  checkpoint. Before the launcher restarts it, one shard of `latest` (step 3) is corrupted and
  one file of step 2 truncated: the restart refuses both and resumes from step 1.

And ``skipping`` (fixture of its own): a store outage shorter than ``upload_timeout_s``, with
periodic saves skipped while the step-2 save retries and taken again once it has committed.

Synchronous saves (checkpoint.async_save=false) are what tests/test_training.py's drills use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid

import boto3
import pytest
from botocore.config import Config
from helpers import tiny_run
from s3_env import hermetic_s3_env

from mega.checkpoint import iteration_name, read_save_log
from mega.config import compose
from mega.storage import open_storage
from mega.storage.seaweed import SeaweedS3

STEPS = 5  # saves at 2, 4 and 5 (checkpoint.interval=2 and the last step)


@pytest.fixture(scope="module")
def s3(seaweed):
    """The session's S3 server (tests/conftest.py)."""
    return seaweed


def train(run_dir, data_index, data_cache, uri, overrides=(), steps=STEPS, log=print):
    extra = ["parallelism=dp2", "checkpoint.interval=2", f"checkpoint.storage_uri={uri}", *overrides]
    return tiny_run(run_dir, data_index, data_cache, extra, steps=steps, log=log)


def _raw_client(server: SeaweedS3):
    env = server.env()
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}),
    )


def _curve(metrics):
    return [(m["step"], m["loss"], m["grad_norm"]) for m in metrics]


UPLOAD_TIMEOUT_S = 10  # longer than a SeaweedFS restart takes (4 s at load average 20)


def _outage(s3: SeaweedS3, run_dir, seen: dict) -> None:
    """Stop the store once the run has restored (init.json), before its first save; start it
    again once that save has failed (checkpoint.upload_timeout_s)."""
    while not (run_dir / "init.json").exists():
        time.sleep(0.05)
    s3.stop()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        failed = [r for r in read_save_log(run_dir) if r["event"] == "failed"]
        if failed:
            seen["failed"] = failed[0]
            break
        time.sleep(0.1)
    s3.start()
    seen["back_at"] = time.time()


@contextlib.contextmanager
def _in_s3_env(s3: SeaweedS3, tmp):
    """The store's credentials in this process's environment (the ranks inherit it) meanwhile."""
    mp = pytest.MonkeyPatch()
    try:
        hermetic_s3_env(mp, s3, tmp)
        yield tmp
    finally:
        mp.undo()


def _train_during(chaos, s3: SeaweedS3, seen: dict, where: tuple, overrides: list[str], steps=STEPS):
    """``train`` (run dir, data index, data cache, URI: ``where``) while ``chaos(s3, run dir,
    seen)`` runs beside it; the store is running again afterwards."""
    thread = threading.Thread(target=chaos, args=(s3, where[0], seen))
    thread.start()
    try:
        return train(*where, overrides, steps=steps)
    finally:
        thread.join()
        s3.start()


class _Corrupter:
    """The launcher's log callback: when attempt 0 has died, corrupt the store before attempt 1."""

    def __init__(self, server: SeaweedS3, uri: str):
        self.server, self.uri, self.messages, self.done = server, uri, [], {}

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        if message.startswith("attempt 0: training exited") and not self.done:
            store = open_storage(self.uri)
            prefix = self.uri.split("/", 3)[3]
            client = _raw_client(self.server)
            for name, damage in (("iter_0000003", "flip"), ("iter_0000002", "truncate")):
                victim = max(store.read_manifest(name).files, key=lambda f: f.size)
                key = f"{prefix}/{name}/{victim.path}"
                data = client.get_object(Bucket=self.server.bucket, Key=key)["Body"].read()
                data = bytes([data[0] ^ 0xFF]) + data[1:] if damage == "flip" else data[: len(data) // 2]
                client.put_object(Bucket=self.server.bucket, Key=key, Body=data)
                self.done[name] = victim.path
            self.done["good_bytes"] = store.read_manifest("iter_0000001").total_bytes


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory, data_index, data_cache):
    with _in_s3_env(s3, tmp_path_factory.mktemp("ckpt-runs")) as tmp:
        tag = uuid.uuid4().hex[:6]
        uris = {"reference": s3.uri(f"reference-{tag}"), "killed": s3.uri(f"killed-{tag}")}
        seen: dict = {}
        reference = _train_during(
            _outage,
            s3,
            seen,
            (tmp / "reference", data_index, data_cache, uris["reference"]),
            ["checkpoint.upload_retry_s=0.5", f"checkpoint.upload_timeout_s={UPLOAD_TIMEOUT_S}"],
        )
        corrupter = _Corrupter(s3, uris["killed"])
        killed = train(
            tmp / "killed",
            data_index,
            data_cache,
            uris["killed"],
            [
                "checkpoint.interval=1",
                "checkpoint.memory_interval=0",  # the durable path
                "fault.mode=kill_in_upload",
                "fault.kill_rank=0",
                "fault.kill_at_step=4",
            ],
            log=corrupter,
        )
        yield {
            "tmp": tmp,
            "uris": uris,
            "reference": reference,
            "outage": seen,
            "killed": killed,
            "messages": corrupter.messages,
            "damaged": corrupter.done,
        }


def test_store_outage_longer_than_the_upload_timeout(runs):
    """The store stayed down past checkpoint.upload_timeout_s: the step-2 save failed with an
    error naming the timeout, `latest` stayed where it was (nothing durable yet), training went
    on meanwhile and was never restarted. The periodic step-4 save came due while step 2's
    upload retried: skipped at once instead of blocking training until step 2 gave up. The last
    save (step 5) is never skipped: it waited for step 2 to give up, retried while the store came
    back, and is the only durable checkpoint."""
    run_dir, outage = runs["tmp"] / "reference", runs["outage"]
    assert runs["reference"].attempts == 1
    assert "failed" in outage, "the save never gave up while the store was down"
    failed = outage["failed"]
    assert failed["step"] == 2 and failed["latest"] is None
    assert "checkpoint.upload_timeout_s=10" in failed["error"] and "giving up" in failed["error"]
    log = read_save_log(run_dir)
    retries = [r for r in log if r["event"] == "retry" and r["time"] < failed["time"]]
    assert retries and failed["time"] - min(r["time"] for r in retries) >= UPLOAD_TIMEOUT_S - 1
    # training went on while the failing save retried: the steps after it ended before it gave up
    steps = {m["step"]: m["time"] for m in runs["reference"].metrics}
    saved = next(r for r in log if r["event"] == "save" and r["step"] == 2)
    assert saved["time"] < steps[3] < steps[4] < failed["time"]
    [skipped] = [r for r in log if r["event"] == "skipped"]
    assert skipped["step"] == 4 and "iter_0000002" in skipped["reason"]
    assert skipped["time"] < failed["time"] - UPLOAD_TIMEOUT_S / 2  # not blocked until the give-up
    assert [r["step"] for r in log if r["event"] == "save"] == [2, 5]
    last = next(r for r in log if r["event"] == "save" and r["step"] == 5)
    assert last["time"] >= failed["time"]  # the last save waited for step 2's to give up
    assert [r["step"] for r in log if r["event"] == "committed"] == [5]
    assert any(r["event"] == "retry" and r["time"] > failed["time"] for r in log)  # step 5 waited it out
    store = open_storage(runs["uris"]["reference"])
    assert store.read_latest() == "iter_0000005"
    assert store.list_checkpoints() == ["iter_0000005"]
    store.download_dir("iter_0000005", runs["tmp"] / "check")  # complete and verified


def test_kill_during_upload_keeps_latest_and_resumes_on_the_same_curve(runs):
    killed = runs["killed"]
    log0 = (runs["tmp"] / "killed" / "train-attempt0.log").read_text()
    assert "[fault] kill_in_upload: rank 0 during stage 2 of step 4" in log0
    # the strike's row, written before the kill, kept attempt 1's save of step 4 clean
    faults = [json.loads(x) for x in (runs["tmp"] / "killed" / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["step"], f["rank"], f["attempt"]) for f in faults] == [("kill_in_upload", 4, 0, 0)]
    assert killed.attempts == 2
    # `latest` did not move to the half-uploaded step-4 checkpoint; the driver reports what the
    # ranks restored (step 1: see below), not what `latest` named.
    assert "attempt 1: launching 2 ranks; `latest` is iter_0000003" in runs["messages"], runs["messages"]
    assert (
        "attempt 1: resumed from iter_0000001, from the durable store (refused iter_0000003, iter_0000002)"
        in runs["messages"]
    )
    assert killed.history[1]["restored_from"] == "durable"
    assert killed.restored == "iter_0000001"
    rows = [json.loads(x) for x in (runs["tmp"] / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["attempt"] == 1] == [2, 3, 4, 5]  # from step 1: see below
    # Bit-exact: the asynchronous checkpoint holds exactly the state of its step.
    assert _curve(killed.metrics) == _curve(runs["reference"].metrics)
    store = open_storage(runs["uris"]["killed"])
    assert store.read_latest() == "iter_0000005"
    assert store.list_checkpoints() == ["iter_0000003", "iter_0000004", "iter_0000005"]  # keep_last=3


def test_corrupt_and_truncated_checkpoints_are_refused(runs):
    """`latest` (step 3) with one shard corrupted (same size) and step 2 with a truncated file:
    both refused naming the file, the restart resumes from step 1, reading each byte from the
    store once per DP group (one group here: the two DP ranks split the pieces)."""
    damaged, info = runs["damaged"], runs["killed"].init["restore"]
    assert [(r["name"], r["file"]) for r in info["refused"]] == [
        ("iter_0000003", damaged["iter_0000003"]),
        ("iter_0000002", damaged["iter_0000002"]),
    ]
    assert "sha256" in info["refused"][0]["reason"] and "size" in info["refused"][1]["reason"]
    assert info["checkpoint"] == "iter_0000001"
    log1 = (runs["tmp"] / "killed" / "train-attempt1.log").read_text()
    assert f"refusing iter_0000003: checkpoint iter_0000003/{damaged['iter_0000003']}: sha256" in log1
    assert info["restore_bytes_read"] == damaged["good_bytes"]  # both ranks together, every byte once
    reads = [r["read_bytes"] for r in info["per_rank"]]
    assert all(0 < n < damaged["good_bytes"] for n in reads) and sum(reads) == damaged["good_bytes"]


SKIP_STEPS = 20


def _short_outage(s3: SeaweedS3, run_dir, seen: dict) -> None:
    """Stop the store before the first save; once a save has been skipped, bring it back with the
    ranks paused (SIGSTOP): a restart takes 3-8 s, 40-100 tiny steps, and the run must have
    periodic saves left once the store answers. The pause changes nothing the checkpointer sees
    but the clock (hence upload_timeout_s well above it)."""
    from mega.cluster.node import read_processes

    while not (run_dir / "init.json").exists():
        time.sleep(0.05)
    stopping = threading.Thread(target=s3.stop)  # a stop takes its 3 s grace: watch meanwhile
    stopping.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any(r["event"] == "skipped" for r in read_save_log(run_dir)):
        time.sleep(0.02)
    pids = [p["pid"] for p in read_processes(run_dir, 0)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        seen["paused_at_step"] = max((m["step"] for m in _metrics(run_dir)), default=0)
        stopping.join()
        s3.start()
        seen["back_at"] = time.time()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def skipping(s3, tmp_path_factory, data_index, data_cache):
    with _in_s3_env(s3, tmp_path_factory.mktemp("ckpt-skip")) as tmp:
        uri, seen = s3.uri(f"skip-{uuid.uuid4().hex[:6]}"), {}
        result = _train_during(
            _short_outage,
            s3,
            seen,
            (tmp / "run", data_index, data_cache, uri),
            ["checkpoint.upload_retry_s=0.5", "checkpoint.upload_timeout_s=60"],
            steps=SKIP_STEPS,
        )
        yield {"result": result, "log": read_save_log(tmp / "run"), "seen": seen, "uri": uri}


def test_saves_due_while_the_previous_retries_are_skipped(skipping):
    """Every periodic save that came due while step 2's upload retried was skipped (recorded with
    its reason), none queued; step 2's save committed once the store was back, and the periodic
    saves after it were taken and committed again, the last one too. Never restarted."""
    log, seen = skipping["log"], skipping["seen"]
    assert skipping["result"].attempts == 1 and skipping["result"].final_step == SKIP_STEPS
    assert "back_at" in seen, "the store was never brought back"
    skipped = [r["step"] for r in log if r["event"] == "skipped"]
    taken = [r["step"] for r in log if r["event"] == "save"]
    committed = [r for r in log if r["event"] == "committed"]
    assert skipped[0] == 4 and taken[0] == 2
    assert all("iter_0000002" in r["reason"] for r in log if r["event"] == "skipped")
    # every periodic save is accounted for: skipped while step 2 retried, taken after it committed
    assert sorted(skipped + taken) == list(range(2, SKIP_STEPS + 1, 2))
    assert max(skipped) < min(s for s in taken if s > 2), (skipped, taken)
    first_commit = committed[0]
    assert first_commit["step"] == 2 and first_commit["time"] > seen["back_at"]
    assert all(r["time"] < first_commit["time"] for r in log if r["event"] == "skipped")
    after = [s for s in taken if s > 2]
    assert after and after[0] < SKIP_STEPS, ("no periodic save came due after the store was back", seen, log)
    assert [r["step"] for r in committed] == taken  # each save taken is durable, none failed
    assert not [r for r in log if r["event"] == "failed"]
    store = open_storage(skipping["uri"])
    assert store.read_latest() == iteration_name(SKIP_STEPS)


@pytest.mark.parametrize(
    "override, key",
    [
        ("checkpoint.storage_uri=gs://bucket/x", "checkpoint.storage_uri"),
        ("checkpoint.storage_uri=s3:///no-bucket", "checkpoint.storage_uri"),
        ("checkpoint.storage_uri=s3://key:secret@bucket/x", "checkpoint.storage_uri"),
        ("checkpoint.storage_uri=file://otherhost/x", "checkpoint.storage_uri"),
        ("checkpoint.s3_endpoint_url=localhost:8333", "checkpoint.s3_endpoint_url"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("checkpoint.memory_interval=-1", "checkpoint.memory_interval"),
        ("checkpoint.upload_retry_s=0", "checkpoint.upload_retry_s"),
        ("checkpoint.upload_timeout_s=1", "checkpoint.upload_timeout_s"),  # below upload_retry_s (5)
        ("checkpoint.upload_timeout_s=900", "checkpoint.upload_timeout_s"),  # above stability.hang_timeout_s
        ("checkpoint.s3_attempts=0", "checkpoint.s3_attempts"),
        ("checkpoint.s3_timeout_s=0", "checkpoint.s3_timeout_s"),
        ("fault.mode=kill_in_upload", None),  # no kill_rank: nothing to check
    ],
)
def test_checkpoint_config_is_checked_before_launch(override, key):
    from mega.config import ConfigError

    if key is None:
        compose([override])
        return
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert err.value.key == key
    assert "secret" not in str(err.value)


def test_a_restores_wait_for_the_store_must_end_before_its_peers_collective_fails():
    """Rank 0 waits for an unanswering store up to upload_timeout_s plus one S3 request's bound
    (s3_attempts x (5 s connect + s3_timeout_s) + back-off) while its peers wait in a collective
    bounded by cluster.pg_timeout_s: a config where the collective fails first is refused."""
    from mega.config import ConfigError

    with pytest.raises(ConfigError) as err:  # 120 + 3 x (5 + 20) + 1 + 2 = 198 s
        compose(["checkpoint=s3", "cluster.pg_timeout_s=190"])
    assert err.value.key == "checkpoint.upload_timeout_s"
    assert "198 s" in str(err.value) and "cluster.pg_timeout_s=190" in str(err.value)
    compose(["checkpoint=s3", "cluster.pg_timeout_s=190", "checkpoint.s3_timeout_s=10"])  # 168 s
    compose(["checkpoint=s3", "cluster.pg_timeout_s=190", "checkpoint.load=false"])  # no restore
    with pytest.raises(ConfigError):  # a file store: upload_timeout_s alone
        compose(["cluster.pg_timeout_s=120"])
    compose(["cluster.pg_timeout_s=121"])


def test_kill_in_upload_needs_a_step_that_saves():
    from mega.config import ConfigError

    drill = [
        "checkpoint.interval=2",
        "train.steps=5",
        "optimizer.warmup_steps=1",
        "fault.mode=kill_in_upload",
        "fault.kill_rank=0",
    ]
    with pytest.raises(ConfigError) as err:
        compose([*drill, "fault.kill_at_step=3"])
    assert err.value.key == "fault.kill_at_step"
    compose([*drill, "fault.kill_at_step=5"])  # the last step saves
