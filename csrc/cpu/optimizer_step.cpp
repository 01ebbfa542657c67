// Fused AdamW and SGD steps on flat fp32 buffers (the ZeRO shard of one rank).
//
// Each step is ONE streaming pass: read param, grad and the states, write param, the states and
// (optionally) the bf16/fp16 param copy. On a large buffer that is memory-bound, so the pass count,
// not the arithmetic, decides the speed. Semantics follow reference_adamw_step / reference_sgd_step
// in parallel_layers/ops/optimizer_step.py; scalars derived from `step` are computed in double
// (as the reference does with Python floats) and rounded to float once, outside the loop.
#include <type_traits>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace pl_cpu {
namespace {

// "No param copy" tag: the copy store compiles away.
struct NoCopy {
  using T = uint16_t;
};

template <class C>
constexpr bool kHasCopy = !std::is_same_v<C, NoCopy>;

// Calls fn(CopyTag{}) for param_copy: NoCopy when absent, else BF16 or F16.
template <class Fn>
void dispatch_copy(const char* op, const std::optional<at::Tensor>& copy, int64_t n, Fn&& fn) {
  if (!copy.has_value() || !copy->defined()) return fn(NoCopy{});
  check_cpu_contig(op, "param_copy", *copy);
  check_numel(op, "param_copy", *copy, n);
  switch (copy->scalar_type()) {
    case at::kBFloat16: return fn(BF16{});
    case at::kHalf: return fn(F16{});
    default: TORCH_CHECK(false, op, ": param_copy has dtype ", copy->scalar_type(), "; expected bfloat16 or float16");
  }
}

// ------------------------------------------------------------------------------------------------
// AdamW
// ------------------------------------------------------------------------------------------------
struct AdamArgs {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  float grad_scale;  // negated for maximize: -(g*s) == g*(-s) exactly
  float decay;       // 1 - lr*wd (decoupled), else exactly 1
  float l2;          // wd for classic (coupled) L2, used when use_l2
  bool use_l2;
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
};

template <class G, class C>
struct AdamKernel {
  static PL_INLINE void run(const AdamArgs* a, int64_t b, int64_t e) {
    float* __restrict p = a->param;
    const typename G::T* __restrict g = static_cast<const typename G::T*>(a->grad);
    float* __restrict m = a->exp_avg;
    float* __restrict v = a->exp_avg_sq;
    typename C::T* __restrict cp = static_cast<typename C::T*>(a->copy);
    const float gs = a->grad_scale, decay = a->decay, l2 = a->l2;
    const bool use_l2 = a->use_l2;
    const float b1 = a->beta1, omb1 = a->one_minus_beta1, b2 = a->beta2, omb2 = a->one_minus_beta2;
    const float step_size = a->step_size, inv_bc2s = a->inv_bias_correction2_sqrt, eps = a->eps;
    for (int64_t i = b; i < e; ++i) {
      float gi = G::load(g[i]) * gs;
      float pi = p[i];
      gi = use_l2 ? gi + l2 * pi : gi;  // loop-invariant select: vectorises as a blend
      pi = pi * decay;
      const float mi = m[i] * b1 + omb1 * gi;
      const float vi = v[i] * b2 + omb2 * gi * gi;
      // A multiply by the precomputed reciprocal instead of the reference's division: one division
      // (and one sqrt) per element is what keeps this pass memory-bound rather than divider-bound.
      const float denom = __builtin_sqrtf(vi) * inv_bc2s + eps;
      pi = pi - step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
      if constexpr (kHasCopy<C>) cp[i] = C::store(pi);
    }
  }
};

}  // namespace

void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                std::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                bool decoupled_weight_decay, bool maximize) {
  const char* op = "cpu_adamw_step";
  check_cpu_contig(op, "param", param);
  check_dtype(op, "param", param, at::kFloat);
  const int64_t n = param.numel();
  check_cpu_contig(op, "grad", grad);
  check_float_dtype(op, "grad", grad);
  check_numel(op, "grad", grad, n);
  for (auto* st : {&exp_avg, &exp_avg_sq}) {
    const char* name = st == &exp_avg ? "exp_avg" : "exp_avg_sq";
    check_cpu_contig(op, name, *st);
    check_dtype(op, name, *st, at::kFloat);
    check_numel(op, name, *st, n);
  }
  const double t = read_scalar(op, "step", step);
  const float gscale = read_scalar(op, "grad_scale", grad_scale);
  if (read_scalar(op, "found_inf", found_inf) != 0.0f) return;  // skipped step: touch nothing
  if (n == 0) return;

  AdamArgs a;
  a.param = param.data_ptr<float>();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  a.copy = param_copy.has_value() && param_copy->defined() ? param_copy->data_ptr() : nullptr;
  a.grad_scale = maximize ? -gscale : gscale;
  const bool decoupled = weight_decay != 0 && decoupled_weight_decay;
  a.decay = decoupled ? float(1.0 - lr * weight_decay) : 1.0f;
  a.use_l2 = weight_decay != 0 && !decoupled_weight_decay;
  a.l2 = float(weight_decay);
  a.beta1 = float(beta1);
  a.one_minus_beta1 = float(1.0 - beta1);
  a.beta2 = float(beta2);
  a.one_minus_beta2 = float(1.0 - beta2);
  a.step_size = float(lr / (1.0 - std::pow(beta1, t)));
  a.inv_bias_correction2_sqrt = float(1.0 / std::sqrt(1.0 - std::pow(beta2, t)));
  a.eps = float(eps);

  dispatch_dtype(grad.scalar_type(), "grad", [&](auto gtag) {
    dispatch_copy(op, param_copy, n, [&](auto ctag) {
      using K = AdamKernel<decltype(gtag), decltype(ctag)>;
      at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { run_isa<K>(&a, b, e); });
    });
  });
}

// ------------------------------------------------------------------------------------------------
// SGD (torch.optim.SGD semantics: the momentum buffer is initialised to the gradient on step 1)
// ------------------------------------------------------------------------------------------------
namespace {

struct SgdArgs {
  float* param;
  const void* grad;
  float* buf;
  void* copy;
  float grad_scale;  // negated for maximize
  float wd;
  bool use_wd;
  float momentum, one_minus_dampening, lr;
  bool nesterov;
};

enum Momentum { kNoMomentum = 0, kFirstStep = 1, kUpdate = 2 };

template <class G, class C, int MOM>
struct SgdKernel {
  static PL_INLINE void run(const SgdArgs* a, int64_t b, int64_t e) {
    float* __restrict p = a->param;
    const typename G::T* __restrict g = static_cast<const typename G::T*>(a->grad);
    float* __restrict buf = a->buf;
    typename C::T* __restrict cp = static_cast<typename C::T*>(a->copy);
    const float gs = a->grad_scale, wd = a->wd, mom = a->momentum, omd = a->one_minus_dampening, lr = a->lr;
    const bool use_wd = a->use_wd, nesterov = a->nesterov;
    for (int64_t i = b; i < e; ++i) {
      float gi = G::load(g[i]) * gs;
      float pi = p[i];
      gi = use_wd ? gi + wd * pi : gi;
      if constexpr (MOM != kNoMomentum) {
        // Step 1 copies g (the buffer may hold garbage, so never read it then).
        const float bi = MOM == kFirstStep ? gi : buf[i] * mom + omd * gi;
        buf[i] = bi;
        gi = nesterov ? gi + mom * bi : bi;
      }
      pi = pi - lr * gi;
      p[i] = pi;
      if constexpr (kHasCopy<C>) cp[i] = C::store(pi);
    }
  }
};

}  // namespace

void sgd_step(at::Tensor param, at::Tensor grad, std::optional<at::Tensor> momentum_buffer,
              std::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  const char* op = "cpu_sgd_step";
  check_cpu_contig(op, "param", param);
  check_dtype(op, "param", param, at::kFloat);
  const int64_t n = param.numel();
  check_cpu_contig(op, "grad", grad);
  check_float_dtype(op, "grad", grad);
  check_numel(op, "grad", grad, n);
  const bool has_buf = momentum_buffer.has_value() && momentum_buffer->defined();
  if (momentum != 0) {
    TORCH_CHECK(has_buf, op, ": momentum=", momentum, " needs a momentum_buffer of ", n, " float32 elements");
    check_cpu_contig(op, "momentum_buffer", *momentum_buffer);
    check_dtype(op, "momentum_buffer", *momentum_buffer, at::kFloat);
    check_numel(op, "momentum_buffer", *momentum_buffer, n);
  }
  const float t = read_scalar(op, "step", step);
  const float gscale = read_scalar(op, "grad_scale", grad_scale);
  if (read_scalar(op, "found_inf", found_inf) != 0.0f) return;
  if (n == 0) return;

  SgdArgs a;
  a.param = param.data_ptr<float>();
  a.grad = grad.data_ptr();
  a.buf = momentum != 0 ? momentum_buffer->data_ptr<float>() : nullptr;
  a.copy = param_copy.has_value() && param_copy->defined() ? param_copy->data_ptr() : nullptr;
  a.grad_scale = maximize ? -gscale : gscale;
  a.wd = float(weight_decay);
  a.use_wd = weight_decay != 0;
  a.momentum = float(momentum);
  a.one_minus_dampening = float(1.0 - dampening);
  a.lr = float(lr);
  a.nesterov = nesterov;
  const int mom_mode = momentum == 0 ? kNoMomentum : (t == 1.0f ? kFirstStep : kUpdate);

  dispatch_dtype(grad.scalar_type(), "grad", [&](auto gtag) {
    dispatch_copy(op, param_copy, n, [&](auto ctag) {
      using G = decltype(gtag);
      using C = decltype(ctag);
      auto go = [&](auto kernel_tag) {
        using K = decltype(kernel_tag);
        at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { run_isa<K>(&a, b, e); });
      };
      if (mom_mode == kNoMomentum) go(SgdKernel<G, C, kNoMomentum>{});
      else if (mom_mode == kFirstStep) go(SgdKernel<G, C, kFirstStep>{});
      else go(SgdKernel<G, C, kUpdate>{});
    });
  });
}

}  // namespace pl_cpu
