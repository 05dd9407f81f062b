"""``python -m mega.goodput RUN_DIR [--json]``: the run's ledger; writes RUN_DIR/goodput.json."""

from __future__ import annotations

import argparse
import json
import sys

from mega.goodput import ledger


def table(led: dict) -> str:
    wall = led["wall_s"] or 1.0
    rows = [f"{c:<18} {s:10.2f} s  {100 * s / wall:6.2f} %" for c, s in led["ledger_s"].items() if s > 0]
    parts = [f"  unattributed: {k}: {v:.2f} s" for k, v in led["unattributed_parts"].items()]
    return "\n".join([f"wall {led['wall_s']:.2f} s, ETTR {led['ettr']:.4f}", *rows, *parts])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mega.goodput", description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="the last line is the ledger as JSON")
    return p


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``main`` does, reading no run (a bad flag exits)."""
    _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        led = ledger.write(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(led))
    if args.json:
        print(json.dumps({k: v for k, v in led.items() if k != "timeline"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
