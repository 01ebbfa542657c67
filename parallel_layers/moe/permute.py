"""Tokens to experts and back: the (token, slot) pairs sorted by expert, and the weighted sum that undoes it.

An expert runs one matrix product over all its tokens only if they are contiguous: :func:`permute` lays
the ``T * k`` (token, slot) pairs out by expert, stably (inside an expert the tokens keep their order), and
leaves out the pairs the router dropped for capacity (expert ``-1``). :func:`unpermute` puts each expert
output back at its (token, slot) and sums the slots weighted by the router:
``out[t] = sum_j weights[t, j] * expert_out[position of (t, j)]``, a dropped slot adding nothing.

``order`` names each permuted row by its flat (token, slot) index ``t * k + j``. Both are plain indexing,
so autograd carries the gradient to the hidden states, the expert outputs and the router weights.
:func:`unpermute` writes every row to its own slot and sums the ``k`` slots of a token in slot order (no
scatter-add of rows onto one token), so the result is deterministic on every device; it accumulates in
fp32 at least (a bf16 model's ``k`` expert outputs are added in fp32, then rounded once).

:func:`permute_reference` and :func:`unpermute_reference` are the loops the tests hold them to. The work is
done by the fused ops of :mod:`parallel_layers.ops.moe_permute` (C++ on CPU, Triton on CUDA, bit-identical in
fp32 to their torch reference, plain indexing that autograd differentiates, which runs where no kernel does).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.moe_permute import permute_tokens, unpermute_tokens


def permute(hidden: torch.Tensor, experts: torch.Tensor, num_experts: int, *, backend: Optional[str] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [T, H]`` and the router's ``experts [T, k]`` (``-1``: dropped) -> ``(permuted [N, H], order [N],
    counts [E])``: the ``N`` kept pairs' hidden states grouped by expert, each row's flat (token, slot) index,
    and the rows of each expert (int64). One host sync (``N`` sizes the output). ``backend``: as the fused
    ops take it (default automatic: the C++ kernels on CPU, Triton on CUDA, else the torch reference)."""
    return permute_tokens(hidden, experts, num_experts, backend=backend)


def unpermute(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int, *,
              backend: Optional[str] = None) -> torch.Tensor:
    """``expert_out [N, H]`` (rows in :func:`permute`'s order), ``weights [T, k]`` -> ``[T, H]`` in
    ``expert_out``'s dtype: ``out[t] = sum_j weights[t, j] * expert_out[position of (t, j)]``."""
    return unpermute_tokens(expert_out, order, weights, num_tokens, backend=backend)


def permute_reference(hidden: torch.Tensor, experts: torch.Tensor, num_experts: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`permute` by loops: for each expert, for each token in order, each slot that chose it."""
    num_tokens, top_k = experts.shape
    rows, order, counts = [], [], []
    for e in range(num_experts):
        n = 0
        for t in range(num_tokens):
            for j in range(top_k):
                if int(experts[t, j]) == e:
                    rows.append(hidden[t])
                    order.append(t * top_k + j)
                    n += 1
        counts.append(n)
    permuted = torch.stack(rows) if rows else hidden[:0]
    return permuted, torch.tensor(order, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)


def unpermute_reference(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int
                        ) -> torch.Tensor:
    """:func:`unpermute` by loops: ``out[t] = sum_j weights[t, j] * expert_out[position of (t, j)]``, slot by
    slot, in the same accumulation dtype."""
    top_k = weights.shape[1]
    acc = torch.promote_types(torch.promote_types(expert_out.dtype, weights.dtype), torch.float32)
    position = {int(flat): p for p, flat in enumerate(order)}
    out = []
    for t in range(num_tokens):
        total = torch.zeros(expert_out.shape[1], dtype=acc)
        for j in range(top_k):
            p = position.get(t * top_k + j)
            if p is not None:
                total = total + weights[t, j].to(acc) * expert_out[p].to(acc)
        out.append(total)
    return torch.stack(out).to(expert_out.dtype) if out else expert_out.new_zeros(0, expert_out.shape[1])
