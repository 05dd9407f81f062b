"""Benchmarks: ``python -m mega.bench <name> [hydra overrides] --json``; the last line is JSON.
``tp_overlap`` is the per-node harness of the ``parallelism.tp_overlap`` backends, started by
torchrun (``infra/gpu-tp-overlap.sh``)."""
