"""Tiled matmul with the linear layer's epilogue fused: ``Y = act(X @ W^T + b)`` cast to Y's dtype.

Kernel contract (``parallel_layers/ops/linear.py`` validates arguments; this launcher trusts them):

    linear_epilogue(x [M, K], weight [N, K], bias [N] | None, activation, out_dtype, pre_out=None) -> y [M, N]

``weight`` is in ``nn.Linear`` layout ([out_features, in_features]); any strides are accepted. x, weight and
bias share one dtype (float32, bfloat16 or float16). The product is accumulated in float32; the bias add,
the activation (None, "gelu" in the exact erf form that ``F.gelu`` uses by default, or "silu") and the
cast to ``out_dtype`` all happen on the float32 accumulator in registers, so Y is written once and the
pre-activation never goes through memory. ``pre_out`` (optional, [M, N]) additionally receives the
pre-activation ``X @ W^T + b`` (cast to ``pre_out``'s dtype), which the autograd backward needs.

Float32 inputs: ``tl.dot`` follows torch's setting for cuBLAS, ``torch.backends.cuda.matmul.allow_tf32``
(False by default -> IEEE fp32 products, like torch; True -> TF32 tensor cores, like cuBLAS then).

Tiling: one program per BLOCK_M x BLOCK_N tile of Y, walking K in BLOCK_K steps; programs are ordered in
groups of GROUP_M tile-rows so that consecutive programs reuse the same W tiles from L2 (the ordering of
the Triton matmul tutorial). Row/column indices past M/N are wrapped (``% M``) for the loads, which keeps
the inner loop's loads unmasked along M and N; only the store is masked. K is masked only when it is not
a multiple of BLOCK_K (the EVEN_K heuristic). Row and column offsets are multiplied by the strides in
int64, so tensors past 2**31 elements address correctly.

Configurations: a few ``triton.autotune`` configs chosen for H100 (wgmma tiles 128x128 / 128x256 with
BLOCK_K 64 and 3-4 stages for large M; narrow tiles with a long BLOCK_K for decode-like M <= 64, where
the matmul is bound by streaming W and needs many programs in flight; two BLOCK_K 32/64 configs whose
pipelines fit shared memory with float32 inputs). Before tuning, configs whose shared-memory pipeline
does not fit the element size are pruned, and so are tiles much taller than M (small M) or too thin
for it (M >= 256), and, with an activation, the tiles holding 128 accumulator registers per thread
(they spill: ``python -m benchmarks.linear_registers`` compiles every config offline and reports it). The tuning
key buckets M to the next
power of two, so a training run with varying token counts does not re-tune for every batch.
``PARALLEL_LAYERS_LINEAR_TUNING=one`` (read per call; default ``full``) skips the autotuner: each call runs the
first config the pruner keeps for its element size, M bucket and epilogue, so a test run compiles one kernel per
dtype and shape class instead of every config (the CUDA tests compiled ~290 kernels otherwise); ``gpu-check``
sets it for everything but its benchmarks.
Under ``TRITON_INTERPRET=1`` (CPU tests) autotuning is skipped and one fixed small config runs; there,
bf16 tiles are widened to float32 before ``tl.dot`` (UPCAST_DOT), because triton 3.9's interpreter
multiplies bf16 tiles as their raw uint16 storage. Exact either way: a product of two bf16 values is exact
in float32, and the tensor cores accumulate in float32 too.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Optional

import torch
import triton
import triton.language as tl

ACTIVATIONS = {None: 0, "gelu": 1, "silu": 2}
_SQRT1_2 = 0.7071067811865476

# Shared memory per SM usable by one program on H100 (227 KiB opt-in); a little headroom for the epilogue.
_SMEM_BUDGET = 220 * 1024
# Accumulator registers per thread at which an activation epilogue spills (measured, see prune_configs).
_SPILLING_ACCUMULATOR = 128


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:    # exact GeLU: 0.5 * z * (1 + erf(z / sqrt(2)))  (F.gelu, approximate="none")
        z = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:  # SiLU: z * sigmoid(z)
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def linear_epilogue_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, z_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_zm, stride_zn,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # M_BUCKET is only part of the autotuning key (next power of two of M); the kernel ignores it.
    # ---- grouped program ordering: GROUP_M tile-rows share the W tiles they stream (L2 reuse) ----
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrap rows/columns past the edge onto valid ones: loads stay unmasked along M and N, the store is masked.
    # No max_contiguous/multiple_of hints on them: at the wrap the run restarts at 0, so a vector load across
    # it reads a misaligned address when N (or M) is odd (H100: "misaligned address" on the bias of N = 47).
    # Loads along K (unit stride) keep their vector width from the strides' own divisibility.
    rm = offs_m % M
    rn = offs_n % N
    rk = tl.arange(0, BLOCK_K)

    # int64 row/column offsets: M * stride_xm can pass 2**31.
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :].to(tl.int64) * stride_xk
    # W is [N, K]; the tile is loaded as W^T[k, n] = W[n, k].
    w_ptrs = w_ptr + rk[:, None].to(tl.int64) * stride_wk + rn.to(tl.int64)[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if UPCAST_DOT:  # interpreter only: its tl.dot multiplies bf16 as raw uint16 (triton 3.9)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ---- epilogue, on the float32 accumulator in registers ----
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    out_m = offs_m.to(tl.int64)
    out_n = offs_n.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_PRE:
        z_ptrs = z_ptr + out_m[:, None] * stride_zm + out_n[None, :] * stride_zn
        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    acc = _activation(acc, ACTIVATION)
    y_ptrs = y_ptr + out_m[:, None] * stride_ym + out_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _config(bm, bn, bk, group, stages, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)


# H100-oriented configs. Large M: wgmma-sized tiles, 64-deep K steps, 3-4 stage pipelines.
# Small M (decode-like): W streaming dominates; narrow N tiles give >= 1 program per SM and long K steps
# keep enough bytes in flight per program.
CONFIGS = [
    _config(128, 256, 64, 8, 3, 8),
    _config(128, 128, 64, 8, 4, 4),
    _config(128, 128, 64, 8, 4, 8),
    _config(256, 128, 64, 8, 3, 8),
    _config(64, 128, 64, 8, 4, 4),
    _config(64, 64, 128, 8, 4, 4),
    _config(16, 64, 256, 1, 4, 4),
    _config(16, 32, 256, 1, 4, 4),
    _config(32, 64, 128, 1, 5, 4),
    # float32 inputs (4-byte elements): the pipelines above mostly exceed shared memory.
    _config(128, 128, 32, 8, 3, 8),
    _config(64, 64, 64, 8, 3, 4),
]

# The one config used under the interpreter: small, so odd shapes exercise every mask path.
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4}


def _accumulator_registers(c) -> int:
    """float32 accumulator registers per thread of a config: BLOCK_M x BLOCK_N over its threads."""
    return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps)


def prune_configs(configs, named_args, **kwargs):
    """Drop configs whose pipeline does not fit shared memory, configs that spill registers in an
    activation epilogue, and big-M tiles when M is tiny."""
    args = {**named_args, **kwargs}     # the constexpr flags arrive as keyword arguments
    elem = args["x_ptr"].element_size()
    m = args["M"]
    fits = [c for c in configs
            if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * elem
            <= _SMEM_BUDGET]
    if args.get("ACTIVATION", 0):
        # 128 accumulator registers per thread leave too few for erf/sigmoid's temporaries: compiled for
        # sm_90 these tiles spill 72-224 bytes per thread with GeLU (python -m benchmarks.linear_registers)
        fits = [c for c in fits if _accumulator_registers(c) < _SPILLING_ACCUMULATOR] or fits
    fits = fits or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]
    # A BLOCK_M over twice M (rounded to 16) only wastes tensor-core work and registers; for large M the
    # narrow decode tiles are never competitive, so do not spend tuning time on them.
    sized = [c for c in fits if c.kwargs["BLOCK_M"] <= max(16, 2 * triton.next_power_of_2(m))
             and (m < 256 or c.kwargs["BLOCK_M"] >= 64)]
    return sized or fits


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(linear_epilogue_kernel)



def _disk_cache_option() -> dict:
    """Triton >= 3.2 can keep autotuning results in its cache folder, keyed by the kernel's source, the
    target and the configs, so a new process (every rank of every run) does not re-tune a shape."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


if _interpreting():
    tuned_kernel = None
else:
    tuned_kernel = triton.autotune(
        configs=CONFIGS,
        key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "STORE_PRE", "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": prune_configs},
        **_disk_cache_option(),
    )(_even_k)


TUNING_ENV = "PARALLEL_LAYERS_LINEAR_TUNING"


def tuning() -> str:
    """``full`` (the autotuner) or ``one`` (one config per dtype and shape class), from ``TUNING_ENV``."""
    value = os.environ.get(TUNING_ENV, "full").strip().lower() or "full"
    if value not in ("full", "one"):
        raise ValueError(f"{TUNING_ENV}={value!r}: expected 'full' or 'one'")
    return value


@functools.lru_cache(maxsize=None)
def one_config(element_size: int, m_bucket: int, activation: int):
    """The config ``PARALLEL_LAYERS_LINEAR_TUNING=one`` runs: the first that ``prune_configs`` keeps for this
    element size, M bucket (next power of two of M) and activation."""
    x = torch.empty(0, dtype={1: torch.int8, 2: torch.bfloat16, 4: torch.float32}[element_size], device="meta")
    return prune_configs(CONFIGS, {"x_ptr": x, "M": m_bucket}, ACTIVATION=activation)[0]


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs


def linear_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    activation: Optional[str], out_dtype: Optional[torch.dtype],
                    pre_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` as ``out_dtype`` (default: x's dtype); see the module docstring."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    store_pre = pre_out is not None
    z = pre_out if store_pre else y  # placeholder pointer; never written when STORE_PRE is False
    b = bias if bias is not None else x  # placeholder pointer; never read when HAS_BIAS is False
    args = (x, weight, b, y, z, M, N, K, triton.next_power_of_2(M),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            y.stride(0), y.stride(1), z.stride(0), z.stride(1))
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], STORE_PRE=store_pre,
                 INPUT_PRECISION=_input_precision(x.dtype))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    if tuned_kernel is None:  # interpreter: one fixed config, no tuning
        cfg = INTERPRET_CONFIG
        linear_epilogue_kernel[grid(cfg)](*args, **flags, EVEN_K=K % cfg["BLOCK_K"] == 0,
                                          UPCAST_DOT=x.dtype == torch.bfloat16, **cfg)
        return y
    if tuning() == "one":
        c = one_config(x.element_size(), triton.next_power_of_2(M), flags["ACTIVATION"])
        kernel = _even_k[grid(c.kwargs)]
        flags.update(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        kernel = tuned_kernel[grid]
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        kernel(*args, **flags, UPCAST_DOT=False)
    else:  # Triton launches on the current device (the guard costs host time, so only when needed)
        with torch.cuda.device(x.device):
            kernel(*args, **flags, UPCAST_DOT=False)
    return y
