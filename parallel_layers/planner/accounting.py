"""Tensor accounting for the planner: what a rank holds, and what one micro-batch allocates, counted
from the package's own objects and operations rather than from a formula.

* :func:`held_bytes`: the distinct storages reachable from some objects (a ``Parallel3D``'s model,
  optimizer, gradient buffers ...), at their current size: a buffer freed with
  ``untyped_storage().resize_(0)`` counts 0, views of one buffer count once. Works on meta tensors
  (the planner's) as on real ones (the benchmark's measurement of the same terms).
* :class:`OpTally`: a ``TorchDispatchMode`` that runs code (on meta tensors, under a fake process
  group) and keeps the live bytes of every tensor the ops create (and, sampled at every op, what a caller
  says is allocated outside them), their peak, the bytes non-matmul ops
  read and write (memory-bound time), the same bytes and calls as a compiler that fuses them would
  leave (``fused_traffic``, ``fused_ops``) and every collective with its bytes. A tensor counts until its
  last reference dies (torch keeps a tensor's Python object alive as long as autograd holds it), so the
  tensors saved for backward count until backward frees them.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Dict, Iterable, List

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> int:
    # guard subclasses (ZeRO's sharded .grad) refuse reads through __torch_function__: step past them
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage()._cdata


def tensors_reachable(roots: Iterable[object], max_depth: int = 8) -> List[torch.Tensor]:
    """Every tensor reachable from ``roots`` through attributes of the package's, torch.nn's and
    torch.optim's objects, lists, tuples and dicts (optimizer state) and module parameters/buffers;
    breadth first (each object at its shortest distance), each visited once. A parameter's ``.grad`` is
    not followed: the buffers that hold gradients are reached through their owners."""
    out, seen = [], set()
    frontier = list(roots)
    for _depth in range(max_depth + 1):
        nxt = []
        for obj in frontier:
            if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                out.append(obj)
                continue
            if isinstance(obj, torch.nn.Module):
                nxt.extend(obj.parameters())
                nxt.extend(obj.buffers())
            if isinstance(obj, dict):
                nxt.extend(obj.keys())
                nxt.extend(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                nxt.extend(obj)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith(
                    ("parallel_layers", "torch.optim", "torch.nn")):
                nxt.extend(vars(obj).values())
        frontier = nxt
    return out


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` at their current size (meta tensors included)."""
    seen, total = set(), 0
    for t in tensors:
        with torch._C.DisableTorchFunctionSubclass():
            st = t.untyped_storage()
        if st._cdata in seen:
            continue
        seen.add(st._cdata)
        total += st.nbytes()
    return total


_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_efficient_attention_backward", "convolution", "convolution_backward",
               "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
# the attention kernels among them (the probe counts their FLOPs apart; the calibration times them apart)
ATTENTION_OPS = {name for name in _MATMUL_OPS if "attention" in name}


# the terms of a shape tally (``FlopTally.shape``, what ``Profile.matmul_seconds`` reads): the matmuls' FLOPs over
# their K, N and M, the attention FLOPs counted (the whole square) and computed (half for a causal kernel), and
# the number of GEMM calls (each pays a fixed cost that the FLOP terms do not hold), and the attention FLOPs
# computed over the head dim and over the query's sequence length (short heads and short sequences run slower)
SHAPE_TERMS = 8
NO_SHAPE = (0.0,) * SHAPE_TERMS


def add_gemm_shape(tally, flops: float, m: int, k: int, n: int) -> None:
    """Add one GEMM [m, k] x [k, n] of ``flops`` to ``tally`` (its K, N, M terms and its call count;
    ``FlopTally.shape`` and the planner's FP8 GEMMs keep them alike)."""
    tally[0] += flops / max(k, 1)
    tally[1] += flops / max(n, 1)
    tally[2] += flops / max(m, 1)
    tally[5] += 1


def _is_causal(func, args, kwargs) -> bool:
    """The ``is_causal`` argument of an attention op, found by name in its schema (False where it has none)."""
    if "is_causal" in kwargs:
        return kwargs["is_causal"] is True
    names = [a.name for a in func._schema.arguments]
    at = names.index("is_causal") if "is_causal" in names else len(args)
    return at < len(args) and args[at] is True
_FREE_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "reshape", "detach", "slice",
             "select", "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "chunk",
             "unbind", "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "_to_copy_meta"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpTally(TorchDispatchMode):
    """Live bytes, their peak, memory traffic of non-matmul ops and collectives, while active."""

    def __init__(self, extra=None):
        super().__init__()
        self.live = 0
        self.peak = 0
        # bytes allocated outside any op (a storage resized in place: ZeRO-3's gathered units), sampled at
        # every op, so the peak is the ops' tensors and those together
        self.extra = extra
        self.traffic = 0                      # bytes read + written by non-matmul ops
        self.ops = 0                          # operator calls (each costs a launch / dispatch overhead)
        # the same ops fused (torch.compile, Transformer Engine): between two matmuls (attention, collectives:
        # the boundaries a fused kernel does not cross) the non-matmul ops are one kernel, which reads each tensor
        # made before it once and writes only what a later kernel reads (``end_region``, ``end_phase``)
        self.fused_traffic = 0
        self.fused_ops = 0
        self._pending: Dict[int, tuple] = {}  # storage -> (bytes, region) made by fused ops, not written yet
        self._saved: Dict[int, int] = {}      # forward's unwritten tensors that backward may read (recomputed)
        self._read: set = set()               # storages this region has read from memory already
        self._region = 0
        self._region_ops = 0
        self.recomputable = 0                 # of the last forward's kept bytes, what a compiled graph recomputes
        self.collectives: Dict[str, List[int]] = defaultdict(list)   # op name -> bytes per call
        self._count: Dict[int, int] = {}      # storage -> tensors alive that own it here
        self._size: Dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live + (self.extra() if self.extra else 0)

    def _release(self, key: int) -> None:
        self._count[key] -= 1
        if self._count[key] == 0:
            self.live -= self._size.pop(key)
            del self._count[key]
            self._pending.pop(key, None)      # died unread: never written to memory
            self._saved.pop(key, None)
            self._read.discard(key)

    def end_region(self) -> None:
        """A boundary of the fused regions (a matmul, a collective): the region's kernel counts as one call;
        what it made stays unwritten until a later kernel reads it (a tensor that dies unread never is)."""
        self._read.clear()
        self._region += 1
        self.fused_ops += 1 if self._region_ops else 0
        self._region_ops = 0

    def end_phase(self, forward: bool) -> None:
        """The end of a forward (``forward``) or a backward. A forward's unwritten tensors that are still alive
        are those autograd keeps: a compiled graph's partitioner recomputes such elementwise results in the
        backward from what it saved, so a backward that reads one is charged its bytes once (the inputs of
        the recomputation read), never the forward's write. What a backward leaves is written (gradients)."""
        self.end_region()
        if forward:
            self._saved = {k: nb for k, (nb, _) in self._pending.items()}
            self.recomputable = sum(self._saved.values())
        else:
            self.fused_traffic += sum(nb for nb, _ in self._pending.values())
            self._saved = {}
        self._pending.clear()

    def _materialize(self, key: int) -> None:
        """A tensor a later kernel reads: written by the kernel that made it, read again (a matmul's reads are
        its own: charged the write only, the caller adds the read of a fused kernel)."""
        if key in self._pending:
            self.fused_traffic += self._pending.pop(key)[0]
        elif key in self._saved:
            self.fused_traffic += self._saved.pop(key)

    def _fused(self, in_keys, in_bytes, out_keys, out_bytes, before: set) -> None:
        self._region_ops += 1
        for key, nbytes in zip(in_keys, in_bytes):
            made = self._pending.get(key)
            if made is not None and made[1] == self._region:
                continue                          # made by this kernel: in registers
            if key in self._read:
                continue
            self._read.add(key)
            if key in self._saved:                # recomputed from its inputs: their read, about its bytes
                self.fused_traffic += self._saved.pop(key)
                continue
            self._materialize(key)
            self.fused_traffic += nbytes
        for key, nbytes in zip(out_keys, out_bytes):
            if key in before and key not in self._pending:
                self.fused_traffic += nbytes         # in place into a tensor written already (a buffer)
            else:
                self._pending[key] = (max(self._pending.get(key, (0,))[0], nbytes), self._region)

    def _track(self, t: torch.Tensor, before: set) -> int:
        key = _storage_key(t)
        if key not in self._count:
            if key in before:                   # a view of (or in place on) a tensor made outside: not ours
                return key
            self._count[key] = 0
            with torch._C.DisableTorchFunctionSubclass():
                self._size[key] = t.untyped_storage().nbytes()
            self.live += self._size[key]
            self.peak = max(self.peak, self.live)
        self._count[key] += 1
        weakref.finalize(t, self._release, key)
        return key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        self.ops += 1
        if name == "_local_scalar_dense" and args[0].device.type == "meta":
            # a host read of a meta tensor (a bounds check, an inf flag): there is no value; reading
            # 0 takes the normal path (ids in range, no overflow), which is the path whose memory counts
            return False if args[0].dtype == torch.bool else 0
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        in_keys = [_storage_key(a) for a in ins]
        before = set(in_keys)
        with torch._C.DisableTorchFunctionSubclass():   # the dispatch level: torch_function has run already
            out = func(*args, **kwargs)
        if func.namespace == "c10d":
            for key in before:
                self._materialize(key)
            self.end_region()
            self.fused_ops += 1
            self.collectives[name].append(sum(_nbytes(a) for a in ins))
            return out
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        # views of ours count too: the storage lives while any does
        out_keys = [self._track(o, before) for o in outs]
        if name in _MATMUL_OPS:
            for key in before:
                self._materialize(key)
            self.end_region()
            self.fused_ops += 1
        elif name not in _FREE_OPS:
            in_bytes, out_bytes = [_nbytes(a) for a in ins], [_nbytes(o) for o in outs]
            self.traffic += sum(in_bytes) + sum(out_bytes)
            self._fused(in_keys, in_bytes, out_keys, out_bytes, before)
        if self.extra is not None:
            self.peak = max(self.peak, self.live + self.extra())
        return out


class FlopTally(TorchDispatchMode):
    """FLOPs of the ops run while active, by torch's own formulas (``torch.utils.flop_counter``'s registry)
    plus ``extra`` ({op: formula of shapes}, as ``FlopCounterMode(custom_mapping=...)`` takes them).

    ``FlopCounterMode`` would count the same, but it also tracks modules: its tracker hooks the gradient
    of every module's inputs and outputs, and under activation checkpointing each recomputed segment's
    tensors stay referenced by those hooks until the whole backward ends. The memory tally beside it
    then sees them all alive at once, a peak the real run never reaches (llama at tp 2 with
    checkpointing: 5.1 MB predicted against 2.5 MB measured). Only the total is needed here."""

    def __init__(self, extra: Dict = None):
        super().__init__()
        from torch.utils.flop_counter import flop_registry, shape_wrapper
        self.formulas = dict(flop_registry)
        self.formulas.update({op: shape_wrapper(f) for op, f in (extra or {}).items()})
        self.total = 0
        # what a GPU's rate depends on beside the FLOPs (``Profile.matmul_seconds``): SHAPE_TERMS above
        self.shape = list(NO_SHAPE)

    def _tally_shape(self, func, args, kwargs, flops: int) -> None:
        name = func.overloadpacket.__name__
        if name in ATTENTION_OPS:
            # torch's formulas count the whole [s, s] square; a causal kernel computes half of it
            computed = flops / 2 if _is_causal(func, args, kwargs) else flops
            self.shape[3] += flops
            self.shape[4] += computed
            query = args[1] if name.endswith("_backward") else args[0]      # [b, h, s, d]; backward: grad_out first
            self.shape[6] += computed / max(query.shape[-1], 1)
            self.shape[7] += computed / max(query.shape[-2], 1)
            return
        mats = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}.get(name)
        if mats is None or flops == 0:
            return
        a, b = args[mats[0]], args[mats[1]]
        add_gemm_shape(self.shape, flops, a.shape[-2], a.shape[-1], b.shape[-1])

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in self.formulas:
            with self:                  # an op with a decomposition: count the ops it is made of
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.total += flops
            self._tally_shape(func, args, kwargs, flops)
        return out


def _flash_on_meta(original):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # grouped kv heads: the flash kernel takes them as they are (no repeat)
        out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    sdpa.original = original
    return sdpa


@contextlib.contextmanager
def fused_attention_on_meta():
    """``F.scaled_dot_product_attention`` on meta tensors through the fused (flash) kernel, as it runs on
    a real device: torch picks its kernel by device, and on meta it takes the math path, which keeps the
    whole [s, s] attention matrix for backward where the flash kernel keeps the output and one
    log-sum-exp per row (the CPU flash kernel stands for every device's here: the same tensors kept).
    The attribute is swapped for the ``with`` block, not a torch function mode: activation
    checkpointing recomputes with the modes switched off, and must recompute what the forward ran.
    Calls on real tensors go to torch's function unchanged."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_on_meta(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def attention_flop_formulas() -> dict:
    """:class:`FlopTally`'s ``extra`` formulas for the fused kernel :func:`fused_attention_on_meta` runs:
    torch's flop counter has formulas for the CUDA flash/efficient/cuDNN attention ops but none for the CPU
    flash kernel, which it would count as 0 FLOPs (the ``s / 6h`` of a transformer's work: 15% of a step
    at d 2304, s 2048). Its inputs are the CUDA kernels' (query, key, value; the backward's grad_out first),
    so torch's own formulas for those count it."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def _counted(t) -> tuple:
    return ("ops", "traffic", "fused_ops", "fused_traffic") if isinstance(t, OpTally) else ("total",)


def _tally_counts(tallies) -> List[int]:
    return [getattr(t, name) for t in tallies for name in _counted(t)]


def _charge(tallies, delta: List[int], times: int) -> None:
    at = iter(delta)
    for t in tallies:
        for name in _counted(t):
            setattr(t, name, getattr(t, name) + next(at) * times)


@contextlib.contextmanager
def sampled_loss_rows(tallies):
    """The cross entropy's row loop on meta run for three of its chunks, the rest charged as the second's.

    The torch reference of the vocab-parallel cross entropy (:mod:`parallel_layers.ops.cross_entropy`, what
    the planner probes) walks the rows in chunks of about 1 MB of float32 (2 rows a chunk at a 128k
    vocabulary): 16,000 chunks of ~16 ops each for 32k tokens, minutes of dispatch on meta, each chunk the
    same ops on the same shapes. Under this block its chunk generator yields the first two chunks and the
    last one only, and adds the second chunk's operator calls, memory traffic and FLOPs to ``tallies``
    (:class:`OpTally` / :class:`FlopTally`) once for every chunk skipped. What each tally counts is then
    the full loop's (every full chunk runs the same ops on the same shapes; the second, not the first,
    is the one repeated: from it on the previous chunk's temporaries are alive while the next ones are
    made, as in every later chunk, so the peak is the full loop's too). The skipped rows are never
    written: on meta there are no values. Use it only where the tensors are on meta."""
    from ..ops import cross_entropy as ce

    def chunks(n_rows, n_cols, chunk_bytes):
        spans = list(ce.row_chunks(n_rows, n_cols, chunk_bytes))
        if len(spans) <= 3:
            yield from spans
            return
        yield spans[0]
        before = _tally_counts(tallies)
        yield spans[1]
        after = _tally_counts(tallies)
        _charge(tallies, [a - b for a, b in zip(after, before)], len(spans) - 3)
        yield spans[-1]

    with ce.sampled_row_walk(chunks):
        yield


__all__ = ["ATTENTION_OPS", "tensors_reachable", "held_bytes", "OpTally", "FlopTally", "fused_attention_on_meta",
           "attention_flop_formulas", "sampled_loss_rows"]
