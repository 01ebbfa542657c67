// Multi-tensor ops on the machinery of multi_tensor.cuh: unscale + non-finite check + L2 norm,
// cast, bucket pack and unpack. Contracts: parallel_layers/ops/{unscale_norm,cast,bucket}.py.
//
// Written values must equal torch's bit for bit: one fp32 multiply (and, for unpack with
// accumulate, one fp32 add) then a round-to-nearest-even down-cast. __fmul_rn/__fadd_rn keep the
// multiply and add separate (no FMA contraction), as they are separate ops in the reference.
#include "multi_tensor.cuh"

namespace pl_cuda {
namespace {

// Per-block ending shared by the ops that detect non-finite values: one store per block that saw
// one. Several blocks may store 1.0f concurrently; the race is benign (same value), and no block
// ever clears the flag, so it accumulates across calls as the contract says.
__device__ __forceinline__ void flag_nonfinite(bool bad, float* found_inf) {
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// y = x * inv_scale; norm^2 += y*y; found_inf if y is not finite; optionally x = y in place.
template <typename T, bool UNSCALE>
struct UnscaleNormOp {
  using In = T;
  using Out = T;
  static constexpr bool kReadsOut = false;
  static constexpr bool kWritesOut = UNSCALE;
  const float* inv_scale_ptr;
  float* found_inf;
  float* partials;  // one per chunk; reduced by norm_finalize_kernel in a fixed order
  float inv_scale = 0.f, sum = 0.f;  // set in begin()
  bool bad = false;

  __device__ void begin() {
    inv_scale = *inv_scale_ptr;
    sum = 0.f;
    bad = false;
  }
  __device__ T apply(T x, T) {
    const float y = __fmul_rn(to_float(x), inv_scale);
    sum += y * y;  // the norm need not be bit-exact; FMA here is fine
    bad |= nonfinite(y);
    return from_float<T>(y);
  }
  __device__ void end() {
    flag_nonfinite(bad, found_inf);
    const float s = block_sum<kMtBlock>(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
  }
};

// Sums the per-chunk partials in double, in an order fixed by the chunk table alone, so the norm
// is deterministic run to run (no float atomics).
constexpr int kFinalBlock = 1024;
__global__ void __launch_bounds__(kFinalBlock)
norm_finalize_kernel(const float* __restrict__ partials, int64_t n, float* __restrict__ norm_out) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalBlock) acc += double(partials[i]);
  acc = block_sum<kFinalBlock>(acc);
  if (threadIdx.x == 0) norm_out[0] = float(sqrt(acc));
}

// dst = (src * scale).to(dst dtype); found_inf if the *written* value is not finite (fp16 overflow).
template <typename S, typename D>
struct CastOp {
  using In = S;
  using Out = D;
  static constexpr bool kReadsOut = false;
  static constexpr bool kWritesOut = true;
  const float* scale_ptr;
  float* found_inf;
  float scale = 0.f;  // set in begin()
  bool bad = false;

  __device__ void begin() {
    scale = *scale_ptr;
    bad = false;
  }
  __device__ D apply(S x, D) {
    const D y = from_float<D>(__fmul_rn(to_float(x), scale));
    bad |= nonfinite(to_float(y));
    return y;
  }
  __device__ void end() { flag_nonfinite(bad, found_inf); }
};

// pack: bucket slice = (src * scale).to(bucket dtype). unpack: dst = [dst +] bucket slice * scale.
template <typename S, typename D, bool ACCUMULATE>
struct ScaleCopyOp {
  using In = S;
  using Out = D;
  static constexpr bool kReadsOut = ACCUMULATE;
  static constexpr bool kWritesOut = true;
  const float* scale_ptr;
  float scale = 0.f;  // set in begin()

  __device__ void begin() { scale = *scale_ptr; }
  __device__ D apply(S x, D old) {
    float y = __fmul_rn(to_float(x), scale);
    if (ACCUMULATE) y = __fadd_rn(to_float(old), y);
    return from_float<D>(y);
  }
  __device__ void end() {}
};

}  // namespace
}  // namespace pl_cuda

using namespace pl_cuda;

extern "C" const char* pl_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

extern "C" int pl_cuda_unscale_and_norm(const int64_t* table, int64_t ntensors, int64_t nchunks,
                                        int64_t chunk_size, int dtype, const float* inv_scale, float* found_inf,
                                        float* partials, float* norm_out, int unscale, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if (unscale) {
      UnscaleNormOp<T, true> op{inv_scale, found_inf, partials};
      return launch_multi_tensor(table, ntensors, nchunks, chunk_size, op, s);
    }
    UnscaleNormOp<T, false> op{inv_scale, found_inf, partials};
    return launch_multi_tensor(table, ntensors, nchunks, chunk_size, op, s);
  });
  if (err != cudaSuccess) return err;
  // Always runs, so that all-empty input still writes norm = 0.
  norm_finalize_kernel<<<1, kFinalBlock, 0, s>>>(partials, nchunks > 0 ? nchunks : 0, norm_out);
  return cudaGetLastError();
}

extern "C" int pl_cuda_multi_tensor_cast(const int64_t* table, int64_t ntensors, int64_t nchunks,
                                         int64_t chunk_size, int src_dtype, int dst_dtype, const float* scale,
                                         float* found_inf, void* stream) {
  return dispatch_dtype(src_dtype, [&](auto st) -> cudaError_t {
    return dispatch_dtype(dst_dtype, [&](auto dt) -> cudaError_t {
      CastOp<typename decltype(st)::type, typename decltype(dt)::type> op{scale, found_inf};
      return launch_multi_tensor(table, ntensors, nchunks, chunk_size, op, static_cast<cudaStream_t>(stream));
    });
  });
}

extern "C" int pl_cuda_pack_bucket(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                                   int src_dtype, int bucket_dtype, const float* scale, void* stream) {
  return dispatch_dtype(src_dtype, [&](auto st) -> cudaError_t {
    return dispatch_dtype(bucket_dtype, [&](auto bt) -> cudaError_t {
      ScaleCopyOp<typename decltype(st)::type, typename decltype(bt)::type, false> op{scale};
      return launch_multi_tensor(table, ntensors, nchunks, chunk_size, op, static_cast<cudaStream_t>(stream));
    });
  });
}

extern "C" int pl_cuda_unpack_bucket(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                                     int bucket_dtype, int dst_dtype, const float* scale, int accumulate,
                                     void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(bucket_dtype, [&](auto bt) -> cudaError_t {
    return dispatch_dtype(dst_dtype, [&](auto dt) -> cudaError_t {
      using B = typename decltype(bt)::type;
      using D = typename decltype(dt)::type;
      if (accumulate) return launch_multi_tensor(table, ntensors, nchunks, chunk_size, ScaleCopyOp<B, D, true>{scale}, s);
      return launch_multi_tensor(table, ntensors, nchunks, chunk_size, ScaleCopyOp<B, D, false>{scale}, s);
    });
  });
}
