"""The driver's progress lines (mega.metrics.ProgressLog) from the rows the logging rank appends."""

from __future__ import annotations

import json

from mega.metrics import METRICS_FILE, ProgressLog, step_line


def row(step: int, step_s: float, end: float = 1000.0) -> dict:
    return {
        "step": step,
        "time": end,
        "loss": 7.0 - step / 10,
        "grad_norm": 1.5,
        "lr": 3e-3,
        "tokens_per_s": 1000.0,
        "mfu": 0.02,
        "step_s": step_s,
    }


def test_every_nth_step_and_the_last_with_the_time_left_and_a_torn_line_waited_for(tmp_path):
    """Rows of an earlier attempt are not this one's; a line the rank is still writing is read
    whole at the next poll; the time left is the steps left at this attempt's wall-clock pace
    (from its first row), or at the one row's step time."""
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps(row(1, 9.0)) + "\n")  # an earlier attempt's row
    logs: list[str] = []
    progress = ProgressLog(tmp_path, every=2, steps=5, log=logs.append)
    # step -> (its step time, its end): a 2 s save after step 3
    times = {2: (0.5, 1000.5), 3: (0.7, 1001.2), 4: (0.4, 1003.6), 5: (0.6, 1004.2)}
    rows = {s: row(s, *t) for s, t in times.items()}
    text = "".join(json.dumps(r) + "\n" for r in rows.values())
    cut = text.index("\n", text.index('"step": 4')) - 5  # inside step 4's row
    with path.open("a") as f:
        f.write(text[:cut])
    progress.poll()
    assert logs == [step_line(rows[2], 5) + " | 2 s left"]  # one row: 3 steps left at its 0.5 s
    with path.open("a") as f:
        f.write(text[cut:] + "not json\n")
    progress.poll()
    # 1 step left at 1.55 s a step: (1003.6 - 1000.5) / 2, the save included
    assert logs[1:] == [step_line(rows[4], 5) + " | 2 s left", step_line(rows[5], 5)]
    assert logs[2].startswith("step 5/5 | loss 6.50000 | grad norm 1.5000 |") and logs[2].endswith("600 ms")
    progress.poll()  # nothing new
    assert len(logs) == 3


def test_no_lines_with_interval_0_or_before_the_file_exists(tmp_path):
    logs: list[str] = []
    ProgressLog(tmp_path, every=3, steps=3, log=logs.append).poll()  # no metrics.jsonl yet
    off = ProgressLog(tmp_path, every=0, steps=3, log=logs.append)
    (tmp_path / METRICS_FILE).write_text(json.dumps(row(3, 0.1)) + "\n")
    off.poll()
    assert logs == []
