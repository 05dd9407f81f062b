"""Compare the ``parallelism.tp_overlap`` backends on one node: decoder forward+backward time and
the difference of outputs and gradients from ``none``. For GPU nodes (``infra/gpu-tp-overlap.sh``);
on CPU it runs ``none`` and ``ring`` over gloo.

    torchrun --standalone --nproc-per-node 8 -m mega.bench.tp_overlap --backends none,ring,symm_mem,te

Prints one JSON line last. The GPU path (NCCL streams, symm_mem kernels, Transformer Engine
userbuffers) was written on a CPU-only machine and has not been run: the JSON says so in
``script_status`` until someone replaces that with a GPU run's facts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

SCRIPT_STATUS = "unverified on GPU: written and run on CPU/gloo only (none, ring)"


def build_config(backend: str, args, world: int, cuda: bool):
    from mega.config import from_dict

    return from_dict(
        {
            "model": {
                "num_layers": args.layers,
                "hidden_size": args.hidden,
                "num_attention_heads": args.heads,
                "seq_length": args.seq,
                "vocab_size": 128,
                "block": args.block,
            },
            "parallelism": {
                "tp": world,
                "sequence_parallel": True,
                "tp_overlap": backend,
                "micro_batch_size": args.micro_batch,
                "global_batch_size": args.micro_batch,
            },
            "cluster": {
                "procs_per_node": world,
                "device": "cuda" if cuda else "cpu",
                "backend": "nccl" if cuda else "gloo",
                "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if cuda else {},
            },
            "train": {"precision": args.precision if cuda else "fp32"},
        }
    )


def run_backend(backend: str, args, world: int, cuda: bool) -> dict:
    """Build the decoder of ``backend`` (same layout-invariant weights for every backend), time
    ``args.iters`` forward+backward passes, return the times, the output and the gradients."""
    from megatron.core import parallel_state as ps

    from mega.model import build_model_chunks, transformer_config

    cfg = build_config(backend, args, world, cuda)
    tcfg = transformer_config(cfg)
    decoder = build_model_chunks(cfg, tcfg)[0].decoder
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    shard = ps.get_tensor_model_parallel_rank()
    full = torch.randn(args.seq, args.micro_batch, args.hidden, generator=gen)
    hidden = full.chunk(world)[shard].to(device, tcfg.params_dtype)
    # a fixed random output gradient (the final LayerNorm makes sum(out**2) constant)
    grad_out = torch.randn(full.shape, generator=gen).chunk(world)[shard].to(device, tcfg.params_dtype)
    hidden.requires_grad_(True)
    times = []
    for i in range(args.warmup + args.iters):
        decoder.zero_grad(set_to_none=True)
        hidden.grad = None
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = decoder(hidden, attention_mask=None)
        out.backward(grad_out)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    grads = {n: p.grad.float().cpu() for n, p in decoder.named_parameters() if p.grad is not None}
    return {
        "times": times,
        "out": out.detach().float().cpu(),
        "grad_input": hidden.grad.float().cpu(),
        "grads": grads,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(backends: list[str], args, world: int, cuda: bool) -> list[dict]:
    from mega.config import ConfigError

    runs, rows = {}, []
    for backend in backends:
        try:
            runs[backend] = run_backend(backend, args, world, cuda)
        except (ConfigError, ImportError) as err:  # e.g. te with --block parallel, TE not installed
            rows.append({"backend": backend, "skipped": str(err)})
    ref = runs.get("none")
    for backend, r in runs.items():
        row = {
            "backend": backend,
            "step_ms_median": 1e3 * statistics.median(r["times"]),
            "step_ms_min": 1e3 * min(r["times"]),
            "iters": len(r["times"]),
        }
        if ref is not None and backend != "none":
            common = sorted(set(r["grads"]) & set(ref["grads"]))  # te renames the LayerNorm weights
            row["max_rel_diff_vs_none"] = {
                "output": _rel(r["out"], ref["out"]),
                "grad_input": _rel(r["grad_input"], ref["grad_input"]),
                "param_grads": max(_rel(r["grads"][n], ref["grads"][n]) for n in common),
                "params_compared": len(common),
            }
        rows.append(row)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="none,ring,symm_mem,te")
    ap.add_argument("--block", default="sequential", choices=["sequential", "parallel"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mega import megatron_cpu, megatron_fixes

    args = parse_args(argv)
    megatron_fixes.apply()  # on every device
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        megatron_cpu.apply()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    backends = [b for b in args.backends.split(",") if b]
    if not cuda:
        backends = [b for b in backends if b in ("none", "ring")]  # the others are CUDA kernels
    rows = compare(backends, args, world, cuda)
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "script_status": SCRIPT_STATUS,
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "tp": world,
                    "block": args.block,
                    "precision": args.precision if cuda else "fp32",
                    "shape": {
                        "seq": args.seq,
                        "micro_batch": args.micro_batch,
                        "hidden": args.hidden,
                        "layers": args.layers,
                    },
                    "rows": rows,
                }
            )
        )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
