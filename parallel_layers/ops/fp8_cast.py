"""FP8 casts for FP8 training: block-wise amax, and a scaled saturating cast that can also write the
transposed copy and the amax of its input in the same pass.

A matrix ``x`` ([R, C]; higher-rank inputs are seen as ``x.reshape(-1, x.shape[-1])``) is cut into blocks of
``block_rows x block_cols``; each block has one amax and one scale. ``-1`` (or ``None``) for a block size
means the whole dimension, so the scaling granularities are:

==================  ============  ========================================================
granularity         block         used for
==================  ============  ========================================================
per tensor          ``(-1, -1)``  current and delayed scaling
per row             ``(1, -1)``   row-wise scaling (one scale per token / output feature)
1 x 128             ``(1, 128)``  DeepSeek-V3's activations and gradients
128 x 128           ``(128, 128)`` DeepSeek-V3's weights
==================  ============  ========================================================

Kernel contracts (every backend, positional):

    fp8_amax(x, amax, block_rows, block_cols) -> None
    fp8_cast(x, scale, out, out_t, amax, block_rows, block_cols) -> None

- ``x``: contiguous [R, C] float32 or bfloat16, R, C > 0; ``block_rows`` divides R, ``block_cols`` divides C.
- ``amax``, ``scale``: contiguous float32 [R // block_rows, C // block_cols].
- ``amax[i, j] = max |x[block i, j]|``, NaN if the block holds a NaN (torch.amax's NaN propagation).
- ``out``: [R, C] float8_e4m3fn or float8_e5m2:
  ``out[r, c] = fp8(clamp(float(x[r, c]) * scale[r // br, c // bc], -max, max))``: one float32 multiply,
  saturation to the format's largest finite value (so +-inf become +-max), NaN stays NaN, then
  round-to-nearest-even. ``out_t`` (optional, [C, R], out's dtype) receives ``out.T``; ``amax``
  (optional in ``fp8_cast``) receives the amax of ``x`` as above.

The casts are exact operations, so every backend must match the reference bit for bit.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _backend

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INPUT_DTYPES = (torch.float32, torch.bfloat16)
BACKENDS = ("torch", "cpp", "triton")


def fp8_dtype(fmt: Union[str, torch.dtype], op: str = "fp8") -> torch.dtype:
    """``"e4m3"`` / ``"e5m2"`` (or the torch dtype itself) -> the torch float8 dtype."""
    if isinstance(fmt, torch.dtype) and fmt in FP8_MAX:
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(f"{op}: format {fmt!r} is not an FP8 format; use 'e4m3' (forward: more precision, max 448) "
                     f"or 'e5m2' (gradients: more range, max 57344)")


# ------------------------------------------------------------------------------ torch reference
def _blocks(t: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[R, C] -> [R/br, C/bc, br*bc]: one row per block."""
    R, C = t.shape
    return t.reshape(R // br, br, C // bc, bc).permute(0, 2, 1, 3).reshape(R // br, C // bc, br * bc)


def _expand(s: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Per-block values [R/br, C/bc] -> per element [R, C]."""
    return s.repeat_interleave(br, 0).repeat_interleave(bc, 1)


def reference_fp8_amax(x, amax, block_rows, block_cols):
    amax.copy_(_blocks(x.float().abs(), block_rows, block_cols).amax(-1))


def reference_fp8_cast(x, scale, out, out_t, amax, block_rows, block_cols):
    fmax = FP8_MAX[out.dtype]
    y = (x.float() * _expand(scale, block_rows, block_cols)).clamp(-fmax, fmax).to(out.dtype)
    out.copy_(y)
    if out_t is not None:
        out_t.copy_(y.t())
    if amax is not None:
        reference_fp8_amax(x, amax, block_rows, block_cols)


# ------------------------------------------------------------------------------ checks
def _matrix(op: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{op}: x has dtype {x.dtype} (shape {tuple(x.shape)}); FP8 casts read float32 or "
                         f"bfloat16: call x.float() or x.bfloat16() first")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension, got a 0-dim tensor; use x.reshape(1, 1)")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def resolve_block(op: str, shape: Tuple[int, int], block) -> Tuple[int, int]:
    """``block`` ((rows, cols); -1/None = whole dimension; None = per tensor) -> sizes dividing ``shape``."""
    if block is None:
        block = (-1, -1)
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"{op}: block={block!r} must be a pair (block_rows, block_cols), -1 for a whole dimension")
    out = []
    for name, size, b in zip(("rows", "cols"), shape, block):
        b = max(size, 1) if b in (-1, None) else b
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"{op}: block {name} = {b!r} must be a positive int or -1 (whole dimension)")
        if size and size % b:
            raise ValueError(f"{op}: block {name} = {b} does not divide the input's {size} {name} (matrix "
                             f"{tuple(shape)}); pad {name} to a multiple of {b} (e.g. {-(-size // b) * b}) or "
                             f"choose a block size that divides {size}")
        out.append(b)
    return out[0], out[1]


def _scale_tensor(op: str, scale, n_blocks: Tuple[int, int], device) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"{op}: scale must be a number or a float32 tensor, got {type(scale).__name__}")
        scale = torch.full(n_blocks, float(scale), dtype=torch.float32, device=device)
    if scale.dtype != torch.float32:
        raise ValueError(f"{op}: scale has dtype {scale.dtype}; scales are float32: pass scale.float()")
    if scale.device != device:
        raise ValueError(f"{op}: scale is on {scale.device} but x is on {device}; keep both on one device")
    if scale.numel() == 1 and n_blocks == (1, 1):
        return scale.reshape(1, 1).contiguous()
    if tuple(scale.shape) != n_blocks:
        raise ValueError(f"{op}: scale has shape {tuple(scale.shape)} but the blocks form a {n_blocks} grid; "
                         f"pass one scale per block, shape {n_blocks}")
    return scale.contiguous()


# ------------------------------------------------------------------------------ public ops
def fp8_amax(x: torch.Tensor, *, block=None, backend: Optional[str] = None) -> torch.Tensor:
    """Amax of each block of ``x`` (see the module docstring): float32 ``[R/br, C/bc]``; zeros if ``x`` is empty."""
    op = "fp8_amax"
    x2 = _matrix(op, x).contiguous()
    br, bc = resolve_block(op, tuple(x2.shape), block)
    amax = torch.zeros((x2.shape[0] // br, x2.shape[1] // bc), dtype=torch.float32, device=x2.device)
    if x2.numel():
        _backend.kernel(op, x2.device, backend, reference_fp8_amax, BACKENDS)(x2, amax, br, bc)
    return amax


def fp8_cast(x: torch.Tensor, scale: Union[float, torch.Tensor], *, fmt: Union[str, torch.dtype] = "e4m3",
             block=None, transpose: bool = False, with_amax: bool = False, backend: Optional[str] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Cast ``x`` (as a matrix [R, C]) to FP8 with one scale per block; returns ``(out, out_t, amax)``.

    ``out`` [R, C] in ``fmt``; ``out_t`` = ``out.T`` made contiguous (if ``transpose``), written in the same
    pass (the weight's two GEMM layouts); ``amax`` per block of ``x`` (if ``with_amax``), read in the same
    pass (delayed scaling records the amax of the tensor it just cast).
    """
    op = "fp8_cast"
    dtype = fp8_dtype(fmt, op)
    x2 = _matrix(op, x).contiguous()
    br, bc = resolve_block(op, tuple(x2.shape), block)
    grid = (x2.shape[0] // br, x2.shape[1] // bc)
    scale_t = _scale_tensor(op, scale, grid, x2.device)
    out = torch.empty(x2.shape, dtype=dtype, device=x2.device)
    out_t = torch.empty((x2.shape[1], x2.shape[0]), dtype=dtype, device=x2.device) if transpose else None
    amax = torch.zeros(grid, dtype=torch.float32, device=x2.device) if with_amax else None
    if x2.numel():
        impl = _backend.kernel(op, x2.device, backend, reference_fp8_cast, BACKENDS)
        impl(x2, scale_t, out, out_t, amax, br, bc)
    return out, out_t, amax


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data`` [R, C] (fp8) times its per-block ``scale_inv`` [R/br, C/bc], in ``dtype``."""
    R, C = data.shape
    br, bc = R // scale_inv.shape[0], C // scale_inv.shape[1]
    return (data.float() * _expand(scale_inv, br, bc)).to(dtype)


__all__ = ["fp8_amax", "fp8_cast", "dequantize", "fp8_dtype", "resolve_block", "FP8_MAX", "FORMATS"]
