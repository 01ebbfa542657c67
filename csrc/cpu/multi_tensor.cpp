// Multi-tensor kernels: unscale + non-finite check + L2 norm, scaled cast, bucket pack / unpack.
//
// The tensor list is seen as one virtual buffer (TensorSpans in cpu_common.h) and split by element
// index, so a single parallel_for covers thousands of small tensors as cheaply as one big one.
// Values are computed exactly as the torch references do: one float32 multiply by the scale, then a
// round-to-nearest-even conversion, so cast/pack/unpack and the unscaled values are bit-identical.
#include <atomic>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace pl_cpu {
namespace {

// ------------------------------------------------------------------------------------------------
// unscale_and_norm. The sum of squares is taken in fixed chunks of kNormChunk virtual elements; within
// a segment `omp simd reduction` keeps one float partial per vector lane (a plain loop would not
// vectorise: without -ffast-math GCC may not reorder a float sum). Segment sums are added in double,
// in order, per chunk, and chunks in order on the host: the result depends on the data (and the ISA's
// vector width), never on the thread count.
// ------------------------------------------------------------------------------------------------
struct NormArgs {
  const int64_t* start;
  int64_t ntensors;
  int64_t total;
  void* const* ptrs;
  float inv_scale;
  bool unscale;
  double* partial;  // one per chunk
  uint32_t* bad;    // one per chunk
};

template <class T, bool WRITE>
PL_INLINE void norm_segment(typename T::T* __restrict x, int64_t n, float inv, double& sum, uint32_t& bad_out) {
  float acc = 0.0f;
  uint32_t bad = 0;
#pragma omp simd reduction(+ : acc) reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) {
    const float y = T::load(x[j]) * inv;
    acc += y * y;
    bad |= f32_nonfinite(y);
    if constexpr (WRITE) x[j] = T::store(y);
  }
  sum += acc;
  bad_out |= bad;
}

template <class T>
struct NormKernel {
  static PL_INLINE void run(const NormArgs* a, int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t b = c * kNormChunk;
      const int64_t e = b + kNormChunk < a->total ? b + kNormChunk : a->total;
      double sum = 0.0;
      uint32_t bad = 0;
      for (int64_t i = first_tensor(a->start, a->ntensors, b); i < a->ntensors && a->start[i] < e; ++i) {
        int64_t lo, hi;
        segment(a->start, i, b, e, lo, hi);
        auto* x = static_cast<typename T::T*>(a->ptrs[i]) + lo;
        if (a->unscale) norm_segment<T, true>(x, hi - lo, a->inv_scale, sum, bad);
        else norm_segment<T, false>(x, hi - lo, a->inv_scale, sum, bad);
      }
      a->partial[c] = sum;
      a->bad[c] = bad & F32::kBadMask;
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Element-wise transfer between two tensor lists (cast, pack, unpack):
//   dst[i][j] = D((ACC ? float(dst[i][j]) : 0) + float(src[i][j]) * scale)
// with per-tensor base pointers (already offset into the bucket where one side is a bucket).
// ------------------------------------------------------------------------------------------------
struct XferArgs {
  const int64_t* start;
  int64_t ntensors;
  const void* const* src;
  void* const* dst;
  float scale;
};

template <class S, class D, bool ACC>
struct XferKernel {
  // Returns the OR of D::nonfinite over the written values (test with D::kBadMask).
  static PL_INLINE void run(const XferArgs* a, int64_t b, int64_t e, uint32_t* bad_out) {
    const float scale = a->scale;
    uint32_t bad = 0;
    for (int64_t i = first_tensor(a->start, a->ntensors, b); i < a->ntensors && a->start[i] < e; ++i) {
      int64_t lo, hi;
      segment(a->start, i, b, e, lo, hi);
      const typename S::T* __restrict s = static_cast<const typename S::T*>(a->src[i]) + lo;
      typename D::T* __restrict d = static_cast<typename D::T*>(a->dst[i]) + lo;
      const int64_t n = hi - lo;
      uint32_t seg_bad = 0;
      for (int64_t j = 0; j < n; ++j) {
        float y = S::load(s[j]) * scale;
        if constexpr (ACC) y = D::load(d[j]) + y;
        const typename D::T o = D::store(y);
        d[j] = o;
        seg_bad |= D::nonfinite(o);
      }
      bad |= seg_bad;
    }
    *bad_out = bad;
  }
};

// Runs XferKernel over the whole virtual range; returns whether any written value is non-finite.
bool run_xfer(const XferArgs& a, int64_t total, at::ScalarType src_type, at::ScalarType dst_type, bool accumulate) {
  std::atomic<bool> any_bad{false};
  if (total == 0) return false;
  dispatch_dtype(src_type, "source", [&](auto stag) {
    dispatch_dtype(dst_type, "destination", [&](auto dtag) {
      using S = decltype(stag);
      using D = decltype(dtag);
      auto go = [&](auto kernel_tag) {
        using K = decltype(kernel_tag);
        at::parallel_for(0, total, kGrain, [&](int64_t b, int64_t e) {
          uint32_t bad = 0;
          run_isa<K>(&a, b, e, &bad);
          if (bad & D::kBadMask) any_bad.store(true, std::memory_order_relaxed);
        });
      };
      if (accumulate) go(XferKernel<S, D, true>{});
      else go(XferKernel<S, D, false>{});
    });
  });
  return any_bad.load();
}

std::vector<void*> data_ptrs(const std::vector<at::Tensor>& ts) {
  std::vector<void*> p(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i].data_ptr();
  return p;
}

// Pointers to the bucket slices [offsets[i], offsets[i] + numel_i), checked to lie inside the bucket.
std::vector<void*> bucket_slices(const char* op, const at::Tensor& bucket, const std::vector<int64_t>& offsets,
                                 const TensorSpans& spans) {
  const int64_t nt = int64_t(spans.start.size()) - 1;
  TORCH_CHECK(int64_t(offsets.size()) == nt, op, ": got ", offsets.size(), " offsets for ", nt, " tensors");
  char* base = static_cast<char*>(bucket.data_ptr());
  const int64_t item = bucket.element_size();
  std::vector<void*> p(nt);
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t n = spans.start[i + 1] - spans.start[i];
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= bucket.numel() - n, op, ": offsets[", i, "]=", offsets[i],
                " with ", n, " elements does not fit in the bucket of ", bucket.numel(), " elements");
    p[i] = base + offsets[i] * item;
  }
  return p;
}

void check_bucket(const char* op, const at::Tensor& bucket) {
  check_cpu_contig(op, "bucket", bucket);
  check_float_dtype(op, "bucket", bucket);
  TORCH_CHECK(bucket.dim() == 1, op, ": bucket must be a 1-D flat buffer, got sizes ", bucket.sizes());
}

}  // namespace

void unscale_and_norm(std::vector<at::Tensor> tensors, at::Tensor inv_scale, at::Tensor found_inf,
                      at::Tensor norm_out, bool unscale) {
  const char* op = "cpu_unscale_and_norm";
  const TensorSpans spans = check_list(op, "tensors", tensors);
  const float inv = read_scalar(op, "inv_scale", inv_scale);
  read_scalar(op, "found_inf", found_inf);
  read_scalar(op, "norm_out", norm_out);
  const int64_t total = spans.total();
  const int64_t nchunks = (total + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(nchunks);
  std::vector<uint32_t> bad(nchunks);
  if (nchunks > 0) {
    const std::vector<void*> ptrs = data_ptrs(tensors);
    const NormArgs a{spans.start.data(), int64_t(tensors.size()), total, ptrs.data(), inv, unscale,
                     partial.data(), bad.data()};
    dispatch_dtype(tensors[0].scalar_type(), "tensors", [&](auto tag) {
      using K = NormKernel<decltype(tag)>;
      at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) { run_isa<K>(&a, cb, ce); });
    });
  }
  double sum = 0;
  bool any_bad = false;
  for (int64_t c = 0; c < nchunks; ++c) {  // chunk order: deterministic whatever the thread count
    sum += partial[c];
    any_bad |= bad[c] != 0;
  }
  norm_out.data_ptr<float>()[0] = float(std::sqrt(sum));
  if (any_bad) found_inf.data_ptr<float>()[0] = 1.0f;
}

void multi_tensor_cast(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, at::Tensor scale,
                       at::Tensor found_inf) {
  const char* op = "cpu_multi_tensor_cast";
  TORCH_CHECK(srcs.size() == dsts.size(), op, ": got ", srcs.size(), " srcs but ", dsts.size(), " dsts");
  const TensorSpans spans = check_list(op, "srcs", srcs);
  check_list(op, "dsts", dsts);
  for (size_t i = 0; i < srcs.size(); ++i)
    TORCH_CHECK(dsts[i].numel() == srcs[i].numel(), op, ": srcs[", i, "] has ", srcs[i].numel(),
                " elements but dsts[", i, "] has ", dsts[i].numel());
  const float s = read_scalar(op, "scale", scale);
  read_scalar(op, "found_inf", found_inf);
  if (spans.total() == 0) return;
  const std::vector<void*> sp = data_ptrs(srcs), dp = data_ptrs(dsts);
  const XferArgs a{spans.start.data(), int64_t(srcs.size()), sp.data(), dp.data(), s};
  if (run_xfer(a, spans.total(), srcs[0].scalar_type(), dsts[0].scalar_type(), false))
    found_inf.data_ptr<float>()[0] = 1.0f;
}

void pack_bucket(std::vector<at::Tensor> srcs, at::Tensor bucket, std::vector<int64_t> offsets, at::Tensor scale) {
  const char* op = "cpu_pack_bucket";
  check_bucket(op, bucket);
  const TensorSpans spans = check_list(op, "srcs", srcs);
  const float s = read_scalar(op, "scale", scale);
  const std::vector<void*> dp = bucket_slices(op, bucket, offsets, spans);
  if (spans.total() == 0) return;
  const std::vector<void*> sp = data_ptrs(srcs);
  const XferArgs a{spans.start.data(), int64_t(srcs.size()), sp.data(), dp.data(), s};
  run_xfer(a, spans.total(), srcs[0].scalar_type(), bucket.scalar_type(), false);
}

void unpack_bucket(at::Tensor bucket, std::vector<at::Tensor> dsts, std::vector<int64_t> offsets, at::Tensor scale,
                   bool accumulate) {
  const char* op = "cpu_unpack_bucket";
  check_bucket(op, bucket);
  const TensorSpans spans = check_list(op, "dsts", dsts);
  const float s = read_scalar(op, "scale", scale);
  const std::vector<void*> sp = bucket_slices(op, bucket, offsets, spans);
  if (spans.total() == 0) return;
  const std::vector<void*> dp = data_ptrs(dsts);
  const XferArgs a{spans.start.data(), int64_t(dsts.size()), sp.data(), dp.data(), s};
  run_xfer(a, spans.total(), bucket.scalar_type(), dsts[0].scalar_type(), accumulate);
}

}  // namespace pl_cpu
