"""`python -m mega.bench step ... --json` prints a JSON result as its last line."""

import json
import os
import subprocess
import sys

import pytest


def test_bench_step_prints_json_last_line(data_cache):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.bench",
            "step",
            "parallelism=dp2",
            f"data.cache_dir={data_cache}",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"tokens_per_s", "mfu", "step_s", "device", "config"}
    assert result["step_s"] > 0 and result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert (
        result["tokens_per_s"]
        == result["config"]["global_batch_size"] * result["config"]["seq_length"] / result["step_s"]
    )
    assert result["config"]["parallelism"] == "dp2" and result["config"]["world_size"] == 2
    assert result["device"].startswith("cpu")


def test_bench_rejects_a_bad_config_naming_the_key():
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "step", "parallelism.tp=3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "parallelism.tp" in out.stderr


def test_bench_bootstrap_prints_results_and_plot(tmp_path):
    """Tiny N (TP=2 x PP=2): schema of the last line, every point replayed to the end on its real
    server with the planned operations, store operations growing as modelled, and one real-rank
    row (a 2-rank tp2 timing job, light groups) with its start-up phases."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.bench",
            "bootstrap",
            "--ranks",
            "8,16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--probe-ranks",
            "",
            "--max-seconds",
            "300",
            "--real",
            "tp2",
            "--real-group-init",
            "light",
            "--real-repeats",
            "1",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["results"]
    names = (
        "torch-default-tcpstore",
        "per-group-barrier-tcpstore",
        "per-group-barrier-redis",
        "light-redis",
        "light-barrier-redis",
    )
    assert [(r["strategy"], r["ranks"]) for r in rows] == [(s, n) for s in names for n in (8, 16)]
    assert result["baseline"] == "torch-default-tcpstore"
    for r in rows:
        assert {"strategy", "ranks", "seconds", "store_ops", "completed", "measured"} <= set(r)
        assert r["measured"] is True and isinstance(r["seconds"], float) and r["seconds"] > 0, r
        assert isinstance(r["store_ops"], int) and r["store_ops"] == sum(r["planned_by_kind"].values())
        issued, planned = r["ops_by_kind"], r["planned_by_kind"]
        assert {k: v for k, v in issued.items() if k != "set"} == {
            k: v for k, v in planned.items() if k != "set"
        }
        assert issued["set"] >= planned["set"]  # ranks reaching a barrier together may each release it
        assert r["torch_dist_init_barrier"] is ("barrier" in r["strategy"])
    ops = {(r["strategy"], r["ranks"]): r["store_ops"] for r in rows}
    # torch 2.13's default issues no barrier: light and default send the same store traffic
    assert ops["torch-default-tcpstore", 16] == ops["light-redis", 16]
    assert ops["per-group-barrier-tcpstore", 8] == ops["per-group-barrier-redis", 8]  # two servers
    # a world-wide barrier per group, groups ~ N -> ~N^2; light's one barrier -> ~N
    assert ops["per-group-barrier-redis", 16] / ops["per-group-barrier-redis", 8] > 3
    assert ops["light-barrier-redis", 16] / ops["light-barrier-redis", 8] < 2.2
    assert ops["light-barrier-redis", 16] < ops["per-group-barrier-redis", 16] / 4
    assert ops["torch-default-tcpstore", 16] < ops["light-barrier-redis", 16]
    assert set(result["growth"]) == set(names)
    assert all(g["exponent"] is not None and g["measured"] is False for g in result["growth"].values())
    # speed-ups only between measured rows at the same N
    seconds = {(r["strategy"], r["ranks"]): r["seconds"] for r in rows}
    for s in result["speedups"]:
        assert s["speedup"] == round(seconds[s["vs"], s["ranks"]] / seconds[s["strategy"], s["ranks"]], 2)
    assert {(s["strategy"], s["vs"]) for s in result["speedups"] if s["ranks"] == 16} == {
        *((n, "torch-default-tcpstore") for n in names[1:]),
        *((n, "per-group-barrier-tcpstore") for n in names if n != "per-group-barrier-tcpstore"),
    }
    # nothing was replayed at 2,048 ranks: the targets there are unmeasured, never met
    target = result["targets"]["speedup_vs_per_group_barrier_at_2048"]
    assert target == {"value": None, "measured": False, "target": 100.0, "met": False}

    (real,) = result["real"]
    assert (real["strategy"], real["layout"], real["ranks"], real["measured"]) == (
        "real-light-tcpstore",
        "tp2",
        2,
        True,
    )
    phases = real["phases"]
    assert set(phases) == {
        "spawn_s",
        "import_s",
        "import_skew_s",
        "pg_init_s",
        "mp_store_s",
        "mp_connect_s",
        "mp_megatron_s",
        "mp_barrier_s",
    }
    assert all(v >= 0 for v in phases.values()), phases
    # the slowest rank's group creation, split without remainder
    parts = ("mp_store_s", "mp_connect_s", "mp_megatron_s", "mp_barrier_s")
    assert sum(phases[k] for k in parts) == pytest.approx(real["seconds"], abs=1e-6)
    assert real["seconds_per_repeat"] == [real["seconds"]]
    # megatron-core's import happens before the clock: it is the import phase, not group creation
    assert phases["import_s"] > real["seconds"] > 0
    assert real["job_s"] > phases["spawn_s"] + phases["import_s"]
    assert result["targets"]["real_group_creation_s_tp2"]["measured"] is True
    assert result["layout"]["tp"] == 2 and result["layout"]["pp"] == 2
    assert os.path.getsize(result["plot"]) > 1000 and result["plot"].endswith(".png")


def test_checkpoint_bench_attributes_each_save_the_steps_it_overlapped():
    """save_costs against a hand-made run of 1 s steps: the first save (one-off costs) and one
    committing after the last step are left out; the second blocked 0.3 s and slowed the one step
    after it by 0.2 s while stage 2 ran, so it cost 0.5 s over two steps."""
    from mega.bench.checkpoint import save_costs

    ends = {1: 0.0, 2: 1.0, 3: 2.0, 4: 3.5, 5: 4.5, 6: 5.5, 7: 6.5, 8: 7.8, 9: 9.0, 10: 10.0}
    metrics = [{"step": s, "time": t} for s, t in ends.items()]
    log = [
        {"event": "save", "step": 3, "time": 2.5, "stall_s": 0.5},
        {"event": "committed", "step": 3, "time": 2.9},
        {"event": "save", "step": 7, "time": 6.8, "stall_s": 0.3},
        {"event": "retry", "time": 7.0},
        {"event": "committed", "step": 7, "time": 8.0},
        {"event": "save", "step": 10, "time": 10.1, "stall_s": 0.1},
        {"event": "committed", "step": 10, "time": 11.0},
    ]
    got = save_costs(metrics, log)
    assert got["clean_step_s"] == 1.0  # the mean of steps 2, 3, 5, 6, 7 and 10
    assert got["overlapped_steps"] == [2]
    assert got["cost_s"] == [pytest.approx(0.5)]
