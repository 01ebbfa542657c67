"""Reading a transformers sparse MoE block (5.x) into :class:`~.layer.MoELayer`'s settings and weights, and
naming the layer's tensors as the block names them.

transformers 5.x stores a block's experts fused: ``experts.gate_up_proj [E, 2I, H]`` (the gate rows first,
then the up rows, as ``.chunk(2)`` splits them) and ``experts.down_proj [E, H, I]``; the router is
``gate.weight [E, H]``. The families differ only in the routing and the shared expert:

- Mixtral: softmax, the top-k always renormalised; nothing beside the routed experts
  (``router_jitter_noise`` must be 0: the layer has no jitter).
- Qwen2-MoE: softmax, ``norm_topk_prob`` as configured; a SwiGLU ``shared_expert`` every token passes
  through, its output times ``sigmoid(shared_expert_gate(x))``, added to the routed experts' sum.
- Qwen3-MoE, OLMoE: softmax, ``norm_topk_prob`` as configured; nothing beside the routed experts.

A block returns only its hidden states (transformers records the router logits with hooks, for a
model-level auxiliary loss); the layer keeps its own losses in ``aux_loss``.

Nothing here imports transformers: a block is read by its attributes, and one that lacks them, or holds
what the layer would silently ignore (expert biases, transposed weights, a shared expert the family does
not have), is refused with the reason.
"""
from __future__ import annotations

from typing import Dict, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


class HFBlock(NamedTuple):
    """A block read: :class:`~.layer.MoELayer`'s keyword arguments and its state dict."""
    kwargs: dict
    state: Dict[str, torch.Tensor]


def _activation(block_name: str, act_fn) -> str:
    probe = torch.linspace(-4, 4, 17)
    for name, fn in (("silu", F.silu), ("gelu", F.gelu)):
        if torch.allclose(act_fn(probe), fn(probe), rtol=1e-6, atol=1e-6):
            return name
    raise ValueError(f"{block_name}: the experts' activation {act_fn!r} is neither silu nor gelu")


def read_hf_block(block: nn.Module, family: str) -> HFBlock:
    """The settings and weights of a transformers ``*SparseMoeBlock`` of ``family`` (one of :data:`FAMILIES`)."""
    name = f"MoELayer.from_hf_{family}({type(block).__name__})"
    if family not in FAMILIES:
        raise ValueError(f"read_hf_block: family={family!r} must be one of {FAMILIES}")
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(getattr(gate, "weight", None), torch.Tensor) or \
            not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        raise ValueError(f"{name}: expected a transformers 5.x sparse MoE block with gate.weight and fused "
                         f"experts.gate_up_proj / experts.down_proj")
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or \
            not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{name}: experts with biases, transposed or interleaved gate/up weights are not supported")
    has_shared = hasattr(block, "shared_expert") or hasattr(block, "shared_experts")
    if has_shared != (family == "qwen2_moe"):
        raise ValueError(f"{name}: the block {'has' if has_shared else 'lacks'} a shared expert, which "
                         f"{family} {'does not have' if has_shared else 'has'}; read it as its own family")
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{name}: router_jitter_noise={block.jitter_noise} is not supported; set it to 0")
    if (family == "mixtral") != (not hasattr(gate, "norm_topk_prob")):
        raise ValueError(f"{name}: the router {'lacks' if family != 'mixtral' else 'has'} norm_topk_prob, so this "
                         f"is not a {family} block; read it as its own family")
    num_experts, intermediate2, hidden = experts.gate_up_proj.shape
    intermediate = intermediate2 // 2
    kwargs = dict(hidden_size=hidden, intermediate_size=intermediate, num_experts=num_experts, top_k=gate.top_k,
                  scoring="softmax", norm_topk_prob=True if family == "mixtral" else bool(gate.norm_topk_prob),
                  activation=_activation(name, experts.act_fn))
    state = {"router.weight": gate.weight.detach(),
             "experts.gate_proj": experts.gate_up_proj.detach()[:, :intermediate],
             "experts.up_proj": experts.gate_up_proj.detach()[:, intermediate:],
             "experts.down_proj": experts.down_proj.detach()}
    if family == "qwen2_moe":
        shared = block.shared_expert
        if _activation(name, shared.act_fn) != kwargs["activation"]:
            raise ValueError(f"{name}: the shared expert's activation differs from the routed experts'")
        kwargs.update(num_shared_experts=1, shared_intermediate_size=shared.gate_proj.weight.shape[0],
                      shared_expert_gate=getattr(block, "shared_expert_gate", None) is not None)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"shared_expert.{proj}.weight"] = getattr(shared, proj).weight.detach()
        if kwargs["shared_expert_gate"]:
            state["shared_expert_gate.weight"] = block.shared_expert_gate.weight.detach()
    return HFBlock(kwargs, state)


def to_hf_names(tensors: Mapping[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """``{MoELayer name: tensor}`` (a state dict, or each parameter's gradient) -> ``{block name: tensor}``:
    the router is ``gate``, gate and up are fused back into ``experts.gate_up_proj``, the rest keep their
    names. A missing gradient (None) stays None."""
    out = {}
    for key, value in tensors.items():
        if key in ("experts.gate_proj", "experts.up_proj"):
            continue
        if key.startswith("router."):
            key = "gate." + key[len("router."):]
            key = key.replace("gate.expert_bias", "gate.e_score_correction_bias")
        out[key] = value
    if "experts.gate_proj" in tensors:
        gate, up = tensors["experts.gate_proj"], tensors["experts.up_proj"]
        out["experts.gate_up_proj"] = None if gate is None or up is None else torch.cat([gate, up], dim=1)
    return out
