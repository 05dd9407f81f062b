"""The frozen optimizer view that lets checkpoint stage 2 build the optimizer state off the
training thread (mega/optimizer_snapshot.py). Its behaviour is exercised end to end by
tests/test_checkpoint.py (asynchronous saves resume onto the uninterrupted curve bit for bit);
here: the megatron-core code it relies on has not changed under it."""

import pytest

from mega import optimizer_snapshot


@pytest.mark.parametrize("target", sorted(optimizer_snapshot.RELIED_ON_SOURCES))
def test_relied_on_sources_unchanged(target):
    from mega.megatron_cpu import source_fingerprint

    assert source_fingerprint(target) == optimizer_snapshot.RELIED_ON_SOURCES[target], (
        f"{target} changed: re-verify mega/optimizer_snapshot.py against it"
    )


def test_only_the_distributed_optimizer_is_frozen():
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        optimizer_snapshot.freeze(object())
