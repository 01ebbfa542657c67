// C interface between the plain-CUDA kernels (csrc/cuda/*.cu, compiled by nvcc) and the torch-facing
// bindings (csrc/cuda/cuda_ops.cpp, compiled by the C++ compiler).
//
// This header includes no CUDA header on purpose: cuda_ops.cpp must compile (and be syntax-checked
// in CI) on machines whose CUDA toolkit lacks the headers ATen's CUDA side needs. Hence:
//   - streams travel as `void*` (a cudaStream_t; torch hands us the stream as an integer),
//   - results travel as `int` (a cudaError_t; 0 == cudaSuccess), and pl_cuda_error_string turns one
//     into text,
//   - dtypes travel as the PL_DTYPE_* codes below.
// Every launcher returns the cudaGetLastError() after its launches (it never synchronises).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { PL_DTYPE_NONE = -1, PL_DTYPE_F32 = 0, PL_DTYPE_BF16 = 1, PL_DTYPE_F16 = 2 };

// Elements per chunk of the multi-tensor kernels: one thread block walks one chunk. Must be a
// multiple of 8 (the widest vector, in elements) so that every chunk of an aligned tensor starts
// aligned. 64Ki elements keeps the chunk table small for huge tensors (16 bytes per chunk) while
// still giving a block 128 elements per thread.
#define PL_CUDA_CHUNK_SIZE 65536

// Device table layout shared by the multi-tensor launchers (int64 words, on the device):
//   rows 0 .. ntensors-1  : {in_address, out_address, numel}          (3 words each)
//   then nchunks rows     : {tensor_index, start_element}              (2 words each)
// Zero-size tensors have a tensor row but no chunk. Each chunk covers
// [start, min(start + chunk_size, numel)) of its tensor.
#define PL_TENSOR_ROW_WORDS 3
#define PL_CHUNK_ROW_WORDS 2

const char* pl_cuda_error_string(int err);

// ---- flat optimizer steps (one tensor each; n elements) -------------------------------------
// grad_dtype: F32/BF16/F16. copy_dtype: NONE (param_copy == NULL), BF16 or F16.
// momentum_buffer may be NULL only when momentum == 0.
int pl_cuda_adamw_step(float* param, const void* grad, int grad_dtype, float* exp_avg, float* exp_avg_sq,
                       void* param_copy, int copy_dtype, int64_t n, const float* step,
                       const float* grad_scale, const float* found_inf, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int decoupled_weight_decay,
                       int maximize, void* stream);

int pl_cuda_sgd_step(float* param, const void* grad, int grad_dtype, float* momentum_buffer,
                     void* param_copy, int copy_dtype, int64_t n, const float* step, const float* grad_scale,
                     const float* found_inf, double lr, double momentum, double dampening,
                     double weight_decay, int nesterov, int maximize, void* stream);

// ---- multi-tensor ops (table as described above, already on the device) ---------------------
// partials: nchunks floats of scratch (may be NULL when nchunks == 0). Tensor rows: in == out == x.
int pl_cuda_unscale_and_norm(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                             int dtype, const float* inv_scale, float* found_inf, float* partials,
                             float* norm_out, int unscale, void* stream);

// Tensor rows: in = srcs[i], out = dsts[i].
int pl_cuda_multi_tensor_cast(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                              int src_dtype, int dst_dtype, const float* scale, float* found_inf,
                              void* stream);

// Tensor rows: in = srcs[i], out = &bucket[offsets[i]].
int pl_cuda_pack_bucket(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                        int src_dtype, int bucket_dtype, const float* scale, void* stream);

// Tensor rows: in = &bucket[offsets[i]], out = dsts[i].
int pl_cuda_unpack_bucket(const int64_t* table, int64_t ntensors, int64_t nchunks, int64_t chunk_size,
                          int bucket_dtype, int dst_dtype, const float* scale, int accumulate,
                          void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif
