// GradViewChecker: the hot check of FlatBuffer.collect ("is every p.grad still exactly its view of the
// flat gradient buffer?") without touching Python objects.
//
// The Python walk `[p.grad for p in params]` + `is` per parameter chases, per parameter, the param's
// PyObject, its TensorImpl, the AutogradMeta, the grad's TensorImpl and the grad's PyObject, and
// allocates a list -- with thousands of small parameters and a cold cache that is milliseconds per step.
// Here the param TensorImpls and the expected grad TensorImpl pointers are stored once; a check reads
// param impl -> autograd meta -> grad impl pointer and compares. Iterations are independent, so the
// CPU overlaps their cache misses.
//
// Same answer as the Python check: a Python tensor object and its TensorImpl are one-to-one (the impl
// owns its PyObject slot), so `p.grad is view` <=> the grad's TensorImpl is the view's TensorImpl. The
// checker keeps references to the params and the views, so a stored pointer can never be reused by a
// different tensor while the checker lives. Header-only: cpu_bindings.cpp registers it.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace pl_cpu {

class GradViewChecker {
 public:
  GradViewChecker(std::vector<at::Tensor> params, std::vector<at::Tensor> views,
                  std::vector<at::Tensor> data_views)
      : params_(std::move(params)), views_(std::move(views)) {
    TORCH_CHECK(params_.size() == views_.size(), "GradViewChecker: ", params_.size(), " params but ",
                views_.size(), " views");
    TORCH_CHECK(data_views.empty() || data_views.size() == params_.size(), "GradViewChecker: ", params_.size(),
                " params but ", data_views.size(), " data views");
    data_ptrs_.reserve(data_views.size());
    for (const at::Tensor& v : data_views) data_ptrs_.push_back(v.data_ptr());
    param_impls_.reserve(params_.size());
    expected_.reserve(views_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      TORCH_CHECK(params_[i].defined() && views_[i].defined(), "GradViewChecker: undefined tensor at ", i);
      param_impls_.push_back(params_[i].unsafeGetTensorImpl());
      expected_.push_back(views_[i].unsafeGetTensorImpl());
    }
  }

  // True iff every params[i].grad is defined and is exactly views[i]. The GIL is held (the Python
  // grad setter, the only writer, needs it too), so the answer cannot change under our feet.
  bool all_views() const {
    const size_t n = param_impls_.size();
    c10::TensorImpl* const* p = param_impls_.data();
    c10::TensorImpl* const* e = expected_.data();
    // Iterations are independent and the exit branch is predicted not taken, so the out-of-order core
    // keeps many pointer chases in flight. Exiting early keeps the miss case (every grad fresh after
    // zero_grad(set_to_none=True)) nearly free before the Python fallback.
    for (size_t i = 0; i < n; ++i) {
      // An undefined grad is UndefinedTensorImpl's singleton, never equal to a (defined) expected view.
      if (p[i]->grad().unsafeGetTensorImpl() != e[i]) return false;
    }
    return true;
  }

  // True iff every params[i]'s data still starts where data_views[i] did (nobody re-pointed ``p.data``,
  // e.g. a wrapper that moved the parameters into buffers of its own). ``p.data = x`` keeps the param's
  // TensorImpl and swaps its storage, so the stored impl pointer reads the current address.
  bool params_in_place() const {
    TORCH_CHECK(data_ptrs_.size() == param_impls_.size(), "GradViewChecker: built without data views");
    for (size_t i = 0; i < data_ptrs_.size(); ++i) {
      if (param_impls_[i]->data() != data_ptrs_[i]) return false;
    }
    return true;
  }

  size_t size() const { return param_impls_.size(); }

 private:
  std::vector<at::Tensor> params_;   // keep the tensors (hence the impl pointers) alive
  std::vector<at::Tensor> views_;
  std::vector<c10::TensorImpl*> param_impls_;
  std::vector<c10::TensorImpl*> expected_;
  std::vector<const void*> data_ptrs_;
};

}  // namespace pl_cpu
