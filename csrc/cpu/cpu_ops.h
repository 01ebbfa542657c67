// The torch-facing CPU kernels. Signatures follow the kernel contracts in parallel_layers/ops/*.py
// exactly (positional arguments, in that order). Only ATen's tensor headers here: torch's pybind11
// casters (<torch/python.h>) cost ~15 s of compile per file, so only the registration (cpu_bindings.cpp)
// includes them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace pl_cpu {

// optimizer_step.cpp
void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                std::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                bool decoupled_weight_decay, bool maximize);
void sgd_step(at::Tensor param, at::Tensor grad, std::optional<at::Tensor> momentum_buffer,
              std::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize);

// multi_tensor.cpp
void unscale_and_norm(std::vector<at::Tensor> tensors, at::Tensor inv_scale, at::Tensor found_inf,
                      at::Tensor norm_out, bool unscale);
void multi_tensor_cast(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, at::Tensor scale,
                       at::Tensor found_inf);
void pack_bucket(std::vector<at::Tensor> srcs, at::Tensor bucket, std::vector<int64_t> offsets, at::Tensor scale);
void unpack_bucket(at::Tensor bucket, std::vector<at::Tensor> dsts, std::vector<int64_t> offsets, at::Tensor scale,
                   bool accumulate);

// moe.cpp
void router_topk(at::Tensor logits, std::optional<at::Tensor> bias, int64_t top_k, bool sigmoid, bool norm,
                 double scale, at::Tensor weights, at::Tensor experts, at::Tensor counts);
void router_topk_backward(at::Tensor logits, at::Tensor experts, at::Tensor grad_weights, bool sigmoid, bool norm,
                          double scale, at::Tensor grad_logits);
void moe_permute_index(at::Tensor experts, int64_t num_experts, at::Tensor counts, at::Tensor positions,
                       at::Tensor order);
void moe_gather_rows(at::Tensor src, at::Tensor order, int64_t top_k, std::optional<at::Tensor> scale,
                     at::Tensor out);
void moe_unpermute(at::Tensor expert_out, at::Tensor positions, at::Tensor weights, int64_t top_k, at::Tensor out);
void moe_permute_backward(at::Tensor grad, at::Tensor positions, int64_t top_k, at::Tensor out);

// fp8_cast.cpp
void fp8_amax(at::Tensor x, at::Tensor amax, int64_t block_rows, int64_t block_cols);
void fp8_cast(at::Tensor x, at::Tensor scale, at::Tensor out, std::optional<at::Tensor> out_t,
              std::optional<at::Tensor> amax, int64_t block_rows, int64_t block_cols);

}  // namespace pl_cpu
