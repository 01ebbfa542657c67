"""Gradient-accumulation fusion: a layer writes its weight gradient straight into the DataParallel buffer.

Megatron-LM's ``gradient_accumulation_fusion`` for the weights where it pays on a CPU: the tied token
embedding and LM head of a GPT (half of the benchmark model's parameters). Without it, backward makes
the head's weight gradient (a ``[V, d]`` GEMM output), the embedding's dense gradient (``[V, d]`` zeros
plus the looked-up rows), sums the two, and DataParallel then copies the sum into its flat buffer. With
it, the GEMM writes into the buffer (``addmm`` with ``beta`` 0 or 1 and ``alpha`` 1/world) and the
embedding adds its rows in place: no ``[V, d]`` temporary at all. What it saves is measured by
``python -m parallel_layers bench --only dp``: rows ``dp_stage0_vs_torch_ddp`` (fused) and
``dp_stage0_unfused_vs_torch_ddp`` (``DataParallel(fuse_grad_accumulation=False)``) time the same 51M GPT
step at 4 ranks (benchmarks/README.md has the figures).

The block linears are left to autograd: their gradients are a few MB, and copying one into the buffer
costs little next to its GEMM.

Protocol: :class:`~parallel_layers.data_parallel.DataParallel` sets ``weight.grad_sink`` to a weak
reference to itself on the parameters it owns (when the parameter dtype equals the gradient dtype). A
layer calls :func:`linear_weight_grad_into_buffer` / :func:`embedding_grad_into_buffer` in place of
``F.linear`` / ``F.embedding``; without a sink they are exactly those torch ops, so the plain model
runs unchanged. In backward the layer hands the sink a
``write(out, beta, alpha)`` that sets ``out = beta * out + alpha * G`` for its contribution ``G``; the
sink picks ``beta`` (0 over a stale slice after ``zero_grad()``, else 1) and ``alpha`` (1/world when the
slice is being averaged at landing, else 1), and returns ``None`` as the weight's autograd gradient.
Autograd still runs the weight's accumulate node (with no gradient), so DataParallel's readiness hook
fires as usual; a contribution that comes through autograd (an unfused layer sharing the weight) is
folded in there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..grad_needed import grad_needed


def grad_sink(weight: torch.Tensor):
    """The DataParallel that takes ``weight``'s gradient writes, or None (plain torch autograd). A copy of
    the parameter (``copy.deepcopy`` of the model) carries the attribute but is not the wrapper's: None."""
    ref = getattr(weight, "grad_sink", None)
    sink = ref() if ref is not None else None
    return sink if sink is not None and sink.owns(weight) else None


class _LinearWeightGradIntoBuffer(torch.autograd.Function):
    """``y = h @ weight^T`` (no bias); backward writes ``grad_y^T @ h`` into the weight's buffer slice."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        ctx.param = weight      # the Parameter itself: under saved-tensor hooks an unpacked one is a plain tensor
        # under autocast F.linear computes in the autocast dtype; backward runs outside autocast, so it
        # casts as autograd's own cast nodes would: the GEMMs in that dtype, each gradient back to its input's
        device = h.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)   # meta: none
        ctx.compute_dtype = torch.get_autocast_dtype(device) if autocast else None
        return F.linear(h, weight)

    @staticmethod
    def backward(ctx, grad_y):
        h, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype or grad_y.dtype
        hc, wc, gc = h.to(dtype), weight.to(dtype), grad_y.to(dtype)
        # a zero-bubble pipeline runs B (grad_h) and W (the weight's write) as two backward calls: each does
        # its own part once (grad_needed.py)
        grad_h = gc.matmul(wc).to(h.dtype) if ctx.needs_input_grad[0] and grad_needed(h) else None
        g2, h2 = gc.reshape(-1, gc.shape[-1]), hc.reshape(-1, hc.shape[-1])

        def write(out, beta, alpha):   # beta = 0: out's stale contents are ignored (NaN included)
            if out.dtype == dtype:
                torch.addmm(out, g2.t(), h2, beta=beta, alpha=alpha, out=out)
            elif beta == 0:
                torch.mul(g2.t().matmul(h2).to(out.dtype), alpha, out=out)
            else:
                out.add_(g2.t().matmul(h2).to(out.dtype), alpha=alpha)

        if grad_needed(weight):
            grad_sink(ctx.param).write_grad(ctx.param, write)
        return grad_h, None


class _EmbeddingGradIntoBuffer(torch.autograd.Function):
    """``weight[idx]``; backward adds the output gradient's rows into the weight's buffer slice."""

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx, weight)
        ctx.param = weight
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad_out):
        idx, weight = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])

        def write(out, beta, alpha):
            if beta == 0:
                out.zero_()
            out.index_add_(0, idx.reshape(-1), rows, alpha=alpha)

        if grad_needed(weight):
            grad_sink(ctx.param).write_grad(ctx.param, write)
        return None, None


def linear_weight_grad_into_buffer(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(h, weight)`` whose weight gradient lands in ``weight.grad_sink``'s buffer (plain
    ``F.linear`` when there is none)."""
    if grad_sink(weight) is None:
        return F.linear(h, weight)
    return _LinearWeightGradIntoBuffer.apply(h, weight)


def embedding_grad_into_buffer(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(idx, weight)`` whose weight gradient lands in ``weight.grad_sink``'s buffer (plain
    ``F.embedding`` when there is none)."""
    if grad_sink(weight) is None:
        return F.embedding(idx, weight)
    return _EmbeddingGradIntoBuffer.apply(idx, weight)


__all__ = ["grad_sink", "linear_weight_grad_into_buffer", "embedding_grad_into_buffer"]
