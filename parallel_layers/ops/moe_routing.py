"""Mixture-of-Experts router top-k in one pass: scores, choice, weights and per-expert counts.

Kernel contract (backends ``cpp`` and ``triton``):

    router_topk(logits, bias, top_k, sigmoid, norm, scale, weights, experts, counts) -> None

- ``logits [T, E]``: contiguous float32, bfloat16 or float16; everything is computed in float32.
- ``sigmoid=False``: ``score = softmax(logits)`` and the choice ranks the scores. ``sigmoid=True``:
  ``score = sigmoid(logits)`` and the choice ranks ``score + bias`` (``bias [E]`` float32 or None), while the
  weights are the unbiased scores (DeepSeek-V3).
- ``experts [T, k]`` int64: the ``k`` largest choices, largest first. ``weights [T, k]`` float32: their
  scores, divided by their sum when ``norm`` (plus 1e-20 under sigmoid), times ``scale`` when it is not 1.
- ``counts [E]`` int64: how many of the ``T * k`` slots chose each expert (written, not accumulated).

Ties: the ``cpp`` kernel runs torch.topk's own CPU algorithm (``std::nth_element``/``std::partial_sort`` then
``std::sort`` over (value, index) pairs, ATen/native/TopKImpl.h), so equal scores pick the experts torch.topk
picks, which is *not* always the lower index. The ``triton`` kernel takes the lower index first on equal
scores (as torch.topk on CUDA does in practice, though torch does not promise it).

Exactness: the choice equals the reference's wherever the kernel's scores order the experts as torch's do.
The scores themselves come from the kernels' own ``exp`` and a sequential row sum, not ATen's vectorised
softmax/sigmoid, so the weights agree with :func:`reference_router_topk` to a few float32 ulps (tests:
``rtol=1e-6, atol=1e-7``), not bit for bit. That is why ``moe.route`` keeps the reference unless a fused
backend is asked for.

Gradient: :func:`router_topk` returns weights differentiable with respect to ``logits``; on a fused backend the
backward recomputes the scores from the saved logits. ``cpp``: one C++ call (``router_topk_backward``, the chain
rule of the weight formula written out per row; it agrees with autograd through the reference to float32
rounding, as the forward's weights do). ``triton``: the ATen backward formulas of the reference's weight formula
(``softmax``/``sigmoid``, ``gather`` of the chosen experts, the normalisation and the scale) in autograd's order
(:func:`chosen_weights_backward`), so its gradient is the one autograd gives through :func:`chosen_weights` for
the same choice, bit for bit.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _backend

OP = "router_topk"
BACKENDS = ("cpp", "triton")
SCORINGS = ("softmax", "sigmoid")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, ``[E]`` int64, by a scatter-add (no host sync, unlike ``bincount`` on CUDA)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def chosen_weights(logits32: torch.Tensor, experts: torch.Tensor, scoring: str, norm_topk_prob: bool,
                   routed_scaling_factor: float) -> torch.Tensor:
    """The weights of the chosen ``experts`` from fp32 logits, as the reference computes them (differentiable)."""
    if scoring == "softmax":
        weights = torch.softmax(logits32, dim=-1).gather(1, experts)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        weights = torch.sigmoid(logits32).gather(1, experts)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights


def reference_router_topk(logits: torch.Tensor, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True,
                          expert_bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch oracle (``moe.route``'s own math, differentiable): ``(weights [T, k] fp32, experts [T, k]
    int64, counts [E] int64)``."""
    logits32 = logits.float()
    if scoring == "softmax":
        probs = torch.softmax(logits32, dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits32)
        choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        experts = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts, expert_counts(experts, logits.shape[1])


class _FusedRouterTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, impl, top_k, scoring, norm, bias, scale, backward_impl):
        T, E = logits.shape
        weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
        experts = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
        counts = torch.empty(E, dtype=torch.int64, device=logits.device)
        impl(logits, bias, top_k, scoring == "sigmoid", norm, float(scale), weights, experts, counts)
        ctx.save_for_backward(logits, experts)
        ctx.options = (scoring, norm, scale)
        ctx.backward_impl = backward_impl
        ctx.mark_non_differentiable(experts, counts)
        return weights, experts, counts

    @staticmethod
    def backward(ctx, grad_weights, _grad_experts, _grad_counts):
        logits, experts = ctx.saved_tensors
        scoring, norm, scale = ctx.options
        if ctx.backward_impl is not None:  # the C++ kernel: one call instead of a dozen torch ops (host time)
            grad = torch.empty_like(logits)
            ctx.backward_impl(logits, experts, grad_weights.float().contiguous(), scoring == "sigmoid", norm,
                              float(scale), grad)
            return grad, None, None, None, None, None, None, None
        grad = chosen_weights_backward(grad_weights, logits.float(), experts, scoring, norm, scale)
        return grad.to(logits.dtype), None, None, None, None, None, None, None


def chosen_weights_backward(grad: torch.Tensor, logits32: torch.Tensor, experts: torch.Tensor, scoring: str,
                            norm_topk_prob: bool, routed_scaling_factor: float) -> torch.Tensor:
    """The gradient of :func:`chosen_weights` with respect to ``logits32``: the ATen backward formulas autograd
    runs through it, called in the same order (so the same bits), without building a graph in the backward
    (that cost ~90 us of host time a call)."""
    grad = grad.float()
    if routed_scaling_factor != 1.0:
        grad = grad * routed_scaling_factor                                  # MulBackward0 (by a scalar)
    if scoring == "softmax":
        scores = torch.softmax(logits32, dim=-1)
    else:
        scores = torch.sigmoid(logits32)
    chosen = scores.gather(1, experts)
    if norm_topk_prob:
        total = chosen.sum(dim=-1, keepdim=True)
        if scoring == "sigmoid":
            total = total + 1e-20                                            # AddBackward0 passes it through
        # DivBackward0: grad / total for the numerator, -grad * (chosen / total / total) summed to [T, 1] for the sum
        grad_total = (-grad * (chosen / total / total)).sum(dim=-1, keepdim=True)
        grad = grad / total + grad_total.expand_as(chosen)                   # SumBackward0 expands it back
    grad = torch.zeros_like(scores).scatter_add_(1, experts, grad)           # GatherBackward0
    if scoring == "softmax":
        return torch.ops.aten._softmax_backward_data(grad, scores, -1, torch.float32)
    return torch.ops.aten.sigmoid_backward(grad, scores)


def check_router_args(op: str, logits: torch.Tensor, top_k: int, scoring: str,
                      expert_bias: Optional[torch.Tensor]) -> None:
    """ValueError naming ``op``, the sizes and the fix for arguments no backend can take."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{op}: logits must be [tokens, num_experts]; got {shape}; reshape to "
                         f"(-1, num_experts) first")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{op}: top_k={top_k!r} must be an integer in [1, num_experts={num_experts}] for logits "
                         f"of shape {tuple(logits.shape)}; choose top_k <= {num_experts}")
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: scoring={scoring!r} must be one of {SCORINGS}")
    if expert_bias is not None:
        if scoring != "sigmoid":
            raise ValueError(f"{op}: expert_bias steers only scoring='sigmoid' (DeepSeek-V3); got "
                             f"scoring={scoring!r}; drop the bias or use sigmoid scoring")
        if expert_bias.shape != (num_experts,):
            raise ValueError(f"{op}: expert_bias must be [num_experts]=[{num_experts}]; got "
                             f"{tuple(expert_bias.shape)}")


def router_topk(logits: torch.Tensor, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True,
                expert_bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0, *,
                backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, experts [T, k] int64, counts [E] int64)`` of router ``logits [T, E]`` (see the
    module docstring); ``weights`` carry the gradient to ``logits``. Logits of another dtype than fp32, bf16
    and fp16 (e.g. fp64) run the reference."""
    check_router_args(OP, logits, top_k, scoring, expert_bias)
    name = _backend.resolve(OP, logits.device, backend, BACKENDS)
    if name == "torch" or logits.dtype not in LOGIT_DTYPES or logits.shape[0] == 0:
        return reference_router_topk(logits, top_k, scoring, norm_topk_prob, expert_bias, routed_scaling_factor)
    impl = _backend.kernel(OP, logits.device, name, reference_router_topk, BACKENDS)
    bias = None if expert_bias is None else expert_bias.detach().to(device=logits.device,
                                                                    dtype=torch.float32).contiguous()
    backward_impl = None
    if name == "cpp" and torch.is_grad_enabled() and logits.requires_grad:
        backward_impl = _backend.kernel(OP + "_backward", logits.device, "cpp", chosen_weights_backward, ("cpp",))
    return _FusedRouterTopK.apply(logits.contiguous(), impl, top_k, scoring, norm_topk_prob, bias,
                                  routed_scaling_factor, backward_impl)
