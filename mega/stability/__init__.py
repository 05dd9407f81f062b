"""Stability of long runs (docs/stability.md): every rank's heartbeat to Redis (``heartbeat``), the
driver's watcher that turns heartbeats into hang and straggler incidents (``detect``), the verdict
that names the rank holding a hung job up (``localise``), the incident record (``incident``), NaN/Inf
rollback with the step's batch skipped (``rollback``) and who runs next after a node fails its
self-check: eviction, spares, fewer nodes (``membership``).

Importing this package is cheap (no torch, no redis); ``heartbeat`` imports torch lazily.
"""
