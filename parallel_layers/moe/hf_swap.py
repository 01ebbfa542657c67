"""Hugging Face MoE models in ``Parallel3D``: their sparse MoE blocks replaced by :class:`~.layer.MoELayer`.

:func:`swap_hf_moe_blocks` replaces each transformers 5.x ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock`` and ``OlmoeSparseMoeBlock`` in place by its bit-identical ``MoELayer.from_hf_*``
copy (the blocks return only hidden states in 5.x, so it is a drop-in), with no loss of its own: the model's
loss has none unless ``output_router_logits``. Done before the recipe and its tensor-parallel plan, so ``ep > 1``
shards the experts and ``tp > 1`` keeps the router and experts replicated (the Qwen2-MoE shared expert is a
plain gated MLP the inferred plan splits column/row-wise). Any other module holding ``gate`` and ``experts`` is
refused when ep > 1 or the router loss is on, naming it: its own forward would train as a dense replica.

The model-level router loss (``output_router_logits=True``) is :mod:`.hf_router_loss`'s.
"""
from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn as nn

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


__all__ = ["HF_BLOCKS", "is_moe_layer", "swap_hf_moe_blocks", "to_hf_state_dict"]
