"""The router of a Mixture-of-Experts layer: which ``k`` experts each token goes to, with what weight.

The routing math is the pure function :func:`route` (logits in, :class:`Routing` out), so it can be tested
alone; :class:`Router` is the linear gate ``hidden -> num_experts`` (no bias by default) in front of it.

Two scorings:

- ``"softmax"`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): ``probs = softmax(logits)`` in fp32, the ``k`` largest
  chosen, their probabilities the weights; ``norm_topk_prob`` divides them by their sum (Mixtral always does,
  Qwen and OLMoE as their config says). This is transformers' ``*TopKRouter`` step for step.
- ``"sigmoid"`` (DeepSeek-V3's auxiliary-loss-free balancing): ``scores = sigmoid(logits)``; the choice ranks
  ``scores + expert_bias``, a per-expert bias that no gradient trains (:meth:`Router.update_bias` nudges it
  toward balance between steps), while the weights are the *unbiased* scores of the chosen experts, divided by
  their sum when ``norm_topk_prob`` (plus DeepSeek's 1e-20) and times ``routed_scaling_factor``. The bias only
  steers the choice, so it never scales an expert's output. (DeepSeek-V3's group-limited choice,
  ``n_group``/``topk_group``, is not done here.)

Losses, each off (and not computed) at coefficient 0:

- load balancing (Switch Transformer, as transformers' ``load_balancing_loss_func`` computes it on one layer):
  ``E * sum_i f_i * P_i`` with ``f_i`` the number of (token, slot) assignments to expert ``i`` divided by the
  number of tokens (so the ``f_i`` sum to ``k`` and a balanced router scores ``k``), and ``P_i`` the mean router
  probability of expert ``i`` (under sigmoid scoring, the scores normalised to sum 1 per token). Gradient flows
  through ``P`` only; ``f`` counts the router's choice before any capacity drop.
- router z-loss (ST-MoE): ``mean_t(logsumexp(logits_t)^2)``, which keeps the logits small.

Capacity: ``capacity_factor=None`` is dropless. With a factor, each expert takes at most
``ceil(factor * T * k / E)`` assignments, the first in token order (token ``t``'s slot ``j`` comes before token
``t + 1``'s; Switch and GShard keep the earliest tokens too); the rest are dropped: their expert is ``-1`` and
their weight 0, so the token's other experts (and the residual around the layer) carry it.
"""
from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import ENV_VAR
from ..ops.moe_routing import router_topk

SCORINGS = ("softmax", "sigmoid")
DROPPED = -1  # the expert index of an assignment dropped for capacity


class Routing(NamedTuple):
    """What :func:`route` decides for ``T`` tokens, ``E`` experts, ``k`` slots."""
    weights: torch.Tensor              # [T, k], the output dtype: expert j's weight for token t (0 where dropped)
    experts: torch.Tensor              # [T, k] int64: the chosen expert, DROPPED (-1) where capacity dropped it
    counts: torch.Tensor               # [E] int64: assignments each expert processes (after capacity)
    dropped: torch.Tensor              # [] int64: assignments dropped for capacity
    aux_loss: Optional[torch.Tensor]   # [] fp32, detached: the load-balancing loss; None when its coef is 0
    z_loss: Optional[torch.Tensor]     # [] fp32, detached: the router z-loss; None when its coef is 0
    loss: torch.Tensor                 # [] fp32 with gradient: aux_loss_coef * aux + z_loss_coef * z (0 if off)


def check_routing_sizes(layer: str, num_experts: int, top_k: int) -> None:
    """``num_experts`` and ``top_k`` are positive ints with ``top_k <= num_experts``, else a ValueError naming
    ``layer``, the sizes and the fix."""
    for name, size in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{layer}: {name}={size!r} must be a positive integer")
    if top_k > num_experts:
        raise ValueError(f"{layer}: top_k={top_k} is larger than num_experts={num_experts}; each token picks top_k "
                         f"distinct experts, so choose top_k <= {num_experts} or at least {top_k} experts")


def check_routing_options(layer: str, scoring: str, capacity_factor: Optional[float], aux_loss_coef: float,
                          z_loss_coef: float) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"{layer}: scoring={scoring!r} must be one of {SCORINGS}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"{layer}: capacity_factor={capacity_factor!r} must be positive, or None for dropless "
                         f"routing")
    for name, coef in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
        if not coef >= 0:
            raise ValueError(f"{layer}: {name}={coef!r} must be >= 0 (0 turns the loss off)")


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(factor * T * k / E)``: the most assignments one expert takes."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def route_backend(backend: Optional[str] = None) -> str:
    """The backend :func:`route` runs its top-k on: ``backend`` if given, else the one
    ``PARALLEL_LAYERS_BACKEND`` names, else ``"torch"``. Not the automatic fused choice: the fused kernels'
    softmax/sigmoid use their own ``exp`` and row sums, so their weights differ from ATen's by float32 ulps
    (the choice and counts agree), and the default keeps the bit-identity with transformers' routers."""
    if backend is not None:
        return backend
    return os.environ.get(ENV_VAR, "").strip() or "torch"


def _keep_within_capacity(experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[T, k]`` bool: True for the first ``capacity`` assignments of each expert in token order."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                  # by expert, token order kept inside each expert
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (rank < capacity).view_as(experts)


BatchSum = Callable[[torch.Tensor], torch.Tensor]


def _batch_sums(sum_over_batch: BatchSum, routed: torch.Tensor, p_sum: Optional[torch.Tensor],
                z_sum: Optional[torch.Tensor], num_tokens: int):
    """The losses' sums over the whole batch when ranks hold different tokens: ``(f_sum [E], p_sum [E], z_sum,
    rows)``, the assignments per expert, the probabilities per expert and the squared log-sum-exps summed
    over every rank's tokens, and the number of those tokens (at least 1), one ``sum_over_batch`` of them all.

    Values are the whole batch's. Gradients are this rank's part of the whole-batch loss's: ``p_sum`` and
    ``z_sum`` are ``total + (local - local.detach())``, so ``d loss / d local logits`` is the one-process
    loss's derivative with respect to these tokens' logits (``E * F_i / T^2`` per probability, ``F`` and
    ``T`` the batch's), no more: summed over the ranks, the replicated router's gradients are the one-process
    gradient of the whole batch's loss, with no collective in the backward."""
    E = routed.numel()
    parts = [routed.to(torch.float64), torch.full((1,), num_tokens, dtype=torch.float64, device=routed.device)]
    parts += [t.detach().to(torch.float64).reshape(-1) for t in (p_sum, z_sum) if t is not None]
    total = sum_over_batch(torch.cat(parts))
    f_sum, rows, rest = total[:E].float(), total[E].clamp(min=1).float(), total[E + 1:].float()
    if p_sum is not None:
        p_sum, rest = rest[:E] + (p_sum - p_sum.detach()), rest[E:]
    if z_sum is not None:
        z_sum = rest[0] + (z_sum - z_sum.detach())
    return f_sum, p_sum, z_sum, rows


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", norm_topk_prob: bool = True,
          expert_bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0,
          capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
          out_dtype: Optional[torch.dtype] = None, sum_over_batch: Optional[BatchSum] = None,
          layer: str = "route", backend: Optional[str] = None) -> Routing:
    """Route ``T`` tokens given their router ``logits [T, E]`` (see the module docstring). ``expert_bias [E]``
    (sigmoid scoring only) shifts the choice, not the weights; ``out_dtype`` is the weights' dtype (default:
    the logits'). The scores, losses and weights are computed in fp32 whatever the logits' dtype.

    ``sum_over_batch`` (when these ``T`` tokens are one rank's part of a batch split over ranks): a function
    that sums a detached fp64 vector over those ranks (an all-reduce); the losses then take the whole
    batch's ``f``, ``P``, z sum and token count (see :func:`_batch_sums`).

    ``backend``: who computes scores, top-k, weights and counts (:func:`~parallel_layers.ops.moe_routing.router_topk`);
    see :func:`route_backend` for the default."""
    if logits.dim() != 2:
        raise ValueError(f"{layer}: logits must be [tokens, num_experts]; got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    check_routing_sizes(layer, num_experts, top_k)
    check_routing_options(layer, scoring, capacity_factor, aux_loss_coef, z_loss_coef)
    if expert_bias is not None and scoring != "sigmoid":
        raise ValueError(f"{layer}: expert_bias steers only scoring='sigmoid' (DeepSeek-V3); got scoring={scoring!r}")
    logits32 = logits.float()
    weights, experts, routed = router_topk(logits, top_k, scoring, norm_topk_prob, expert_bias,
                                           routed_scaling_factor, backend=route_backend(backend))
    loss = logits32.new_zeros(())
    aux = z = None
    f_sum = routed.to(torch.float32)                 # the numerators of f, P and z, and their denominator
    p_sum = z_sum = None
    rows = max(num_tokens, 1)
    if aux_loss_coef > 0:
        if scoring == "softmax":
            p = torch.softmax(logits32, dim=-1)
        else:
            scores = torch.sigmoid(logits32)
            p = scores / scores.sum(dim=-1, keepdim=True)
        p_sum = p.sum(dim=0)
    if z_loss_coef > 0:
        z_sum = torch.logsumexp(logits32, dim=-1).square().sum()
    if sum_over_batch is not None and (p_sum is not None or z_sum is not None):
        f_sum, p_sum, z_sum, rows = _batch_sums(sum_over_batch, routed, p_sum, z_sum, num_tokens)
    if p_sum is not None:
        aux_value = num_experts * torch.sum((f_sum / rows) * (p_sum / rows))
        loss = loss + aux_loss_coef * aux_value
        aux = aux_value.detach()
    if z_sum is not None:
        z_value = z_sum / rows
        loss = loss + z_loss_coef * z_value
        z = z_value.detach()

    if capacity_factor is None:
        counts, dropped = routed, torch.zeros((), dtype=torch.int64, device=logits.device)
    else:
        capacity = expert_capacity(capacity_factor, num_tokens, top_k, num_experts)
        keep = _keep_within_capacity(experts, routed, capacity)
        experts = experts.masked_fill(~keep, DROPPED)
        weights = weights.masked_fill(~keep, 0.0)
        counts = routed.clamp(max=capacity)
        dropped = (~keep).sum()
    return Routing(weights.to(out_dtype or logits.dtype), experts, counts, dropped, aux, z, loss)


class Router(nn.Module):
    """The gate ``logits = x @ weight.T (+ bias)`` of ``hidden_size -> num_experts``, then :func:`route`.

    ``forward(x [T, hidden])`` returns a :class:`Routing` whose weights have ``x``'s dtype. Under sigmoid
    scoring the router holds ``expert_bias [E]`` (fp32, a buffer: saved in the state dict, never trained by a
    gradient), moved by :meth:`update_bias`.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        check_routing_sizes(type(self).__name__, num_experts, top_k)
        check_routing_options(type(self).__name__, scoring, capacity_factor, aux_loss_coef, z_loss_coef)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring, self.norm_topk_prob = scoring, norm_topk_prob
        self.routed_scaling_factor, self.capacity_factor = routed_scaling_factor, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        gate = nn.Linear(hidden_size, num_experts, bias=bias, device=device, dtype=dtype)
        self.weight = gate.weight
        self.bias = gate.bias
        if scoring == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, sum_over_batch: Optional[BatchSum] = None) -> Routing:
        """``sum_over_batch``: as :func:`route` takes it (the losses over a batch that ranks split)."""
        return route(self.logits(x), self.top_k, scoring=self.scoring, norm_topk_prob=self.norm_topk_prob,
                     expert_bias=self.expert_bias, routed_scaling_factor=self.routed_scaling_factor,
                     capacity_factor=self.capacity_factor, aux_loss_coef=self.aux_loss_coef,
                     z_loss_coef=self.z_loss_coef, out_dtype=x.dtype, sum_over_batch=sum_over_batch,
                     layer=type(self).__name__)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's bias update, once per step: ``expert_bias += rate * sign(mean(counts) - counts)``, so an
        overloaded expert is chosen less and an idle one more. ``counts [E]`` are the assignments per expert
        over the step (under data parallelism, summed over the ranks first so every replica moves alike)."""
        if self.expert_bias is None:
            raise ValueError(f"{type(self).__name__}: update_bias needs scoring='sigmoid' (the bias only steers "
                             f"DeepSeek-V3's sigmoid routing); this router has scoring={self.scoring!r}")
        if counts.shape != (self.num_experts,):
            raise ValueError(f"{type(self).__name__}: counts must be [num_experts]=[{self.num_experts}]; got shape "
                             f"{tuple(counts.shape)}")
        load = counts.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring!r}, norm_topk_prob={self.norm_topk_prob}")
