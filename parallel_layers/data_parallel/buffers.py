"""Flat parameter and gradient buffers cut into buckets (Megatron-LM's distributed-optimizer layout).

Why flat: one collective per bucket instead of one per tensor, and a ZeRO optimizer can own a
contiguous *shard* of every bucket. Parameters and gradients share one layout: element ``i`` of the
param buffer and element ``i`` of the grad buffer belong to the same parameter element.

Layout rules:
- Parameters are laid out in the *reverse* of the given order: in backward the gradients of the last
  layers arrive first, so the first bucket fills (and its communication starts) early.
- The first bucket is small (``first_bucket_cap_mb``) so communication starts as soon as possible,
  like PyTorch's reducer (``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB); later ones up to ``bucket_cap_mb``.
- A parameter never straddles buckets. A bucket is padded to a multiple of ``lcm(dp_size, pad_to_multiple)``
  elements, so it splits into ``dp_size`` equal shards; rank r owns shard r of EVERY bucket.
- Padding is zero in both buffers and stays zero (nobody writes it; reduce of zeros is zero).
- Gradients live in one flat ``grad_buffer`` (bucket views of it), or, after :meth:`split_grad_storage`
  (ZeRO-2), in one tensor per bucket, so each bucket's memory can be freed as soon as it is reduced.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed import collectives as C


class Bucket:
    """A contiguous slice of the flat buffers holding whole parameters."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], param_offsets: List[int], numel: int,
                 dp_size: int, param_data: torch.Tensor, grad_data: torch.Tensor, global_offset: int):
        self.index = index
        self.params = params
        self.param_offsets = param_offsets
        self.numel = numel
        self.dp_size = dp_size
        self.shard_numel = numel // dp_size
        self.param_data = param_data
        self.grad_data = grad_data
        self.global_offset = global_offset   # start of this bucket in the flat buffers

    def shard_range(self, dp_rank: int) -> Tuple[int, int]:
        """[start, end) of rank ``dp_rank``'s shard, in elements within this bucket."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"Bucket {self.index}: dp_rank {dp_rank} out of range for dp_size {self.dp_size}")
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def param_shard_overlaps(self, dp_rank: int) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """For each param intersecting the shard: (param, start_in_param_flat, start_in_shard, length)."""
        s0, s1 = self.shard_range(dp_rank)
        out = []
        for p, o in zip(self.params, self.param_offsets):
            a, b = max(o, s0), min(o + p.numel(), s1)
            if a < b:
                out.append((p, a - o, a - s0, b - a))
        return out

    def __repr__(self) -> str:
        return f"Bucket(index={self.index}, params={len(self.params)}, numel={self.numel})"


class ParamAndGradBuffer:
    """Owns the flat param and grad buffers for ``params``; ``p.data`` and ``p.main_grad`` become views.

    ``p.main_grad`` (fp32 by default, Megatron's name) is where reduced gradients live; DataParallel
    points ``p.grad`` at it for fp32 params so autograd accumulates straight into the buffer.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dp_group, *, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0, param_dtype: Optional[torch.dtype] = None,
                 grad_dtype: torch.dtype = torch.float32, pad_to_multiple: int = 64):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("ParamAndGradBuffer: no parameters with requires_grad=True")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("ParamAndGradBuffer: a parameter is listed twice (shared weights must be listed once)")
        devs = {p.device for p in params}
        if len(devs) != 1:
            raise ValueError(f"ParamAndGradBuffer: parameters on several devices {devs}; use one buffer per device")
        self.device = params[0].device
        self.dp_group = dp_group
        self.dp_size = C.world_size(dp_group)
        self.dp_rank = C.rank(dp_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.param_dtype = param_dtype or params[0].dtype
        self.grad_dtype = grad_dtype
        self.align = math.lcm(self.dp_size, max(1, int(pad_to_multiple)))
        self.separate_grads = False      # one grad tensor per bucket (split_grad_storage) instead of one flat one
        # reverse: last layers' grads arrive first in backward
        self._layout(list(reversed(params)), copy_from=None)

    # ------------------------------------------------------------------ layout
    def _plan(self, order: List[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
        """Greedy split of ``order`` into buckets by byte caps (first bucket smaller)."""
        esize = max(torch.empty(0, dtype=self.grad_dtype).element_size(), 1)
        groups, cur, cur_bytes = [], [], 0
        for p in order:
            cap = (self.first_bucket_cap_mb if not groups else self.bucket_cap_mb) * 1024 * 1024
            cur.append(p)
            cur_bytes += p.numel() * esize
            if cur_bytes >= cap:
                groups.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            groups.append(cur)
        return groups

    def _layout(self, order: List[torch.nn.Parameter],
                copy_from: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]]):
        groups = self._plan(order)
        sizes = []
        for g in groups:
            n = sum(p.numel() for p in g)
            sizes.append(max(self.align, -(-n // self.align) * self.align))
        total = sum(sizes)
        with torch.no_grad():
            self.param_buffer = torch.zeros(total, dtype=self.param_dtype, device=self.device)
            self.grad_buffer = torch.zeros(total, dtype=self.grad_dtype, device=self.device)
            self.buckets: List[Bucket] = []
            self._where: Dict[int, Tuple[int, int]] = {}   # id(param) -> (bucket index, offset in bucket)
            self.params: List[torch.nn.Parameter] = []
            start = 0
            for bi, (g, n) in enumerate(zip(groups, sizes)):
                offs, pos = [], 0
                for p in g:
                    offs.append(pos)
                    k = p.numel()
                    pv = self.param_buffer[start + pos:start + pos + k]
                    gv = self.grad_buffer[start + pos:start + pos + k]
                    if copy_from is None:
                        pv.copy_(p.data.reshape(-1))
                    else:
                        old_p, old_g = copy_from[id(p)]
                        pv.copy_(old_p)
                        gv.copy_(old_g)
                    p.data = pv.view(p.shape)
                    p.main_grad = gv.view(p.shape)
                    self._where[id(p)] = (bi, pos)
                    self.params.append(p)
                    pos += k
                self.buckets.append(Bucket(bi, list(g), offs, n, self.dp_size, self.param_buffer[start:start + n],
                                           self.grad_buffer[start:start + n], start))
                start += n

    def rebuild(self, order: List[torch.nn.Parameter]) -> None:
        """Re-lay out once, buckets filled in ``order`` (the order gradients actually became ready).

        Parameters missing from ``order`` are appended in their current layout order. Values of params
        and main grads are preserved. ``p.data``/``p.main_grad`` become views of NEW buffers, so anything
        holding the old views (``p.grad`` aliases, optimizer flat state) must be re-derived by the caller.
        """
        seen = {id(p) for p in order}
        if len(seen) != len(order) or not seen <= set(self._where):
            raise ValueError("ParamAndGradBuffer.rebuild: order must list buffer parameters, each once")
        if self.separate_grads:
            raise RuntimeError("ParamAndGradBuffer.rebuild: the gradients live in one tensor per bucket "
                               "(split_grad_storage, ZeRO-2), which keeps its first layout")
        full = list(order) + [p for p in self.params if id(p) not in seen]
        old = {id(p): (p.data.reshape(-1).clone(), p.main_grad.reshape(-1).clone()) for p in self.params}
        self._layout(full, copy_from=old)

    def split_grad_storage(self) -> None:
        """Give every bucket its own gradient tensor (values kept), so that one bucket's memory can be freed
        and brought back alone (ZeRO-2 frees each as soon as its reduction is done). ``grad_buffer`` is then
        None; :meth:`grad_tensors` lists the gradient memory either way."""
        if self.separate_grads:
            return
        self.separate_grads = True
        with torch.no_grad():
            for b in self.buckets:
                b.grad_data = b.grad_data.clone()
                for p, o in zip(b.params, b.param_offsets):
                    p.main_grad = b.grad_data[o:o + p.numel()].view(p.shape)
        self.grad_buffer = None          # freed once the last view of it (a p.grad) is dropped

    def grad_tensors(self) -> List[torch.Tensor]:
        """The tensors holding the gradient memory: the flat buffer, or one per bucket."""
        return [self.grad_buffer] if self.grad_buffer is not None else [b.grad_data for b in self.buckets]

    # ------------------------------------------------------------------ queries
    def bucket_of(self, param) -> Tuple[Bucket, int]:
        try:
            bi, off = self._where[id(param)]
        except KeyError:
            raise KeyError(f"ParamAndGradBuffer.bucket_of: parameter of shape {tuple(param.shape)} "
                           f"is not in this buffer") from None
        return self.buckets[bi], off

    def zero_grad(self) -> None:
        for t in self.grad_tensors():
            if t.untyped_storage().nbytes():
                t.zero_()

    def __repr__(self) -> str:
        return (f"ParamAndGradBuffer(params={len(self.params)}, numel={sum(b.numel for b in self.buckets)}, "
                f"buckets={[b.numel for b in self.buckets]}, dp_size={self.dp_size})")
