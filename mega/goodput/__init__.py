"""Goodput: where a run's wall clock went (docs/goodput.md).

``marks`` records the timestamps (ranks, driver, flow) on one clock; ``ledger`` attributes every
second of the run to one category and computes ETTR; ``samples`` checks that every sample of the
schedule was trained on exactly once; ``plot`` draws the ledger. ``python -m mega.goodput RUN_DIR``.
"""
