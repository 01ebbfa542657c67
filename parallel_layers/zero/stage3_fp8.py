"""ZeRO-3's FP8 all-gather (``ZeroStage3(fp8_gather=True)``): FP8 layers' weights travel as FP8 bytes.

FSDP2's float8 all-gather (torchao's ``enable_fsdp_float8_all_gather``). Without it, a unit's all-gather moves
every weight in the parameter dtype (2 or 4 bytes an element) and the FP8 layer then quantizes the gathered
weight to E4M3 with a per-tensor current scale (``scale = fp8_max / amax(W)``). With it, for every weight this
module gathers in FP8 (below), each rank:

1. takes the amax of its own piece of the weight (the unit's flat shard cuts weights anywhere: a rank may hold
   a piece, all, or none of one), and max-all-reduces the unit's amaxes over the dp group (ONE small
   all-reduce per unit gather: 4 bytes per FP8 weight); a tensor-parallel layer's weight is itself a TP shard,
   scaled as one tensor with the other TP ranks' (:mod:`parallel_layers.fp8.parallel`), so its amax is also
   max-reduced over the layer's ``weight_amax_group()``;
2. computes the weight's scale from that amax (``scale_from_amax``, as the layer's ``quantize`` does) and casts
   its piece to FP8 with it (``fp8_cast``, elementwise: ``fp8(clamp(x * scale))``);
3. all-gathers one byte buffer per unit: each rank's non-FP8 elements (biases, norms, ...) in the parameter
   dtype, then its FP8 bytes, padded to the largest rank's part (rounded up to 16 bytes). The unit's padding
   elements are not sent.

The gathered FP8 bytes of each weight are handed to its layer (``FP8Mixin.use_gathered_fp8_weight``: a
:class:`~parallel_layers.fp8.Quantized`, whose ``FP8LinearFunction`` uses it instead of quantizing the
weight), the non-FP8 elements are copied into the unit's full buffer as usual.

Bit identity: the amax is a max (exact, in any order, over any split: NaN reported as inf as ``quantize``
does), so every rank computes the very scale the layer would compute from the whole gathered weight, and the
cast is elementwise with that scale, so the gathered FP8 bytes are the ones the layer would make from the
gathered full-precision weight. Training with the FP8 all-gather gives the same losses and parameters bit for
bit as without it. The backward is unchanged: dgrad uses the FP8 weight (its transpose made in backward),
wgrad makes the weight's gradient in the parameter dtype, which autograd accumulates into the parameter and
ZeRO-3 reduce-scatters in ``reduce_dtype`` as every other gradient.

The parameter. An FP8-gathered weight keeps its full shape (its gradient needs it) and its place in the unit's
full buffer, but its elements there are never written while the unit is gathered in FP8: reading them (any
torch op on the parameter but the FP8 layer's own) raises a ``RuntimeError`` naming the parameter. Inside
``ZeroStage3.gathered_parameters()`` (and ``full_state_dict``) every unit is gathered in full precision.

What is gathered in FP8: the ``weight`` of an FP8 layer (``isinstance(m, FP8Mixin)``) whose recipe is per-tensor
current scaling (``recipe.scaling == "tensor"``), held by no other module (a weight tied to an embedding is
read in full precision there: it is gathered as usual), in a unit with the layer's input format and margin
(a weight shared by FP8 layers with different ones is gathered as usual). Not gathered in FP8: delayed scaling
(its scale comes from the history, not from this weight's amax; the history's update would need the whole
weight's amax too), row and block scaling (per-row / per-block amaxes: not implemented), biases and every
other parameter.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..fp8.linear import FP8Mixin
from ..fp8.recipes import Quantized, scale_from_amax
from ..ops.fp8_cast import fp8_amax, fp8_cast, fp8_dtype
from .sharded_param import sharded_info

PAYLOAD_ALIGN = 16   # bytes: every rank's part of a unit's FP8 all-gather starts aligned


class _Weight:
    """One FP8-gathered weight of a unit: its parameter, layers, place in the flat buffer, cast settings."""

    def __init__(self, p: nn.Parameter, layers: List[FP8Mixin], offset: int):
        self.p, self.layers, self.offset, self.numel, self.shape = p, layers, offset, p.numel(), tuple(p.shape)
        r = layers[0].recipe
        self.dtype, self.margin, self.backend = fp8_dtype(r.fwd_format), r.margin, layers[0].backend
        self.group = layers[0].weight_amax_group()


def _runs(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Sorted ``[lo, hi)`` ranges with touching ones merged."""
    out: List[List[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class FP8GatherPlan:
    """One unit's FP8 all-gather: the static layout of every rank's payload, and the gather in flight or done.

    Rank r's payload (``payload_bytes`` long for every rank): its non-FP8 elements of the unit (runs of the flat
    buffer, in the parameter dtype) from byte 0, then its pieces of the FP8 weights (one byte each)."""

    def __init__(self, unit, weights: List[_Weight], dp: int, rank: int, dtype: torch.dtype, device):
        self.unit, self.weights, self.dp, self.rank, self.dtype, self.device = unit, weights, dp, rank, dtype, device
        fp8_ranges = [(w.offset, w.offset + w.numel) for w in weights]
        fp8_ids = {id(w.p) for w in weights}
        rest = _runs([(o, o + n) for p, o, n in zip(unit.params, unit.offsets, unit.numels) if id(p) not in fp8_ids])
        S, isz = unit.shard_numel, dtype.itemsize
        self.rest: List[List[Tuple[int, int, int]]] = []        # per rank: (flat lo, flat hi, element in payload)
        self.fp8: List[List[Tuple[int, int, int, int]]] = []    # per rank: (weight, flat lo, flat hi, payload byte)
        sizes = []
        for r in range(dp):
            lo, hi = r * S, (r + 1) * S
            mine, pos = [], 0
            for a, b in rest:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    mine.append((a, b, pos))
                    pos += b - a
            self.rest.append(mine)
            byte, pieces = pos * isz, []
            for i, (a, b) in enumerate(fp8_ranges):
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    pieces.append((i, a, b, byte))
                    byte += b - a
            self.fp8.append(pieces)
            sizes.append(byte)
        self.payload_bytes = max(PAYLOAD_ALIGN, -(-max(sizes) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN)
        self.recv_bytes = dp * self.payload_bytes           # what one gather moves (every rank's part)
        self.fp8_bytes = sum(w.numel for w in weights)       # the gathered FP8 weights, alive while gathered
        self._groups: Dict[int, Tuple[object, List[int]]] = {}
        for i, w in enumerate(weights):
            if w.group is not None and C.world_size(w.group) > 1:
                self._groups.setdefault(id(w.group), (w.group, []))[1].append(i)
        self._recv: Optional[torch.Tensor] = None     # in flight
        self._scales: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None   # (scale_inv, amax) per weight
        self.handed_off = False

    # ------------------------------------------------------------------ gather
    def launch(self, shard: torch.Tensor, group):
        """Amaxes (one max all-reduce over ``group``, and over each TP weight group), the cast, and the async
        all-gather of the payloads; returns its work (None for a group of one). ``shard``: the unit's shard."""
        lo = self.rank * self.unit.shard_numel
        amax = torch.zeros(len(self.weights), dtype=torch.float32, device=self.device)
        for i, a, b, _ in self.fp8[self.rank]:
            amax[i:i + 1].copy_(fp8_amax(shard[a - lo:b - lo], backend=self.weights[i].backend).reshape(1))
        amax = torch.nan_to_num(amax, nan=float("inf"))   # as quantize: a max-reduction cannot lose a NaN
        C.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        for g, idx in self._groups.values():
            index = torch.tensor(idx, dtype=torch.long, device=self.device)
            sub = amax.index_select(0, index)
            C.all_reduce(sub, g, op=dist.ReduceOp.MAX)
            amax.index_copy_(0, index, sub)
        scales = []
        for i, w in enumerate(self.weights):
            a = amax[i:i + 1].reshape(1, 1).clone()
            scale, _ = scale_from_amax(a, w.dtype, w.margin)
            scales.append((scale, a))
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=self.device)
        rest = self.rest[self.rank]
        if rest:
            as_dtype = payload[:(rest[-1][2] + rest[-1][1] - rest[-1][0]) * self.dtype.itemsize].view(self.dtype)
            for a, b, pos in rest:
                as_dtype[pos:pos + b - a].copy_(shard[a - lo:b - lo])
        for i, a, b, byte in self.fp8[self.rank]:
            w = self.weights[i]
            data, _, _ = fp8_cast(shard[a - lo:b - lo], scales[i][0], fmt=w.dtype, backend=w.backend)
            payload[byte:byte + b - a].copy_(data.view(torch.uint8).reshape(-1))
        self._scales = [(torch.reciprocal(s), a) for s, a in scales]
        self._recv, work = C.all_gather_dim0(payload, group, async_op=True)
        return work

    @property
    def in_flight(self) -> bool:
        return self._recv is not None

    @torch.no_grad()
    def finish(self, full: torch.Tensor) -> None:
        """After the all-gather's wait: the non-FP8 elements into ``full`` (the unit's full buffer), the FP8
        weights to their layers; the weights' own elements in ``full`` are left unwritten and unreadable."""
        recv, self._recv = self._recv, None
        M, isz = self.payload_bytes, self.dtype.itemsize
        datas = [torch.empty(w.shape, dtype=w.dtype, device=self.device) for w in self.weights]
        flat = [d.view(torch.uint8).reshape(-1) for d in datas]
        for r in range(self.dp):
            seg = recv[r * M:(r + 1) * M]
            rest = self.rest[r]
            if rest:
                as_dtype = seg[:(rest[-1][2] + rest[-1][1] - rest[-1][0]) * isz].view(self.dtype)
                for a, b, pos in rest:
                    full[a:b].copy_(as_dtype[pos:pos + b - a])
            for i, a, b, byte in self.fp8[r]:
                o = self.weights[i].offset
                flat[i][a - o:b - o].copy_(seg[byte:byte + b - a])
        for w, d, (sinv, amax) in zip(self.weights, datas, self._scales):
            q = Quantized(d, sinv, None, amax)
            for layer in w.layers:
                layer.use_gathered_fp8_weight(q)
            sharded_info(w.p).fp8_only = True
        self._scales = None
        self.handed_off = True

    def full_precision(self) -> None:
        """The unit's full buffer now holds every element (a full-precision gather wrote it): the weights are
        readable again (their layers keep the FP8 weights, made from the same shard)."""
        for w in self.weights:
            sharded_info(w.p).fp8_only = False

    def release(self) -> int:
        """Drop the gather in flight (already waited for) or the handed-off weights; the bytes freed."""
        freed = 0
        if self._recv is not None:
            self._recv, self._scales = None, None
            freed += self.recv_bytes
        if self.handed_off:
            for w in self.weights:
                for layer in w.layers:
                    layer.use_gathered_fp8_weight(None)
                sharded_info(w.p).fp8_only = False
            self.handed_off = False
            freed += self.fp8_bytes
        return freed


def fp8_gather_plans(module: nn.Module, units, dp: int, rank: int, dtype: torch.dtype, device
                     ) -> Dict[int, FP8GatherPlan]:
    """``{unit index: plan}`` for the units holding weights gathered in FP8 (see the module docstring)."""
    holders: Dict[int, list] = {}
    for m in module.modules():
        for n, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((n, m))
    plans = {}
    for u in units:
        weights = []
        for p, o in zip(u.params, u.offsets):
            hs = holders.get(id(p), [])
            if not hs or not all(n == "weight" and isinstance(m, FP8Mixin) and m.recipe.scaling == "tensor"
                                 for n, m in hs):
                continue
            if len({(m.recipe.fwd_format, m.recipe.margin) for _, m in hs}) != 1:
                continue
            weights.append(_Weight(p, [m for _, m in hs], o))
        if weights:
            plans[u.index] = FP8GatherPlan(u, weights, dp, rank, dtype, device)
    return plans


__all__ = ["FP8GatherPlan", "fp8_gather_plans", "PAYLOAD_ALIGN"]
