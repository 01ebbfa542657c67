// ISA detection and argument checks of the CPU kernels.
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
