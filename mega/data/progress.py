"""How a dataset preparation shows progress: ``Progress`` is False (nothing), True (a live rich bar
and notes on stderr: a terminal) or a function taking one line (a log: the flow's prepare-data task),
which gets the notes and a tokenizing line every ``LOG_EVERY_S`` and at the end."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

Progress = bool | Callable[[str], None]
LOG_EVERY_S = 30.0  # a log gets a tokenizing line this often: a long preparation is seen moving


def say(progress: Progress, message: str) -> None:
    """A note (a download, the tokenizer's training, a wait on another preparer)."""
    if callable(progress):
        progress(message)
    elif progress:
        print(message, file=sys.stderr)


def _counts(counts: dict, seconds: float) -> str:
    mb_s = counts["bytes"] / 1e6 / max(seconds, 1e-9)
    return f"{counts['documents']:,} docs, {counts['tokens']:,} tokens, {mb_s:.1f} MB/s"


@contextlib.contextmanager
def tokenizing(progress: Progress, corpus) -> Iterator[Callable]:
    """``show(unit, counts, seconds)`` after each unit encoded: the files done, documents, tokens
    and MB/s so far."""
    if not progress:
        yield lambda *args: None
        return
    if callable(progress):
        last = {"at": time.monotonic(), "counts": None, "seconds": 0.0}

        def log(unit, counts, seconds) -> None:
            last.update(counts=dict(counts), seconds=seconds)
            if time.monotonic() - last["at"] >= LOG_EVERY_S:
                last["at"] = time.monotonic()
                progress(
                    f"tokenizing: file {unit.file + 1} of {len(corpus.files)}, {_counts(counts, seconds)}"
                )

        yield log
        if last["counts"] is not None:
            progress(f"tokenized {_counts(last['counts'], last['seconds'])} in {last['seconds']:.1f} s")
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=Console(stderr=True)
    ) as bar:
        task = bar.add_task("tokenizing", total=len(corpus.files))

        def show(unit, counts, seconds) -> None:
            bar.update(
                task,
                completed=unit.file + (unit.end >= corpus.files[unit.file].size),
                description=f"tokenizing: {_counts(counts, seconds)}",
            )

        yield show
