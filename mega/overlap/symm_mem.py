"""``tp_overlap=symm_mem``: torch's symmetric-memory fused ops as the overlap kernels (CUDA only).

``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` (the kernels
behind torchtitan's async tensor parallelism) micro-pipeline the collective with the GEMM through
symmetric memory on NVLink. They are forward ops with no autograd; here each is wrapped in an
autograd Function whose backward uses the dual fused op:

* all-gather->GEMM (column-parallel): forward ``fused_all_gather_matmul(x, [W^T])``; input
  gradient ``fused_matmul_reduce_scatter(g, W)``; weight gradient ``W^T``-grad =
  ``fused_all_gather_matmul(x^T, [g], gather_dim=1)`` (the input shards gathered again, as
  megatron does, instead of keeping the gathered input);
* GEMM->reduce-scatter (row-parallel, or several summed pairs): forward
  ``fused_matmul_reduce_scatter([x_1 | x_2], [W_1^T ; W_2^T])`` (the summed pairs are one GEMM
  over the concatenated inner dimension); backward one ``fused_all_gather_matmul(g, [W_1, W_2],
  return_A=True)`` gives both input gradients and the gathered g for the weight gradients.

The ops register CUDA (and Meta) kernels only. ``kernels`` selects them; the CPU tests select
torch's own reference implementations of the same ops (``_fused_*_fallback``: functional
collectives + matmul, what the CUDA op itself runs in torch's test mode), which checks this
module's layouts and gradients on gloo but not the CUDA kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_REFERENCE = False  # True: torch's reference implementations of the fused ops (CPU tests)


@contextlib.contextmanager
def reference_kernels():
    """Run the fused ops through torch's reference implementations (any device, any backend)."""
    global _REFERENCE
    saved, _REFERENCE = _REFERENCE, True
    try:
        yield
    finally:
        _REFERENCE = saved


def kernels():
    """(all_gather_matmul, matmul_reduce_scatter) with torch.ops.symm_mem's signatures."""
    if _REFERENCE:
        from torch.distributed import _symmetric_memory as sm

        return sm._fused_all_gather_matmul_fallback, sm._fused_matmul_reduce_scatter_fallback
    return torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter


_ENABLED: set[str] = set()


def group_name(group: dist.ProcessGroup) -> str:
    """The group's name, with symmetric memory enabled for it once (CUDA) where torch still
    needs that: torch 2.13 sets a group up by itself and deprecates ``enable_symm_mem_for_group``."""
    name = group.group_name
    if not _REFERENCE and name not in _ENABLED:
        from torch.distributed import _symmetric_memory as sm

        if needs_enable(sm):
            sm.enable_symm_mem_for_group(name)
        _ENABLED.add(name)
    return name


def needs_enable(sm) -> bool:
    """Whether this torch's symmetric memory wants ``enable_symm_mem_for_group`` called: it exists
    and is not marked deprecated (``@deprecated`` sets ``__deprecated__``)."""
    enable = getattr(sm, "enable_symm_mem_for_group", None)
    return enable is not None and not hasattr(enable, "__deprecated__")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ag_mm, _ = kernels()
        name = group_name(group)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        _, (out,) = ag_mm(_rows(x).contiguous(), [weight.t()], 0, name, return_A=False)
        if bias is not None:
            out = out + bias
        return out.view(-1, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        ag_mm, mm_rs = kernels()
        x, weight = ctx.saved_tensors
        name = group_name(ctx.group)
        g = _rows(grad).contiguous()
        grad_x = mm_rs(g, weight, "sum", 0, name)
        _, (grad_w_t,) = ag_mm(_rows(x).t(), [g], 1, name, return_A=False)
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x.view_as(x), grad_w_t.t(), grad_b, None


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs_and_ws):
        _, mm_rs = kernels()
        xs, ws = xs_and_ws[0::2], xs_and_ws[1::2]
        ctx.group = group
        ctx.save_for_backward(*xs_and_ws)
        a = torch.cat([_rows(x) for x in xs], dim=-1) if len(xs) > 1 else _rows(xs[0]).contiguous()
        b = torch.cat([w.t() for w in ws], dim=0) if len(ws) > 1 else ws[0].t()
        out = mm_rs(a, b, "sum", 0, group_name(group))
        return out.view(-1, *xs[0].shape[1:-1], ws[0].shape[0])

    @staticmethod
    def backward(ctx, grad):
        ag_mm, _ = kernels()
        saved = ctx.saved_tensors
        xs, ws = saved[0::2], saved[1::2]
        gathered, grad_rows = ag_mm(
            _rows(grad).contiguous(), list(ws), 0, group_name(ctx.group), return_A=True
        )
        grads = []
        for x, _w, gx in zip(xs, ws, grad_rows):
            grads += [gx.view_as(x), gathered.t() @ _rows(x)]
        return (None, *grads)


def all_gather_linear(x, weight, bias, group):
    return _AllGatherLinear.apply(x, weight, bias, group)


def linear_reduce_scatter(pairs, group):
    return _LinearReduceScatter.apply(group, *[t for pair in pairs for t in pair])
