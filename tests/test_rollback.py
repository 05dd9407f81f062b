"""NaN/Inf steps and loss spikes roll back and skip (mega/stability/rollback.py): a NaN injected
at step k ends the attempt before anything of step k is saved, the driver relaunches from `latest`
skipping step k's batch, losses after are finite, the skip is recorded; a loss spike later in the
same run (the last stage's final layer norm scaled 30x) is caught by the robust z-score and handled
the same way; the curve equals a run configured from the start never to train on those batches,
bit for bit (CPU, real processes)."""

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_run_logged

from mega.config import compose
from mega.launch.runs import read_record
from mega.stability import rollback
from mega.stability.incident import read_incidents

STEPS, NAN_AT, SPIKE_AT = 8, 4, 7


PP2_SAVED_EVERY_2 = ["parallelism=pp2", "train.eval_batches=0", "checkpoint.async_save=false"]
PP2_SAVED_EVERY_2 += ["checkpoint.interval=2", "stability.spike_min_steps=3"]


def train(run_dir, data_index, data_cache, overrides):
    return tiny_run_logged(run_dir, data_index, data_cache, [*PP2_SAVED_EVERY_2, *overrides], steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_index, data_cache):
    """The drill (NaN at step 4, a loss spike at step 7) and the reference (both steps skipped from
    the start)."""
    root = tmp_path_factory.mktemp("rollback")
    drill = train(
        root / "drill",
        data_index,
        data_cache,
        [f"fault.nan_at_step={NAN_AT}", f"fault.spike_at_step={SPIKE_AT}"],
    )
    reference = train(root / "reference", data_index, data_cache, [f"train.skip_steps=[{NAN_AT},{SPIKE_AT}]"])
    return root, drill, reference


@pytest.mark.slow
def test_nan_step_and_spike_roll_back_and_are_skipped(runs):
    root, (drill, logs), _ = runs
    assert drill.attempts == 3
    first, second, third = drill.history
    assert first["skipped_step"] == NAN_AT and first["final_step"] == NAN_AT - 1  # nothing of step 4 logged
    assert second["restored"] == "iter_0000002"  # the last durable checkpoint before the NaN
    assert any(f"step {NAN_AT}: loss not finite and grad_norm not finite" in line for line in logs), logs
    assert second["skipped_step"] == SPIKE_AT and second["final_step"] == SPIKE_AT - 1
    assert third["restored"] == "iter_0000006"  # saved after the skipped step 4, before the spike
    assert any(f"step {SPIKE_AT}: loss spike" in line for line in logs), logs
    # both faults were real arithmetic: a poisoned weight (NaN), a 30x final layer norm (spike)
    faults = [json.loads(line) for line in (root / "drill" / "faults.jsonl").read_text().splitlines()]
    assert {(f["kind"], f["step"], f["attempt"]) for f in faults} == {
        ("nan", NAN_AT, 0),
        ("spike", SPIKE_AT, 1),
    }
    # the skips are in the run record and the metrics; every other step has a finite loss
    record = read_record(root / "drill")
    assert [(s["step"], s["attempt"]) for s in record.skipped_steps] == [(NAN_AT, 0), (SPIKE_AT, 1)]
    assert [m["step"] for m in drill.metrics] == list(range(1, STEPS + 1))
    for k in (NAN_AT, SPIKE_AT):
        skipped = drill.metrics[k - 1]
        assert skipped["data_skipped"] and skipped["skipped"] and math.isnan(skipped["loss"])
    assert all(math.isfinite(m["loss"]) for m in drill.metrics if not m.get("data_skipped"))
    assert not (root / "drill" / rollback.ROLLBACK_FILE).exists()  # taken by the driver
    # incidents (mega/launch/incidents.py), each recovered by the next attempt's first step
    nan, spike = [i for i in read_incidents(root / "drill") if i["kind"] != "straggler"]
    assert (nan["kind"], nan["action"]) == ("nan", f"rolled back to iter_0000002, step {NAN_AT} skipped")
    assert (
        nan["summary"] == f"step {NAN_AT}: loss not finite and grad_norm not finite"
        and nan["steps_lost"] == 1
    )
    assert (spike["kind"], spike["action"], spike["attempt"]) == (
        "spike",
        f"rolled back to iter_0000006, step {SPIKE_AT} skipped",
        1,
    )
    assert spike["summary"] == f"step {SPIKE_AT}: loss spike" and spike["steps_lost"] == 0
    assert nan["time_to_recover_s"] > 0 and spike["time_to_recover_s"] > 0


def _window(losses, **stability):
    cfg = compose(["model=tiny", *(f"stability.{k}={v}" for k, v in stability.items())])
    w = rollback.LossWindow(cfg)
    for x in losses:
        w.add(x)
    return w


def test_spike_rule_is_a_robust_z_score_of_increases_only():
    losses = [5.0, 4.9, 5.2, 4.8, 5.1, 5.0, 4.7, 5.3, 5.05]
    w = _window(losses)
    # independent reference: numpy's median, the MAD scaled to a normal's sigma
    med = float(np.median(losses))
    sigma = 1.4826 * float(np.median(np.abs(np.array(losses) - med)))
    assert w.z_score(6.8) == pytest.approx((6.8 - med) / sigma, rel=1e-9)
    assert w.is_spike(6.8)  # z ~ 12, 36% above the median
    assert not w.is_spike(5.6)  # noise: z ~ 3.7
    assert not w.is_spike(1.0)  # a fall is training, however large
    assert not w.is_spike(float("nan"))  # not finite: the NaN rule's job
    # a flat curve: z is huge for any rise, the relative floor keeps noise out
    flat = _window([3.0] * 10)
    assert not flat.is_spike(3.3) and flat.is_spike(3.9)
    # too few losses yet, or the rule turned off
    assert not _window(losses[:7]).is_spike(50.0)
    assert not _window(losses, spike_z=0).is_spike(50.0)


def test_a_restart_judges_spikes_with_the_window_of_the_run_without_it(tmp_path):
    """A relaunch from step 24 rebuilds the window from metrics.jsonl: the losses of the good
    steps up to 24 (a skipped step's NaN and a failed attempt's steps past 24 left out), so the
    spike right after the restart is flagged as the uninterrupted run flags it."""
    cfg = compose([f"train.run_dir={tmp_path}", "stability.spike_window=8"])
    uninterrupted = rollback.LossWindow(cfg)
    rows = []
    for step in range(1, 25):
        loss = float("nan") if step == 20 else 5.0 + 0.01 * (step % 5)  # step 20 skipped
        rows.append({"step": step, "attempt": 0, "loss": loss})
        if math.isfinite(loss):
            uninterrupted.add(loss)
    # the attempt that failed after step 24 logged steps 25-27; the relaunch redoes them
    rows += [{"step": s, "attempt": 0, "loss": 9.0} for s in (25, 26, 27)]
    rows += [{"step": 23, "attempt": 1, "loss": rows[22]["loss"]}]  # a repeated step: the last wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    resumed = rollback.LossWindow.resumed(cfg, 24)
    assert list(resumed.losses) == list(uninterrupted.losses) and len(resumed.losses) == 8
    assert resumed.is_spike(8.0) and uninterrupted.is_spike(8.0)
    assert not rollback.LossWindow(cfg).is_spike(8.0)  # an empty window would let it through


def test_a_bad_step_right_after_a_restore_goes_back_one_checkpoint_and_skips_to_it():
    names = ["iter_0000016", "iter_0000020", "iter_0000024"]
    # restored 24, skipped 25 (the first rollback), 26 spiked: the damage is in iter_0000024
    first = {"step": 26, "restored_step": 24, "first_after_restore": True}
    assert rollback.further_back(first, names) == ("iter_0000020", [21, 22, 23, 24])
    # a step trained since the restore: `latest` was good, nothing more to do
    assert rollback.further_back({**first, "first_after_restore": False}, names) == (None, [])
    # no older checkpoint, or the attempt restored nothing
    assert rollback.further_back(first, ["iter_0000024"]) == (None, [])
    assert rollback.further_back({**first, "restored_step": 0}, names) == (None, [])


@pytest.mark.slow
def test_curve_after_skip_equals_a_run_that_never_saw_the_batch(runs):
    _, (drill, _), (reference, _) = runs
    assert reference.attempts == 1
    assert [m["step"] for m in reference.metrics] == [m["step"] for m in drill.metrics]
    for got, want in zip(drill.metrics, reference.metrics):
        if want.get("data_skipped"):
            assert got.get("data_skipped") and got["lr"] == want["lr"]
            continue
        # bit-identical on CPU: same data order, same updates, a bit-exact resume in between
        assert (got["loss"], got["grad_norm"], got["lr"]) == (want["loss"], want["grad_norm"], want["lr"]), (
            got,
            want,
        )


def _verdict_worker(rank: int, port: int, out: str) -> None:
    """Rank 1's 'stage 2' thread reduces on the default group before its main thread checks the
    step; rank 0's only after: on one shared group the two would pair with the wrong peers."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )  # a wrong pairing errors out, never hangs the suite
    ps.is_pipeline_last_stage = lambda ignore_virtual=False: True  # no model here: every rank holds a loss
    cfg = compose(["model=tiny", "cluster.pg_timeout_s=20", "checkpoint.load=false"])
    group = rollback.verdict_group(cfg)
    window = rollback.LossWindow(cfg)
    side = {}

    def stage2():
        t = torch.tensor([100.0 + rank])
        dist.all_reduce(t)  # what megatron's async save planning does on the default group
        side["sum"] = t.item()

    thread = threading.Thread(target=stage2)
    if rank == 1:
        thread.start()
        time.sleep(0.5)
    verdict = rollback.check_step(
        {"loss": float("nan") if rank == 0 else 5.0, "grad_norm": 1.0}, window, group
    )
    if rank == 0:
        thread.start()
    thread.join()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"verdict": verdict, "sum": side["sum"]}))
    dist.destroy_process_group()


def test_step_verdict_does_not_pair_with_a_save_threads_collectives(tmp_path, free_port):
    import torch.multiprocessing as mp

    mp.spawn(_verdict_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"verdict": {"loss": True, "grad_norm": False, "spike": False}, "sum": 201.0}, (
            rank,
            got,
        )


@pytest.mark.slow
def test_sample_ledger_lists_the_skipped_batches_and_the_rest_once(runs):
    """The goodput ledger of the drill (mega/goodput): every second attributed, the NaN step's and
    the spike's batches listed as skipped with their walk positions, every other sample of the
    schedule trained on exactly once; the reference (skipped from the start) lists the same."""
    from mega.goodput import ledger
    from tests.goodput_checks import assert_sums_to_wall

    root, (drill, _), _ = runs
    batch = json.loads((root / "drill" / "config.json").read_text())["parallelism"]["global_batch_size"]
    for name in ("drill", "reference"):
        led = ledger.write(root / name)
        assert_sums_to_wall(led)
        s = led["samples"]
        assert s["exact"], s
        assert [(x["step"], x["positions"]) for x in s["skipped"]] == [
            (k, list(range((k - 1) * batch, k * batch))) for k in (NAN_AT, SPIKE_AT)
        ]
        assert s["trained_samples"] == s["distinct_samples"] == (STEPS - 2) * batch
    # the final weights equal the reference's bit for bit (the soak's comparison, mega/bench/soak.py)
    from mega.bench.soak import weights_equal

    last = f"iter_{STEPS:07d}"
    same = weights_equal(
        root / "drill" / "checkpoints" / last, root / "reference" / "checkpoints" / last, root / "weights"
    )
    assert same["equal"] and same["tensors"] > 10, same
    drill_led = ledger.build(root / "drill")
    assert {(x["attempt"], x["step"]) for x in drill_led["lost_steps"]} >= {(0, 3), (0, NAN_AT)}
    assert drill_led["ledger_s"]["lost_work"] > 0 and drill_led["ledger_s"]["fault_detection"] > 0


def test_the_side_groups_fail_after_the_configured_timeout_not_torchs_default():
    """Every gloo group of mega's own (saves, save checks, in-memory copies, rollback verdicts)
    comes from gloo_side_group: it fails after cluster.pg_timeout_s as the world group does;
    dist.new_group alone would wait torch's default 30 minutes."""
    import subprocess
    import sys

    probe = (
        "import torch, torch.distributed as dist\n"
        "from mega.config import compose\n"
        "from mega.cluster.rendezvous import gloo_side_group\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "timeout = lambda g: g._get_backend(torch.device('cpu')).options._timeout.total_seconds()\n"
        "print(timeout(gloo_side_group(compose(['cluster.pg_timeout_s=7', 'checkpoint.load=false']))), timeout(dist.new_group(backend='gloo')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["7.0", "1800.0"]
    sources = " ".join(p.read_text() for p in Path(rollback.__file__).parents[1].rglob("*.py"))
    assert "new_group(backend=" not in sources.replace('dist.new_group(backend="gloo", timeout=', "")
