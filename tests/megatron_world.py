"""A gloo world of spawned CPU processes running megatron-core as mega.train sets it up, for tests
that build megatron models by hand (CPU patches stay out of pytest's own process)."""

from __future__ import annotations

import json
import os

import torch
from helpers import free_port


def start_world(rank: int, world_size: int, port: int) -> None:
    """A gloo world of CPU processes with megatron's CPU adaptations, as mega.train sets up."""
    import torch.distributed as dist

    from mega import megatron_cpu, megatron_fixes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    megatron_fixes.apply()
    megatron_cpu.apply()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def use_tp(tp: int) -> None:
    """(Re)build megatron's process groups for tensor-parallel size `tp` (the rest is DP)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def stop_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def build(cfg):
    """The rank's model (its only chunk), as mega.train builds it."""
    from mega.model import build_model_chunks, transformer_config

    return build_model_chunks(cfg, transformer_config(cfg))[0]


def loss(model, vocab: int, seq: int, micro_batch: int) -> float:
    """The mean loss of one fixed batch of random tokens predicting themselves."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (micro_batch, seq), generator=gen)
    positions = torch.arange(seq)[None].expand_as(tokens)
    return model(tokens, positions, None, labels=tokens).mean().item()


def perturb(module) -> None:
    """Add noise to every parameter, so that norms and biases (which the init sets to 1 and 0)
    take part in a check against a formula."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for param in module.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))


def spawn(worker, nprocs: int, out_dir) -> dict:
    """Run ``worker(rank, port, out_dir)`` in ``nprocs`` spawned processes; what rank 0 wrote to
    ``out_dir/results.json``."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=nprocs, join=True)
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)
