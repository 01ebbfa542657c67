"""How to walk many tensors in one launch (apex ``multi_tensor_apply``'s idea, in Triton).

The per-element work ("what to do") lives in each op's kernel; this module holds the shared
machinery ("how to walk"):

* ``build_table`` (host) packs, into ONE int64 device tensor, the raw addresses of every tensor, their
  element counts and a chunk list, so the grid is one program per chunk:

      [ptrs of list 0 (T) | ptrs of list 1 (T) | ... | numel (T) | chunk entries (C)]

  A chunk entry is ``tensor_index << 32 | chunk_index``; the chunk starts at element
  ``chunk_index * BLOCK * iters`` of its tensor. Encoding the start as a chunk *index* means the kernel
  multiplies by a constexpr, so the compiler knows the start is a multiple of BLOCK (needed for
  vectorised loads) without a hint, and one load per program gives both numbers.
  Zero-size tensors get no chunks (their address is never dereferenced).
* ``chunk_of_program`` / ``tensor_ptr`` (device) decode the table.
* ``load_block`` / ``store_block`` (device): a full block is loaded WITHOUT a mask. A mask ``offs < n``
  with ``n`` read from memory has unknown divisibility, which makes Triton fall back to scalar
  (non-vectorised) accesses; so kernels branch on "is this block full" and only the tail is masked.

Addresses read from memory have unknown alignment too; when every address is 16-byte aligned (the
host checks, it is cheap) the kernel is told so with ``tl.multiple_of`` on the pointer (``ALIGNED`` constexpr) and the
accesses become 128-bit vectors. Views at odd offsets still work, just with narrower accesses.
"""
from __future__ import annotations

import contextlib
import os
import struct
from collections import OrderedDict
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Elements per inner step of a multi-tensor program, and warps. 2048 fp32 elements with 8 warps is
# 8 elements (two 128-bit accesses) per thread per stream: enough bytes in flight for HBM.
BLOCK = 2048
NUM_WARPS = 8
_MAX_ITERS = 16          # a chunk is BLOCK * iters elements, iters a power of two <= 16
_TARGET_CHUNKS = 4096    # grow chunks only past this many programs (keeps the table small)

# The interpreter converts float32 -> bfloat16 by truncation (triton 3.9's cast_impl), not round to
# nearest even as the GPU's cvt.rn.bf16.f32 does. Under the interpreter we round with integer ops
# instead, matching torch's vectorised CPU conversion (NaN -> 0xFFFF, as ATen's cvtfp32_bf16 does);
# compiled kernels use the native cvt, which torch's CUDA conversion uses too, so each path matches
# torch on its own device.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

_cache: "OrderedDict[tuple, Tuple[torch.Tensor, int, int, bool]]" = OrderedDict()
_CACHE_SIZE = 64


def f32_pair(x: float) -> Tuple[float, float]:
    """Split a double into two float32s (hi + lo == x to ~48 bits): Triton passes Python floats as
    float32, and a kernel that needs a double-precision constant rebuilds it as hi.to(f64) + lo.to(f64)."""
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, x - hi


def launch_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device; make it the tensors' device."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def build_table(ptr_lists: Sequence[Sequence[int]], sizes: Sequence[int],
                device: torch.device) -> Tuple[torch.Tensor, int, int, bool]:
    """Return ``(table, n_chunks, iters, aligned)`` for tensors of ``sizes`` at addresses ``ptr_lists``.

    ``aligned``: every non-empty tensor starts on a 16-byte boundary (chunk starts are multiples of
    BLOCK elements, so every full block is then 16-byte aligned and can use 128-bit accesses).

    The table is a pure function of (addresses, sizes, device), so it is cached: an optimizer calling
    the same op on the same tensors every step pays only for building the key.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, tuple(sizes), *[tuple(p) for p in ptr_lists])
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit

    n_blocks = sum((n + BLOCK - 1) // BLOCK for n in sizes)
    iters = 1
    while iters < _MAX_ITERS and n_blocks > iters * _TARGET_CHUNKS:
        iters *= 2
    chunk = BLOCK * iters

    # Vectorised on the host CPU: a Python loop over chunks would cost ~1 us per chunk.
    sizes_t = torch.tensor(list(sizes), dtype=torch.int64)
    n_chunks_t = (sizes_t + (chunk - 1)) // chunk
    n_chunks = int(n_chunks_t.sum())
    tid = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64), n_chunks_t)
    first = torch.cumsum(n_chunks_t, 0) - n_chunks_t
    idx = torch.arange(n_chunks, dtype=torch.int64) - first[tid]
    entries = (tid << 32) | idx
    ptrs = torch.tensor([p for lst in ptr_lists for p in lst], dtype=torch.int64)
    table = torch.cat([ptrs, sizes_t, entries])
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the current stream, no host sync.
        table = table.pin_memory().to(device, non_blocking=True)
    else:
        table = table.to(device)

    aligned = all(p % 16 == 0 for lst in ptr_lists for p, n in zip(lst, sizes) if n)
    result = (table, n_chunks, iters, aligned)
    _cache[key] = result
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return result


def ptrs_of(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.data_ptr() for t in tensors]


# ----------------------------------------------------------------------------------------------
# device side
# ----------------------------------------------------------------------------------------------
@triton.jit
def chunk_of_program(table_ptr, n_tensors, N_LISTS: tl.constexpr, CHUNK_BLOCKS, BLOCK: tl.constexpr):
    """(tensor index, first element of this program's chunk (int64), numel of that tensor)."""
    pid = tl.program_id(0).to(tl.int64)
    e = tl.load(table_ptr + (N_LISTS + 1) * n_tensors + pid)
    tid = e >> 32
    idx = e - (tid << 32)
    start = idx * CHUNK_BLOCKS * BLOCK
    n = tl.load(table_ptr + N_LISTS * n_tensors + tid)
    return tid, start, n


@triton.jit
def tensor_ptr(table_ptr, n_tensors, WHICH: tl.constexpr, tid, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointer to tensor ``tid`` of pointer list ``WHICH``."""
    ptr = tl.load(table_ptr + WHICH * n_tensors + tid).to(tl.pointer_type(DTYPE), bitcast=True)
    if ALIGNED:
        # The hint must sit on the pointer: on the int64 before the cast it is not propagated
        # (checked in the PTX: scalar ld.global.b32 vs ld.global.v4.b32).
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _f32_to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0xFFFF, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round to nearest even, also under the interpreter."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            if x.dtype == tl.float32:
                return _f32_to_bf16_rne(x)
    return x.to(DTYPE)


@triton.jit
def load_block(ptr, offs, n, MASKED: tl.constexpr):
    """``ptr[offs]`` as stored; masked lanes read 0 (so they can never look non-finite)."""
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(ptr + offs)
    return x


@triton.jit
def store_block(ptr, offs, value, n, MASKED: tl.constexpr):
    """Store ``value`` converted (round to nearest even) to the pointer's element type."""
    value = cast_to(value, ptr.dtype.element_ty)
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def not_finite(y):
    """int32 1 where y is inf or nan: |y| < inf is false exactly for those (NaN compares false)."""
    return tl.where(tl.abs(y) < float("inf"), 0, 1)
