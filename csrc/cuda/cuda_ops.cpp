// Torch-facing bindings of the plain-CUDA kernels: argument checks, device tables, launches.
//
// Only <torch/python.h> is included (no c10/cuda or ATen/cuda headers, which need CUDA toolkit
// headers that CPU-only CI machines lack), so this file compiles, and is syntax-checked, anywhere.
// The kernels are reached through the C launchers of launchers.h; streams arrive from Python as
// integers (torch.cuda.current_stream().cuda_stream) and are handed on as void*.
//
// Stream safety: the device tables and scratch buffers below are allocated with torch's caching
// allocator and used on the *current* stream, which is the stream the launchers run on, so their
// memory is only reused after our kernels in stream order. Host tables live in pinned memory
// from torch's caching host allocator, which keeps each block alive until its async copy is done.
#include <torch/python.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "launchers.h"

namespace {

const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

int dtype_code(const char* op, const std::string& name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return PL_DTYPE_F32;
    case at::kBFloat16: return PL_DTYPE_BF16;
    case at::kHalf: return PL_DTYPE_F16;
    default:
      TORCH_CHECK(false, op, ": ", name, " has dtype ", dtype_name(t.scalar_type()),
                  "; expected float32, bfloat16 or float16");
  }
  return PL_DTYPE_NONE;
}

void check_cuda(const char* op, const std::string& name, const at::Tensor& t, const at::Device& dev) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), " but the other tensors are on ", dev);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous; call .contiguous() first");
}

void check_flat(const char* op, const std::string& name, const at::Tensor& t, const at::Device& dev,
                int64_t numel) {
  check_cuda(op, name, t, dev);
  TORCH_CHECK(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements, expected ", numel);
}

void check_f32(const char* op, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(t.scalar_type()));
}

// step, grad_scale, found_inf, ...: 1-element float32 tensors the kernels read on the device.
float* scalar_ptr(const char* op, const std::string& name, const at::Tensor& t, const at::Device& dev) {
  check_flat(op, name, t, dev, 1);
  check_f32(op, name, t);
  return t.data_ptr<float>();
}

void check_launch(const char* op, int err) {
  TORCH_CHECK(err == 0, op, ": CUDA kernel launch failed: ", pl_cuda_error_string(err), " (error ", err, ")");
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

// The multi-tensor ops copy their tables and allocate scratch on torch's current stream; launching on
// another stream would race with that copy and with the allocator's reuse of the memory. Cheap
// (no CUDA header needed: c10's device-generic guard knows the current stream).
void check_current_stream(const char* op, const at::Device& dev, int64_t stream) {
  const c10::Stream current = c10::impl::getDeviceGuardImpl(dev.type())->getStream(dev);
  TORCH_CHECK(reinterpret_cast<intptr_t>(current.native_handle()) == static_cast<intptr_t>(stream), op,
              ": asked to launch on stream ", stream, " but torch's current stream on ", dev, " is ", current,
              "; pass torch.cuda.current_stream().cuda_stream (or make the stream current first)");
}

int copy_dtype_code(const char* op, const c10::optional<at::Tensor>& copy, const at::Device& dev, int64_t n) {
  if (!copy.has_value() || !copy->defined()) return PL_DTYPE_NONE;
  check_flat(op, "param_copy", *copy, dev, n);
  const int code = dtype_code(op, "param_copy", *copy);
  TORCH_CHECK(code != PL_DTYPE_F32, op, ": param_copy must be bfloat16 or float16, got float32");
  return code;
}

// ---- multi-tensor tables --------------------------------------------------------------------
struct Row {
  const void* in;
  void* out;
  int64_t numel;
};

struct DeviceTable {
  at::Tensor table;  // int64 on the device (keep alive until the launch is queued)
  int64_t ntensors = 0, nchunks = 0;
};

// Layout in launchers.h: one row per tensor, then one row per chunk; empty tensors get no chunk.
DeviceTable upload_table(const std::vector<Row>& rows, const at::Device& dev) {
  const int64_t chunk = PL_CUDA_CHUNK_SIZE;
  DeviceTable t;
  t.ntensors = static_cast<int64_t>(rows.size());
  for (const Row& r : rows) t.nchunks += (r.numel + chunk - 1) / chunk;
  TORCH_CHECK(t.nchunks <= 0x7fffffff, "parallel_layers: too many chunks (", t.nchunks, ") for one launch");
  if (t.nchunks == 0) return t;
  const int64_t words = t.ntensors * PL_TENSOR_ROW_WORDS + t.nchunks * PL_CHUNK_ROW_WORDS;
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* w = host.data_ptr<int64_t>();
  for (const Row& r : rows) {
    *w++ = static_cast<int64_t>(reinterpret_cast<intptr_t>(r.in));
    *w++ = static_cast<int64_t>(reinterpret_cast<intptr_t>(r.out));
    *w++ = r.numel;
  }
  for (int64_t i = 0; i < t.ntensors; ++i)
    for (int64_t start = 0; start < rows[i].numel; start += chunk) {
      *w++ = i;
      *w++ = start;
    }
  t.table = host.to(dev, at::kLong, /*non_blocking=*/true);
  return t;
}

// Tables already on the device. A table is a pure function of (device, stream, rows): optimizers and
// gradient buckets call an op on the same flat-buffer views every step, so after the first step the
// pinned buffer, its host-to-device copy and the chunk loop are skipped. A cached table is only read
// by kernels, so reusing it on the stream it was copied on is ordered; the key holds the stream. A
// freed tensor whose address comes back with the same size gets the same (still correct) table.
class TableCache {
 public:
  DeviceTable get(const std::vector<Row>& rows, const at::Device& dev, int64_t stream) {
    std::vector<int64_t> key;
    key.reserve(2 + 3 * rows.size());
    key.push_back(dev.index());
    key.push_back(stream);
    for (const Row& r : rows) {
      key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(r.in)));
      key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(r.out)));
      key.push_back(r.numel);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto hit = entries_.find(key);
    if (hit != entries_.end()) {
      hit->second.last_use = ++clock_;
      return hit->second.table;
    }
    DeviceTable t = upload_table(rows, dev);
    if (entries_.size() >= kCapacity) evict_oldest();
    entries_.emplace(std::move(key), Entry{t, ++clock_});
    return t;
  }

 private:
  struct Entry {
    DeviceTable table;
    uint64_t last_use;
  };
  static constexpr size_t kCapacity = 64;

  void evict_oldest() {
    auto oldest = std::min_element(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.second.last_use < b.second.last_use;
    });
    entries_.erase(oldest);
  }

  std::mutex mutex_;
  std::map<std::vector<int64_t>, Entry> entries_;
  uint64_t clock_ = 0;
};

DeviceTable build_table(const std::vector<Row>& rows, const at::Device& dev, int64_t stream) {
  static TableCache cache;
  return cache.get(rows, dev, stream);
}

// A list of contiguous CUDA tensors of one dtype on `dev`; returns that dtype's code.
int check_list(const char* op, const char* name, const std::vector<at::Tensor>& ts, const at::Device& dev) {
  int code = PL_DTYPE_NONE;
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    const bool plain = t.defined() && t.is_cuda() && t.device() == dev && t.is_contiguous() &&
                       (i == 0 || t.scalar_type() == ts[0].scalar_type());
    if (plain && code != PL_DTYPE_NONE) continue;  // the common case: no name built, no lookup
    const std::string item = std::string(name) + "[" + std::to_string(i) + "]";
    check_cuda(op, item, t, dev);
    const int c = dtype_code(op, item, t);
    TORCH_CHECK(i == 0 || c == code, op, ": ", item, " has dtype ", dtype_name(t.scalar_type()), " but ",
                name, "[0] has ", dtype_name(ts[0].scalar_type()), "; call the op once per dtype");
    code = c;
  }
  return code;
}

// ---- ops -------------------------------------------------------------------------------------
void cuda_adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                     c10::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale,
                     at::Tensor found_inf, double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool decoupled_weight_decay, bool maximize, int64_t stream) {
  const char* op = "cuda_adamw_step";
  TORCH_CHECK(param.is_cuda(), op, ": param must be a CUDA tensor, got one on ", param.device());
  const at::Device dev = param.device();
  const int64_t n = param.numel();
  check_flat(op, "param", param, dev, n);
  check_f32(op, "param", param);
  check_flat(op, "grad", grad, dev, n);
  const int grad_code = dtype_code(op, "grad", grad);
  check_flat(op, "exp_avg", exp_avg, dev, n);
  check_f32(op, "exp_avg", exp_avg);
  check_flat(op, "exp_avg_sq", exp_avg_sq, dev, n);
  check_f32(op, "exp_avg_sq", exp_avg_sq);
  const int copy_code = copy_dtype_code(op, param_copy, dev, n);
  const float* step_p = scalar_ptr(op, "step", step, dev);
  const float* scale_p = scalar_ptr(op, "grad_scale", grad_scale, dev);
  const float* inf_p = scalar_ptr(op, "found_inf", found_inf, dev);
  if (n == 0) return;
  const c10::DeviceGuard guard(dev);  // the launcher sizes its grid for the current device
  check_launch(op, pl_cuda_adamw_step(param.data_ptr<float>(), grad.data_ptr(), grad_code,
                                      exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                                      copy_code == PL_DTYPE_NONE ? nullptr : param_copy->data_ptr(), copy_code, n,
                                      step_p, scale_p, inf_p, lr, beta1, beta2, eps, weight_decay,
                                      decoupled_weight_decay ? 1 : 0, maximize ? 1 : 0, as_stream(stream)));
}

void cuda_sgd_step(at::Tensor param, at::Tensor grad, c10::optional<at::Tensor> momentum_buffer,
                   c10::optional<at::Tensor> param_copy, at::Tensor step, at::Tensor grad_scale,
                   at::Tensor found_inf, double lr, double momentum, double dampening, double weight_decay,
                   bool nesterov, bool maximize, int64_t stream) {
  const char* op = "cuda_sgd_step";
  TORCH_CHECK(param.is_cuda(), op, ": param must be a CUDA tensor, got one on ", param.device());
  const at::Device dev = param.device();
  const int64_t n = param.numel();
  check_flat(op, "param", param, dev, n);
  check_f32(op, "param", param);
  check_flat(op, "grad", grad, dev, n);
  const int grad_code = dtype_code(op, "grad", grad);
  float* buf = nullptr;
  if (momentum != 0.0) {
    TORCH_CHECK(momentum_buffer.has_value() && momentum_buffer->defined(), op, ": momentum=", momentum,
                " needs a momentum_buffer of ", n, " float32 elements");
    check_flat(op, "momentum_buffer", *momentum_buffer, dev, n);
    check_f32(op, "momentum_buffer", *momentum_buffer);
    buf = momentum_buffer->data_ptr<float>();
  }
  const int copy_code = copy_dtype_code(op, param_copy, dev, n);
  const float* step_p = scalar_ptr(op, "step", step, dev);
  const float* scale_p = scalar_ptr(op, "grad_scale", grad_scale, dev);
  const float* inf_p = scalar_ptr(op, "found_inf", found_inf, dev);
  if (n == 0) return;
  const c10::DeviceGuard guard(dev);
  check_launch(op, pl_cuda_sgd_step(param.data_ptr<float>(), grad.data_ptr(), grad_code, buf,
                                    copy_code == PL_DTYPE_NONE ? nullptr : param_copy->data_ptr(), copy_code, n,
                                    step_p, scale_p, inf_p, lr, momentum, dampening, weight_decay,
                                    nesterov ? 1 : 0, maximize ? 1 : 0, as_stream(stream)));
}

void cuda_unscale_and_norm(std::vector<at::Tensor> tensors, at::Tensor inv_scale, at::Tensor found_inf,
                           at::Tensor norm_out, bool unscale, int64_t stream) {
  const char* op = "cuda_unscale_and_norm";
  TORCH_CHECK(norm_out.is_cuda(), op, ": norm_out must be a CUDA tensor, got one on ", norm_out.device());
  const at::Device dev = norm_out.device();
  float* norm_p = scalar_ptr(op, "norm_out", norm_out, dev);
  const float* inv_p = scalar_ptr(op, "inv_scale", inv_scale, dev);
  float* inf_p = scalar_ptr(op, "found_inf", found_inf, dev);
  const int code = tensors.empty() ? PL_DTYPE_F32 : check_list(op, "tensors", tensors, dev);
  std::vector<Row> rows;
  rows.reserve(tensors.size());
  for (const at::Tensor& t : tensors) rows.push_back({t.data_ptr(), t.data_ptr(), t.numel()});
  const c10::DeviceGuard guard(dev);
  check_current_stream(op, dev, stream);
  const DeviceTable table = build_table(rows, dev, stream);
  at::Tensor partials = at::empty({std::max<int64_t>(table.nchunks, 1)}, norm_out.options());
  check_launch(op, pl_cuda_unscale_and_norm(table.nchunks ? table.table.data_ptr<int64_t>() : nullptr,
                                            table.ntensors, table.nchunks, PL_CUDA_CHUNK_SIZE, code, inv_p, inf_p,
                                            partials.data_ptr<float>(), norm_p, unscale ? 1 : 0,
                                            as_stream(stream)));
}

void cuda_multi_tensor_cast(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, at::Tensor scale,
                            at::Tensor found_inf, int64_t stream) {
  const char* op = "cuda_multi_tensor_cast";
  TORCH_CHECK(srcs.size() == dsts.size(), op, ": got ", srcs.size(), " srcs but ", dsts.size(), " dsts");
  TORCH_CHECK(found_inf.is_cuda(), op, ": found_inf must be a CUDA tensor, got one on ", found_inf.device());
  const at::Device dev = found_inf.device();
  float* inf_p = scalar_ptr(op, "found_inf", found_inf, dev);
  const float* scale_p = scalar_ptr(op, "scale", scale, dev);
  if (srcs.empty()) return;
  const int src_code = check_list(op, "srcs", srcs, dev);
  const int dst_code = check_list(op, "dsts", dsts, dev);
  std::vector<Row> rows;
  rows.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK(srcs[i].numel() == dsts[i].numel(), op, ": srcs[", i, "] has ", srcs[i].numel(),
                " elements but dsts[", i, "] has ", dsts[i].numel());
    rows.push_back({srcs[i].data_ptr(), dsts[i].data_ptr(), srcs[i].numel()});
  }
  const c10::DeviceGuard guard(dev);
  check_current_stream(op, dev, stream);
  const DeviceTable table = build_table(rows, dev, stream);
  if (table.nchunks == 0) return;
  check_launch(op, pl_cuda_multi_tensor_cast(table.table.data_ptr<int64_t>(), table.ntensors, table.nchunks,
                                             PL_CUDA_CHUNK_SIZE, src_code, dst_code, scale_p, inf_p,
                                             as_stream(stream)));
}

// Checks the bucket slices [offsets[i], offsets[i] + n_i) and returns their start addresses.
std::vector<char*> bucket_slices(const char* op, const at::Tensor& bucket, const std::vector<at::Tensor>& ts,
                                 const std::vector<int64_t>& offsets, const char* name) {
  TORCH_CHECK(offsets.size() == ts.size(), op, ": got ", offsets.size(), " offsets for ", ts.size(), " ", name);
  TORCH_CHECK(bucket.dim() == 1, op, ": bucket must be a 1-D flat buffer, got ", bucket.dim(), " dims");
  std::vector<char*> starts(ts.size());
  char* base = static_cast<char*>(bucket.data_ptr());
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t o = offsets[i], n = ts[i].numel();
    TORCH_CHECK(o >= 0 && o <= bucket.numel() - n, op, ": ", name, "[", i, "] (", n, " elements at offset ", o,
                ") does not fit in a bucket of ", bucket.numel(), " elements");
    starts[i] = base + o * static_cast<int64_t>(bucket.element_size());
  }
  return starts;
}

// What pack and unpack share: the checks on the bucket, the scale and the tensors, and the chunk table
// whose rows copy between each tensor and its bucket slice (tensor -> slice when packing, back when not).
struct BucketLaunch {
  DeviceTable table;
  int bucket_code = 0;
  int list_code = 0;
  const float* scale_p = nullptr;
};

BucketLaunch prepare_bucket(const char* op, const at::Tensor& bucket, const std::vector<at::Tensor>& ts,
                            const std::vector<int64_t>& offsets, const at::Tensor& scale, const char* name,
                            bool pack, int64_t stream) {
  TORCH_CHECK(bucket.is_cuda(), op, ": bucket must be a CUDA tensor, got one on ", bucket.device());
  const at::Device dev = bucket.device();
  check_cuda(op, "bucket", bucket, dev);
  BucketLaunch launch;
  launch.bucket_code = dtype_code(op, "bucket", bucket);
  launch.scale_p = scalar_ptr(op, "scale", scale, dev);
  if (ts.empty()) return launch;
  launch.list_code = check_list(op, name, ts, dev);
  const std::vector<char*> starts = bucket_slices(op, bucket, ts, offsets, name);
  std::vector<Row> rows;
  rows.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    rows.push_back(pack ? Row{ts[i].data_ptr(), starts[i], ts[i].numel()}
                        : Row{starts[i], ts[i].data_ptr(), ts[i].numel()});
  }
  check_current_stream(op, dev, stream);
  launch.table = build_table(rows, dev, stream);
  return launch;
}

void cuda_pack_bucket(std::vector<at::Tensor> srcs, at::Tensor bucket, std::vector<int64_t> offsets,
                      at::Tensor scale, int64_t stream) {
  const char* op = "cuda_pack_bucket";
  const c10::DeviceGuard guard(bucket.device());
  const BucketLaunch l = prepare_bucket(op, bucket, srcs, offsets, scale, "srcs", /*pack=*/true, stream);
  if (l.table.nchunks == 0) return;
  check_launch(op, pl_cuda_pack_bucket(l.table.table.data_ptr<int64_t>(), l.table.ntensors, l.table.nchunks,
                                       PL_CUDA_CHUNK_SIZE, l.list_code, l.bucket_code, l.scale_p,
                                       as_stream(stream)));
}

void cuda_unpack_bucket(at::Tensor bucket, std::vector<at::Tensor> dsts, std::vector<int64_t> offsets,
                        at::Tensor scale, bool accumulate, int64_t stream) {
  const char* op = "cuda_unpack_bucket";
  const c10::DeviceGuard guard(bucket.device());
  const BucketLaunch l = prepare_bucket(op, bucket, dsts, offsets, scale, "dsts", /*pack=*/false, stream);
  if (l.table.nchunks == 0) return;
  check_launch(op, pl_cuda_unpack_bucket(l.table.table.data_ptr<int64_t>(), l.table.ntensors, l.table.nchunks,
                                         PL_CUDA_CHUNK_SIZE, l.bucket_code, l.list_code, l.scale_p,
                                         accumulate ? 1 : 0, as_stream(stream)));
}

}  // namespace

void register_cuda_ops(pybind11::module_& m) {
  using pybind11::arg;
  m.def("cuda_adamw_step", &cuda_adamw_step, "Fused AdamW step on flat fp32 buffers (CUDA)", arg("param"),
        arg("grad"), arg("exp_avg"), arg("exp_avg_sq"), arg("param_copy"), arg("step"), arg("grad_scale"),
        arg("found_inf"), arg("lr"), arg("beta1"), arg("beta2"), arg("eps"), arg("weight_decay"),
        arg("decoupled_weight_decay"), arg("maximize"), arg("stream"));
  m.def("cuda_sgd_step", &cuda_sgd_step, "Fused SGD step on flat fp32 buffers (CUDA)", arg("param"), arg("grad"),
        arg("momentum_buffer"), arg("param_copy"), arg("step"), arg("grad_scale"), arg("found_inf"), arg("lr"),
        arg("momentum"), arg("dampening"), arg("weight_decay"), arg("nesterov"), arg("maximize"), arg("stream"));
  m.def("cuda_unscale_and_norm", &cuda_unscale_and_norm,
        "Multi-tensor unscale + non-finite check + L2 norm, one launch (CUDA)", arg("tensors"), arg("inv_scale"),
        arg("found_inf"), arg("norm_out"), arg("unscale"), arg("stream"));
  m.def("cuda_multi_tensor_cast", &cuda_multi_tensor_cast, "Multi-tensor scaled cast, one launch (CUDA)",
        arg("srcs"), arg("dsts"), arg("scale"), arg("found_inf"), arg("stream"));
  m.def("cuda_pack_bucket", &cuda_pack_bucket, "Pack tensors into a flat bucket, one launch (CUDA)", arg("srcs"),
        arg("bucket"), arg("offsets"), arg("scale"), arg("stream"));
  m.def("cuda_unpack_bucket", &cuda_unpack_bucket, "Unpack (or accumulate) a bucket into tensors (CUDA)",
        arg("bucket"), arg("dsts"), arg("offsets"), arg("scale"), arg("accumulate"), arg("stream"));
}
