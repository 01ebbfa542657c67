"""A model's linear layers turned into FP8 ones: what ``PrecisionConfig(fp8=...)`` does in ``Parallel3D``, usable
alone on any module.

:func:`convert_to_fp8` swaps, in place, every chosen ``nn.Linear`` for an :class:`.FP8Linear` and every
``ColumnParallelLinear`` / ``RowParallelLinear`` for its FP8 twin, each sharing the parameters of the layer it
replaces (an optimizer, ZeRO or a checkpoint sees the same tensors, fp32 or bf16 master weights as before).
Run it after tensor parallelism has split the model (the TP layers then exist) and before anything holds the
modules.

Which layers (``modules(name, module) -> bool``; default :func:`default_fp8_modules`): every linear layer
except the language-model head (the model's ``get_output_embeddings()``, or a module named ``lm_head``: its
logits decide the loss and its GEMM is a small share of the FLOPs, so torchtitan and Transformer Engine recipes
keep it in high precision), the MoE router (not an ``nn.Linear`` here: it never converts) and any layer whose
local in or out features are not multiples of 16 (the FP8 GEMM kernels need that alignment; torchtitan skips
them too). transformers' ``Conv1D`` (GPT-2) is not a linear layer here and stays as it is.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional

import torch.nn as nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .linear import FP8Linear, FP8Mixin
from .parallel import FP8ColumnParallelLinear, FP8RowParallelLinear
from .recipes import DelayedScaling, FP8Recipe

ALIGNMENT = 16


def _local_sizes(module: nn.Module):
    if isinstance(module, ColumnParallelLinear):
        return module.in_features, module.out_features_per_partition
    if isinstance(module, RowParallelLinear):
        return module.in_features_per_partition, module.out_features
    return module.in_features, module.out_features


def _is_linear(module: nn.Module) -> bool:
    return (isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear))
            and not isinstance(module, FP8Mixin))


def default_fp8_modules(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """The default choice for ``model``: every linear layer but its LM head and layers whose local sizes are
    not multiples of 16 (see the module docstring)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None

    def chosen(name: str, module: nn.Module) -> bool:
        if module is head or name.rsplit(".", 1)[-1] == "lm_head":
            return False
        return all(n % ALIGNMENT == 0 for n in _local_sizes(module))
    return chosen


def convert_to_fp8(model: nn.Module, recipe: Optional[FP8Recipe] = None, *,
                   modules: Optional[Callable[[str, nn.Module], bool]] = None, row_group=None,
                   delayed_update: str = "cast", backend: Optional[str] = None) -> List[str]:
    """Swap ``model``'s chosen linear layers for FP8 ones (in place); returns their names.

    ``recipe``: :class:`.FP8Recipe` (default per-tensor current scaling); ``modules(name, module)``: which
    layers (default :func:`default_fp8_modules`); ``row_group``: the tokens are split over this group besides
    the tensor-parallel one (context parallelism: per-tensor amaxes are reduced over it, so the scales are
    those of the whole sequence); ``delayed_update``: ``"step"`` when a training loop commits the delayed
    histories once per optimizer step (:func:`.recipes.commit_delayed`, as ``Parallel3D`` does)."""
    recipe = recipe if recipe is not None else FP8Recipe()
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(f"convert_to_fp8: recipe must be an FP8Recipe, got {type(recipe).__name__}")
    choose = modules if modules is not None else default_fp8_modules(model)
    targets = [(name, m) for name, m in model.named_modules() if _is_linear(m) and choose(name, m)]
    for name, module in targets:
        kwargs = dict(recipe=recipe, backend=backend)
        if isinstance(module, ColumnParallelLinear):
            layer = FP8ColumnParallelLinear.from_parallel(module, **kwargs)
        elif isinstance(module, RowParallelLinear):
            layer = FP8RowParallelLinear.from_parallel(module, **kwargs)
        else:
            layer = FP8Linear.from_linear(module, **kwargs)
        layer.set_row_group(row_group)
        layer.set_delayed_update(delayed_update)
        layer.train(module.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return [name for name, _ in targets]


def fp8_layers(model: nn.Module) -> Iterator[tuple]:
    """``(name, layer)`` of every FP8 layer in ``model``."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, FP8Mixin))


def delayed_scaling_states(model: nn.Module) -> Iterator[tuple]:
    """``(name, DelayedScaling)`` of every FP8 layer's delayed-scaling states in ``model`` (names
    ``<layer>.fp8.<input|weight|grad>``)."""
    for name, layer in fp8_layers(model):
        for role, state in layer.fp8_states.items():
            if isinstance(state, DelayedScaling):
                yield f"{name}.fp8.{role}", state


__all__ = ["convert_to_fp8", "default_fp8_modules", "fp8_layers", "delayed_scaling_states", "ALIGNMENT"]
