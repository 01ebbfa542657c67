"""``MoELayer``: a Mixture-of-Experts MLP in one process, the drop-in for a transformer block's dense MLP.

``y = sum_j w[t, j] * expert_{e[t, j]}(x_t)  (+ shared(x_t), optionally times sigmoid(gate_s(x_t)))``

The pieces, each usable alone: :class:`~.router.Router` picks each token's experts and weights,
:func:`~.permute.permute` groups the (token, slot) pairs by expert, :class:`~.experts.GroupedExperts` runs
every expert over its block in one grouped product, :func:`~.permute.unpermute` sums each token's weighted
outputs back. Shared experts (Qwen2-MoE, DeepSeek) are one dense gated MLP of ``shared_intermediate_size``
every token passes through; Qwen2-MoE scales its output per token by ``sigmoid(shared_expert_gate(x))``.

After each forward, ``layer.aux_loss`` is the router's weighted losses (a scalar with gradient: add it to the
training loss; zero when both coefficients are 0; or set ``layer.aux_loss_scale = s`` and the backward of the
layer's output adds ``s * d aux_loss`` itself, as Megatron-core's auxiliary-loss scaler does: what the
reference GPT and ``Parallel3D`` do) and ``layer.stats`` holds detached values for logging:
``aux_loss``, ``z_loss`` (None when off), ``counts`` (assignments per expert), ``dropped`` (assignments
over capacity) and ``experts`` (each token's chosen experts, ``[tokens, k]``, -1 where dropped).

``from_hf_mixtral``, ``from_hf_qwen2_moe``, ``from_hf_qwen3_moe`` and ``from_hf_olmoe`` build the layer from a
transformers 5.x sparse MoE block with its weights (:mod:`.hf`); ``hf_state_dict`` names tensors back.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .experts import ACTIVATIONS, BACKENDS, GatedMLP, GroupedExperts
from .hf import read_hf_block, to_hf_names
from .permute import permute, unpermute
from .router import Router, check_routing_options, check_routing_sizes


def check_layer_options(name: str, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                        scoring: str, capacity_factor: Optional[float], aux_loss_coef: float, z_loss_coef: float,
                        num_shared_experts: int, shared_expert_gate: bool, activation: str, backend: str) -> None:
    """The constructor arguments of an MoE layer (:class:`MoELayer` and the expert-parallel one), else a
    ValueError naming ``name``, the argument and the fix."""
    for what, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name}: {what}={size!r} must be a positive integer")
    check_routing_sizes(name, num_experts, top_k)
    check_routing_options(name, scoring, capacity_factor, aux_loss_coef, z_loss_coef)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation={activation!r} must be one of {tuple(ACTIVATIONS)}")
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend={backend!r} must be one of {BACKENDS}")
    if num_shared_experts < 0:
        raise ValueError(f"{name}: num_shared_experts={num_shared_experts} must be >= 0")
    if shared_expert_gate and not num_shared_experts:
        raise ValueError(f"{name}: shared_expert_gate=True gates the shared experts, but num_shared_experts=0; "
                         f"set num_shared_experts >= 1 or shared_expert_gate=False")


def shared_experts(hidden_size: int, intermediate_size: int, num_shared_experts: int,
                   shared_intermediate_size: Optional[int], shared_expert_gate: bool, activation: str, **kw
                   ) -> Tuple[Optional[GatedMLP], Optional[nn.Linear]]:
    """The shared experts (one dense gated MLP of ``shared_intermediate_size``, default
    ``num_shared_experts * intermediate_size``) and their per-token gate, or None for each."""
    if not num_shared_experts:
        return None, None
    size = shared_intermediate_size or num_shared_experts * intermediate_size
    shared = GatedMLP(hidden_size, size, activation=activation, **kw)          # first: the init draws in this order
    return shared, nn.Linear(hidden_size, 1, bias=False, **kw) if shared_expert_gate else None


def add_shared_experts(out: torch.Tensor, tokens: torch.Tensor, shared: Optional[nn.Module],
                       gate: Optional[nn.Module]) -> torch.Tensor:
    """``out + shared(tokens)`` (times ``sigmoid(gate(tokens))`` with a gate); ``out`` alone without shared experts."""
    if shared is None:
        return out
    extra = shared(tokens)
    if gate is not None:
        extra = torch.sigmoid(gate(tokens)) * extra
    return out + extra


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; its backward also sends ``scale`` into the auxiliary loss, so the
    router's losses train with whatever backward the output's loss runs (a pipeline stage's included), with
    no term added to that loss."""

    @staticmethod
    def forward(ctx, out, aux_loss, scale: float):
        ctx.scale, ctx.aux = scale, (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return out

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(out: torch.Tensor, aux_loss: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """``out``, whose backward adds ``scale * d aux_loss`` (None: nothing attached; the caller adds
    ``layer.aux_loss`` to its loss itself)."""
    if scale is None or not torch.is_grad_enabled() or not aux_loss.requires_grad:
        return out
    return _AttachAuxLoss.apply(out, aux_loss, float(scale))


def summed_over(group):
    """The router's ``sum_over_batch`` for a batch split over ``group`` (an all-reduce, in place), or None
    without a group (the losses over this process's tokens)."""
    if group is None:
        return None
    from ..distributed import collectives as C

    def total(stats: torch.Tensor) -> torch.Tensor:
        C.all_reduce(stats, group)
        return stats
    return total


def check_layer_input(name: str, x: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> None:
    """``x`` is ``[..., hidden_size]`` of the layer's ``dtype`` (any dtype under autocast), else a ValueError."""
    if x.dim() < 2 or x.shape[-1] != hidden_size:
        raise ValueError(f"{name}: input must be [..., hidden_size] with hidden_size={hidden_size} (e.g. "
                         f"[batch, seq, {hidden_size}]); got shape {tuple(x.shape)}. Pass tensors of that "
                         f"hidden size or build the layer with hidden_size={x.shape[-1] if x.dim() else '?'}")
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{name}: input dtype {x.dtype} differs from the layer's {dtype}; cast one to "
                         f"the other (x.to({dtype}) or layer.to({x.dtype}))")


class MoELayer(nn.Module):
    """``forward(x [..., hidden_size]) -> [..., hidden_size]`` (see the module docstring).

    ``num_experts`` routed SwiGLU experts of ``intermediate_size``, ``top_k`` per token; routing options as
    :func:`~.router.route` takes them; ``num_shared_experts > 0`` adds one dense gated MLP of
    ``shared_intermediate_size`` (default ``num_shared_experts * intermediate_size``), gated per token by
    ``sigmoid(shared_expert_gate(x))`` when ``shared_expert_gate``; ``backend`` as
    :class:`~.experts.GroupedExperts` takes it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 scoring: str = "softmax", norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 num_shared_experts: int = 0, shared_intermediate_size: Optional[int] = None,
                 shared_expert_gate: bool = False, activation: str = "silu", backend: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        check_layer_options(type(self).__name__, hidden_size, intermediate_size, num_experts, top_k, scoring=scoring,
                            capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
                            num_shared_experts=num_shared_experts, shared_expert_gate=shared_expert_gate,
                            activation=activation, backend=backend)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        kw = dict(device=device, dtype=dtype)
        self.router = Router(hidden_size, num_experts, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
                             routed_scaling_factor=routed_scaling_factor, capacity_factor=capacity_factor,
                             aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, **kw)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, activation=activation,
                                      backend=backend, **kw)
        self.shared_expert, self.shared_expert_gate = shared_experts(
            hidden_size, intermediate_size, num_shared_experts, shared_intermediate_size, shared_expert_gate,
            activation, **kw)
        self.aux_loss: Optional[torch.Tensor] = None
        self.aux_loss_scale: Optional[float] = None
        # the group the batch is split over (data-parallel replicas): the losses then take the whole batch's
        # statistics (:func:`~.router.route`'s ``sum_over_batch``); None: this process's tokens only
        self.aux_loss_group = None
        self.stats: Dict[str, Optional[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(type(self).__name__, x, self.hidden_size, self.router.weight.dtype)
        tokens = x.reshape(-1, self.hidden_size)
        routing = self.router(tokens, summed_over(self.aux_loss_group))
        permuted, order, counts = permute(tokens, routing.experts, self.num_experts)
        out = unpermute(self.experts(permuted, counts), order, routing.weights, tokens.shape[0])
        out = add_shared_experts(out, tokens, self.shared_expert, self.shared_expert_gate)
        out = attach_aux_loss(out, routing.loss, self.aux_loss_scale)
        self.aux_loss = routing.loss
        self.stats = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss, "counts": routing.counts,
                      "dropped": routing.dropped, "experts": routing.experts}
        return out.reshape(x.shape)

    # ------------------------------------------------------------------ transformers blocks
    @classmethod
    def _from_hf(cls, block: nn.Module, family: str, **overrides) -> "MoELayer":
        read = read_hf_block(block, family)
        weight = read.state["router.weight"]
        layer = cls(**{**read.kwargs, **overrides}, device="meta", dtype=weight.dtype)
        layer = layer.to_empty(device=weight.device)
        missing, unexpected = layer.load_state_dict(read.state, strict=False)
        left = [k for k in missing if k != "router.expert_bias"]
        if left or unexpected:
            raise ValueError(f"MoELayer.from_hf_{family}: the block's weights do not fill the layer (missing "
                             f"{left}, unexpected {unexpected})")
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()
        return layer

    @classmethod
    def from_hf_mixtral(cls, block: nn.Module, **overrides) -> "MoELayer":
        """A copy of transformers' ``MixtralSparseMoeBlock``; ``overrides`` (e.g. ``aux_loss_coef=0.02``,
        ``backend=``) go to the constructor."""
        return cls._from_hf(block, "mixtral", **overrides)

    @classmethod
    def from_hf_qwen2_moe(cls, block: nn.Module, **overrides) -> "MoELayer":
        """A copy of ``Qwen2MoeSparseMoeBlock``, its shared expert and shared-expert gate included."""
        return cls._from_hf(block, "qwen2_moe", **overrides)

    @classmethod
    def from_hf_qwen3_moe(cls, block: nn.Module, **overrides) -> "MoELayer":
        """A copy of ``Qwen3MoeSparseMoeBlock``."""
        return cls._from_hf(block, "qwen3_moe", **overrides)

    @classmethod
    def from_hf_olmoe(cls, block: nn.Module, **overrides) -> "MoELayer":
        """A copy of ``OlmoeSparseMoeBlock``."""
        return cls._from_hf(block, "olmoe", **overrides)

    def hf_state_dict(self, tensors: Optional[Mapping[str, Optional[torch.Tensor]]] = None
                      ) -> Dict[str, Optional[torch.Tensor]]:
        """``tensors`` keyed by this layer's names (default: its state dict; or e.g. each parameter's ``.grad``)
        under the names of the transformers block it came from (:func:`~.hf.to_hf_names`)."""
        return to_hf_names(self.state_dict() if tensors is None else tensors)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}"
