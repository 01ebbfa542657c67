"""Mixture-of-Experts token permutation: the (token, slot) pairs grouped by expert, and the weighted sum back.

Kernel contracts (backends ``cpp`` and ``triton``; ``T`` tokens, ``k`` slots, ``n = T * k`` pairs, ``N`` kept):

    moe_permute_index(experts, num_experts, counts, positions, order) -> None
    moe_gather_rows(src, order, top_k, scale, out) -> None
    moe_unpermute(expert_out, positions, weights, top_k, out) -> None
    moe_permute_backward(grad, positions, top_k, out) -> None

- ``moe_permute_index``: ``experts [n]`` int64 (``-1``: dropped). Writes ``counts [E]`` (kept pairs per expert),
  ``positions [n]`` (where pair ``i`` lands in the expert-grouped layout, ``-1`` if dropped) and the first ``N``
  entries of ``order [n]`` (``order[positions[i]] = i``). Stable: inside an expert, pairs keep flat order.
- ``moe_gather_rows``: ``out[p] = src[order[p] // k]`` (``src [T, H]``, ``out [N, H]`` of its dtype), or with
  ``scale [n]`` float32, ``out[p] = round(float(src[order[p] // k]) * scale[order[p]])``.
- ``moe_unpermute``: ``out[t] = round(0 + w[t,0] * x_0 + w[t,1] * x_1 + ...)`` in float32, slot order, with
  ``x_j = float(expert_out[positions[t*k+j]])``; a dropped slot adds ``0``. ``weights [n]`` float32.
- ``moe_permute_backward``: ``out[t] = round(0 + g_a + g_b + ...)`` in float32 over token ``t``'s kept rows of
  ``grad [N, H]``, in ascending position order (the order index_add_, the reference's backward, adds them).

Exactness against the torch references (:func:`reference_permute`, :func:`reference_unpermute`, plain indexing
that autograd differentiates): the forward gathers, the index, ``unpermute``'s float32 result and both
backward gathers are bit-identical for float32, bfloat16 and float16; the permute backward is bit-identical for
float32 on the CPU (its index_add_ adds in position order, as the kernel does; CUDA's adds with atomics, in no
fixed order, so there the reference is a float32 rounding apart) while for bf16/fp16 the kernel accumulates in
float32 and rounds once where the reference's index_add_ rounds after every add (identical for ``k <= 2`` up
to a double rounding). The weights' gradient is torch math (a row-wise dot over ``H`` whose order only ATen
fixes), so it is the reference's exactly. Other dtypes (e.g. float64) run the reference.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import _backend

BACKENDS = ("cpp", "triton")
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def accumulation_dtype(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    """fp32 at least: a bf16 model's ``k`` expert outputs are added in fp32, then rounded once."""
    return torch.promote_types(torch.promote_types(expert_out.dtype, weights.dtype), torch.float32)


def reference_permute(hidden: torch.Tensor, experts: torch.Tensor, num_experts: int, n_kept: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch oracle: a stable argsort by expert (dropped pairs sort last and are cut off), then
    ``index_select``; ``n_kept`` is the number of pairs not dropped."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)[:n_kept]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    return hidden.index_select(0, order // top_k), order, counts


def reference_unpermute(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int
                        ) -> torch.Tensor:
    """The torch oracle: each row weighted and written to its own (token, slot), then the ``k`` slots summed
    one after the other from zero (an explicit loop: ``sum(dim=1)`` may regroup the adds)."""
    top_k, hidden = weights.shape[1], expert_out.shape[1]
    acc = accumulation_dtype(expert_out, weights)
    w = weights.reshape(-1).index_select(0, order).to(acc)
    rows = expert_out.to(acc) * w.unsqueeze(-1)
    slots = rows.new_zeros(num_tokens * top_k, hidden).index_copy(0, order, rows).view(num_tokens, top_k, hidden)
    total = rows.new_zeros(num_tokens, hidden)
    for j in range(top_k):
        total = total + slots[:, j]
    return total.to(expert_out.dtype)


def positions_of(order: torch.Tensor, pairs: int) -> torch.Tensor:
    """``[pairs]`` int64: where each (token, slot) pair sits in ``order``, ``-1`` for pairs not in it."""
    return torch.full((pairs,), -1, dtype=torch.int64, device=order.device).index_copy_(
        0, order, torch.arange(order.numel(), device=order.device))


def fused_backend(op: str, device: torch.device, backend, *tensors: torch.Tensor):
    """The kernel module's backend name for ``op`` on ``device``, or None where the reference runs (forced, or
    a dtype the kernels do not take)."""
    name = _backend.resolve(op, device, backend, BACKENDS)
    if name == "torch" or any(t.dtype not in ROW_DTYPES for t in tensors):
        return None
    return name


def _kernel(op: str, device: torch.device, name: str):
    return _backend.kernel(op, device, name, lambda *a: None, BACKENDS)


class FusedPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, experts, num_experts, n_kept, name):
        device = hidden.device
        flat = experts.reshape(-1).contiguous()
        top_k = experts.shape[1]
        counts = torch.empty(num_experts, dtype=torch.int64, device=device)
        positions = torch.empty_like(flat)
        order = torch.empty_like(flat)
        try:
            _kernel("moe_permute_index", device, name)(flat, num_experts, counts, positions, order)
        except RuntimeError:
            _check_expert_range(flat, num_experts)
            raise
        if n_kept is None:  # a CPU kernel's counts: reading them back is no device sync
            n_kept = int(counts.sum())
        order = order[:n_kept]
        permuted = hidden.new_empty(n_kept, hidden.shape[1])
        _kernel("moe_gather_rows", device, name)(hidden.contiguous(), order, top_k, None, permuted)
        ctx.save_for_backward(positions)
        ctx.meta = (name, top_k, hidden.shape[0])
        ctx.mark_non_differentiable(order, counts)
        return permuted, order, counts

    @staticmethod
    def backward(ctx, grad, _grad_order, _grad_counts):
        (positions,) = ctx.saved_tensors
        name, top_k, num_tokens = ctx.meta
        out = grad.new_empty(num_tokens, grad.shape[1])
        _kernel("moe_permute_backward", grad.device, name)(grad.contiguous(), positions, top_k, out)
        return out, None, None, None, None


class FusedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, order, weights, num_tokens, name):
        top_k = weights.shape[1]
        positions = positions_of(order, num_tokens * top_k)
        w32 = weights.reshape(-1).float().contiguous()
        out = expert_out.new_empty(num_tokens, expert_out.shape[1])
        _kernel("moe_unpermute", expert_out.device, name)(expert_out.contiguous(), positions, w32, top_k, out)
        ctx.save_for_backward(expert_out, order, w32)
        ctx.meta = (name, top_k, weights.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        expert_out, order, w32 = ctx.saved_tensors
        name, top_k, w_dtype = ctx.meta
        gather = _kernel("moe_gather_rows", grad.device, name)
        grad = grad.contiguous()
        grad_expert = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_expert = grad.new_empty(order.numel(), grad.shape[1])
            gather(grad, order, top_k, w32, grad_expert)   # round(float(grad[t]) * w): the reference's product
        if ctx.needs_input_grad[2]:
            grad_rows = grad.new_empty(order.numel(), grad.shape[1])
            gather(grad, order, top_k, None, grad_rows)
            # the reference's autograd: (grad[t] * expert_out[p]).sum over H, in fp32, then back to the pair
            dots = (grad_rows.float() * expert_out.float()).sum(-1).to(w_dtype)
            grad_w = torch.zeros(w32.numel(), dtype=w_dtype, device=grad.device).index_add_(0, order, dots)
            grad_w = grad_w.view(-1, top_k)
        return grad_expert, None, grad_w, None, None


def permute_tokens(hidden: torch.Tensor, experts: torch.Tensor, num_experts: int, *, backend=None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [T, H]``, ``experts [T, k]`` (``-1``: dropped) -> ``(permuted [N, H], order [N], counts [E])``
    (see the module docstring); differentiable with respect to ``hidden``. On CUDA one host sync (``N`` sizes
    the output, and the expert indices are checked against ``num_experts``); the C++ kernel checks the indices
    and counts ``N`` in its own pass."""
    op = "permute"
    if not isinstance(hidden, torch.Tensor) or not isinstance(experts, torch.Tensor) or hidden.dim() != 2 \
            or experts.dim() != 2 or experts.shape[0] != hidden.shape[0]:
        raise ValueError(f"{op}: hidden must be [T, H] and experts [T, k] with the same T; got hidden "
                         f"{tuple(getattr(hidden, 'shape', ()))} and experts {tuple(getattr(experts, 'shape', ()))}; "
                         f"pass the router's experts for these tokens")
    if experts.dtype != torch.int64 or experts.device != hidden.device:
        raise ValueError(f"{op}: experts must be int64 on {hidden.device} (the router's); got {experts.dtype} on "
                         f"{experts.device}; convert with experts.to({hidden.device!s}, torch.int64)")
    # meta (the planner's probe): the reference's ops, which meta tensors run, with no fallback warning
    name = None if hidden.is_meta else fused_backend("moe_permute_index", hidden.device, backend, hidden)
    if name == "cpp":
        # the C++ index kernel refuses an index past num_experts itself (explained then) and its counts give N:
        # no separate pass over the experts
        return FusedPermute.apply(hidden, experts, num_experts, None, name)
    flat = experts.reshape(-1)
    if flat.is_meta:                 # the planner's probe: no values to read; every pair kept (moe.meta)
        n_kept = flat.numel()
    else:
        n_kept, largest = torch.stack([(flat >= 0).sum(), flat.max() if flat.numel() else flat.new_zeros(())]).tolist()
        if largest >= num_experts:
            _check_expert_range(flat, num_experts)
    if name is None:
        return reference_permute(hidden, experts, num_experts, n_kept)
    return FusedPermute.apply(hidden, experts, num_experts, n_kept, name)


def _check_expert_range(flat: torch.Tensor, num_experts: int) -> None:
    largest = int(flat.max()) if flat.numel() else 0
    if largest >= num_experts:
        raise ValueError(f"permute: experts holds index {largest} but there are num_experts={num_experts}; the "
                         f"router and the experts must agree on the number of experts")


def unpermute_tokens(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int, *,
                     backend=None) -> torch.Tensor:
    """``expert_out [N, H]`` (rows in :func:`permute_tokens`' order), ``weights [T, k]`` -> ``[T, H]`` in
    ``expert_out``'s dtype: ``out[t] = sum_j weights[t, j] * expert_out[position of (t, j)]``, slot by slot
    in fp32 at least; differentiable with respect to ``expert_out`` and ``weights``."""
    op = "unpermute"
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"{op}: weights must be [num_tokens, k] = [{num_tokens}, k]; got "
                         f"{tuple(weights.shape)}; pass the router's weights for these tokens")
    if expert_out.dim() != 2 or order.dim() != 1 or expert_out.shape[0] != order.shape[0]:
        raise ValueError(f"{op}: expert_out must be [N, H] with N = len(order) = {order.shape[0]}; got "
                         f"{tuple(expert_out.shape)}; pass the rows in permute's order")
    name = None if expert_out.is_meta else fused_backend("moe_unpermute", expert_out.device, backend, expert_out,
                                                          weights)
    if name is None or num_tokens == 0:
        return reference_unpermute(expert_out, order, weights, num_tokens)
    return FusedUnpermute.apply(expert_out, order, weights, num_tokens, name)
