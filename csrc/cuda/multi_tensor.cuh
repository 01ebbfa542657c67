// The multi-tensor machinery (apex multi_tensor_apply's idea): WHAT to do with one element is a
// small functor; HOW to walk thousands of tensors in a single launch lives here, once.
//
// The host builds one int64 table (layout in launchers.h): a row per tensor {in, out, numel} and a
// row per chunk {tensor, start}. Block b walks chunk b, so a launch covers any number of tensors of
// any sizes, and a tensor of 2^33 elements is just many chunks (all index math is int64).
//
// Functor interface (Op):
//   using In, Out                      element types of the input and output streams
//   static constexpr bool kReadsOut    the functor needs the old output value (accumulate)
//   static constexpr bool kWritesOut   the output stream is stored (false: a pure reduction)
//   __device__ void begin()            read device scalars (scale, ...) once per block
//   __device__ Out apply(In x, Out old) per element; may update per-thread state
//   __device__ void end()               called by EVERY thread of the block after the walk
//                                      (block reductions, flags); may use __syncthreads
#pragma once

#include "common.cuh"

namespace pl_cuda {

constexpr int kMtBlock = 512;

struct TensorRow { int64_t in, out, numel; };
struct ChunkRow { int64_t tensor, start; };
static_assert(sizeof(TensorRow) == PL_TENSOR_ROW_WORDS * 8 && sizeof(ChunkRow) == PL_CHUNK_ROW_WORDS * 8,
              "table layout must match launchers.h");

// 16 bytes of the narrower stream per vector: fp32->fp32 moves 4 elements, anything touching a
// 2-byte type moves 8 (two 16-byte fp32 accesses + one 16-byte bf16/fp16 access).
template <typename In, typename Out>
struct MtVec { static constexpr int value = 16 / (sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out)); };
static_assert(PL_CUDA_CHUNK_SIZE % 8 == 0, "chunks must start on a vector boundary");

template <class Op>
__global__ void __launch_bounds__(kMtBlock)
multi_tensor_kernel(const int64_t* __restrict__ table, int64_t ntensors, int64_t chunk_size, Op op) {
  using In = typename Op::In;
  using Out = typename Op::Out;
  constexpr int V = MtVec<In, Out>::value;

  const TensorRow* tensors = reinterpret_cast<const TensorRow*>(table);
  const ChunkRow* chunks = reinterpret_cast<const ChunkRow*>(table + ntensors * PL_TENSOR_ROW_WORDS);
  const ChunkRow c = chunks[blockIdx.x];
  const TensorRow t = tensors[c.tensor];
  const int64_t left = t.numel - c.start;
  const int64_t n = left < chunk_size ? left : chunk_size;  // elements in this chunk, >= 1
  const In* in = reinterpret_cast<const In*>(t.in) + c.start;
  Out* out = reinterpret_cast<Out*>(t.out) + c.start;
  // Addresses read from the table are generic pointers to the compiler; promise they are global so
  // it emits LDG/STG rather than generic loads and stores.
  __builtin_assume(__isGlobal(in));
  __builtin_assume(__isGlobal(out));

  op.begin();
  // Same decision for the whole block (depends on the chunk only): no divergence.
  if (vec_aligned_dev<In, V>(in) && vec_aligned_dev<Out, V>(out)) {
    const int64_t nvec = n / V;
    for (int64_t i = threadIdx.x; i < nvec; i += kMtBlock) {
      const Vec<In, V> x = load_vec<In, V>(in + i * V);
      Vec<Out, V> y;
      if constexpr (Op::kReadsOut) y = load_vec<Out, V>(out + i * V);
#pragma unroll
      for (int k = 0; k < V; ++k) y.v[k] = op.apply(x.v[k], y.v[k]);
      if constexpr (Op::kWritesOut) store_vec(out + i * V, y);
    }
    // Fewer than V elements remain: one per thread.
    const int64_t e = nvec * V + threadIdx.x;
    if (e < n) {
      const Out old = Op::kReadsOut ? out[e] : Out();
      const Out y = op.apply(in[e], old);
      if (Op::kWritesOut) out[e] = y;
    }
  } else {
    // Misaligned (e.g. a bucket slice at an odd offset): scalar but still coalesced, with V loads
    // in flight per thread before the first store.
    for (int64_t base = 0; base < n; base += int64_t(kMtBlock) * V) {
      In x[V];
      Out y[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t e = base + int64_t(k) * kMtBlock + threadIdx.x;
        if (e < n) {
          x[k] = in[e];
          if (Op::kReadsOut) y[k] = out[e];
        }
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t e = base + int64_t(k) * kMtBlock + threadIdx.x;
        if (e < n) {
          y[k] = op.apply(x[k], y[k]);
          if (Op::kWritesOut) out[e] = y[k];
        }
      }
    }
  }
  op.end();
}

// Launch `op` over every chunk of the table (one block per chunk) on `stream`.
template <class Op>
cudaError_t launch_multi_tensor(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                                const Op& op, cudaStream_t stream) {
  if (nchunks <= 0) return cudaSuccess;
  if (nchunks > 0x7fffffff || chunk_size <= 0 || chunk_size % 8 != 0) return cudaErrorInvalidValue;
  multi_tensor_kernel<Op><<<unsigned(nchunks), kMtBlock, 0, stream>>>(table, ntensors, chunk_size, op);
  return cudaGetLastError();
}

}  // namespace pl_cuda
