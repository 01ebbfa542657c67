"""FP8 casts: block amax, and the scaled saturating cast (+ transposed copy, + amax) in one pass.

Kernel contracts: ``parallel_layers/ops/fp8_cast.py``. Each program reads a ``TR x TC`` tile of ``x`` that lies
inside one block column (``TC`` divides ``block_cols``), writes the cast tile (and its transpose), and stores the
tile's per-row amax into a partial buffer ``[R, C / TC]``; the per-block amax is the max of those partials
(max is exact in any order, so this matches the reference bit for bit).

The fp32 -> fp8 conversion is written with integer bit operations (c10's round-to-nearest-even algorithm) and
stored as bytes, rather than ``.to(tl.float8e4nv)``: the interpreter and the GPU then round identically, and
saturation/NaN follow the contract, not the hardware's conversion mode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import launch_guard

# (fp8 max, first fp32 bit pattern past it, denorm magic, min-normal bits, mantissa shift, exponent re-bias)
_E4M3 = (448.0, 1087 << 20, 141 << 23, 121 << 23, 20, (7 - 127) << 23)
_E5M2 = (57344.0, 143 << 23, 134 << 23, 113 << 23, 21, (15 - 127) << 23)
_FORMAT = {torch.float8_e4m3fn: _E4M3, torch.float8_e5m2: _E5M2}
TR = 16


@triton.jit
def _to_fp8_bits(y, MAX_BITS: tl.constexpr, DENORM: tl.constexpr, NORMAL: tl.constexpr, SHIFT: tl.constexpr,
                 REBIAS: tl.constexpr, E5M2: tl.constexpr):
    u = y.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80                                  # arithmetic shift: keep only the sign bit
    if E5M2:
        over = tl.where(a > 0x7F800000, 0x7F, 0x7C)
    else:
        over = tl.zeros_like(a) + 0x7F                        # only NaN gets here: the input was clamped
    denorm_f = tl.full(a.shape, DENORM, tl.int32).to(tl.float32, bitcast=True)
    sub = (a.to(tl.float32, bitcast=True) + denorm_f).to(tl.int32, bitcast=True) - DENORM
    odd = (a >> SHIFT) & 1
    nrm = (a + REBIAS + ((1 << (SHIFT - 1)) - 1) + odd) >> SHIFT
    r = tl.where(a >= MAX_BITS, over, tl.where(a < NORMAL, sub, nrm)) & 0xFF
    return (r | sign).to(tl.uint8)


@triton.jit
def _fp8_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, part_ptr, R, C, br, bc, n_tiles_c,
                CAST: tl.constexpr, TRANSPOSE: tl.constexpr, AMAX: tl.constexpr, FMAX: tl.constexpr,
                MAX_BITS: tl.constexpr, DENORM: tl.constexpr, NORMAL: tl.constexpr, SHIFT: tl.constexpr,
                REBIAS: tl.constexpr, E5M2: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * TR + tl.arange(0, TR)
    cols = pid_c * TC + tl.arange(0, TC)
    rmask = rows < R
    mask = rmask[:, None] & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        a = tl.abs(v)
        isnan = a != a
        m = tl.max(tl.where(isnan, 0.0, a), axis=1)
        m = tl.where(tl.max(isnan.to(tl.int32), axis=1) > 0, float("nan"), m)
        tl.store(part_ptr + rows.to(tl.int64) * n_tiles_c + pid_c, m, mask=rmask)
    if CAST:
        nbc = C // bc
        sc = tl.load(scale_ptr + (rows // br) * nbc + (pid_c * TC) // bc, mask=rmask, other=1.0)
        y = v * sc[:, None]
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))   # NaN fails both tests and stays NaN
        q = _to_fp8_bits(y, MAX_BITS, DENORM, NORMAL, SHIFT, REBIAS, E5M2)
        tl.store(out_ptr + offs, q, mask=mask)
        if TRANSPOSE:
            tl.store(out_t_ptr + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)


def _tile_cols(bc: int) -> int:
    """The largest power of two <= 256 dividing ``bc``: a tile never straddles two block columns."""
    tc = 1
    while tc < 256 and bc % (tc * 2) == 0:
        tc *= 2
    return tc


def _launch(x, scale, out, out_t, amax, br, bc):
    R, C = x.shape
    tc = _tile_cols(bc)
    n_tiles_c = C // tc
    part = torch.empty((R, n_tiles_c), dtype=torch.float32, device=x.device) if amax is not None else None
    fmt = _FORMAT[out.dtype] if out is not None else _E4M3
    dummy = x
    with launch_guard(x):
        _fp8_kernel[(triton.cdiv(R, TR), n_tiles_c)](
            x, scale if scale is not None else dummy,
            out.view(torch.uint8) if out is not None else dummy,
            out_t.view(torch.uint8) if out_t is not None else dummy,
            part if part is not None else dummy, R, C, br, bc, n_tiles_c,
            CAST=out is not None, TRANSPOSE=out_t is not None, AMAX=amax is not None, FMAX=fmt[0],
            MAX_BITS=fmt[1], DENORM=fmt[2], NORMAL=fmt[3], SHIFT=fmt[4], REBIAS=fmt[5],
            E5M2=out is not None and out.dtype == torch.float8_e5m2, TR=TR, TC=tc, enable_fp_fusion=False)
    if amax is not None:
        amax.copy_(part.view(R // br, br, C // bc, bc // tc).amax(dim=(1, 3)))


def fp8_amax(x, amax, block_rows, block_cols) -> None:
    """Kernel contract: ``amax[i, j] = max |x[block i, j]|``, NaN-propagating."""
    _launch(x, None, None, None, amax, block_rows, block_cols)


def fp8_cast(x, scale, out, out_t, amax, block_rows, block_cols) -> None:
    """Kernel contract: saturating scaled cast to fp8 (+ ``out_t = out.T``, + amax of ``x``)."""
    _launch(x, scale, out, out_t, amax, block_rows, block_cols)
