// Mixture-of-Experts routing kernels on CPU: router top-k, the permutation's index, the row gather, and the
// two weighted/plain row sums back to tokens. Contracts: parallel_layers/ops/moe_routing.py and moe_permute.py.
//
// Every sum here runs in a fixed order in float32 (no reassociation: the extension is built with
// -ffp-contract=off), so results are deterministic and equal the torch references bit for bit where those
// references sum in the same order (see the ops modules for which ones do).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace pl_cpu {
namespace {

constexpr int64_t kTokenGrain = 64;   // tokens per parallel task: rows of a few hundred floats each

using Pair = std::pair<float, int64_t>;

// torch.topk's CPU algorithm (ATen/native/TopKImpl.h, largest=True, sorted=True): the same std algorithms with
// the same comparator over (value, index) pairs laid out in index order, so that exact ties resolve the way
// torch resolves them (introselect's order, not "lower index first").
void topk_like_torch(std::vector<Pair>& queue, const float* values, int64_t n, int64_t k) {
  for (int64_t j = 0; j < n; ++j) queue[j] = Pair(values[j], j);
  auto greater = [](const Pair& x, const Pair& y) -> bool {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.begin() + n, greater);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.begin() + n, greater);
    std::sort(queue.begin(), queue.begin() + k - 1, greater);
  }
}

// One row's scores in float32: sigmoid(logits), or the softmax over the row (max-subtracted, sequential sum).
template <class Tag>
void row_scores(const typename Tag::T* row, int64_t E, bool sigmoid, float* score) {
  if (sigmoid) {
    for (int64_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-Tag::load(row[e])));
    return;
  }
  float m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, Tag::load(row[e]));
  float total = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    score[e] = std::exp(Tag::load(row[e]) - m);
    total += score[e];
  }
  for (int64_t e = 0; e < E; ++e) score[e] = score[e] / total;
}

template <class Tag>
void router_rows(const typename Tag::T* logits, const float* bias, int64_t T, int64_t E, int64_t k, bool sigmoid,
                 bool norm, float scale, float* weights, int64_t* experts) {
  at::parallel_for(0, T, kTokenGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(E), choice(E);
    std::vector<Pair> queue(E);
    for (int64_t t = begin; t < end; ++t) {
      row_scores<Tag>(logits + t * E, E, sigmoid, score.data());
      for (int64_t e = 0; e < E; ++e) choice[e] = (sigmoid && bias) ? score[e] + bias[e] : score[e];
      topk_like_torch(queue, choice.data(), E, k);
      float* w = weights + t * k;
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = queue[j].second;
        experts[t * k + j] = e;
        w[j] = score[e];
        sum += w[j];
      }
      if (norm) {
        const float denom = sigmoid ? sum + 1e-20f : sum;   // DeepSeek-V3's epsilon on sigmoid scores only
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / denom;
      }
      if (scale != 1.0f) {
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] * scale;
      }
    }
  });
}

// The gradient of the chosen weights with respect to the logits, row by row (the chain of the reference's
// weight formula, written out): scale, then the normalisation's quotient rule, then the softmax's or the
// sigmoid's derivative. Experts of a row are distinct (top-k), so each chosen expert gets one slot's gradient.
template <class Tag>
void router_backward_rows(const typename Tag::T* logits, const int64_t* experts, const float* grad, int64_t T,
                          int64_t E, int64_t k, bool sigmoid, bool norm, float scale, typename Tag::T* out) {
  at::parallel_for(0, T, kTokenGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(E), dq(k);
    for (int64_t t = begin; t < end; ++t) {
      row_scores<Tag>(logits + t * E, E, sigmoid, score.data());
      const int64_t* ex = experts + t * k;
      const float* g = grad + t * k;
      float total = 0.0f, dot = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        dq[j] = scale != 1.0f ? g[j] * scale : g[j];
        total += score[ex[j]];
        dot += dq[j] * score[ex[j]];
      }
      if (norm) {
        const float denom = sigmoid ? total + 1e-20f : total;
        const float shift = dot / denom / denom;
        for (int64_t j = 0; j < k; ++j) dq[j] = dq[j] / denom - shift;
      }
      typename Tag::T* o = out + t * E;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) o[e] = Tag::store(0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float s = score[ex[j]];
          o[ex[j]] = Tag::store(dq[j] * (s * (1.0f - s)));
        }
        continue;
      }
      float inner = 0.0f;   // sum over experts of (upstream gradient x score): only the chosen ones are non-zero
      for (int64_t j = 0; j < k; ++j) inner += dq[j] * score[ex[j]];
      for (int64_t e = 0; e < E; ++e) o[e] = Tag::store(-score[e] * inner);
      for (int64_t j = 0; j < k; ++j) o[ex[j]] = Tag::store(score[ex[j]] * (dq[j] - inner));
    }
  });
}

// Tokens [begin, end) of the weighted slot-order sum: out[t] = round(0 + w_0 * x_0 + w_1 * x_1 + ...).
template <class Tag>
void unpermute_rows(const typename Tag::T* src, const int64_t* positions, const float* weights, int64_t k,
                    int64_t H, typename Tag::T* out, int64_t begin, int64_t end) {
  std::vector<float> acc(H);
  for (int64_t t = begin; t < end; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = positions[t * k + j];
      if (p < 0) {
        // the reference adds the dropped slot's zero row too: 0 + -0.0 is +0.0, so do the same
        for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + 0.0f;
        continue;
      }
      const float w = weights[t * k + j];
      const typename Tag::T* x = src + p * H;
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + Tag::load(x[h]) * w;
    }
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = Tag::store(acc[h]);
  }
}

// Tokens [begin, end) of permute's backward: each token's rows summed in ascending position order, the order
// in which index_add_ (the torch reference's backward) adds them on CPU.
template <class Tag>
void permute_backward_rows(const typename Tag::T* grad, const int64_t* positions, int64_t k, int64_t H,
                           typename Tag::T* out, int64_t begin, int64_t end) {
  std::vector<float> acc(H);
  std::vector<int64_t> pos(k);
  for (int64_t t = begin; t < end; ++t) {
    int64_t n = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = positions[t * k + j];
      if (p < 0) continue;
      int64_t i = n++;
      for (; i > 0 && pos[i - 1] > p; --i) pos[i] = pos[i - 1];   // insertion sort: k is small
      pos[i] = p;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const typename Tag::T* g = grad + pos[i] * H;
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + Tag::load(g[h]);
    }
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = Tag::store(acc[h]);
  }
}

void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t rows, int64_t cols) {
  check_cpu_contig(op, name, t);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name, " must be [", rows, ", ",
              cols, "], got ", t.sizes());
}

void check_index(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  check_cpu_contig(op, name, t);
  check_dtype(op, name, t, at::kLong);
  check_numel(op, name, t, n);
}

}  // namespace

void router_topk(at::Tensor logits, std::optional<at::Tensor> bias, int64_t top_k, bool sigmoid, bool norm,
                 double scale, at::Tensor weights, at::Tensor experts, at::Tensor counts) {
  const char* op = "router_topk";
  check_cpu_contig(op, "logits", logits);
  check_float_dtype(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [T, E], got ", logits.sizes());
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, op, ": top_k=", top_k, " must be in [1, E=", E, "]");
  check_rows(op, "weights", weights, T, top_k);
  check_dtype(op, "weights", weights, at::kFloat);
  check_rows(op, "experts", experts, T, top_k);
  check_dtype(op, "experts", experts, at::kLong);
  check_index(op, "counts", counts, E);
  const float* b = nullptr;
  if (bias.has_value()) {
    check_cpu_contig(op, "bias", *bias);
    check_dtype(op, "bias", *bias, at::kFloat);
    check_numel(op, "bias", *bias, E);
    b = bias->data_ptr<float>();
  }
  dispatch_dtype(logits.scalar_type(), "router_topk: logits", [&](auto tag) {
    using Tag = decltype(tag);
    router_rows<Tag>(reinterpret_cast<const typename Tag::T*>(logits.data_ptr()), b, T, E, top_k, sigmoid, norm,
                     static_cast<float>(scale), weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  });
  // The counts in one serial pass: T * k integers, far less work than the rows above.
  int64_t* c = counts.data_ptr<int64_t>();
  std::fill(c, c + E, 0);
  const int64_t* e = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * top_k; ++i) ++c[e[i]];
}

void router_topk_backward(at::Tensor logits, at::Tensor experts, at::Tensor grad_weights, bool sigmoid, bool norm,
                          double scale, at::Tensor grad_logits) {
  const char* op = "router_topk_backward";
  check_cpu_contig(op, "logits", logits);
  check_float_dtype(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [T, E], got ", logits.sizes());
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == T, op, ": experts must be [T, k], got ", experts.sizes());
  const int64_t k = experts.size(1);
  check_rows(op, "experts", experts, T, k);
  check_dtype(op, "experts", experts, at::kLong);
  check_rows(op, "grad_weights", grad_weights, T, k);
  check_dtype(op, "grad_weights", grad_weights, at::kFloat);
  check_rows(op, "grad_logits", grad_logits, T, E);
  TORCH_CHECK(grad_logits.scalar_type() == logits.scalar_type(), op, ": grad_logits must have the logits' dtype");
  dispatch_dtype(logits.scalar_type(), "router_topk_backward: logits", [&](auto tag) {
    using Tag = decltype(tag);
    using V = typename Tag::T;
    router_backward_rows<Tag>(reinterpret_cast<const V*>(logits.data_ptr()), experts.data_ptr<int64_t>(),
                              grad_weights.data_ptr<float>(), T, E, k, sigmoid, norm, static_cast<float>(scale),
                              reinterpret_cast<V*>(grad_logits.data_ptr()));
  });
}

void moe_permute_index(at::Tensor experts, int64_t num_experts, at::Tensor counts, at::Tensor positions,
                       at::Tensor order) {
  const char* op = "moe_permute_index";
  const int64_t n = experts.numel(), E = num_experts;
  check_index(op, "experts", experts, n);
  check_index(op, "counts", counts, E);
  check_index(op, "positions", positions, n);
  check_index(op, "order", order, n);
  const int64_t* ex = experts.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* ord = order.data_ptr<int64_t>();
  // Chunks of the flat (token, slot) pairs: a histogram per chunk, then each chunk's starting slot per expert
  // (the expert's offset plus the earlier chunks' counts) keeps the order stable inside every expert.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096));
  const int64_t per = (n + chunks - 1) / std::max<int64_t>(chunks, 1);
  std::vector<int64_t> hist(chunks * E, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      for (int64_t i = c * per; i < std::min(n, (c + 1) * per); ++i) {
        const int64_t e = ex[i];
        TORCH_CHECK(e < E, op, ": experts holds index ", e, " but num_experts=", E);
        if (e >= 0) ++hist[c * E + e];
      }
    }
  });
  int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t h = hist[c * E + e];
      hist[c * E + e] = start + total;   // now: chunk c's first slot for expert e
      total += h;
    }
    cnt[e] = total;
    start += total;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t* next = hist.data() + c * E;
      for (int64_t i = c * per; i < std::min(n, (c + 1) * per); ++i) {
        const int64_t e = ex[i];
        if (e < 0) {
          pos[i] = -1;
          continue;
        }
        const int64_t p = next[e]++;
        pos[i] = p;
        ord[p] = i;
      }
    }
  });
}

void moe_gather_rows(at::Tensor src, at::Tensor order, int64_t top_k, std::optional<at::Tensor> scale,
                     at::Tensor out) {
  const char* op = "moe_gather_rows";
  check_cpu_contig(op, "src", src);
  TORCH_CHECK(src.dim() == 2, op, ": src must be [T, H], got ", src.sizes());
  const int64_t T = src.size(0), H = src.size(1), N = order.numel();
  check_index(op, "order", order, N);
  check_rows(op, "out", out, N, H);
  TORCH_CHECK(out.scalar_type() == src.scalar_type(), op, ": out must have src's dtype");
  const int64_t* ord = order.data_ptr<int64_t>();
  if (!scale.has_value()) {
    const int64_t row_bytes = H * src.element_size();
    const char* s = static_cast<const char*>(src.data_ptr());
    char* o = static_cast<char*>(out.data_ptr());
    at::parallel_for(0, N, kTokenGrain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t t = ord[p] / top_k;
        TORCH_CHECK(t >= 0 && t < T, op, ": order[", p, "]=", ord[p], " is outside the ", T * top_k, " pairs");
        std::memcpy(o + p * row_bytes, s + t * row_bytes, row_bytes);
      }
    });
    return;
  }
  check_cpu_contig(op, "scale", *scale);
  check_dtype(op, "scale", *scale, at::kFloat);
  check_numel(op, "scale", *scale, T * top_k);
  const float* w = scale->data_ptr<float>();
  dispatch_dtype(src.scalar_type(), "moe_gather_rows: src", [&](auto tag) {
    using Tag = decltype(tag);
    const auto* s = reinterpret_cast<const typename Tag::T*>(src.data_ptr());
    auto* o = reinterpret_cast<typename Tag::T*>(out.data_ptr());
    at::parallel_for(0, N, kTokenGrain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t t = ord[p] / top_k;
        TORCH_CHECK(t >= 0 && t < T, op, ": order[", p, "]=", ord[p], " is outside the ", T * top_k, " pairs");
        const float f = w[ord[p]];
        for (int64_t h = 0; h < H; ++h) o[p * H + h] = Tag::store(Tag::load(s[t * H + h]) * f);
      }
    });
  });
}

void moe_unpermute(at::Tensor expert_out, at::Tensor positions, at::Tensor weights, int64_t top_k,
                   at::Tensor out) {
  const char* op = "moe_unpermute";
  check_cpu_contig(op, "expert_out", expert_out);
  TORCH_CHECK(expert_out.dim() == 2, op, ": expert_out must be [N, H], got ", expert_out.sizes());
  const int64_t H = expert_out.size(1), T = out.size(0);
  check_rows(op, "out", out, T, H);
  TORCH_CHECK(out.scalar_type() == expert_out.scalar_type(), op, ": out must have expert_out's dtype");
  check_index(op, "positions", positions, T * top_k);
  check_cpu_contig(op, "weights", weights);
  check_dtype(op, "weights", weights, at::kFloat);
  check_numel(op, "weights", weights, T * top_k);
  dispatch_dtype(expert_out.scalar_type(), "moe_unpermute: expert_out", [&](auto tag) {
    using Tag = decltype(tag);
    const auto* src = reinterpret_cast<const typename Tag::T*>(expert_out.data_ptr());
    auto* o = reinterpret_cast<typename Tag::T*>(out.data_ptr());
    at::parallel_for(0, T, kTokenGrain, [&](int64_t begin, int64_t end) {
      unpermute_rows<Tag>(src, positions.data_ptr<int64_t>(), weights.data_ptr<float>(), top_k, H, o, begin, end);
    });
  });
}

void moe_permute_backward(at::Tensor grad, at::Tensor positions, int64_t top_k, at::Tensor out) {
  const char* op = "moe_permute_backward";
  check_cpu_contig(op, "grad", grad);
  TORCH_CHECK(grad.dim() == 2, op, ": grad must be [N, H], got ", grad.sizes());
  const int64_t H = grad.size(1), T = out.size(0);
  check_rows(op, "out", out, T, H);
  TORCH_CHECK(out.scalar_type() == grad.scalar_type(), op, ": out must have grad's dtype");
  check_index(op, "positions", positions, T * top_k);
  dispatch_dtype(grad.scalar_type(), "moe_permute_backward: grad", [&](auto tag) {
    using Tag = decltype(tag);
    const auto* g = reinterpret_cast<const typename Tag::T*>(grad.data_ptr());
    auto* o = reinterpret_cast<typename Tag::T*>(out.data_ptr());
    at::parallel_for(0, T, kTokenGrain, [&](int64_t begin, int64_t end) {
      permute_backward_rows<Tag>(g, positions.data_ptr<int64_t>(), top_k, H, o, begin, end);
    });
  });
}

}  // namespace pl_cpu
