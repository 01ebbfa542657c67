"""Grouped matrix product of a Mixture-of-Experts layer: each expert's block of rows times its weight.

Kernel contract (backend ``triton``; the kernels are in ``triton_kernels/grouped_mm.py``):

    grouped_mm(x [N, in], weight [E, out, in], counts [E] int64, out [N, out]) -> None
    grouped_mm_weight_grad(dy [N, out], x [N, in], counts [E] int64, grad_weight [E, out, in] fp32) -> None

``x``'s rows are grouped by expert (``counts[e]`` rows of expert ``e``, in expert order, as ``permute`` lays
them out); ``out``'s block of expert ``e`` is ``x_e @ weight[e].T``. Products accumulate in float32.

:func:`grouped_mm` is differentiable: ``dx`` is the same grouped product with each weight transposed (a view,
no copy), ``dW[e] = dy_e.T @ x_e``. :func:`reference_grouped_mm` (one ``F.linear`` per expert, one host sync
for the block sizes) is the torch oracle and the ``torch`` backend. The kernel's sums run in tile order, not
cuBLAS's or ATen's, so results agree with the reference to float32 rounding (tests: ``atol=rtol=1e-5``),
not bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _backend

OP = "grouped_mm"
BACKENDS = ("triton",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One ``F.linear`` per expert over its contiguous block of rows."""
    sizes = counts.tolist()
    blocks = [F.linear(block, weight[e]) for e, block in enumerate(x.split(sizes)) if sizes[e]]
    if not blocks:                                         # no rows: still a product, so the graph reaches weight
        return F.linear(x, weight[0])
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0]


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, kernels):
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[1])
        kernels[0](x, weight, counts, out)
        ctx.save_for_backward(x, weight, counts)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, counts = ctx.saved_tensors
        product, weight_grad = ctx.kernels
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dy.new_empty(x.shape)
            product(dy, weight.transpose(1, 2), counts, dx)
        if ctx.needs_input_grad[1]:
            dw = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            weight_grad(dy, x, counts, dw)
            dw = dw.to(weight.dtype)
        return dx, dw, None, None


def check_grouped_mm_args(op: str, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or counts.shape != weight.shape[:1]:
        raise ValueError(f"{op}: x must be [N, in], weight [E, out, in] and counts [E]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, counts {tuple(counts.shape)}; "
                         f"pass permute's rows and counts with the experts' stacked weight")


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """``x [N, in]`` (``counts[e]`` rows per expert, in expert order), ``weight [E, out, in]`` -> ``[N, out]``.
    On the ``triton`` backend: one launch for all experts, no host sync; fp32, bf16 and fp16 of one dtype."""
    check_grouped_mm_args(OP, x, weight, counts)
    name = _backend.resolve(OP, x.device, backend, BACKENDS)
    if name == "torch":
        return reference_grouped_mm(x, weight, counts)
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"{OP}: the triton kernel takes fp32, bf16 or fp16 inputs of one dtype; got x "
                         f"{x.dtype} and weight {weight.dtype}; cast them, or use the torch backend")
    kernels = (_backend.kernel(OP, x.device, name, reference_grouped_mm, BACKENDS),
               _backend.kernel("grouped_mm_weight_grad", x.device, name, reference_grouped_mm, BACKENDS))
    return _GroupedMM.apply(x, weight, counts.to(device=x.device, dtype=torch.int64), kernels)
