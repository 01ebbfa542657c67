"""Hugging Face MoE models in ``Parallel3D``: their sparse MoE blocks replaced by :class:`~.layer.MoELayer`,
and the model-level router loss transformers adds with ``output_router_logits=True``.

:func:`swap_hf_moe_blocks` replaces each transformers 5.x ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock`` and ``OlmoeSparseMoeBlock`` in place by its bit-identical ``MoELayer.from_hf_*``
copy (the blocks return only hidden states in 5.x, so it is a drop-in), with no loss of its own: the model's
loss has none unless ``output_router_logits``. Done before the recipe and its tensor-parallel plan, so ``ep > 1``
shards the experts and ``tp > 1`` keeps the router and experts replicated (the Qwen2-MoE shared expert is a
plain gated MLP the inferred plan splits column/row-wise). Any other module holding ``gate`` and ``experts`` is
refused when ep > 1 or the router loss is on, naming it: its own forward would train as a dense replica.

:class:`HFRouterLoss` reproduces ``router_aux_loss_coef * load_balancing_loss_func(router logits of every
layer)``: ``E * sum_e (C_e / R) * (P_e / R)`` with ``C_e`` the top-k assignments to expert ``e`` and ``P_e`` its
softmax probabilities, both summed over ALL layers and tokens, and ``R`` = layers x tokens (not the sum of
per-layer losses). Each layer's router records its ``C``, token count and ``P`` (summed over the replicas with
the layer's ``sum_over_batch``); the gradient ``coef * E * C / R^2`` of each probability needs every layer's
``C``, so it is injected in the layer's backward (through the routing weights), once the whole micro-batch's
forward has recorded them: all layers on one pipeline rank, no padding (the HF loss leaves padded tokens
out). Otherwise it is refused naming the setting and the fix. Activation checkpointing: the recomputation
runs the hook's operations again but records nothing (backward runs the forward's own nodes, which hold
the forward's record).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch
import torch.nn as nn

from ..activations.recompute import recomputing
from .expert_parallel import ExpertParallelMoE
from .hf import to_hf_names
from .layer import MoELayer

# transformers class name -> family read by MoELayer.from_hf_<family>
HF_BLOCKS = {"MixtralSparseMoeBlock": "mixtral", "Qwen2MoeSparseMoeBlock": "qwen2_moe",
             "Qwen3MoeSparseMoeBlock": "qwen3_moe", "OlmoeSparseMoeBlock": "olmoe"}


def is_moe_layer(m: nn.Module) -> bool:
    """``m`` is one of our MoE layers (one process or expert-parallel)."""
    return isinstance(m, (MoELayer, ExpertParallelMoE))


def swap_hf_moe_blocks(model: nn.Module, ep: int = 1) -> int:
    """Replace (in place) every transformers sparse MoE block of ``model`` by its ``MoELayer`` copy (no
    auxiliary loss of its own: see :class:`HFRouterLoss`). Returns how many were replaced. A module with
    ``gate`` and ``experts`` of another class is a ValueError when ``ep > 1`` or ``output_router_logits``."""
    router_logits = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    replaced = 0
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            where = f"{path}.{name}" if path else name
            family = HF_BLOCKS.get(type(child).__name__)
            if family is not None:
                try:
                    layer = getattr(MoELayer, f"from_hf_{family}")(child)
                except ValueError as e:
                    raise ValueError(f"Parallel3D: {where}: {e}") from e
                setattr(parent, name, layer)
                replaced += 1
            elif hasattr(child, "gate") and hasattr(child, "experts") and not is_moe_layer(child) \
                    and (ep > 1 or router_logits):
                why = f"ep={ep} would train it as a dense replica" if ep > 1 else \
                    "output_router_logits=True adds a router loss its forward here does not"
                raise ValueError(f"Parallel3D: {where} ({type(child).__module__}.{type(child).__name__}) looks like a "
                                 f"Mixture-of-Experts block (gate, experts) of a class not known here; {why}. "
                                 f"Known: {', '.join(HF_BLOCKS)} (replaced by parallel_layers.moe.MoELayer). Replace "
                                 f"it yourself by an MoELayer holding its weights (and pass a hand-written recipe, "
                                 f"docs/custom_recipe.md), or train with ep=1 and output_router_logits=False")
    return replaced


def to_hf_state_dict(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A state dict of a model whose blocks :func:`swap_hf_moe_blocks` replaced (e.g.
    ``Parallel3D.dense_state_dict()``) under the HF model's names: each MoE layer's ``router.weight`` back to
    ``gate.weight``, ``experts.gate_proj``/``up_proj`` fused into ``experts.gate_up_proj``; the rest as given."""
    prefixes = {k[:-len("router.weight")] for k in state if k.endswith("router.weight")
                and k[:-len("router.weight")] + "experts.gate_proj" in state}
    out, layers = {}, {p: {} for p in prefixes}
    for key, value in state.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            out[key] = value
        else:
            layers[prefix][key[len(prefix):]] = value
    for prefix, tensors in layers.items():
        out.update({prefix + k: v for k, v in to_hf_names(tensors).items()})
    return out


class _Record:
    """One micro-batch's router statistics: layer index -> ``[C (E), tokens, P (E)]`` fp64, over the replicas."""

    def __init__(self):
        self.slots: Dict[int, torch.Tensor] = {}

    def totals(self, num_experts: int):
        total = torch.stack(list(self.slots.values())).sum(0)
        return total[:num_experts].float(), total[num_experts].clamp(min=1).float(), total[num_experts + 1:].float()


class _InjectRouterLoss(torch.autograd.Function):
    """Identity on the routing weights; the backward also sends ``scale * coef * E * C / R^2`` (every layer's
    ``C`` and ``R``, read from the record at backward time) into this layer's local probability sums."""

    @staticmethod
    def forward(ctx, weights, p_local, record, owner, scale: float):
        ctx.record, ctx.owner, ctx.scale = record, owner, scale
        return weights

    @staticmethod
    def backward(ctx, grad):
        owner, record = ctx.owner, ctx.record
        if len(record.slots) != owner.num_layers:
            raise RuntimeError(f"HFRouterLoss: a backward met {len(record.slots)} of the {owner.num_layers} MoE "
                               f"layers' router statistics of its micro-batch; the model-level router loss needs every "
                               f"layer's forward before any backward (one pipeline rank, no recomputation)")
        counts, rows, _ = record.totals(owner.num_experts)
        d_p = (ctx.scale * owner.coef * owner.num_experts) * counts / rows.square()
        return grad, d_p, None, None, None


class HFRouterLoss:
    """transformers' ``router_aux_loss_coef * load_balancing_loss_func`` over ``layers`` (see the module
    docstring). ``value``: the last micro-batch's ``load_balancing_loss_func`` (without the coefficient), the
    number the HF model returns as ``aux_loss``."""

    def __init__(self, layers: List[nn.Module], coef: float):
        self.coef, self.num_layers = float(coef), len(layers)
        self.num_experts = layers[0].num_experts
        self.current: Optional[_Record] = None
        self.last: Optional[_Record] = None
        for index, layer in enumerate(layers):
            layer.router.register_forward_hook(self._hook(index, layer))

    def _hook(self, index: int, layer: nn.Module):
        def hook(router, args, routing):
            if not torch.is_grad_enabled():          # evaluation: the loss is not part of the reported one
                return None
            tokens, sum_over_batch = args[0], (args[1] if len(args) > 1 else None)
            p_local = torch.softmax(router.logits(tokens).float(), dim=-1).sum(0)
            scale = 1.0 if layer.aux_loss_scale is None else layer.aux_loss_scale
            if recomputing():        # activation checkpointing: the forward's record is the one its nodes use
                return routing._replace(weights=_InjectRouterLoss.apply(routing.weights, p_local, self.current,
                                                                        self, scale))
            stats = torch.cat([routing.counts.to(torch.float64),
                               torch.full((1,), tokens.shape[0], dtype=torch.float64, device=tokens.device),
                               p_local.detach().to(torch.float64)])
            if sum_over_batch is not None:
                stats = sum_over_batch(stats)
            if self.current is None or index in self.current.slots:   # the first layer of a new micro-batch
                self.current = _Record()
            self.current.slots[index] = stats
            if len(self.current.slots) == self.num_layers:
                self.last = self.current
            return routing._replace(weights=_InjectRouterLoss.apply(routing.weights, p_local, self.current, self,
                                                                    scale))
        return hook

    @property
    def value(self) -> Optional[float]:
        if self.last is None:
            return None
        counts, rows, probs = self.last.totals(self.num_experts)
        return float(self.num_experts * torch.sum((counts / rows) * (probs / rows)))


def hf_router_loss(model: nn.Module, layers: List[nn.Module], *, pp: int) -> Optional[HFRouterLoss]:
    """The model-level router loss of an HF model whose blocks were swapped, when its config says
    ``output_router_logits=True`` (else None); a ValueError naming the setting and the fix where it cannot
    be reproduced."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not layers:
        return None
    fix = ("or set config.output_router_logits=False (and, for a balancing loss per layer instead, the layers' "
           "own aux_loss_coef)")
    if pp > 1:
        raise ValueError(f"Parallel3D: {type(model).__name__} has output_router_logits=True: its loss adds "
                         f"router_aux_loss_coef * load_balancing_loss_func over every layer's router logits at "
                         f"once, which needs all {len(layers)} MoE layers on one pipeline rank, but pp={pp}; "
                         f"train with pp=1 {fix}")
    if any(getattr(layer.router, "capacity_factor", None) is not None for layer in layers):
        raise ValueError("Parallel3D: output_router_logits=True with a capacity factor: transformers' loss counts "
                         "the choice before any drop; use capacity_factor=None")
    return HFRouterLoss(layers, getattr(model, "router_aux_loss_coef", config.router_aux_loss_coef))


def check_no_padding(side: Mapping[str, object]) -> None:
    """The HF router loss leaves padded tokens out; our layers see every token: refuse a padding mask."""
    mask = side.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and not bool((mask != 0).all()):
        raise ValueError("Parallel3D.train_step: output_router_logits=True with padding (an attention_mask with "
                         "zeros): transformers' router loss leaves padded tokens out, which the MoE layers here do "
                         "not; pack the sequences without padding, or set config.output_router_logits=False")


__all__ = ["HF_BLOCKS", "is_moe_layer", "swap_hf_moe_blocks", "to_hf_state_dict", "HFRouterLoss", "hf_router_loss",
           "check_no_padding"]
