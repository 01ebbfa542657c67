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

:func:`permute_reference` and :func:`unpermute_reference` are the loops the tests hold them to.
"""
from __future__ import annotations

from typing import Tuple

import torch


def permute(hidden: torch.Tensor, experts: torch.Tensor, num_experts: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [T, H]`` and the router's ``experts [T, k]`` (``-1``: dropped) -> ``(permuted [N, H], order [N],
    counts [E])``: the ``N`` kept pairs' hidden states grouped by expert, each row's flat (token, slot) index,
    and the rows of each expert (int64). One host sync (``N`` sizes the output)."""
    if hidden.dim() != 2 or experts.dim() != 2 or experts.shape[0] != hidden.shape[0]:
        raise ValueError(f"permute: hidden must be [T, H] and experts [T, k] with the same T; got hidden "
                         f"{tuple(hidden.shape)} and experts {tuple(experts.shape)}")
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    kept = flat >= 0
    n_kept, largest = torch.stack([kept.sum(), flat.max() if flat.numel() else flat.new_zeros(())]).tolist()
    if largest >= num_experts:
        raise ValueError(f"permute: experts holds index {largest} but there are num_experts={num_experts}; the "
                         f"router and the experts must agree on the number of experts")
    key = torch.where(kept, flat, num_experts)              # dropped pairs sort last, then are cut off
    order = torch.argsort(key, stable=True)[:n_kept]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    return hidden.index_select(0, order // top_k), order, counts


def unpermute(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int
              ) -> torch.Tensor:
    """``expert_out [N, H]`` (rows in :func:`permute`'s order), ``weights [T, k]`` -> ``[T, H]`` in
    ``expert_out``'s dtype: ``out[t] = sum_j weights[t, j] * expert_out[position of (t, j)]``."""
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"unpermute: weights must be [num_tokens, k] = [{num_tokens}, k]; got "
                         f"{tuple(weights.shape)}")
    if expert_out.dim() != 2 or expert_out.shape[0] != order.shape[0]:
        raise ValueError(f"unpermute: expert_out must be [N, H] with N = len(order) = {order.shape[0]}; got "
                         f"{tuple(expert_out.shape)}")
    top_k, hidden = weights.shape[1], expert_out.shape[1]
    acc = torch.promote_types(torch.promote_types(expert_out.dtype, weights.dtype), torch.float32)
    w = weights.reshape(-1).index_select(0, order).to(acc)
    rows = expert_out.to(acc) * w.unsqueeze(-1)
    slots = rows.new_zeros(num_tokens * top_k, hidden).index_copy(0, order, rows)
    return slots.view(num_tokens, top_k, hidden).sum(dim=1).to(expert_out.dtype)


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
