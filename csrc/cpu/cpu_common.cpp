// ISA detection, argument checks and the pybind11 registration of the CPU kernels.
#include "cpu_common.h"

#include <cstdlib>
#include <cstring>

#include "cpu_ops.h"

namespace pl_cpu {

static Isa detect_isa() {
  __builtin_cpu_init();
  Isa best = Isa::kDefault;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::kAvx512;
  // Allow forcing a *lower* ISA only: a higher one than the CPU has would crash with SIGILL.
  if (const char* env = std::getenv("PARALLEL_LAYERS_CPU_ISA")) {
    Isa want = best;
    if (!std::strcmp(env, "default")) want = Isa::kDefault;
    else if (!std::strcmp(env, "avx2")) want = Isa::kAvx2;
    else if (!std::strcmp(env, "avx512")) want = Isa::kAvx512;
    if (int(want) < int(best)) best = want;
  }
  return best;
}

Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "default";
  }
}

void check_cpu_contig(const char* op, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (sizes ", t.sizes(), ", strides ",
              t.strides(), ")");
}

void check_float_dtype(const char* op, const std::string& name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, op, ": ", name, " has dtype ", s,
              "; expected float32, bfloat16 or float16");
}

void check_dtype(const char* op, const std::string& name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " has dtype ", t.scalar_type(), "; expected ", want);
}

void check_numel(const char* op, const std::string& name, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.numel() == n, op, ": ", name, " has ", t.numel(), " elements, expected ", n);
}

float read_scalar(const char* op, const char* name, const at::Tensor& t) {
  check_cpu_contig(op, name, t);
  check_dtype(op, name, t, at::kFloat);
  check_numel(op, name, t, 1);
  return t.data_ptr<float>()[0];
}

TensorSpans check_list(const char* op, const char* name, const std::vector<at::Tensor>& ts) {
  TensorSpans spans;
  spans.start.resize(ts.size() + 1);
  spans.start[0] = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string item = std::string(name) + "[" + std::to_string(i) + "]";
    check_cpu_contig(op, item, ts[i]);
    check_float_dtype(op, item, ts[i]);
    TORCH_CHECK(ts[i].scalar_type() == ts[0].scalar_type(), op, ": ", item, " has dtype ",
                ts[i].scalar_type(), " but ", name, "[0] has ", ts[0].scalar_type());
    spans.start[i + 1] = spans.start[i] + ts[i].numel();
  }
  return spans;
}

}  // namespace pl_cpu

void register_cpu_ops(pybind11::module_& m) {
  using namespace pybind11::literals;
  // The optimizer steps touch no Python object, so they let go of the GIL: an offloaded step's I/O threads
  // (parallel_layers/zero/offload.py) and a delayed host step's caller keep running while a shard is stepped.
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("cpu_adamw_step", &pl_cpu::adamw_step,
        "Fused AdamW/Adam step on flat fp32 buffers (see parallel_layers.ops.optimizer_step)",
        "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "param_copy"_a, "step"_a, "grad_scale"_a,
        "found_inf"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "decoupled_weight_decay"_a,
        "maximize"_a, release_gil());
  m.def("cpu_sgd_step", &pl_cpu::sgd_step,
        "Fused SGD step on flat fp32 buffers (see parallel_layers.ops.optimizer_step)",
        "param"_a, "grad"_a, "momentum_buffer"_a, "param_copy"_a, "step"_a, "grad_scale"_a, "found_inf"_a,
        "lr"_a, "momentum"_a, "dampening"_a, "weight_decay"_a, "nesterov"_a, "maximize"_a, release_gil());
  m.def("cpu_unscale_and_norm", &pl_cpu::unscale_and_norm,
        "Unscale + non-finite check + global L2 norm (see parallel_layers.ops.unscale_norm)",
        "tensors"_a, "inv_scale"_a, "found_inf"_a, "norm_out"_a, "unscale"_a);
  m.def("cpu_multi_tensor_cast", &pl_cpu::multi_tensor_cast,
        "Multi-tensor scaled cast with overflow detection (see parallel_layers.ops.cast)",
        "srcs"_a, "dsts"_a, "scale"_a, "found_inf"_a);
  m.def("cpu_pack_bucket", &pl_cpu::pack_bucket, "Pack tensors into a flat bucket (see parallel_layers.ops.bucket)",
        "srcs"_a, "bucket"_a, "offsets"_a, "scale"_a);
  m.def("cpu_unpack_bucket", &pl_cpu::unpack_bucket,
        "Unpack (or accumulate) a flat bucket into tensors (see parallel_layers.ops.bucket)",
        "bucket"_a, "dsts"_a, "offsets"_a, "scale"_a, "accumulate"_a);
  m.def("cpu_isa", []() { return std::string(pl_cpu::isa_name(pl_cpu::cpu_isa())); },
        "The instruction set the CPU kernels dispatch to (avx512, avx2 or default)");
  void register_grad_views(pybind11::module_&); register_grad_views(m);  // csrc/cpu/grad_views.cpp
}
