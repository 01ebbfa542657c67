// pybind11 entry point of parallel_layers._C. Each kernel family registers its own functions, so
// the CPU and CUDA halves can be built (and read) independently. Nothing of torch is needed here, only
// pybind11 (the copy in torch's include folder, as the other files' casters use): <torch/extension.h> would
// cost ~30 s of compile for a file of twenty lines.
#include <pybind11/pybind11.h>

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
