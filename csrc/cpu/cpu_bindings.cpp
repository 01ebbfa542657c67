// pybind11 registration of the CPU kernels and the grad-view checker: the one CPU file that includes
// torch's pybind11 casters (see cpu_ops.h for why the kernels do not). <torch/python.h>, not
// <torch/extension.h>: the latter adds torch's whole C++ frontend (nn, optim, data), half this file's compile.
#include <torch/python.h>

#include <string>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "grad_views.h"

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
  m.def("cpu_router_topk", &pl_cpu::router_topk,
        "Router scores, top-k, normalisation and per-expert counts in one pass (see parallel_layers.ops.moe_routing)",
        "logits"_a, "bias"_a, "top_k"_a, "sigmoid"_a, "norm"_a, "scale"_a, "weights"_a, "experts"_a, "counts"_a,
        release_gil());
  m.def("cpu_router_topk_backward", &pl_cpu::router_topk_backward,
        "The router weights' gradient with respect to the logits (see parallel_layers.ops.moe_routing)",
        "logits"_a, "experts"_a, "grad_weights"_a, "sigmoid"_a, "norm"_a, "scale"_a, "grad_logits"_a, release_gil());
  m.def("cpu_moe_permute_index", &pl_cpu::moe_permute_index,
        "Counts and stable positions of the (token, slot) pairs by expert (see parallel_layers.ops.moe_permute)",
        "experts"_a, "num_experts"_a, "counts"_a, "positions"_a, "order"_a, release_gil());
  m.def("cpu_moe_gather_rows", &pl_cpu::moe_gather_rows,
        "Rows of tokens gathered by pair order, optionally scaled (see parallel_layers.ops.moe_permute)",
        "src"_a, "order"_a, "top_k"_a, "scale"_a, "out"_a, release_gil());
  m.def("cpu_moe_unpermute", &pl_cpu::moe_unpermute,
        "Weighted slot-order sum of expert rows back to tokens (see parallel_layers.ops.moe_permute)",
        "expert_out"_a, "positions"_a, "weights"_a, "top_k"_a, "out"_a, release_gil());
  m.def("cpu_moe_permute_backward", &pl_cpu::moe_permute_backward,
        "Rows summed back to their tokens in position order (see parallel_layers.ops.moe_permute)",
        "grad"_a, "positions"_a, "top_k"_a, "out"_a, release_gil());
  m.def("cpu_fp8_amax", &pl_cpu::fp8_amax, "Block-wise amax of a matrix (see parallel_layers.ops.fp8_cast)",
        "x"_a, "amax"_a, "block_rows"_a, "block_cols"_a, release_gil());
  m.def("cpu_fp8_cast", &pl_cpu::fp8_cast,
        "Scaled saturating cast to fp8, with the transposed copy and the amax in the same pass "
        "(see parallel_layers.ops.fp8_cast)",
        "x"_a, "scale"_a, "out"_a, "out_t"_a, "amax"_a, "block_rows"_a, "block_cols"_a, release_gil());
  m.def("cpu_isa", []() { return std::string(pl_cpu::isa_name(pl_cpu::cpu_isa())); },
        "The instruction set the CPU kernels dispatch to (avx512, avx2 or default)");
  pybind11::class_<pl_cpu::GradViewChecker>(m, "GradViewChecker",
                                            "Checks that every params[i].grad is exactly views[i] (FlatBuffer.collect's "
                                            "fast path)")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>(), "params"_a,
           "views"_a, "data_views"_a = std::vector<at::Tensor>())
      .def("params_in_place", &pl_cpu::GradViewChecker::params_in_place,
           "True iff every params[i] still points at the storage of data_views[i]")
      .def("all_views", &pl_cpu::GradViewChecker::all_views,
           "True iff every params[i].grad is defined and is exactly views[i]")
      .def("__len__", &pl_cpu::GradViewChecker::size);
}
