"""`python -m mega.bench step ... --json` prints a JSON result as its last line."""

import json
import os
import subprocess
import sys


def test_bench_step_prints_json_last_line(data_cache):
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "step", "parallelism=dp2", f"data.cache_dir={data_cache}",
         "--steps", "4", "--warmup", "1", "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"tokens_per_s", "mfu", "step_s", "device", "config"}
    assert result["step_s"] > 0 and result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["tokens_per_s"] == result["config"]["global_batch_size"] * result["config"]["seq_length"] / result["step_s"]
    assert result["config"]["parallelism"] == "dp2" and result["config"]["world_size"] == 2
    assert result["device"].startswith("cpu")


def test_bench_rejects_a_bad_config_naming_the_key():
    out = subprocess.run([sys.executable, "-m", "mega.bench", "step", "parallelism.tp=3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "parallelism.tp" in out.stderr


def test_bench_bootstrap_prints_results_and_plot(tmp_path):
    """Tiny N (TP=2 x PP=2): schema of the last line, every point replayed to the end on its real
    server with the planned operations, and store operations growing as modelled."""
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "bootstrap", "--ranks", "8,16", "--tp", "2", "--pp", "2",
         "--probe-ranks", "", "--max-seconds", "300", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["results"]
    assert [(r["strategy"], r["ranks"]) for r in rows] == [
        (s, n) for s in ("default-tcpstore", "default-redis", "light-redis") for n in (8, 16)]
    for r in rows:
        assert {"strategy", "ranks", "seconds", "store_ops", "completed"} <= set(r)
        assert r["completed"] is True and isinstance(r["seconds"], float) and r["seconds"] > 0, r
        assert isinstance(r["store_ops"], int) and r["store_ops"] == sum(r["planned_by_kind"].values())
        issued, planned = r["ops_by_kind"], r["planned_by_kind"]
        assert {k: v for k, v in issued.items() if k != "set"} == {k: v for k, v in planned.items() if k != "set"}
        assert issued["set"] >= planned["set"]  # ranks reaching a barrier together may each release it
    ops = {(r["strategy"], r["ranks"]): r["store_ops"] for r in rows}
    assert ops["default-tcpstore", 8] == ops["default-redis", 8]  # same traffic, two servers
    # default: a world-wide barrier per group, groups ~ N -> ~N^2; light: members only -> ~N
    assert ops["default-redis", 16] / ops["default-redis", 8] > 3
    assert ops["light-redis", 16] / ops["light-redis", 8] < 2.2
    assert ops["light-redis", 16] < ops["default-redis", 16] / 4
    assert set(result["growth"]) == {"default-tcpstore", "default-redis", "light-redis"}
    assert all(g["exponent"] is not None for g in result["growth"].values())
    assert result["layout"]["tp"] == 2 and result["layout"]["pp"] == 2
    assert os.path.getsize(result["plot"]) > 1000 and result["plot"].endswith(".png")
