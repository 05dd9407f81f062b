"""`python -m mega.bench ablation`: four rows trained on one token budget, JSON last line, a plot.

The budget here is tiny (8 baseline steps, 2 steps of the 4x batch, one seed, 64 held-out
sequences): this checks the benchmark's plumbing and arithmetic, not convergence
(docs/benchmarks.md has the measured numbers, two seeds per row)."""

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
        [
            sys.executable,
            "-m",
            "mega.bench",
            "ablation",
            f"data.cache_dir={data_cache}",
            "--tokens",
            str(TOKENS),
            "--seeds",
            "5",
            "--eval-sequences",
            "64",
            "--out",
            str(tmp_path / "out"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    rows = result["rows"]
    assert [r["name"] for r in rows] == ["baseline", "ptb", "ptb+swa", "ptb+swa+lamb4x"]
    for row in rows:
        assert {
            "name",
            "final_loss",
            "tokens_per_s",
            "loss_vs_baseline",
            "seeds",
            "val_loss",
            "val_loss_per_seed",
            "val_loss_vs_baseline",
        } <= set(row)
        assert math.isfinite(row["final_loss"]) and 0 < row["final_loss"] < 10, row
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert row["loss_vs_baseline"] == pytest.approx(row["final_loss"] / rows[0]["final_loss"] - 1)
        assert row["seeds"] == [5] and len(row["val_loss_per_seed"]) == 1
        assert row["val_loss"] == row["val_loss_per_seed"][0] and 0 < row["val_loss"] < 10, row
        assert row["val_loss_vs_baseline"] == pytest.approx(row["val_loss"] / rows[0]["val_loss"] - 1)
        assert row["within_target"] is (row["val_loss_vs_baseline"] <= 0.02)
    assert rows[0]["loss_vs_baseline"] == 0 and rows[0]["val_loss_vs_baseline"] == 0
    # the same 64 held-out sequences for every row: 4 batches of 16, 1 of the 4x row's 64
    assert [r["eval_batches"] for r in rows] == [4, 4, 4, 1] and result["eval_sequences"] == 64
    assert result["seeds"] == [5] and result["tuning_seed"] == 1234 and result["lamb_lr_tuning"] == []

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
    assert [len(details["curves"][r["name"]]["5"]) for r in rows] == [8, 8, 8, 2]
    assert (
        details["curves"]["ptb+swa+lamb4x"]["5"][-1][0] == details["curves"]["baseline"]["5"][-1][0] == TOKENS
    )


def test_row_configs_and_budget_arithmetic():
    table = ablation.rows(window=16)
    base = compose([*ablation.DEFAULT_OVERRIDES, *table[0].overrides])
    assert ablation.budget(base, None, 4) == (512 * 1024, 512)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        ablation.budget(base, 6 * 1024, 4)
    assert ablation.tail_tokens(128 * 1024, 4096) == 16 * 1024
    assert ablation.tail_tokens(8 * 1024, 4096) == 4096

    lamb = compose(
        ablation._row_overrides(table[3], ["model.num_layers=2"], base, 32, seed=7, eval_sequences=128)
        + ["train.steps=32"]
    )
    assert (lamb.train.seed, lamb.train.eval_batches, lamb.train.eval_interval) == (7, 2, 0)  # 128 = 2 x 64
    assert (lamb.optimizer.name, lamb.parallelism.global_batch_size, lamb.model.num_layers) == ("lamb", 64, 2)
    assert (lamb.model.block, lamb.model.window_size, lamb.model.full_attention_every) == ("parallel", 16, 2)
    assert lamb.optimizer.warmup_steps == 3  # lamb.yaml's 10 steps of 16 sequences = 2.5 steps of 64
    assert (lamb.optimizer.lr, lamb.optimizer.min_lr) == (
        ablation.DEFAULT_LAMB_LR,
        ablation.DEFAULT_LAMB_LR / 10,
    )
    baseline = compose(ablation._row_overrides(table[0], [], base, 128) + ["train.steps=128"])
    assert (baseline.model.block, baseline.optimizer.name) == ("sequential", "adam")
    assert baseline.optimizer.warmup_steps == 10

    # the mean loss over the steps ending in the final window; same tokens for every row
    curve = [(1024 * s, float(s)) for s in range(1, 9)]
    assert ablation.final_loss(curve, 8192, 4096) == (5 + 6 + 7 + 8) / 4
    assert ablation.final_loss([(4096, 1.0), (8192, 2.0)], 8192, 4096) == 2.0


def test_throughput_rows_add_each_overlap_on_top_of_ptb_swa():
    """The --throughput part: cumulative rows in the paper's order, each a valid 8-rank config with
    exactly one more kind of overlap than the row before; tokens/s compared row to row."""
    names = [r.name for r in ablation.throughput_rows()]
    assert names == ["ptb+swa", "+tp-overlap", "+pp-overlap", "+dp-overlap"]
    cfgs = [
        compose([*ablation.DEFAULT_OVERRIDES, *ablation.THROUGHPUT_LAYOUT, *r.overrides])
        for r in ablation.throughput_rows()
    ]
    assert all(c.parallelism.world_size == 8 and c.model.block == "parallel" for c in cfgs)
    flags = [
        (c.parallelism.tp_overlap, c.parallelism.overlap_p2p_comm, c.parallelism.align_param_gather)
        for c in cfgs
    ]
    assert flags == [
        ("none", False, False),
        ("ring", False, False),
        ("ring", True, False),
        ("ring", True, True),
    ]

    def metrics(tps):
        return [
            {
                "step": i + 1,
                "loss": 1.0,
                "tokens_per_s": t,
                "step_s": 1 / t,
                "exposed_tp_s": 0.1,
                "exposed_pp_s": 0.2,
                "exposed_dp_s": 0.3,
            }
            for i, t in enumerate(tps)
        ]

    first = ablation.throughput_row("ptb+swa", metrics([1.0, 1.0, 100.0, 100.0, 100.0]), None)
    second = ablation.throughput_row("+tp-overlap", metrics([1.0, 1.0, 110.0, 110.0, 120.0]), first)
    assert (first["tokens_per_s"], second["tokens_per_s"]) == (100.0, 110.0)  # warm-up steps left out
    assert first["tokens_per_s_vs_previous"] is None and second["tokens_per_s_vs_previous"] == 0.1


@pytest.mark.parametrize(
    "args, key",
    [
        (["features=megascale"], "features"),
        (["train.seed=3"], "train.seed"),
        (["--seeds", "2,1234"], "--seeds"),  # 1234 chose the LAMB learning rate
    ],
)
def test_ablation_rejects_what_it_sets_itself(args, key):
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "ablation", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"config error: {key}" in out.stderr, out.stderr


def test_lamb_lr_is_picked_by_validation_loss_and_the_held_out_set_is_whole_batches(data_index):
    tuning = [
        {"lr": 0.03, "val_loss": 4.1},
        {"lr": 0.05, "val_loss": 4.0},
        {"lr": 0.2, "val_loss": float("nan")},
    ]
    assert ablation.pick_lamb_lr(tuning) == 0.05
    with pytest.raises(RuntimeError, match="diverged"):
        ablation.pick_lamb_lr([{"lr": 0.2, "val_loss": float("nan")}])

    from mega.data import TokenDataset

    base = compose([*ablation.DEFAULT_OVERRIDES, f"data.cache_dir={data_index.parent.parent}"])
    held_out = TokenDataset(data_index, base.model.seq_length, seed=0, split="val").num_samples
    assert ablation.eval_sequences(base, data_index, 64, None) == held_out // 64 * 64 > 0
    assert ablation.eval_sequences(base, data_index, 64, 128) == 128
    for bad in (100, 0, (held_out // 64 + 1) * 64):
        with pytest.raises(ConfigError, match="--eval-sequences"):
            ablation.eval_sequences(base, data_index, 64, bad)
