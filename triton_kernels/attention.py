"""Attention of queries over one block of keys/values, flash-attention style: the per-block work of ring
attention (context parallelism), with the merge into the running result fused in.

The kernel contracts are written in ``parallel_layers/ops/block_attention.py``; these launchers trust the
arguments the ops layer validated.

The mask is never a tensor: every tile evaluates it from the tokens' positions and segment ids (a query
sees a key when both are in the same segment, the key is not padding (segment -1) and, causal, the key's
position is not after the query's). A key tile that no query of the tile can see (all padding, segment
ranges disjoint, or entirely in the future) is skipped before its keys are loaded.

``block_attention_forward``: one program per (tile of BLOCK_M queries, batch x query head) walks the key
tiles with an online softmax (running max ``m``, sum ``l`` and unnormalised output, rescaled when the max
grows), so no ``[sq, sk]`` score matrix is ever stored. At the end it merges its result into the running
``(out, lse)`` in place: ``lse' = logaddexp(lse, m + log l)``, ``out' = out exp(lse - lse') + acc exp(m -
lse')`` (``acc / l`` is the block's output and ``l exp(m)`` its exp-sum). Rows that see nothing keep
``lse = -inf`` and ``out = 0``.

Backward (flash attention's rule, from the FINAL ``out``/``lse`` and ``delta = rowsum(dout * out)``):
``_dq_kernel``, one program per (query tile, batch x query head), walks the key tiles and adds its ``dQ``
to ``dq``; ``_dkdv_kernel``, one program per (key tile, batch x key head), walks the query tiles of every
query head of its group (grouped-query attention folds there, no atomics) and adds ``dK``, ``dV``.

Accumulation is float32. fp32 inputs multiply in IEEE fp32 (``input_precision="ieee"``: no TF32, so the
result matches the torch reference to rounding); bf16/fp16 inputs multiply in their own dtype with fp32
accumulation, and the probabilities (and ``dS``) are rounded to that dtype before their matmuls, as flash
attention does. Offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import launch_guard


@triton.jit
def _skip_tile(q_pos_max, qs_min, qs_max, kpos_ptr, kseg_ptr, b, sk, start, CAUSAL: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """True when no query of the tile (its max position, segment range) can see a key of this key tile."""
    offs_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
    n_ok = offs_n < sk
    k_seg = tl.load(kseg_ptr + b * sk + offs_n, mask=n_ok, other=-1)
    ks_max = tl.max(k_seg, axis=0)
    ks_min = tl.min(tl.where(k_seg >= 0, k_seg, ks_max), axis=0)
    skip = (ks_max < 0) | (ks_max < qs_min) | (ks_min > qs_max)
    if CAUSAL:
        k_pos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=0)
        kp0 = tl.load(kpos_ptr + start)
        skip = skip | (tl.min(tl.where(n_ok, k_pos, kp0), axis=0) > q_pos_max)
    return skip


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. UPCAST (interpreter, bf16 only): widen the tiles first, because
    triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 storage; exact, as a product of two
    bf16 values is exact in float32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _visible(q_pos, q_seg, k_pos, k_seg, CAUSAL: tl.constexpr):
    """``[M, N]`` mask of the tile (out-of-range queries and keys carry segment -1: they see nothing)."""
    vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
    if CAUSAL:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    return vis


@triton.jit(do_not_specialize=["sq", "sk", "hq", "hkv", "group"])  # one compile for any lengths, heads
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, out_ptr, lse_ptr,
                     sq, sk, hq, group, head_dim, scale,
                     q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                     CAUSAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    m0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hq
    h = bh % hq
    hk = h // group
    offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_ok = offs_m < sq
    d_ok = offs_d < head_dim
    q = tl.load(q_ptr + b * q_sb + h * q_sh + offs_m[:, None] * q_ss + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + offs_m, mask=m_ok, other=0)
    q_seg = tl.load(qseg_ptr + b * sq + offs_m, mask=m_ok, other=-1)
    qp0 = tl.load(qpos_ptr + m0)
    qs0 = tl.load(qseg_ptr + b * sq + m0)
    q_pos_max = tl.max(tl.where(m_ok, q_pos, qp0), axis=0)
    qs_min = tl.min(tl.where(m_ok, q_seg, qs0), axis=0)
    qs_max = tl.max(tl.where(m_ok, q_seg, qs0), axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * k_sb + hk * k_sh
    v_base = v_ptr + b * v_sb + hk * v_sh
    for start in tl.range(0, sk, BLOCK_N):
        skip = _skip_tile(q_pos_max, qs_min, qs_max, kpos_ptr, kseg_ptr, b, sk, start, CAUSAL, BLOCK_N)
        if skip == 0:
            offs_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
            n_ok = offs_n < sk
            k_pos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=0)
            k_seg = tl.load(kseg_ptr + b * sk + offs_n, mask=n_ok, other=-1)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * k_ss + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
            s = tl.where(_visible(q_pos, q_seg, k_pos, k_seg, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # rows that saw nothing yet: exp -> 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n[:, None] * v_ss + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
            m_i = m_new

    # The fused merge into the running (out, lse).
    row = bh * sq + offs_m
    lse_old = tl.load(lse_ptr + row, mask=m_ok, other=float("-inf"))
    lse_b = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    hi = tl.maximum(lse_old, lse_b)
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
    finite = hi > float("-inf")
    new = hi_safe + tl.log(tl.where(finite, tl.exp(lse_old - hi_safe) + tl.exp(lse_b - hi_safe), 1.0))
    new = tl.where(finite, new, float("-inf"))
    new_safe = tl.where(finite, new, 0.0)
    wa = tl.where(finite, tl.exp(lse_old - new_safe), 0.0)
    wb = tl.where(finite & (l_i > 0), tl.exp(m_i - new_safe), 0.0)
    o_ptrs = out_ptr + row[:, None] * head_dim + offs_d[None, :]
    o_mask = m_ok[:, None] & d_ok[None, :]
    old = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, old * wa[:, None] + acc * wb[:, None], mask=o_mask)
    tl.store(lse_ptr + row, new, mask=m_ok)


@triton.jit(do_not_specialize=["sq", "sk", "hq", "hkv", "group"])  # one compile for any lengths, heads
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, lse_ptr, delta_ptr, dq_ptr,
               sq, sk, hq, group, head_dim, scale,
               q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss,
               CAUSAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    m0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hq
    h = bh % hq
    hk = h // group
    offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_ok = offs_m < sq
    d_ok = offs_d < head_dim
    md_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * q_sb + h * q_sh + offs_m[:, None] * q_ss + offs_d[None, :], mask=md_mask, other=0.0)
    do = tl.load(do_ptr + b * do_sb + h * do_sh + offs_m[:, None] * do_ss + offs_d[None, :], mask=md_mask,
                 other=0.0).to(q.dtype)
    row = bh * sq + offs_m
    lse = tl.load(lse_ptr + row, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)          # a row that sees nothing: every p is exp(-inf) = 0
    delta = tl.load(delta_ptr + row, mask=m_ok, other=0.0)
    q_pos = tl.load(qpos_ptr + offs_m, mask=m_ok, other=0)
    q_seg = tl.load(qseg_ptr + b * sq + offs_m, mask=m_ok, other=-1)
    qp0 = tl.load(qpos_ptr + m0)
    qs0 = tl.load(qseg_ptr + b * sq + m0)
    q_pos_max = tl.max(tl.where(m_ok, q_pos, qp0), axis=0)
    qs_min = tl.min(tl.where(m_ok, q_seg, qs0), axis=0)
    qs_max = tl.max(tl.where(m_ok, q_seg, qs0), axis=0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * k_sb + hk * k_sh
    v_base = v_ptr + b * v_sb + hk * v_sh
    for start in tl.range(0, sk, BLOCK_N):
        skip = _skip_tile(q_pos_max, qs_min, qs_max, kpos_ptr, kseg_ptr, b, sk, start, CAUSAL, BLOCK_N)
        if skip == 0:
            offs_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
            n_ok = offs_n < sk
            k_pos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=0)
            k_seg = tl.load(kseg_ptr + b * sk + offs_n, mask=n_ok, other=-1)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * k_ss + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * v_ss + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
            s = tl.where(_visible(q_pos, q_seg, k_pos, k_seg, CAUSAL), s, float("-inf"))
            p = tl.exp(s - lse[:, None])
            dp = _dot(do, tl.trans(v), PREC, UPCAST)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PREC, UPCAST)
    dq_ptrs = dq_ptr + row[:, None] * head_dim + offs_d[None, :]
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=md_mask, other=0.0) + dq * scale, mask=md_mask)


@triton.jit(do_not_specialize=["sq", "sk", "hq", "hkv", "group"])  # one compile for any lengths, heads
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, lse_ptr, delta_ptr,
                 dk_ptr, dv_ptr, sq, sk, hkv, group, head_dim, scale,
                 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss,
                 CAUSAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    n0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hkv
    hk = bh % hkv
    hq = hkv * group
    offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    n_ok = offs_n < sk
    d_ok = offs_d < head_dim
    nd_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b * k_sb + hk * k_sh + offs_n[:, None] * k_ss + offs_d[None, :], mask=nd_mask, other=0.0)
    v = tl.load(v_ptr + b * v_sb + hk * v_sh + offs_n[:, None] * v_ss + offs_d[None, :], mask=nd_mask, other=0.0)
    k_pos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=0)
    k_seg = tl.load(kseg_ptr + b * sk + offs_n, mask=n_ok, other=-1)
    # This key tile's bounds, for skipping query tiles that see none of it.
    kp0 = tl.load(kpos_ptr + n0)
    k_pos_min = tl.min(tl.where(n_ok, k_pos, kp0), axis=0)
    ks_max = tl.max(k_seg, axis=0)
    ks_min = tl.min(tl.where(k_seg >= 0, k_seg, ks_max), axis=0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if ks_max >= 0:                                           # a tile of padding keys only gets no gradient
        for g in tl.range(0, group):
            h = hk * group + g
            q_base = q_ptr + b * q_sb + h * q_sh
            do_base = do_ptr + b * do_sb + h * do_sh
            for start in tl.range(0, sq, BLOCK_M):
                offs_m = start + tl.arange(0, BLOCK_M).to(tl.int64)
                m_ok = offs_m < sq
                q_pos = tl.load(qpos_ptr + offs_m, mask=m_ok, other=0)
                q_seg = tl.load(qseg_ptr + b * sq + offs_m, mask=m_ok, other=-1)
                qp0 = tl.load(qpos_ptr + start)
                qs0 = tl.load(qseg_ptr + b * sq + start)
                skip = (ks_max < tl.min(tl.where(m_ok, q_seg, qs0), axis=0)) | \
                       (ks_min > tl.max(tl.where(m_ok, q_seg, qs0), axis=0))
                if CAUSAL:
                    skip = skip | (k_pos_min > tl.max(tl.where(m_ok, q_pos, qp0), axis=0))
                if skip == 0:
                    md_mask = m_ok[:, None] & d_ok[None, :]
                    q = tl.load(q_base + offs_m[:, None] * q_ss + offs_d[None, :], mask=md_mask, other=0.0)
                    do = tl.load(do_base + offs_m[:, None] * do_ss + offs_d[None, :], mask=md_mask,
                                 other=0.0).to(q.dtype)
                    row = (b * hq + h) * sq + offs_m
                    lse = tl.load(lse_ptr + row, mask=m_ok, other=0.0)
                    lse = tl.where(lse == float("-inf"), 0.0, lse)
                    delta = tl.load(delta_ptr + row, mask=m_ok, other=0.0)
                    # Transposed tile: [BLOCK_N keys, BLOCK_M queries].
                    st = _dot(k, tl.trans(q), PREC, UPCAST) * scale
                    vis_t = (k_seg[:, None] == q_seg[None, :]) & (k_seg[:, None] >= 0)
                    if CAUSAL:
                        vis_t = vis_t & (k_pos[:, None] <= q_pos[None, :])
                    pt = tl.exp(tl.where(vis_t, st, float("-inf")) - lse[None, :])
                    dv += _dot(pt.to(do.dtype), do, PREC, UPCAST)
                    dpt = _dot(v, tl.trans(do), PREC, UPCAST)
                    dst = pt * (dpt - delta[None, :])
                    dk += _dot(dst.to(q.dtype), q, PREC, UPCAST)
    row_k = bh * sk + offs_n
    dk_ptrs = dk_ptr + row_k[:, None] * head_dim + offs_d[None, :]
    dv_ptrs = dv_ptr + row_k[:, None] * head_dim + offs_d[None, :]
    tl.store(dk_ptrs, tl.load(dk_ptrs, mask=nd_mask, other=0.0) + dk * scale, mask=nd_mask)
    tl.store(dv_ptrs, tl.load(dv_ptrs, mask=nd_mask, other=0.0) + dv, mask=nd_mask)


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _blocks(q: torch.Tensor, block_d: int):
    """(BLOCK_M, BLOCK_N, num_warps): small tiles under the interpreter (cheap, and tests cross tile
    boundaries with small sizes); on a GPU 64 x 64 up to head_dim 64, else 32 x 32 for the fp32 tiles to
    fit in registers (not tuned)."""
    if _interpreted(q):
        return 16, 16, 4
    return (64, 64, 4) if block_d <= 64 else (32, 32, 4)


def _dot_flags(q: torch.Tensor) -> dict:
    """fp32: IEEE products (no TF32). The interpreter widens bf16 tiles (see ``_dot``)."""
    upcast = _interpreted(q) and q.dtype == torch.bfloat16
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"   # "tf32" (the default) affects fp32 only
    return dict(PREC=prec, UPCAST=upcast)


def _strides(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


def block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out, lse) -> None:
    """Kernel contract (see parallel_layers/ops/block_attention.py)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if b == 0 or hq == 0 or sq == 0 or sk == 0 or d == 0:
        return
    block_d = max(16, triton.next_power_of_2(d))
    bm, bn, warps = _blocks(q, block_d)
    grid = (triton.cdiv(sq, bm), b * hq)
    with launch_guard(q):
        _attn_fwd_kernel[grid](q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse, sq, sk, hq, hq // hkv, d,
                               float(scale), *_strides(q), *_strides(k), *_strides(v),
                               CAUSAL=bool(causal), **_dot_flags(q), BLOCK_M=bm, BLOCK_N=bn,
                               BLOCK_D=block_d, num_warps=warps)


def block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, lse, dout, delta,
                             dq, dk, dv) -> None:
    """Kernel contract (see parallel_layers/ops/block_attention.py)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if b == 0 or hq == 0 or sq == 0 or sk == 0 or d == 0:
        return
    block_d = max(16, triton.next_power_of_2(d))
    bm, bn, warps = _blocks(q, block_d)
    if not _interpreted(q):
        bm, bn = min(bm, 32), min(bn, 32)      # the backward holds more tiles per program
    common = dict(CAUSAL=bool(causal), **_dot_flags(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
                  num_warps=warps)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    with launch_guard(q):
        _dq_kernel[(triton.cdiv(sq, bm), b * hq)](q, k, v, dout, q_pos, k_pos, q_seg, k_seg, lse, delta, dq,
                                                 sq, sk, hq, hq // hkv, d, float(scale), *strides, **common)
        _dkdv_kernel[(triton.cdiv(sk, bn), b * hkv)](q, k, v, dout, q_pos, k_pos, q_seg, k_seg, lse, delta,
                                                    dk, dv, sq, sk, hkv, hq // hkv, d, float(scale), *strides,
                                                    **common)


__all__ = ["block_attention_forward", "block_attention_backward"]
