"""Routing sizes on the meta device.

The layout planner runs the package's own code on the meta device (:mod:`parallel_layers.planner.probe`),
where tensors have shapes but no values, so the sizes routing decides at run time (rows per expert, rows per
peer) cannot be read. There they are taken as perfectly balanced: every expert (and every expert-parallel
peer) gets an equal share of the rows, the remainder spread one each over the first ones. That is the load a
planner prices (a skewed router costs more; the aux loss exists to keep it near balanced).
"""
from __future__ import annotations

from typing import List

import torch


def balanced(total: int, parts: int) -> List[int]:
    """``total`` split into ``parts`` sizes as equal as possible (the first ``total % parts`` one larger)."""
    base, extra = divmod(int(total), int(parts))
    return [base + (i < extra) for i in range(parts)]


def sizes_of(counts: torch.Tensor, total: int) -> List[int]:
    """The values of the 1-D ``counts`` (one host sync), or on the meta device ``total`` split evenly over its
    entries."""
    if counts.is_meta:
        return balanced(total, counts.numel())
    return counts.tolist()


__all__ = ["balanced", "sizes_of"]
