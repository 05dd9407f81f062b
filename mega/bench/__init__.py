"""Benchmarks: ``python -m mega.bench <name> [hydra overrides] --json``; the last line is JSON."""
