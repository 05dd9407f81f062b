"""Rendezvous stores beyond torch's TCPStore: ``RedisStore`` and a local ``RedisServer``.

A store here is a ``torch.distributed.Store``: the small key-value service ranks meet through
(``store.kind``). Checkpoint files go to ``mega.storage``, a different thing.

Names resolve lazily: ``mega.store.redis_server`` (server, URL helpers) imports neither torch nor
redis-py at import time, so config validation can use it cheaply; ``RedisStore`` needs torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RedisServer": "redis_server",
    "RedisServerError": "redis_server",
    "find_redis_server": "redis_server",
    "parse_redis_url": "redis_server",
    "redact_url": "redis_server",
    "RedisStore": "redis_store",
    "RedisStoreError": "redis_store",
    "RedisUnreachableError": "redis_store",
    "RedisAuthError": "redis_store",
    "drop_attempts": "redis_store",
    "RecordingStore": "recording",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mega.store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mega.store.{_EXPORTS[name]}"), name)
