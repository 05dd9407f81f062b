"""Checkpoints of a training run: two-stage saves to a durable store, and restores in which each
rank fetches and holds only what its own shards need. See docs/checkpoints.md.

* ``save.py``: ``Checkpointer`` -- stage 1 (a host snapshot, all training waits for), stage 2
  (serialise, upload, commit, move ``latest``) on a background thread; uploads give up after
  ``checkpoint.upload_timeout_s`` of the store not answering.
* ``restore.py``: ``restore`` -- `latest`, or the newest complete checkpoint that verifies; the
  model shards of the rank's TP/PP coordinates and the optimizer state of its DP slice, fetched
  as verified byte ranges once per DP group (``exchange.py``) and passed to the DP peers that
  need them.
* ``megatron_io.py``: the seams into megatron-core's dist_checkpointing those two use.
* ``memory.py``: ``MemoryCheckpoints`` -- in-memory copies of every rank's shard in node-local
  shared memory, replicated to a rank on the next node; restored before the durable ``latest``
  when newer (a crashed rank's or lost node's state in seconds, without the store).
* ``common.py``: names, where a run's checkpoints live, the state dicts.

The data-loader position is the step: ``TokenDataset.microbatch`` is a pure function of (seed,
step, DP rank), so a restored step sees the same data. Nothing is unpickled except with
``weights_only=True`` (and dist_checkpointing's ``.metadata`` by torch's reader, once verified).

megatron-core is imported inside the functions that need it: the flow process reads `latest`
through this package and should not pay for (or print the warnings of) importing megatron.
"""

from mega.checkpoint.common import (
    LATEST,
    META_FILE,
    SHARDING_METADATA,
    CheckpointError,
    iteration_dir,
    iteration_name,
    latest_durable,
    open_store,
    read_latest,
    staging_root,
    storage_uri,
)
from mega.checkpoint.memory import MemoryCheckpoints
from mega.checkpoint.restore import describe_source, load, restore, restore_source
from mega.checkpoint.save import Checkpointer
from mega.storage.save_log import SAVE_LOG, read_save_log

__all__ = [
    "LATEST",
    "MemoryCheckpoints",
    "META_FILE",
    "SAVE_LOG",
    "SHARDING_METADATA",
    "CheckpointError",
    "Checkpointer",
    "iteration_dir",
    "iteration_name",
    "latest_durable",
    "load",
    "open_store",
    "read_latest",
    "read_save_log",
    "restore",
    "restore_source",
    "describe_source",
    "staging_root",
    "storage_uri",
]
