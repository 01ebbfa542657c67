// pybind11 entry point of parallel_layers._C. Each kernel family registers its own functions, so
// the CPU and CUDA halves can be built (and read) independently.
#include <torch/extension.h>

void register_cpu_ops(pybind11::module_& m);   // csrc/cpu/*.cpp
#ifdef WITH_CUDA
void register_cuda_ops(pybind11::module_& m);  // csrc/cuda/cuda_ops.cpp
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "parallel_layers fused kernels (C++ CPU, and CUDA when built with it)";
  register_cpu_ops(m);
#ifdef WITH_CUDA
  register_cuda_ops(m);
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
