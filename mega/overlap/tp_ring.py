"""Chunked ring all-gather->GEMM and GEMM->reduce-scatter for sequence parallelism, in pure torch.

Under sequence parallelism each tensor-parallel rank holds ``s/p`` of the sequence. A
column-parallel linear (attention ``linear_qkv``, MLP ``linear_fc1``) all-gathers its input
before its GEMM; a row-parallel linear (``linear_proj``, ``linear_fc2``) reduce-scatters its
output after it. megatron issues each as one blocking collective. Here both become a ring of
``p`` steps over the TP group, one chunk (one rank's ``s/p`` rows) per step:

* all-gather->GEMM: at step k this rank multiplies the chunk it holds (its own at k=0) while the
  same chunk travels on to the next rank and the previous rank's arrives in the spare buffer;
* GEMM->reduce-scatter: at step k this rank computes its partial product of the chunk that ends
  on rank ``r-k-1`` while the running sum of the previous step travels; it adds the sum that
  arrived and passes it on; after ``p`` steps it holds the full sum of its own chunk.

Each step posts ONE send (to ``rank+1``) and ONE receive (from ``rank-1``) and waits for both
before the next step, so every message on a link is matched in posting order (batched p2p on gloo
pairs messages wrongly, see docs/overlap.md). The backward of each is the dual ring, overlapped
the same way: all-gather->GEMM's input gradient is a GEMM->reduce-scatter and its weight gradient
a second all-gather ring of the saved input shard (megatron also re-gathers rather than keeping
the gathered input); GEMM->reduce-scatter's backward is one all-gather ring of the output
gradient that feeds both the input-gradient and the weight-gradient GEMMs.

``linear_reduce_scatter`` accepts several (input, weight) pairs whose products are summed before
the one reduction: the parallel transformer block's attention and MLP outputs share one ring.

Transport (``_Ring``): on gloo, plain ``isend``/``irecv``. On NCCL the pair is one
``batch_isend_irecv`` (an NCCL group: both directions at once, no send/recv deadlock when the
previous and the next rank are the same) issued on a side stream that first waits for the
compute stream; ``wait`` makes the side stream wait for NCCL, records the buffers on it and
makes the compute stream wait for the side stream (torch docs: ``Work.wait`` blocks the current
stream, not the host, for NCCL). The NCCL path is not run by the CPU test suite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mega import obs


class _Ring:
    """A tensor-parallel group seen as a ring: this rank sends to rank+1, receives from rank-1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.nccl = "nccl" in dist.get_backend(group)  # "nccl" or the default group's "cpu:gloo,cuda:nccl"
        self.stream = torch.cuda.Stream() if self.nccl else None

    def start(self, send: torch.Tensor, recv: torch.Tensor):
        """Post one send of ``send`` to the next rank and one receive into ``recv`` from the previous."""
        # the launch, not blocked: mega.obs.analysis counts a peer's ring wait from this moment
        with obs.span("ring start", "tp"):
            if not self.nccl:
                return [
                    dist.isend(send, group=self.group, group_dst=self.next),
                    dist.irecv(recv, group=self.group, group_src=self.prev),
                ], ()
            return self._start_cuda(send, recv)

    def wait(self, pending) -> None:
        works, tensors = pending
        with obs.span("ring wait", "tp", blocked=True):  # exposed TP communication (docs/observability.md)
            if not self.nccl:
                for work in works:
                    work.wait()
                return
            self._wait_cuda(works, tensors)

    # -- NCCL: the p2p on a side stream (not exercised on CPU) ------------------------------------

    def _start_cuda(self, send, recv):
        # The chunk to send was produced on the compute stream: the side stream (and through it
        # NCCL's own stream, which waits on the stream current at issue) starts after it.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, send, group=self.group, group_peer=self.next),
                    dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev),
                ]
            )
        return works, (send, recv)

    def _wait_cuda(self, works, tensors):
        with torch.cuda.stream(self.stream):
            for work in works:
                work.wait()  # the side stream waits for NCCL's; the host does not block
            for t in tensors:  # allocated on the compute stream, used on the side stream
                t.record_stream(self.stream)
        torch.cuda.current_stream().wait_stream(self.stream)


_RINGS: dict[object, _Ring] = {}


def ring_of(group: dist.ProcessGroup) -> _Ring:
    ring = _RINGS.get(group)
    if ring is None:
        ring = _RINGS[group] = _Ring(group)
    return ring


def ring_all_gather(ring: _Ring, shard: torch.Tensor, on_chunk: Callable[[int, torch.Tensor], None]) -> None:
    """Call ``on_chunk(j, shard_j)`` for the shard of every rank j of the ring, each while the
    next shard is in flight. Own shard first, then rank-1's, rank-2's, ... (double buffered)."""
    held = shard.contiguous()
    bufs = [torch.empty_like(held), None]  # never receive into the caller's tensor
    for step in range(ring.size):
        pending = None
        if step < ring.size - 1:
            if bufs[step % 2] is None:
                bufs[step % 2] = torch.empty_like(held)
            pending = ring.start(held, bufs[step % 2])
        on_chunk((ring.rank - step) % ring.size, held)
        if pending is not None:
            ring.wait(pending)  # both done: `held` was sent, the other buffer holds the next shard
            held = bufs[step % 2]


def ring_reduce_scatter(
    ring: _Ring, partial: Callable[[int, torch.Tensor], None], shape: Sequence[int], like: torch.Tensor
) -> torch.Tensor:
    """The sum over ranks of ``partial(c, out)`` (which writes this rank's partial product of
    chunk c into ``out``), for chunk c = this rank. Step k computes the partial of chunk
    ``rank-k-1`` while the running sum of step k-1 travels; two output buffers alternate."""
    bufs = [like.new_empty(shape), like.new_empty(shape) if ring.size > 1 else None]
    received = like.new_empty(shape) if ring.size > 1 else None
    pending = None
    for step in range(ring.size):
        acc = bufs[step % 2]
        partial((ring.rank - step - 1) % ring.size, acc)
        if pending is not None:
            ring.wait(pending)
            acc.add_(received)  # the previous ranks' running sum of this chunk
        if step == ring.size - 1:
            return acc
        pending = ring.start(acc, received)
    raise AssertionError("unreachable")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [s*b, h] (sequence-major rows, so a chunk of s is a chunk of rows)."""
    return t.reshape(-1, t.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T (+ b), x: [s/p, b, h] -> y: [s, b, o/p]; column-parallel."""

    @staticmethod
    def forward(ctx, x, weight, bias, ring: _Ring):
        ctx.ring, ctx.has_bias = ring, bias is not None
        ctx.save_for_backward(x, weight)
        rows = _as_rows(x)
        out = x.new_empty(ring.size, rows.shape[0], weight.shape[0])
        w_t = weight.t()
        ring_all_gather(ring, rows, lambda j, chunk: torch.mm(chunk, w_t, out=out[j]))
        if bias is not None:
            out.add_(bias)
        return out.view(ring.size * x.shape[0], *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ring = ctx.ring
        rows = _as_rows(x)
        g = grad.contiguous().view(ring.size, rows.shape[0], weight.shape[0])
        # input gradient: reduce-scatter over the sequence of g @ W, ring-overlapped
        grad_x = ring_reduce_scatter(ring, lambda c, out: torch.mm(g[c], weight, out=out), rows.shape, x)
        # weight gradient: the input shards travel the ring again, one GEMM per shard
        grad_w = torch.zeros_like(weight)
        ring_all_gather(ring, rows, lambda j, chunk: grad_w.addmm_(g[j].t(), chunk))
        grad_b = g.sum(dim=(0, 1)) if ctx.has_bias else None
        return grad_x.view_as(x), grad_w, grad_b, None


class _LinearReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(sum_i x_i @ W_i^T), x_i: [s, b, h_i/p] -> y: [s/p, b, o];
    row-parallel (several pairs: the parallel block's summed branches)."""

    @staticmethod
    def forward(ctx, ring: _Ring, *xs_and_ws):
        xs, ws = xs_and_ws[0::2], xs_and_ws[1::2]
        ctx.ring = ring
        ctx.save_for_backward(*xs_and_ws)
        p = ring.size
        seq = xs[0].shape[0]
        if seq % p:
            raise ValueError(f"sequence length {seq} is not divisible by the tensor-parallel size {p}")
        chunks = [_as_rows(x).view(p, -1, x.shape[-1]) for x in xs]
        w_ts = [w.t() for w in ws]

        def partial(c, out):
            torch.mm(chunks[0][c], w_ts[0], out=out)
            for chunk, w_t in zip(chunks[1:], w_ts[1:]):
                out.addmm_(chunk[c], w_t)

        out = ring_reduce_scatter(ring, partial, (chunks[0].shape[1], ws[0].shape[0]), xs[0])
        return out.view(seq // p, *xs[0].shape[1:-1], ws[0].shape[0])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        xs, ws = saved[0::2], saved[1::2]
        ring = ctx.ring
        p = ring.size
        chunks = [_as_rows(x).view(p, -1, x.shape[-1]) for x in xs]
        grad_xs = [torch.empty_like(c) for c in chunks]
        grad_ws = [torch.zeros_like(w) for w in ws]

        def on_chunk(j, g_j):  # the output gradient of chunk j feeds both GEMMs of every pair
            for chunk, w, gx, gw in zip(chunks, ws, grad_xs, grad_ws):
                torch.mm(g_j, w, out=gx[j])
                gw.addmm_(g_j.t(), chunk[j])

        ring_all_gather(ring, _as_rows(grad), on_chunk)
        grads = []
        for x, gx, gw in zip(xs, grad_xs, grad_ws):
            grads += [gx.view_as(x), gw]
        return (None, *grads)


def all_gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """Column-parallel linear under sequence parallelism: all-gather of x and the GEMM, as a ring."""
    return _AllGatherLinear.apply(x, weight, bias, ring_of(group))


def linear_reduce_scatter(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup
) -> torch.Tensor:
    """Row-parallel linear(s) under sequence parallelism: sum_i x_i @ W_i^T reduce-scattered over
    the sequence, as a ring."""
    flat = [t for pair in pairs for t in pair]
    return _LinearReduceScatter.apply(ring_of(group), *flat)
