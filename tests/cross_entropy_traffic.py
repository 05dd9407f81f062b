"""The memory traffic of megatron-core's vocab-parallel cross entropy over the logits, counted op by
op as it runs on a one-rank gloo world. Run as a script (``python cross_entropy_traffic.py PORT``):
prints {dtype: {"forward": [bytes per logit, kernels], "backward": [...]}} as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LogitTraffic(TorchDispatchMode):
    """Bytes each aten op reads and writes of tensors the size of the logits (per-token tensors
    are the loss's small change; an ``out=`` argument is written, not read). Gathers at the
    target, views and allocations move no logit-sized data."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.bytes, self.kernels = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.is_view or name.startswith(("index", "new_", "empty")):
            return out
        reads = tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
        moved = sum(
            t.nbytes
            for t in reads + tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.numel() == self.numel
        )
        if moved:
            self.bytes += moved
            self.kernels += 1
        return out


def traffic(dtype: torch.dtype) -> dict[str, list[float]]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    seq, batch, vocab = 16, 2, 1000
    logits = torch.randn(seq, batch, vocab, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (seq, batch))
    with LogitTraffic(logits.numel()) as forward:
        loss = vocab_parallel_cross_entropy(logits, target)
    with LogitTraffic(logits.numel()) as backward:  # the gradient the output layer receives
        torch.autograd.grad(loss, logits, torch.rand_like(loss))
    n = logits.numel()
    return {
        "forward": [forward.bytes / n, forward.kernels],
        "backward": [backward.bytes / n, backward.kernels],
    }


def main(port: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        print(json.dumps({name: traffic(getattr(torch, name)) for name in ("bfloat16", "float32")}))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
