"""Dense layers that are not plain ``nn.Linear`` rows, brought to and from the layout the parallel
linears split: Hugging Face's ``Conv1D`` (GPT-2: ``y = x @ W + b`` with ``W`` as ``[in, out]``) and fused
projections (GPT-2's ``c_attn`` = ``[q | k | v]``, Phi-3's ``qkv_proj``, fused ``gate_up``), whose output
is several sections that must each be split over the ranks.

A fused projection with sections ``s_1 .. s_k`` (each divisible by tp) is split so that rank ``r`` holds
the r-th slice of every section, in order: ``[q_r | k_r | v_r]``. The dense rows are permuted so that a
plain contiguous column-parallel split gives exactly that, and the module keeps the sections so that
gathering undoes the permutation (``to_dense``). The attention code after the projection must then
split its local output in local sizes (GPT-2 splits by ``split_size``: divide it with the ``"divide"``
style, see ``parallelize``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (matched by name, so transformers stays
    optional): a linear layer storing its weight as ``[in_features, out_features]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def linear_sizes(module: nn.Module) -> Tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def section_permutation(sections: Sequence[int], tp: int) -> torch.Tensor:
    """Row order that makes a contiguous split over ``tp`` ranks give each rank its slice of every section."""
    starts = [sum(sections[:j]) for j in range(len(sections))]
    order = [start + r * (size // tp) + i
             for r in range(tp) for start, size in zip(starts, sections) for i in range(size // tp)]
    return torch.tensor(order, dtype=torch.long)


def as_linear(name: str, module: nn.Module, sections: Optional[Sequence[int]], tp: int) -> nn.Linear:
    """An ``nn.Linear`` computing what ``module`` does (Conv1D transposed), its output rows permuted for
    ``sections``; parameters share nothing with ``module``."""
    n_in, n_out = linear_sizes(module)
    weight = module.weight.detach().t() if is_conv1d(module) else module.weight.detach()
    bias = module.bias.detach() if module.bias is not None else None
    if sections:
        sections = [int(s) for s in sections]
        if sum(sections) != n_out or any(s % tp for s in sections):
            raise ValueError(f"parallelize: module {name!r} has {n_out} output features but sections={sections} "
                             f"(they must add up to {n_out} and each divide by the tensor-parallel size {tp})")
        perm = section_permutation(sections, tp).to(weight.device)
        weight = weight.index_select(0, perm)
        bias = bias.index_select(0, perm) if bias is not None else None
    lin = nn.Linear(n_in, n_out, bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=module.weight.requires_grad)
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone(), requires_grad=module.bias.requires_grad)
    return lin


def mark(layer: nn.Module, dense: nn.Module, sections: Optional[Sequence[int]]) -> nn.Module:
    """Record on the parallel layer how its dense original was laid out (read by :func:`to_dense`)."""
    layer.dense_transposed = is_conv1d(dense)
    layer.dense_sections = tuple(int(s) for s in sections) if sections else None
    return layer


def to_dense(layer: nn.Module, param_name: str, gathered: torch.Tensor) -> torch.Tensor:
    """The gathered (Linear-layout, permuted) ``param_name`` of ``layer`` back in its dense original's layout."""
    sections = getattr(layer, "dense_sections", None)
    if sections and param_name in ("weight", "bias"):   # sections: column-parallel only, rows permuted
        inverse = torch.argsort(section_permutation(sections, layer.tp_size))
        gathered = gathered.index_select(0, inverse.to(gathered.device))
    if getattr(layer, "dense_transposed", False) and param_name == "weight":
        gathered = gathered.t().contiguous()
    rows = getattr(layer, "dense_rows", None)          # rows padded to a multiple of tp (the GPT's untied head)
    if rows is not None and param_name == "weight" and gathered.shape[0] > rows:
        gathered = gathered[:rows]
    return gathered


def from_dense(layer: nn.Module, param_name: str, dense: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_dense`: a dense original's ``param_name`` in the parallel layer's layout
    (Linear-layout, rows permuted for sections), ready to be cut into contiguous TP shards."""
    if getattr(layer, "dense_transposed", False) and param_name == "weight":
        dense = dense.t().contiguous()
    sections = getattr(layer, "dense_sections", None)
    if sections and param_name in ("weight", "bias"):
        dense = dense.index_select(0, section_permutation(sections, layer.tp_size).to(dense.device))
    return dense


__all__ = ["is_conv1d", "linear_sizes", "section_permutation", "as_linear", "mark", "to_dense", "from_dense"]
