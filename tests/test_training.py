"""Training on megatron-core across real gloo processes: every parallel layout computes the same
model as one process, a checkpoint resumes in another layout, and dead or hung ranks become
bounded restarts. (Bit-exact resume after a kill: tests/test_checkpoint.py, test_lamb.py,
test_recovery.py.)"""

import json

import pytest
from helpers import assert_same_curve, tiny_run

from mega.checkpoint import read_latest
from mega.config import compose
from mega.launch import TrainingFailed
from mega.metrics import read_metrics

STEPS = 4
# fp32 sums in another order (TP splits GEMMs, DP splits the batch): equal to ~6 digits.
RTOL = 2e-5


def train(tmp_path, data_index, data_cache, overrides, steps=STEPS, log=print):
    # The fault drills here kill a rank right after a save and expect that save to be `latest`:
    # synchronous saves (the asynchronous ones: tests/test_checkpoint.py).
    extra = ["checkpoint.async_save=false", *overrides]
    return tiny_run(tmp_path, data_index, data_cache, extra, steps=steps, log=log)


@pytest.fixture(scope="module")
def reference_run(single_process_reference):
    """One process: the numbers every layout must reproduce (conftest: shared with other files)."""
    assert len(single_process_reference.metrics) == STEPS
    return single_process_reference


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run.metrics


def _assert_same_curve(metrics, reference, rtol=RTOL):
    # with the held-out evaluation after the last step (forward only through the same schedule)
    assert_same_curve(metrics, reference, rtol, grad_norm_rtol=1e-4, val_loss=True)


def test_clean_run_ledger_sums_to_its_wall_clock(reference_run):
    """The goodput ledger of a run without faults: every second attributed, nothing lost, every
    sample of the schedule trained on once (mega/goodput)."""
    from mega.goodput import ledger
    from tests.goodput_checks import assert_sums_to_wall

    led = ledger.write(reference_run.run_dir)
    assert_sums_to_wall(led)
    assert (
        led["lost_steps"] == []
        and led["ledger_s"]["lost_work"] == 0
        and led["ledger_s"]["fault_detection"] == 0
    )
    assert led["ledger_s"]["productive"] > 0 and led["ledger_s"]["startup"] > 0
    batch = json.loads((reference_run.run_dir / "config.json").read_text())["parallelism"][
        "global_batch_size"
    ]
    assert (
        led["samples"]["exact"]
        and led["samples"]["distinct_samples"] == led["samples"]["trained_samples"] == STEPS * batch
    )


def test_reference_run_learns(reference):
    assert len(reference) == STEPS
    losses = [m["loss"] for m in reference]
    assert all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < losses[0]
    assert all(m["tokens_per_s"] > 0 and m["mfu"] > 0 for m in reference)
    # MFU is throughput over one peak measured at start-up (on a shared CPU its value depends on the
    # load then, so no bound of 1 here): the same ratio at every step
    ratios = [m["mfu"] / m["tokens_per_s"] for m in reference]
    assert max(ratios) / min(ratios) < 1 + 1e-9, ratios
    # train.eval_batches=4, eval_interval=0: one validation loss, after the last step
    assert [("val_loss" in m) for m in reference] == [False, False, False, True]
    assert 0 < reference[-1]["val_loss"] < 10


@pytest.mark.parametrize(
    "layout",
    # tp2 runs with sequence parallelism (TP without SP: tests/test_lamb.py, test_parallel_block.py);
    # tp2-pp2-dp2: test_resume_with_another_layout; dp2: test_hung_rank_becomes_a_restart_not_a_silent_wait
    [
        ["parallelism=tp2", "parallelism.sequence_parallel=true"],
        ["parallelism=pp2"],
        ["parallelism=pp2-vpp2"],
        # megatron-core's split counting the embedding and the loss as layers: 1, 2, 1 layers
        [
            "parallelism=pp2",
            "parallelism.pp=3",
            "parallelism.account_for_embedding_in_pipeline_split=true",
            "parallelism.account_for_loss_in_pipeline_split=true",
        ],
        # one slot a chunk: the first stage's first chunk holds only the embedding, the last
        # stage's last chunk only the loss (Llama 3's layout, section 3.3.2): 0, 1, 1 and 1, 1, 0
        [
            "parallelism=pp2-vpp2",
            "parallelism.vpp=3",
            "parallelism.account_for_embedding_in_pipeline_split=true",
            "parallelism.account_for_loss_in_pipeline_split=true",
        ],
    ],
    ids=["tp2-sp", "pp2", "pp2-vpp2", "pp3-accounted", "pp2-vpp3-one-slot"],
)
def test_layout_matches_single_process(layout, tmp_path, data_index, data_cache, reference):
    result = train(tmp_path, data_index, data_cache, [*layout, "checkpoint.interval=0"])
    assert result.attempts == 1
    _assert_same_curve(result.metrics, reference)
    assert result.init["world_size"] == compose(layout).parallelism.world_size


@pytest.fixture(scope="module")
def killed_3d_run(tmp_path_factory, data_index, data_cache):
    """TP2xPP2xDP2 with no restarts allowed, its rank 0 killed right after the step-2 checkpoint:
    the run fails (test_restarts_are_bounded) and leaves that checkpoint as `latest` for the
    resumes in other layouts (test_resume_with_another_layout)."""
    root = tmp_path_factory.mktemp("killed-3d")
    with pytest.raises(TrainingFailed) as failed:
        train(
            root / "saved",
            data_index,
            data_cache,
            [
                "parallelism=tp2-pp2-dp2",
                "checkpoint.interval=2",
                "restart.max_restarts=0",
                "fault.kill_rank=0",
                "fault.kill_at_step=2",
                f"checkpoint.dir={root / 'checkpoints'}",
            ],
        )
    return root, failed.value


def test_resume_with_another_layout(tmp_path, killed_3d_run, data_index, data_cache, reference, monkeypatch):
    """Save with TP2xPP2xDP2, resume with DP4 (TP and PP gone, the distributed optimizer's shards
    split four ways) and with one process: both continue the
    uninterrupted curve (megatron's fully reshardable format; the data order does not depend on
    the layout). The saving run dies right after its step-2 checkpoint, so that checkpoint is the
    `latest` both resumes read; they save nothing themselves (interval 0), leaving it in place.
    Each rank of a resume held exactly what dist_checkpointing's metadata says its shards need."""
    from mega.checkpoint.restore import AUDIT_ENV

    root, _ = killed_3d_run
    ckpt = ["checkpoint.dir=" + str(root / "checkpoints")]
    saved = read_metrics(root / "saved")
    _assert_same_curve(saved, reference[:2])
    for name, layout in [
        ("dp4", ["parallelism=dp2", "parallelism.dp=4"]),
        ("single", ["parallelism=single"]),
    ]:
        monkeypatch.setenv(AUDIT_ENV, str(tmp_path / f"audit-{name}"))
        resumed = train(tmp_path / name, data_index, data_cache, [*layout, "checkpoint.interval=0", *ckpt])
        assert [m["step"] for m in resumed.metrics] == [3, 4], name
        # resharded optimizer state, fp32 sums in another order: equal to ~5 digits
        _assert_same_curve(resumed.metrics, reference[2:], rtol=1e-4)
        _assert_restore_footprint(
            tmp_path / f"audit-{name}", root / "checkpoints" / "iter_0000002", resumed.init["restore"]
        )
    assert read_latest(root / "checkpoints").name == "iter_0000002"


def _assert_restore_footprint(audit_dir, ckpt_dir, info):
    """Per rank: what it asked to load (its requests: tensor shards by key, global offset and
    shape; objects by key), mapped through the checkpoint's ``.metadata`` (which chunk of which
    tensor lives at which file offset) to byte ranges, plus the small files every rank reads, is
    exactly what it fetched and the most it held at once besides its load buffers. The optimizer
    state is requested for the rank's DP slice only; every byte was read from the store once."""
    from torch.distributed.checkpoint import FileSystemReader

    from mega.checkpoint.restore import COMMON_FILES

    md = FileSystemReader(str(ckpt_dir)).read_metadata()
    where = {
        (i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
        for i, s in md.storage_data.items()
    }
    chunks = {
        k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks")
    }
    files = {f["path"]: f["size"] for f in json.loads((ckpt_dir / "manifest.json").read_text())["files"]}

    def needs(requests):
        pieces = set()
        for r in requests:
            if len(r) == 1:  # an object, stored whole
                pieces.add(where[(r[0], None)])
                continue
            key, _, offset, shape = r
            for c_offset, c_size in chunks[key]:
                if all(o < g + n and g < o + s for o, s, g, n in zip(c_offset, c_size, offset, shape)):
                    pieces.add(where[(key, c_offset)])
        return pieces

    audits = [json.loads(p.read_text()) for p in sorted(audit_dir.glob("rank*.json"))]
    assert [a["rank"] for a in audits] == list(range(len(audits))) and audits
    union, optimizer_bytes = set(), []
    for a in audits:
        pieces = needs(a["requests"])
        held = {tuple(p[:3]) for p in a["pieces"]}
        assert held == pieces | {(f, 0, files[f]) for f in COMMON_FILES}, a["rank"]
        expected = sum(n for _, _, n in pieces) + sum(files[f] for f in COMMON_FILES)
        assert a["peak_bytes"] - a["buffer_bytes"] == expected, a["rank"]
        assert a["read_bytes"] + a["received_bytes"] == expected
        optimizer_bytes.append(
            sum(n for r in a["requests"] if r[0].startswith("optimizer.") for _, _, n in needs([r]))
        )
        union |= held
    all_optimizer = sum(s.length for i, s in md.storage_data.items() if i.fqn.startswith("optimizer."))
    if len(audits) > 1:  # DP slices: each rank asks for part of the optimizer state, all of it together
        assert max(optimizer_bytes) < all_optimizer / 2, (optimizer_bytes, all_optimizer)
    else:
        assert optimizer_bytes == [all_optimizer]
    assert {k for a in audits for k, *_ in a["requests"] if k.startswith("optimizer.")} == {
        k for k in md.state_dict_metadata if k.startswith("optimizer.")
    }
    # one DP group: every piece read from the store once, by one rank
    assert info["restore_bytes_read"] == sum(a["read_bytes"] for a in audits) == sum(n for _, _, n in union)
    assert info["restore_peak_bytes_per_rank"] == max(a["peak_bytes"] for a in audits)


def test_restarts_are_bounded(killed_3d_run):
    """A job that dies with no restarts left (restart.max_restarts=0) stops with a clear error."""
    root, failed = killed_3d_run
    assert str(failed).startswith("training failed 1 times (last: ") and str(failed).endswith(
        f"see {root / 'saved'}/train-attempt*.log"
    ), str(failed)


def test_a_failed_runs_ledger_keeps_only_the_steps_its_last_save_made_durable(killed_3d_run):
    """The run ends failed (no restart left) right after its step-2 save committed: the ledger
    reads that commit from the run's save log and counts no step up to it as lost; a step after
    it would be (tests/test_goodput.py)."""
    from mega.checkpoint import read_save_log
    from mega.goodput import ledger

    run_dir = killed_3d_run[0] / "saved"
    assert [r["step"] for r in read_save_log(run_dir) if r["event"] == "committed"] == [2]
    led = ledger.build(run_dir)
    assert led["attempts"][-1]["ok"] is False
    assert all(x["step"] > 2 for x in led["lost_steps"]), led["lost_steps"]
    assert led["ledger_s"]["productive"] > 0


def test_hung_rank_becomes_a_restart_not_a_silent_wait(
    tmp_path, tmp_path_factory, data_index, data_cache, reference
):
    """A rank that stops making progress: the launcher sees no progress for stability.hang_timeout_s,
    kills the job and resumes it from the in-memory copies of the last step. Through the restart, the DP2 run computes the
    model of one process (the dp2 case of test_layout_matches_single_process)."""
    messages = []
    result = train(
        tmp_path,
        data_index,
        data_cache,
        [
            "parallelism=dp2",
            "checkpoint.interval=2",
            "stability.hang_timeout_s=12",
            "checkpoint.upload_timeout_s=6",
            "fault.kill_rank=1",
            "fault.kill_at_step=3",
            "fault.mode=hang",
        ],
        steps=4,
        log=messages.append,
    )
    assert result.attempts == 2
    assert any("hung (no progress) at step 3" in m for m in messages), messages
    # the heartbeats localise it (mega.stability): rank 1 sleeps, alive, behind its DP peer
    from mega.stability.incident import read_incidents

    [incident] = read_incidents(tmp_path)
    assert incident["culprit"]["rank"] == 1 and incident["culprit"]["reason"] == "behind", incident
    assert incident["culprit"]["group"].startswith("dp")  # the DP (x CP) group its peer waits in
    # rank 1 hung after handing over its copy of step 3 (the copy thread finished it): no step lost
    assert [m["attempt"] for m in result.metrics] == [0, 0, 0, 1]
    assert (result.init["restore"]["source"], result.init["restore"]["step"]) == ("memory", 3)
    _assert_same_curve(result.metrics, reference)
    assert result.init["world_size"] == 2
    # the goodput ledger of the hang: every second attributed, the lost step counted from the metrics
    from tests.goodput_checks import assert_cut_off_records_are_named, assert_ledger_of_faulted_run

    assert_ledger_of_faulted_run(tmp_path, steps=4)
    assert_cut_off_records_are_named(tmp_path, tmp_path_factory.mktemp("cut-off"))
