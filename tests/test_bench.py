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
