"""``VocabParallelEmbedding``: the embedding table split by vocabulary rows over the TP group.

Rank ``r`` owns rows ``[r * V_pad/tp, (r+1) * V_pad/tp)``. Each rank looks up the ids that fall in
its rows, writes zeros for the others, and an all-reduce (the sum over ranks, where exactly one rank
contributed each token) gives every rank the full ``[b, s, D]`` embeddings; under sequence
parallelism a reduce-scatter along the sequence gives ``[b, s/tp, D]`` instead.

A vocabulary that does not divide by tp is padded with zero rows up to the next multiple of tp
(Megatron-LM pads the same way); ids past the true vocabulary are an error, so the padding rows are
never read and never get a gradient. ``padding_idx`` behaves as in ``nn.Embedding`` (its row starts
at zero and gets no gradient), on the one rank that owns that row.

Initialisation draws the full ``[V, D]`` table exactly as ``nn.Embedding`` does (normal(0, 1), padding
row zeroed) and keeps this rank's rows: one full table of transient memory per rank (see
:mod:`.random`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import collectives as C
from ..mesh import check_group
from .layers import check_positive, check_sequence_input, set_parameter
from .mappings import reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region
from .random import embedding_default_init_, shard


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the tensor-parallel group.

    Args:
        num_embeddings: the true vocabulary size ``V`` (padded internally to a multiple of tp).
        embedding_dim: ``D``.
        tp_group: the tensor-parallel process group.
        padding_idx: as ``nn.Embedding`` (negative values count from the end of the true vocabulary).
        sequence_parallel: output ``[b, s/tp, D]`` (reduce-scattered along dim 1) instead of ``[b, s, D]``.
        init_method: ``fn(full_weight)`` in place on the ``[V, D]`` table; the padding row is zeroed after.
        mesh: optional :class:`ParallelMesh`; when given, ``tp_group`` must be its TP group.

    Attributes: ``num_embeddings`` (V), ``num_embeddings_padded``, ``vocab_start_index``,
    ``vocab_end_index`` (this rank's rows, end exclusive, in padded-vocabulary ids).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, padding_idx: Optional[int] = None,
                 sequence_parallel: bool = False, init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 dtype=None, device=None, mesh=None):
        super().__init__()
        name = type(self).__name__
        check_positive(name, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        world = check_group(name, tp_group, mesh)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx={padding_idx} is outside the vocabulary of "
                                 f"{num_embeddings} (allowed: {-num_embeddings} .. {num_embeddings - 1})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.tp_group, self.tp_size, self.tp_rank = tp_group, world, C.rank(tp_group)
        self.sequence_parallel = sequence_parallel
        self.num_embeddings_padded = -(-num_embeddings // world) * world
        self.num_embeddings_per_partition = self.num_embeddings_padded // world
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        own = padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
        self._local_padding_idx = padding_idx - self.vocab_start_index if own else None

        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        if full.device.type != "meta":
            if init_method is None:
                embedding_default_init_(full, padding_idx)
            else:
                with torch.no_grad():
                    init_method(full)
                    if padding_idx is not None:
                        full[padding_idx].zero_()
        set_parameter(self, "weight", shard(full, 0, self.tp_rank, world, self.num_embeddings_padded),
                      tensor_parallel=True, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name}: token ids must be an integer tensor, got {ids.dtype}")
        if self.sequence_parallel:
            check_sequence_input(name, ids, self.tp_size, "dim 1 of the ids, reduce-scattered over the TP group",
                                 min_dim=2)
        if self.tp_size == 1:
            if not ids.is_cpu:  # on CPU F.embedding refuses an id outside the table itself: explained only then
                self._check_ids(ids)
            try:
                out = F.embedding(ids, self.weight, self._local_padding_idx)
            except IndexError:
                self._check_ids(ids)
                raise
        else:  # the other ranks' ids are masked out here: one outside the vocabulary would pass silently
            self._check_ids(ids)
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local, self.weight, self._local_padding_idx)
            out = out.masked_fill(outside.unsqueeze(-1), 0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group, dim=1)
        if self.tp_size == 1:
            return out  # the all-reduce over one rank is the identity: skip its Function's host time
        return reduce_from_tensor_parallel_region(out, self.tp_group)

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Ids outside ``[0, num_embeddings)`` are an error naming the range. On CUDA the check is queued on the
        stream (``torch._assert_async``: a device-side assert with this message) instead of reading the ids
        back, which would stall the host at every forward."""
        if not ids.numel() or ids.is_meta:
            return
        lo, hi = torch.aminmax(ids)
        what = (f"{type(self).__name__}: token ids must lie in [0, {self.num_embeddings}) (the vocabulary size)")
        if ids.is_cuda:
            torch._assert_async((lo >= 0) & (hi < self.num_embeddings), what)
            return
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= self.num_embeddings:
            raise ValueError(f"{what}; got ids from {lo} to {hi}")

    @classmethod
    def from_dense(cls, module: nn.Embedding, *, tp_group, **kwargs) -> "VocabParallelEmbedding":
        """A vocabulary-parallel copy of ``module``: this rank keeps its rows (zero rows as padding)."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_dense: expected an nn.Embedding, got {type(module).__name__}")
        for key in ("dtype", "device", "init_method", "padding_idx"):
            if key in kwargs:
                raise TypeError(f"{cls.__name__}.from_dense: {key!r} comes from the dense module; do not pass it")
        unsupported = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, k)]
        if unsupported:
            raise ValueError(f"{cls.__name__}.from_dense: nn.Embedding options {unsupported} are not supported "
                             f"with a vocabulary split over ranks")
        w = module.weight
        layer = cls(module.num_embeddings, module.embedding_dim, tp_group=tp_group,
                    padding_idx=module.padding_idx, dtype=w.dtype, device="meta", **kwargs)
        set_parameter(layer, "weight", shard(w.detach(), 0, layer.tp_rank, layer.tp_size,
                                             layer.num_embeddings_padded),
                      w.requires_grad, tensor_parallel=True, partition_dim=0)
        return layer

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (padded to {self.num_embeddings_padded}; rows "
                f"[{self.vocab_start_index}, {self.vocab_end_index}) on this rank of {self.tp_size}), "
                f"padding_idx={self.padding_idx}, sequence_parallel={self.sequence_parallel}")


__all__ = ["VocabParallelEmbedding"]
