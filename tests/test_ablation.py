"""`python -m mega.bench ablation`: four rows trained on one token budget, JSON last line, a plot.

The budget here is tiny (8 baseline steps, 2 steps of the 4x batch): this checks the benchmark's
plumbing and arithmetic, not convergence (docs/benchmarks.md has the measured numbers)."""

import json
import math
import os
import subprocess
import sys

import pytest

from mega.bench import ablation
from mega.config import ConfigError, compose

TOKENS = 8 * 16 * 64  # 8 steps of the single layout's batch (16 sequences of 64 tokens)


def test_ablation_prints_four_rows_and_plots_the_curves(data_index, data_cache, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "ablation", f"data.cache_dir={data_cache}",
         "--tokens", str(TOKENS), "--out", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    rows = result["rows"]
    assert [r["name"] for r in rows] == ["baseline", "ptb", "ptb+swa", "ptb+swa+lamb4x"]
    for row in rows:
        assert {"name", "final_loss", "tokens_per_s", "loss_vs_baseline"} <= set(row)
        assert math.isfinite(row["final_loss"]) and 0 < row["final_loss"] < 10, row
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert row["loss_vs_baseline"] == pytest.approx(row["final_loss"] / rows[0]["final_loss"] - 1)
    assert rows[0]["loss_vs_baseline"] == 0

    # what each row trains: the same tokens, the 4x batch in 1/4 of the steps
    by_name = {r["name"]: r for r in rows}
    assert [(r["steps"], r["global_batch_size"]) for r in rows] == [(8, 16), (8, 16), (8, 16), (2, 64)]
    assert (by_name["baseline"]["block"], by_name["ptb"]["block"]) == ("sequential", "parallel")
    assert [r["window_size"] for r in rows] == [None, None, 16, 16]
    assert [r["optimizer"] for r in rows] == ["adam", "adam", "adam", "lamb"]
    assert result["tokens"] == TOKENS and result["final_loss_tokens"] == 4 * 16 * 64

    png = tmp_path / "out" / "loss_curves.png"
    assert result["plot"] == str(png.resolve())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curves: {png.resolve()}" in out.stderr
    details = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert [len(details["curves"][r["name"]]) for r in rows] == [8, 8, 8, 2]
    assert details["curves"]["ptb+swa+lamb4x"][-1][0] == details["curves"]["baseline"][-1][0] == TOKENS


def test_row_configs_and_budget_arithmetic():
    table = ablation.rows(window=16)
    base = compose([*ablation.DEFAULT_OVERRIDES, *table[0].overrides])
    assert ablation.budget(base, None, 4) == (512 * 1024, 512)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        ablation.budget(base, 6 * 1024, 4)
    assert ablation.tail_tokens(128 * 1024, 4096) == 16 * 1024
    assert ablation.tail_tokens(8 * 1024, 4096) == 4096

    lamb = compose(ablation._row_overrides(table[3], ["model.num_layers=2"], base, 32) + ["train.steps=32"])
    assert (lamb.optimizer.name, lamb.parallelism.global_batch_size, lamb.model.num_layers) == ("lamb", 64, 2)
    assert (lamb.model.block, lamb.model.window_size, lamb.model.full_attention_every) == ("parallel", 16, 2)
    assert lamb.optimizer.warmup_steps == 3  # lamb.yaml's 10 steps of 16 sequences = 2.5 steps of 64
    assert (lamb.optimizer.lr, lamb.optimizer.min_lr) == (ablation.DEFAULT_LAMB_LR, ablation.DEFAULT_LAMB_LR / 10)
    baseline = compose(ablation._row_overrides(table[0], [], base, 128) + ["train.steps=128"])
    assert (baseline.model.block, baseline.optimizer.name) == ("sequential", "adam")
    assert baseline.optimizer.warmup_steps == 10

    # the mean loss over the steps ending in the final window; same tokens for every row
    curve = [(1024 * s, float(s)) for s in range(1, 9)]
    assert ablation.final_loss(curve, 8192, 4096) == (5 + 6 + 7 + 8) / 4
    assert ablation.final_loss([(4096, 1.0), (8192, 2.0)], 8192, 4096) == 2.0


def test_ablation_rejects_a_features_override():
    out = subprocess.run([sys.executable, "-m", "mega.bench", "ablation", "features=megascale", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "features" in out.stderr
