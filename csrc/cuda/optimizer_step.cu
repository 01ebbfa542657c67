// Fused AdamW and SGD steps on flat fp32 buffers (a ZeRO shard), contract in
// parallel_layers/ops/optimizer_step.py.
//
// One pass reads grad (fp32/bf16/fp16) and the fp32 state, writes param, state and optionally a
// bf16/fp16 copy of the new param. step, grad_scale and found_inf are read from device memory so
// nothing waits for the host; found_inf != 0 makes every thread return before any store.
//
// Rounding: the reference is a chain of separate torch ops, each rounding to fp32. We keep those
// roundings where fusion would change them (__fmul_rn/__fadd_rn are never contracted into an FMA;
// __fsqrt_rn/__fdiv_rn stay IEEE even if someone builds with --use_fast_math), and compute the
// step-dependent scalars in double like the reference's Python floats, then round them to fp32 as
// torch does. Expect agreement with torch to a few ulp, not bit equality (torch's CUDA kernels
// may contract a + alpha*b differently).
#include "common.cuh"

namespace pl_cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kVec = 4;  // fp32 state: 16 bytes per access

struct AdamHyper {
  double lr, beta1, beta2;
  float beta1_f, beta2_f, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay_factor;
  bool decoupled, maximize;
};

struct AdamConsts { float step_size, bias_correction2_sqrt; };

__device__ __forceinline__ AdamConsts adam_consts(const AdamHyper& h, float step) {
  // Once per thread, in double: 1 - beta^t for beta2 = 0.999 loses digits in fp32 at small t.
  const double t = step;
  const double bc1 = 1.0 - pow(h.beta1, t);
  const double bc2 = 1.0 - pow(h.beta2, t);
  return {float(h.lr / bc1), float(sqrt(bc2))};
}

__device__ __forceinline__ void adamw_elem(float& p, float& m, float& v, float g, const AdamHyper& h,
                                           const AdamConsts& c) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) {
    if (h.decoupled) p = __fmul_rn(p, h.decay_factor);
    else g = __fadd_rn(g, __fmul_rn(h.weight_decay, p));  // two torch ops, two roundings
  }
  m = __fmul_rn(m, h.beta1_f) + h.one_minus_beta1 * g;
  v = __fmul_rn(v, h.beta2_f) + h.one_minus_beta2 * g * g;
  const float denom = __fdiv_rn(__fsqrt_rn(v), c.bias_correction2_sqrt) + h.eps;
  p = p - c.step_size * __fdiv_rn(m, denom);
}

// HAS_COPY is a template flag so the no-copy variant carries no copy code at all.
template <typename G, typename C, bool HAS_COPY>
__global__ void __launch_bounds__(kBlock)
adamw_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
             float* __restrict__ exp_avg_sq, C* __restrict__ copy, int64_t n, const float* step,
             const float* grad_scale, const float* found_inf, AdamHyper h, bool vectorised) {
  if (flag_set(*found_inf)) return;  // uniform across the grid: nothing is written anywhere
  const float gs = *grad_scale;
  const AdamConsts c = adam_consts(h, *step);
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t scalar_from = 0;
  if (vectorised) {
    const int64_t nvec = n / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      const int64_t e = i * kVec;
      Vec<float, kVec> p = load_vec<float, kVec>(param + e);
      Vec<float, kVec> m = load_vec<float, kVec>(exp_avg + e);
      Vec<float, kVec> v = load_vec<float, kVec>(exp_avg_sq + e);
      const Vec<G, kVec> g = load_vec<G, kVec>(grad + e);
#pragma unroll
      for (int k = 0; k < kVec; ++k) adamw_elem(p.v[k], m.v[k], v.v[k], __fmul_rn(to_float(g.v[k]), gs), h, c);
      store_vec(param + e, p);
      store_vec(exp_avg + e, m);
      store_vec(exp_avg_sq + e, v);
      if constexpr (HAS_COPY) {
        Vec<C, kVec> out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) out.v[k] = from_float<C>(p.v[k]);
        store_vec(copy + e, out);
      }
    }
    scalar_from = nvec * kVec;
  }
  for (int64_t e = scalar_from + tid; e < n; e += stride) {
    float p = param[e], m = exp_avg[e], v = exp_avg_sq[e];
    adamw_elem(p, m, v, __fmul_rn(to_float(grad[e]), gs), h, c);
    param[e] = p;
    exp_avg[e] = m;
    exp_avg_sq[e] = v;
    if constexpr (HAS_COPY) copy[e] = from_float<C>(p);
  }
}

struct SgdHyper {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize;
};

// buf is only touched when momentum != 0 (then the buffer pointer is non-null).
__device__ __forceinline__ void sgd_elem(float& p, float& buf, float g, bool first, const SgdHyper& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) g = __fadd_rn(g, __fmul_rn(h.weight_decay, p));
  if (h.momentum != 0.f) {
    buf = first ? g : __fmul_rn(buf, h.momentum) + h.one_minus_dampening * g;
    g = h.nesterov ? __fadd_rn(g, __fmul_rn(h.momentum, buf)) : buf;
  }
  p = p - h.lr * g;
}

template <typename G, typename C, bool HAS_COPY>
__global__ void __launch_bounds__(kBlock)
sgd_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ buffer,
           C* __restrict__ copy, int64_t n, const float* step, const float* grad_scale,
           const float* found_inf, SgdHyper h, bool vectorised) {
  if (flag_set(*found_inf)) return;
  const float gs = *grad_scale;
  const bool first = *step == 1.0f;  // torch.optim.SGD initialises the buffer on the first step
  const bool has_buf = h.momentum != 0.f;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t scalar_from = 0;
  if (vectorised) {
    const int64_t nvec = n / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      const int64_t e = i * kVec;
      Vec<float, kVec> p = load_vec<float, kVec>(param + e);
      Vec<float, kVec> b;
      // The first step overwrites the buffer, so it need not be read (it may hold garbage).
      if (has_buf && !first) b = load_vec<float, kVec>(buffer + e);
      const Vec<G, kVec> g = load_vec<G, kVec>(grad + e);
#pragma unroll
      for (int k = 0; k < kVec; ++k) sgd_elem(p.v[k], b.v[k], __fmul_rn(to_float(g.v[k]), gs), first, h);
      store_vec(param + e, p);
      if (has_buf) store_vec(buffer + e, b);
      if constexpr (HAS_COPY) {
        Vec<C, kVec> out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) out.v[k] = from_float<C>(p.v[k]);
        store_vec(copy + e, out);
      }
    }
    scalar_from = nvec * kVec;
  }
  for (int64_t e = scalar_from + tid; e < n; e += stride) {
    float p = param[e];
    float b = (has_buf && !first) ? buffer[e] : 0.f;
    sgd_elem(p, b, __fmul_rn(to_float(grad[e]), gs), first, h);
    param[e] = p;
    if (has_buf) buffer[e] = b;
    if constexpr (HAS_COPY) copy[e] = from_float<C>(p);
  }
}

// Calls f(Tag<G>, Tag<C>, has_copy) for the runtime grad/copy dtypes.
template <class F>
cudaError_t dispatch_grad_copy(int grad_dtype, int copy_dtype, F&& f) {
  return dispatch_dtype(grad_dtype, [&](auto g) -> cudaError_t {
    switch (copy_dtype) {
      case PL_DTYPE_NONE: return f(g, Tag<__half>{}, std::false_type{});
      case PL_DTYPE_BF16: return f(g, Tag<__nv_bfloat16>{}, std::true_type{});
      case PL_DTYPE_F16: return f(g, Tag<__half>{}, std::true_type{});
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace
}  // namespace pl_cuda

using namespace pl_cuda;

extern "C" int pl_cuda_adamw_step(float* param, const void* grad, int grad_dtype, float* exp_avg,
                                  float* exp_avg_sq, void* param_copy, int copy_dtype, int64_t n,
                                  const float* step, const float* grad_scale, const float* found_inf,
                                  double lr, double beta1, double beta2, double eps, double weight_decay,
                                  int decoupled_weight_decay, int maximize, void* stream) {
  if (n <= 0) return cudaSuccess;
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  // The reference passes Python floats to torch ops, which round them to fp32: do the same.
  h.beta1_f = float(beta1);
  h.beta2_f = float(beta2);
  h.one_minus_beta1 = float(1.0 - beta1);
  h.one_minus_beta2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.weight_decay = float(weight_decay);
  h.decay_factor = float(1.0 - lr * weight_decay);
  h.decoupled = decoupled_weight_decay != 0;
  h.maximize = maximize != 0;
  return dispatch_grad_copy(grad_dtype, copy_dtype, [&](auto gt, auto ct, auto has_copy) -> cudaError_t {
    using G = typename decltype(gt)::type;
    using C = typename decltype(ct)::type;
    const bool vectorised = vec_aligned<float, kVec>(param) && vec_aligned<float, kVec>(exp_avg) &&
                            vec_aligned<float, kVec>(exp_avg_sq) && vec_aligned<G, kVec>(grad) &&
                            (!has_copy || vec_aligned<C, kVec>(param_copy));
    auto kernel = adamw_kernel<G, C, decltype(has_copy)::value>;
    const int64_t blocks = grid_for(kernel, vectorised ? (n + kVec - 1) / kVec : n, kBlock);
    kernel<<<unsigned(blocks), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
        param, static_cast<const G*>(grad), exp_avg, exp_avg_sq, static_cast<C*>(param_copy), n, step, grad_scale,
        found_inf, h, vectorised);
    return cudaGetLastError();
  });
}

extern "C" int pl_cuda_sgd_step(float* param, const void* grad, int grad_dtype, float* momentum_buffer,
                                void* param_copy, int copy_dtype, int64_t n, const float* step,
                                const float* grad_scale, const float* found_inf, double lr, double momentum,
                                double dampening, double weight_decay, int nesterov, int maximize,
                                void* stream) {
  if (n <= 0) return cudaSuccess;
  if (momentum != 0.0 && momentum_buffer == nullptr) return cudaErrorInvalidValue;
  SgdHyper h;
  h.lr = float(lr);
  h.momentum = float(momentum);
  h.one_minus_dampening = float(1.0 - dampening);
  h.weight_decay = float(weight_decay);
  h.nesterov = nesterov != 0;
  h.maximize = maximize != 0;
  return dispatch_grad_copy(grad_dtype, copy_dtype, [&](auto gt, auto ct, auto has_copy) -> cudaError_t {
    using G = typename decltype(gt)::type;
    using C = typename decltype(ct)::type;
    const bool vectorised = vec_aligned<float, kVec>(param) && vec_aligned<G, kVec>(grad) &&
                            (momentum_buffer == nullptr || vec_aligned<float, kVec>(momentum_buffer)) &&
                            (!has_copy || vec_aligned<C, kVec>(param_copy));
    auto kernel = sgd_kernel<G, C, decltype(has_copy)::value>;
    const int64_t blocks = grid_for(kernel, vectorised ? (n + kVec - 1) / kVec : n, kBlock);
    kernel<<<unsigned(blocks), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
        param, static_cast<const G*>(grad), momentum_buffer, static_cast<C*>(param_copy), n, step, grad_scale,
        found_inf, h, vectorised);
    return cudaGetLastError();
  });
}
