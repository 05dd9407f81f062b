"""Where mega's checkpoints plug into megatron-core's dist_checkpointing (and torch DCP under it).

Five seams, each a small object megatron calls or reads, none a patch of megatron's code:

* ``use_in_process_results_queue``: the queue megatron's asynchronous writer reports its write
  results on. megatron creates it on first use as a ``multiprocessing`` Manager queue of the spawn
  context, because its own async caller runs the writer in another process; starting that
  Manager spawns a server process that imports the rank's ``__main__`` (mega.train: torch and
  megatron), seconds of every rank's first save of every attempt. mega runs the writer in the
  rank's stage-2 thread (the writer puts its results from the calling thread), so an in-process
  queue carries them.

* ``write_in_this_thread``: runs megatron's asynchronous writer in the stage-2 thread instead of
  the process it forks per save (its docstring says why).
* ``WriteResultsTap``: stands in for megatron's results queue in the asynchronous writer's
  arguments. It sees this rank's write results -- (file, offset, length) of every serialised
  tensor and object -- so stage 2 can hash each piece while it uploads the file (the manifest's
  ``ranges``), and a restore can fetch and verify single pieces.
* ``optimizer_load_request``: the distributed optimizer's ``fully_reshardable`` load request,
  asking only for the parameters of this rank's DP slice. megatron's own request
  (``sharded_param_state_fully_reshardable(is_loading=True)``) allocates and loads the whole
  TP/PP slice of optimizer state on every DP rank, then keeps 1/DP of it. The request here names
  the same keys and shapes, only fewer of them; parameters wholly inside the slice load straight
  into the live optimizer state, the few that straddle a slice boundary into a buffer.
  megatron's ``load_parameter_state_from_fully_reshardable`` reads only the local entries.
* ``ExchangeLoadStrategy`` / ``ExchangeReader``: megatron's ``TorchDistLoadShardedStrategy``
  with a torch DCP reader whose ``read_data`` gets the bytes of the pieces its load plan names
  from a ``PieceExchange`` (mega/checkpoint/exchange.py: read once per DP group from the store,
  verified, passed to the DP peers that need them) instead of from files on local disk.

``RELIED_ON_SOURCES`` pins the megatron-core and torch functions these depend on; a change
fails ``tests/test_checkpoint_seams.py``.
"""

from __future__ import annotations

import io
import queue
from contextlib import contextmanager
from functools import partial

import torch

# "module:qualname" -> sha256 (16 hex digits) of the source verified with megatron-core 0.16.1
# and torch 2.13.0.
RELIED_ON_SOURCES = {
    # WriteResultsTap: the writer's arguments are [rank, write_buckets, results_queue] and the
    # writer puts {proc: [WriteResult]} (or an exception) on the queue from the calling thread.
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.get_save_function_and_args": "0ff91ddb4e33e526",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.write_preloaded_data_multiproc": "bef05e8d525e7eed",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.write_preloaded_data": "0aef9e6cbe573e10",
    # use_in_process_results_queue: the module-level queue is made on first use only, and read
    # with get_nowait() by the finalisation
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue": "349269cbdd569d41",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.retrieve_write_results": "2eea63c5350046e0",
    # optimizer_load_request mirrors the first, is called by the second, is read by the third.
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fully_reshardable": "e888c7cccb71525a",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict": "2d70893ff7c08a35",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_fully_reshardable": "ea3388fac4318b9f",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states": "b4a1328a3db8a0b2",
    # ExchangeLoadStrategy: load() builds its reader with _get_filesystem_reader(dir, cache_metadata=True)
    "megatron.core.dist_checkpointing.strategies.torch:TorchDistLoadShardedStrategy.load": "960cfa14f177d722",
    "megatron.core.dist_checkpointing.strategies.torch:_get_filesystem_reader": "dde7021dc2565a96",
    # ExchangeReader.read_data mirrors torch's, from bytes in memory instead of a file
    "torch.distributed.checkpoint.filesystem:FileSystemReader.read_data": "86ad890ac621f4f5",
}

_OPTIMIZER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # as get_parameter_state_dp_zero's


# ---------------------------------------------------------------------------------------------
# Save: the writer's results queue, and which bytes of each file hold which serialised item


def use_in_process_results_queue() -> None:
    """Make megatron's write-results queue an in-process ``queue.Queue`` (see the module
    docstring) unless it already has one; before the first save of the process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class WriteResultsTap:
    """Takes the place of the results queue in megatron's asynchronous writer arguments:
    remembers what the writer puts there and passes it on to megatron's queue."""

    def __init__(self, queue):
        self.queue = queue
        self.results = None

    def put(self, item) -> None:
        self.results = item
        if self.queue is not None:
            self.queue.put(item)

    def pieces(self) -> dict[str, list[tuple[int, int]]]:
        """{file relative to the checkpoint: [(offset, length), ...]} of this rank's write."""
        out: dict[str, list[tuple[int, int]]] = {}
        if not isinstance(self.results, dict):  # nothing written, or the writer failed
            return out
        for results in self.results.values():
            for r in results:
                info = r.storage_data
                out.setdefault(info.relative_path, []).append((info.offset, info.length))
        return out


def tap_write_results(request) -> WriteResultsTap | None:
    """Put a tap in a megatron AsyncRequest's writer arguments (None: nothing to write)."""
    if request.async_fn is None:
        return None
    args = request.async_fn_args  # [rank, write_buckets, results_queue]
    tap = WriteResultsTap(args[2])
    args[2] = tap
    return tap


def write_in_this_thread(request) -> None:
    """Run megatron's asynchronous writer (``FileSystemWriterAsync.write_preloaded_data_multiproc``,
    ``request.async_fn``) without its fork: each write bucket goes through megatron's
    ``write_preloaded_data`` in the calling thread (stage 2's), and the results reach the queue
    as the forking writer puts them ({bucket: [WriteResult]}, or the exception).

    Why: the fork copies the rank's page tables (torch, megatron, the model), and while the child
    writes, every page the training thread touches is copied -- CPU that training pays, on no
    counter (the child's own CPU is not the rank's either). The staging files are not fsynced:
    they are uploaded, then deleted; durability is the store's."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fn = request.async_fn
    if getattr(fn, "func", None) is not FileSystemWriterAsync.write_preloaded_data_multiproc:
        fn(*request.async_fn_args, **request.async_fn_kwargs)  # another writer: as megatron calls it
        return
    transform_list, use_msc = fn.args
    _, buckets, results = request.async_fn_args  # [rank, write_buckets, results_queue]
    write = FileSystemWriterAsync.write_preloaded_data.__wrapped__  # without the GC pause its fork needs
    out: dict | Exception = {}
    for i, bucket in enumerate(buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)  # the writer takes its token back when done
        write(transform_list, i, bucket, local, count, False, **({"use_msc": True} if use_msc else {}))
        _, written = local.get()
        if isinstance(written, Exception):
            out = written
            break
        out[i] = written
    results.put(out)


# ---------------------------------------------------------------------------------------------
# Restore: the optimizer asks for its DP slice only


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def _dp_slice_request(opt, counter: list, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """``sharded_param_state_fully_reshardable(is_loading=True)`` for the parameters of this
    rank's DP slice only (see the module docstring). Same keys, shapes and replica ids as
    megatron's, and the same ``param_idx`` numbering, with the entries of other ranks' params
    left out."""
    from collections import ChainMap
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    assert is_loading, "the DP-slice request is for loading only"
    param_to_sharded_metadata = {}
    model_sharded_state_dict, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    for sh_base in nested_values(model_sharded_state_dict):
        param_to_sharded_metadata[sh_base.data] = sh_base
    # Live tensors only when they are the optimizer's own (not unscaled copies).
    in_place = not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    state = {}
    param_idx = 0
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
            local = ChainMap(*(m["param_map"] for m in gbuf_range_map_for_all_buckets))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                if model_param in local:
                    sharded = param_to_sharded_metadata[model_param]
                    param_range = local[model_param]["param"]
                    whole = param_range.start == 0 and param_range.end == model_param.numel()
                    live = (
                        opt._get_main_param_and_optimizer_states(model_param) if whole and in_place else None
                    )
                    tensors = {}
                    for key in _OPTIMIZER_STATE_KEYS:
                        if (
                            live is not None
                            and live[key].dtype == torch.float32
                            and live[key].is_contiguous()
                        ):
                            data = live[key].detach().view(sharded.data.shape)  # loads in place
                        else:  # straddles a slice boundary: the whole param's state, trimmed later
                            data = torch.empty(sharded.data.shape, dtype=torch.float32)
                            counter[0] += data.numel() * data.element_size()
                        kwargs = dict(
                            key=f"optimizer.state.{key}.{sharded.key}",
                            data=data,
                            dtype=data.dtype,
                            replica_id=sharded.replica_id,
                        )
                        if isinstance(sharded, ShardedTensorFactory):
                            kwargs.pop("dtype")
                        tensors[key] = replace(sharded, **kwargs)
                        tensors[key].validate_metadata_integrity()
                    state[param_idx] = tensors
                param_idx += 1
    return state


def optimizer_load_request(optimizer, model_sd: dict, metadata: dict) -> tuple[dict, int]:
    """(the optimizer's sharded state dict for loading, bytes of buffers allocated for it).

    For megatron's distributed optimizer in the ``fully_reshardable`` format the request names
    this rank's DP slice only; anything else gets megatron's own request."""
    opts = _distributed_optimizers(optimizer)
    counter = [0]
    if metadata.get("distrib_optim_sharding_type") != "fully_reshardable" or not opts:
        return optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata), 0
    for opt in opts:  # an instance attribute shadows the method for this object only
        opt.sharded_param_state_fully_reshardable = partial(_dp_slice_request, opt, counter)
    try:
        return optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata), counter[0]
    finally:
        for opt in opts:
            del opt.sharded_param_state_fully_reshardable


# ---------------------------------------------------------------------------------------------
# Restore: a torch DCP reader fed by the DP group's exchange


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class ExchangeReader(FileSystemReader):
        """A FileSystemReader over the local staging directory (``.metadata`` is there) whose
        ``read_data`` takes the bytes of every piece of its plan from a PieceExchange."""

        def __init__(self, path, exchange):
            super().__init__(path)
            self.exchange = exchange
            self._metadata = None

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                self._metadata = super().read_metadata(*args, **kwargs)
            return self._metadata

        def read_data(self, plan, planner):
            from torch.distributed._shard._utils import narrow_tensor_by_index
            from torch.distributed.checkpoint.planner import LoadItemType
            from torch.futures import Future

            wanted = []
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                if info.transform_descriptors:
                    raise NotImplementedError(
                        f"{info.relative_path}: stream transforms "
                        f"{info.transform_descriptors} are not supported"
                    )
                wanted.append((info.relative_path, info.offset, info.length))
            self.exchange.fetch(wanted)  # collective: every rank of the job calls read_data once
            for req, piece in zip(plan.items, wanted):
                data = io.BytesIO(self.exchange.get(*piece))
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, data)
                else:
                    tensor = torch.load(data, map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(
                            f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
                del data
                self.exchange.release(*piece)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    return ExchangeReader


def load_strategy(exchange, requests: list | None = None):
    """megatron's torch_dist load strategy reading through ``exchange``; ``requests`` (a list)
    receives what this rank asked to load: (key, global shape, global offset, shape of its box)
    of each tensor shard, (unique key,) of each object."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    reader_class = _reader_class()

    class ExchangeLoadStrategy(torch_strategy.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            if requests is not None:
                requests.extend(_requests(sharded_state_dict))
            with _reader(torch_strategy, lambda path, cache_metadata=False: reader_class(path, exchange)):
                return super().load(sharded_state_dict, checkpoint_dir)

    return ExchangeLoadStrategy()


@contextmanager
def _reader(module, factory):
    """``TorchDistLoadShardedStrategy.load`` builds its reader with the module-level
    ``_get_filesystem_reader``: swap it for the duration of one load (restores are
    single-threaded, at start-up)."""
    original = module._get_filesystem_reader
    module._get_filesystem_reader = factory
    try:
        yield
    finally:
        module._get_filesystem_reader = original


def _requests(sharded_state_dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            # the box in the global tensor: prepended axes (stacked layers) are one element wide
            out.append(
                [
                    sh.key,
                    list(sh.global_shape),
                    list(sh.global_offset),
                    [1] * sh.prepend_axis_num + list(sh.local_shape),
                ]
            )
        elif isinstance(sh, ShardedObject):
            out.append([sh.unique_key])
    return out
