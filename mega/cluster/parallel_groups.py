"""megatron-core's model-parallel groups, built the upstream way or barrier-light.

``initialize_model_parallel(strategy, **megatron_kwargs)`` takes megatron-core's own keyword
arguments (``parallel_state.initialize_model_parallel``) and a strategy (``cluster.group_init``):

* ``"default"``: megatron-core unchanged. Every rank calls ``torch.distributed.new_group`` for
  *every* group of the layout, in the same order, also for the groups it is not a member of.
* ``"light"`` (MegaScale, NSDI'24 section 3.5): the same groups, with the same rank lists, the same
  order and the same group names, but only the member ranks of a group call into torch for it
  (``use_local_synchronization=True``); a non-member gets ``GroupMember.NON_GROUP_MEMBER`` without
  touching torch or the store. A rank therefore synchronises only with the ranks it shares a group
  with, and never waits on a group it does not belong to.

megatron-core still computes every rank list (``RankGenerator``) and decides which group is which;
``light`` only replaces ``parallel_state.create_group`` for the duration of the call (a context
manager restores it, also on errors).

Store operations per group (torch 2.13, measured with ``mega.store.recording.RecordingStore``;
n = world size, k = group size, "name" = torch's group name, keys relative to the default store):

==========================  =============================================================
strategy                    store operations issued for one group
==========================  =============================================================
default, every member       gloo rendezvous on ``<name>/cpu/``: 1 ``set`` (own address),
                            k ``wait`` + k ``get`` (every member's address, itself included).
                            NCCL (lazy, the default): none at creation; the first collective
                            exchanges the ncclUniqueId (member 0 ``set``, the others ``get``)
default, every non-member   nothing (torch returns NON_GROUP_MEMBER before any store access)
default, +barrier           with ``TORCH_DIST_INIT_BARRIER=1`` (torch's default before 2.1;
                            MegaScale's setting) additionally, on EVERY rank of the world:
                            2 ``add`` + 1 ``wait`` on ``store_based_barrier_key:<name>``, and
                            one ``set`` of ``...:last_worker`` by the last rank to arrive:
                            3n + 1 operations per group, all ranks blocked until all arrive
light, every member         the same gloo/NCCL rendezvous as ``default``
light, every non-member     nothing, and no Python call into torch at all
light, +barrier             no barrier per group. Once all groups exist, ONE barrier over the
                            world on the default store: per rank 1 ``add`` + 1 ``wait`` on
                            ``mega_groups_ready:<first group name>``, plus one ``set`` of
                            ``...:done`` by the rank whose ``add`` completes the count
==========================  =============================================================

So with the post-init barrier, ``default`` costs every rank 3 store operations for every group of
the job: O(groups x n) = O(n^2 / k) in total, each group a world-wide rendezvous. ``light`` costs a
rank only the rendezvous of the groups it is in (a fixed number per rank, ~15 for megatron's
layouts) and 2 operations for the one barrier: O(n) in total, and until that barrier a slow rank
delays only the ranks it shares groups with. The per-group barriers add nothing a member relies
on: a gloo group's rendezvous already connects every member to every other, and an NCCL
communicator is created at its first collective, which waits for the unique id itself; what the
barrier promised ("once we return, every rank has its groups") the one barrier at the end still
gives. Without the barrier (torch >= 2.1's default) both strategies issue the same store
operations; ``light`` still skips the per-group Python work on non-members, and it keeps start-up
O(n) whatever ``TORCH_DIST_INIT_BARRIER`` says.

Why the group name needs care. With ``use_local_synchronization=True`` torch names a group by a
hash of its ranks *and of how many groups this process already holds* (``_hash_ranks_to_str``).
Under members-only creation that count differs between members (with pp=2 only the first stage
holds the position-embedding group), so members of a later cross-stage group would rendezvous
under different names and hang -- reproduced with megatron-core 0.16.1 at tp=1 pp=2 (the
``EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``). ``light`` therefore names each group by its
global creation index, the name ``default`` gives it (``str(_world.group_count)`` at that point),
and advances ``_world.group_count`` past all groups afterwards, as ``default`` does. Groups created
later with plain ``new_group`` get the same names under both strategies.

Limits: ``light`` needs a default group without a bound device (``init_process_group`` without
``device_id``, as mega does): with one, torch creates NCCL sub-communicators by ``ncclCommSplit``
of the world communicator, a collective every rank must join. ``tests/test_parallel_groups.py``
checks every group megatron-core exposes against ``default``, rank for rank, and fingerprints the
torch and megatron-core functions this relies on (``RELIED_ON_SOURCES``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

STRATEGIES = ("default", "light")

# "module:qualname" -> sha256 (16 hex digits) of the source verified with torch 2.13.0 and
# megatron-core 0.16.1; tests/test_parallel_groups.py fails when one changes.
RELIED_ON_SOURCES = {
    # every group of initialize_model_parallel goes through create_group, and its return value is
    # only kept on member ranks
    "megatron.core.parallel_state:create_group": "c63a8d09e4df84b5",
    "megatron.core.parallel_state:initialize_model_parallel": "82b593e47f68d4d2",
    # non-members return before naming; members name through _process_group_name(hashed=True)
    "torch.distributed.distributed_c10d:_new_group_with_tag": "fef33c1ee0580a5f",
    "torch.distributed.distributed_c10d:_process_group_name": "b242a927cc6857a5",
    # the per-group barrier of _new_group_with_tag asks this, once per group
    "torch.distributed.distributed_c10d:_is_barrier_after_init": "f6218773e858b436",
}

READY_BARRIER_PREFIX = "mega_groups_ready"


def initialize_model_parallel(strategy: str = "default", **megatron_kwargs: Any) -> None:
    """megatron-core's ``parallel_state.initialize_model_parallel`` with the given strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"cluster.group_init: unknown strategy {strategy!r}, expected one of {list(STRATEGIES)}"
        )
    from megatron.core import parallel_state

    if strategy == "default":
        parallel_state.initialize_model_parallel(**megatron_kwargs)
    else:
        with members_only_group_creation():
            parallel_state.initialize_model_parallel(**megatron_kwargs)


@contextlib.contextmanager
def members_only_group_creation() -> Iterator[None]:
    """Within the block, megatron-core's ``create_group`` creates a group on its members only."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("members-only group creation needs torch.distributed to be initialized")
    if c10d._get_default_group().bound_device_id is not None:
        raise RuntimeError(
            "cluster.group_init=light needs a default process group without a bound device: "
            "torch then splits NCCL communicators from the world one, which every rank must join"
        )
    rank = dist.get_rank()
    # The name `default` gives the i-th group: new_group without local synchronisation takes
    # str(_world.group_count) and increments it on every rank, member or not.
    names = (str(i) for i in itertools.count(c10d._world.group_count))
    created = 0
    next_name: list[str] = []
    original_create_group = parallel_state.create_group
    original_group_name = c10d._process_group_name

    def group_name(ranks, use_hashed_name):
        if next_name:
            return c10d.GroupName(next_name.pop())
        return original_group_name(ranks, use_hashed_name)

    def create_group(
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
    ):
        nonlocal created
        name = next(names)
        created += 1
        if ranks is None:
            ranks = list(range(dist.get_world_size()))
        if rank not in ranks:
            # megatron keeps a group only `if rank in ranks`; the sentinel is what new_group
            # would have returned here
            return dist.GroupMember.NON_GROUP_MEMBER
        next_name.append(name)
        try:
            group = original_create_group(
                ranks,
                timeout=timeout,
                backend=backend,
                pg_options=pg_options,
                use_local_synchronization=True,
                group_desc=group_desc,
            )
        finally:
            unnamed = bool(next_name)
            next_name.clear()
        if unnamed:  # torch named the group some other way: members could disagree on the name
            raise RuntimeError(
                "torch.distributed.new_group did not name the group through "
                "_process_group_name; re-verify mega/cluster/parallel_groups.py"
            )
        return group

    base = c10d._world.group_count
    barrier_after_init = c10d._is_barrier_after_init()
    original_barrier_after_init = c10d._is_barrier_after_init
    parallel_state.create_group = create_group
    c10d._process_group_name = group_name
    c10d._is_barrier_after_init = lambda: 0  # one barrier at the end instead of one per group
    try:
        yield
    finally:
        parallel_state.create_group = original_create_group
        c10d._process_group_name = original_group_name
        c10d._is_barrier_after_init = original_barrier_after_init
        # as if every rank had called new_group for every group: later names agree with `default`
        c10d._world.group_count = base + created
    if barrier_after_init == 1:
        world_barrier(c10d._get_default_store(), f"{READY_BARRIER_PREFIX}:{base}", dist.get_world_size())


def world_barrier(store, key: str, world_size: int) -> None:
    """Every rank of the world: one ``add`` and one ``wait`` (the rank that completes the count
    also ``set``s the release key), under the store's timeout. torch's ``_store_based_barrier``
    spends three operations per rank (it re-reads the count with ``add(key, 0)``)."""
    if store.add(key, 1) == world_size:
        store.set(key + ":done", b"1")
    store.wait([key + ":done"])
