"""Attention of queries over one block of keys, merged into a running result, and its backward: the per-block
work of ring attention (``parallel_layers.context_parallel.ring``), as one fused op.

The mask is given by what it is computed from, never as a dense ``[b, sq, sk]`` tensor: the tokens'
positions and segment ids (``parallel_layers.context_parallel.layout.visible``). Query ``i`` of row ``r``
sees key ``j`` when ``q_seg[r, i] == k_seg[r, j]``, ``k_seg[r, j] >= 0`` (-1 is padding) and, if ``causal``,
``k_pos[j] <= q_pos[i]``.

Kernel contract (``q [b, hq, sq, d]``, ``k, v [b, hkv, sk, d]``: one float dtype (float32, bfloat16,
float16), last dimension of unit stride, ``hq`` a multiple of ``hkv``: query head ``h`` reads key head ``h //
(hq / hkv)``; ``q_pos [sq]``, ``k_pos [sk]``, ``q_seg [b, sq]``, ``k_seg [b, sk]``: contiguous int64;
``scale``: a Python float; ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``delta``: contiguous float32):

    block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out, lse) -> None
        With ``S = q k^T scale`` masked to -inf where not visible, ``lse_b = logsumexp(S)`` and
        ``out_b = softmax(S) v`` over this block, merge in place (``out [b, hq, sq, d]``, ``lse [b, hq,
        sq]``, the running result, initially 0 and -inf):
            lse' = logaddexp(lse, lse_b);  out' = out exp(lse - lse') + out_b exp(lse_b - lse')
        A row that has seen no key keeps lse = -inf and out = 0 (never NaN).

    block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, lse, dout, delta,
                             dq, dk, dv) -> None
        Given the FINAL ``lse [b, hq, sq]`` of the queries (over every block), ``dout [b, hq, sq, d]`` (any
        float dtype; the triton backend rounds it to ``q``'s dtype) and ``delta = rowsum(dout * out)
        [b, hq, sq]``, ADD this block's share to ``dq [b, hq, sq, d]``, ``dk, dv [b, hkv, sk, d]`` (the
        query heads of a group summed into their key head): ``P = exp(S - lse)`` (0 where masked or where
        lse = -inf), ``dV = P^T dout``, ``dS = P (dout v^T - delta)``, ``dQ = dS k scale``, ``dK = dS^T q
        scale``.

Backends: ``triton`` (CUDA; CPU under TRITON_INTERPRET=1; flash-attention style, no score matrix or mask
in memory: ``triton_kernels/attention.py``) and the torch reference, which is also the CPU implementation:
it walks the queries in chunks of about ``CHUNK_BYTES`` of float32 scores and skips a chunk that sees no
key. The oracle of both is ``context_parallel/blocks.py`` (dense ``visible``, ``block_attention``,
``merge``, ``block_attention_backward``), which the tests compare against.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _backend, _checks, block_attention_cpu
from ._attention_rules import merge_into
from ._attention_rules import visible as _visible

BACKENDS = ("triton",)  # besides the torch reference
CHUNK_BYTES = 8 << 20   # float32 scores per query chunk of the torch reference
_FWD, _BWD = "block_attention_forward", "block_attention_backward"


def _chunks(b, hq, sq, sk, chunk_bytes):
    step = max(1, chunk_bytes // (4 * max(b * hq * sk, 1)))
    for r0 in range(0, sq, step):
        yield r0, min(sq, r0 + step)


def _scores(q, kf, vis, scale, hkv):
    """``[b, hkv, group, m, sk]`` fp32 masked scores (grouped heads broadcast, key heads never repeated)."""
    b, hq, m, d = q.shape
    qc = q.float().reshape(b, hkv, hq // hkv, m, d)
    s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
    return qc, s.masked_fill(~vis[:, None, None], float("-inf"))


def _no_inf(lse):
    return lse.masked_fill(torch.isinf(lse), 0.0)


def reference_block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out, lse,
                                      chunk_bytes: int = CHUNK_BYTES):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if min(b, hq, sq, sk) == 0:
        return
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]          # [b, hkv, 1, sk, d]
    for r0, r1 in _chunks(b, hq, sq, sk, chunk_bytes):
        vis = _visible(q_pos[r0:r1], k_pos, q_seg[:, r0:r1], k_seg, causal)
        if not bool(vis.any()):
            continue                      # merging lse_b = -inf, out_b = 0 changes nothing
        _, s = _scores(q[:, :, r0:r1], kf, vis, scale, hkv)
        lse_b = torch.logsumexp(s, dim=-1)
        out_b = torch.matmul(torch.exp(s - _no_inf(lse_b)[..., None]), vf).reshape(b, hq, r1 - r0, d)
        lse_b = lse_b.reshape(b, hq, r1 - r0)
        merge_into(out, lse, slice(r0, r1), out_b, lse_b)


def reference_block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, lse, dout, delta,
                                       dq, dk, dv, chunk_bytes: int = CHUNK_BYTES):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if min(b, hq, sq, sk) == 0:
        return
    g = hq // hkv
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]
    for r0, r1 in _chunks(b, hq, sq, sk, chunk_bytes):
        m = r1 - r0
        vis = _visible(q_pos[r0:r1], k_pos, q_seg[:, r0:r1], k_seg, causal)
        if not bool(vis.any()):
            continue
        qc, s = _scores(q[:, :, r0:r1], kf, vis, scale, hkv)
        p = torch.exp(s - _no_inf(lse[:, :, r0:r1]).reshape(b, hkv, g, m)[..., None])
        do = dout[:, :, r0:r1].float().reshape(b, hkv, g, m, d)
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        dp = torch.matmul(do, vf.transpose(-1, -2))
        ds = p * (dp - delta[:, :, r0:r1].reshape(b, hkv, g, m)[..., None])
        dq[:, :, r0:r1] += torch.matmul(ds, kf).reshape(b, hq, m, d) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qc).sum(2) * scale


def _valid(q, k, v, q_pos, k_pos, q_seg, k_seg, fp32_outputs) -> bool:
    """Whether every check of ``_check`` passes and no tensor needs a copy, in one expression: a call with good
    arguments pays ~3 us here instead of ~25 us through ``_check``'s per-tensor messages (run only then)."""
    dev, dt, i64, f32 = q.device, q.dtype, torch.int64, torch.float32
    kshape = k.shape
    ok = (q.dim() == 4 and k.dim() == 4 and kshape == v.shape and dt in _checks.FLOAT_DTYPES
          and k.dtype == dt and v.dtype == dt and k.device == dev and v.device == dev
          and kshape[0] == q.shape[0] and kshape[3] == q.shape[3] and kshape[1] and not q.shape[1] % kshape[1]
          and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
          and q_pos.shape == q.shape[2:3] and k_pos.shape == kshape[2:3]
          and q_seg.shape == (q.shape[0], q.shape[2]) and k_seg.shape == (kshape[0], kshape[2]))
    if not ok:
        return False
    for t in (q_pos, k_pos, q_seg, k_seg):
        if t.dtype != i64 or t.device != dev or not t.is_contiguous():
            return False
    for _, t, shape in fp32_outputs:
        if t.dtype != f32 or t.device != dev or t.shape != shape or not t.is_contiguous():
            return False
    return True


def _check(op, q, k, v, q_pos, k_pos, q_seg, k_seg, fp32_outputs):
    """Validate; returns ``(q, k, v, q_pos, k_pos, q_seg, k_seg)`` with unit last strides and contiguous
    index tensors."""
    if _valid(q, k, v, q_pos, k_pos, q_seg, k_seg, fp32_outputs):
        return q, k, v, q_pos, k_pos, q_seg, k_seg
    dev = q.device
    _checks.tensor(op, "q", q, dtypes=_checks.FLOAT_DTYPES, contiguous=False)
    for name, t in (("k", k), ("v", v)):
        _checks.tensor(op, name, t, dtypes=(q.dtype,), device=dev, contiguous=False)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"{op}: q must be [b, hq, sq, d] and k, v [b, hkv, sk, d] alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: k, v {tuple(k.shape)} must share q's batch and head size {b}, {d} and have a "
                         f"number of heads dividing q's {hq} (grouped-query attention)")
    for name, t, shape in (("q_pos", q_pos, (sq,)), ("k_pos", k_pos, (sk,)), ("q_seg", q_seg, (b, sq)),
                           ("k_seg", k_seg, (b, sk))):
        _checks.tensor(op, name, t, dtypes=(torch.int64,), device=dev, contiguous=False)
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t, shape in fp32_outputs:
        _checks.tensor(op, name, t, dtypes=(torch.float32,), device=dev)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    unit = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return unit + tuple(t.contiguous() for t in (q_pos, k_pos, q_seg, k_seg))


def block_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                            k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor, causal: bool,
                            scale: float, out: torch.Tensor, lse: torch.Tensor, backend: Optional[str] = None):
    """Merge ``q``'s attention over this block of keys into ``(out, lse)`` in place (see the kernel
    contract). Returns ``(out, lse)``."""
    b, hq, sq, d = q.shape
    args = _check(_FWD, q, k, v, q_pos, k_pos, q_seg, k_seg, (("out", out, (b, hq, sq, d)),
                                                             ("lse", lse, (b, hq, sq))))
    if _cpu_kernel(q, backend):
        block_attention_cpu.forward(*args, bool(causal), float(scale), out, lse)
        return out, lse
    impl = _impl(_FWD, q.device, backend, reference_block_attention_forward)
    impl(*args, bool(causal), float(scale), out, lse)
    return out, lse


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                             k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor, causal: bool,
                             scale: float, lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                             dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, backend: Optional[str] = None,
                             out: Optional[torch.Tensor] = None):
    """Add this block's share of the gradients to ``dq``, ``dk``, ``dv`` (see the kernel contract).
    ``out``: the queries' final output, where the caller has it (the CPU kernel takes it instead of
    ``delta``). Returns ``(dq, dk, dv)``."""
    b, hq, sq, d = q.shape
    kv_shape = tuple(k.shape)
    args = _check(_BWD, q, k, v, q_pos, k_pos, q_seg, k_seg,
                  (("lse", lse, (b, hq, sq)), ("delta", delta, (b, hq, sq)), ("dq", dq, (b, hq, sq, d)),
                   ("dk", dk, kv_shape), ("dv", dv, kv_shape)))
    _checks.tensor(_BWD, "dout", dout, dtypes=_checks.FLOAT_DTYPES, device=q.device, contiguous=False)
    if dout.shape != q.shape:
        raise ValueError(f"{_BWD}: dout has shape {tuple(dout.shape)}, expected q's {tuple(q.shape)}")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if _cpu_kernel(q, backend) and out is not None:
        block_attention_cpu.backward(*args, bool(causal), float(scale), lse, dout, out, dq, dk, dv)
        return dq, dk, dv
    impl = _impl(_BWD, q.device, backend, reference_block_attention_backward)
    impl(*args, bool(causal), float(scale), lse, dout, delta, dq, dk, dv)
    return dq, dk, dv


def _cpu_kernel(q: torch.Tensor, backend: Optional[str]) -> bool:
    """CPU tensors with no backend asked for (argument or environment): ATen's CPU flash kernels
    (:mod:`.block_attention_cpu`), where this torch has them, rather than the chunked torch reference."""
    return (q.device.type == "cpu" and _backend.requested_backend(backend) == "auto"
            and block_attention_cpu.available(q))


def _impl(op: str, device: torch.device, backend: Optional[str], reference):
    if _backend.resolve(op, device, backend, BACKENDS) == "torch":
        return reference
    # triton_kernels/__init__.py exports the multi-tensor ops only; these live in their own module.
    from ..triton_kernels import attention as tk
    return getattr(tk, op)


__all__ = ["block_attention_forward", "block_attention_backward", "reference_block_attention_forward",
           "reference_block_attention_backward"]
