// Small device helpers shared by the .cu files: dtype conversion, vector access, non-finite test,
// block reductions, grid sizing. Plain CUDA only (no torch headers): see docs/architecture.md, "The kernel contract".
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"

namespace pl_cuda {

// ---- conversions -----------------------------------------------------------------------------
// Up-casts are exact; down-casts round to nearest even, as torch's .to(dtype) does.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// inf or nan, decided on the bit pattern: unlike isfinite() this cannot be folded away by
// fast-math assumptions ("no infs/nans"), whatever flags the extension is built with.
__device__ __forceinline__ bool nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// "found_inf != 0" as Python reads it (nan counts as nonzero; -0.0 does not).
__device__ __forceinline__ bool flag_set(float x) { return (__float_as_uint(x) << 1) != 0u; }

// ---- vector access ---------------------------------------------------------------------------
// N elements moved as one (or, for 32 bytes, two) 16-byte transactions. The alignment the caller
// must guarantee is VecAlign<T, N>::value bytes; callers check it at run time and fall back to scalars.
template <typename T, int N>
struct VecAlign { static constexpr int value = sizeof(T) * N < 16 ? int(sizeof(T) * N) : 16; };

template <typename T, int N>
struct alignas(VecAlign<T, N>::value) Vec { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) { return *reinterpret_cast<const Vec<T, N>*>(p); }

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) { *reinterpret_cast<Vec<T, N>*>(p) = v; }

template <typename T, int N>
inline bool vec_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % VecAlign<T, N>::value == 0;
}
template <typename T, int N>
__device__ __forceinline__ bool vec_aligned_dev(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % VecAlign<T, N>::value == 0;
}

// ---- reductions ------------------------------------------------------------------------------
// Fixed-shape trees (xor shuffles, then warp 0 over the warp sums): the same inputs in the same
// threads always give the same bits, which the deterministic norm relies on. Result valid in
// thread 0. Every thread of the block must call these.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int BLOCK, typename T>
__device__ __forceinline__ T block_sum(T v) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "block must be whole warps");
  __shared__ T warp_sums[BLOCK / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < BLOCK / 32 ? warp_sums[lane] : T(0);
    v = warp_sum(v);
  }
  return v;
}

// ---- dtype dispatch (host) -------------------------------------------------------------------
template <typename T> struct Tag { using type = T; };

template <class F>
inline cudaError_t dispatch_dtype(int code, F&& f) {
  switch (code) {
    case PL_DTYPE_F32: return f(Tag<float>{});
    case PL_DTYPE_BF16: return f(Tag<__nv_bfloat16>{});
    case PL_DTYPE_F16: return f(Tag<__half>{});
    default: return cudaErrorInvalidValue;
  }
}

// Blocks for a grid-stride kernel over `work` items, BLOCK threads each: exactly the number of
// blocks the device keeps resident at once (one full wave, per the occupancy calculator, so no
// block waits for a second wave and leaves a tail), never more than the work needs.
template <typename Kernel>
inline int64_t grid_for(Kernel kernel, int64_t work, int block) {
  int dev = 0, sms = 132, per_sm = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) sms = v;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0) != cudaSuccess || per_sm < 1) {
    (void)cudaGetLastError();  // do not leave a sticky query error for the launch check to report
    per_sm = 1;
  }
  const int64_t needed = (work + block - 1) / block;
  const int64_t cap = int64_t(sms) * per_sm;
  return needed < cap ? (needed > 0 ? needed : 1) : cap;
}

}  // namespace pl_cuda
