// FP8 cast kernels: block amax, and scaled cast (+ amax of the input, + transposed copy) in one pass.
// Kernel contracts: parallel_layers/ops/fp8_cast.py. x is a contiguous [R, C] float32 or bfloat16 matrix,
// cut into blocks of br x bc (both divide R and C); scale and amax are float32 [R/br, C/bc].
//
// Bit-exactness with the torch reference ((float(x) * scale).clamp(-max, max).to(fp8)): one float32 multiply
// (-ffp-contract=off), a clamp that keeps NaN, then c10's round-to-nearest-even fp32 -> fp8 conversion written
// out with integer bit tricks (the same algorithm as c10::Float8_e4m3fn / c10::Float8_e5m2's constructors).
// The amax propagates NaN as torch.amax does.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace pl_cpu {
namespace {

// Format parameters for c10's conversion: fp8 encodes fp32 values below `kMaxBits` (the first value that
// rounds past the largest finite); below `kNormalBits` the value is subnormal in fp8.
struct E4M3 {
  static constexpr float kMax = 448.0f;
  static constexpr uint32_t kMaxBits = 1087u << 20;      // 480.0f
  static constexpr uint32_t kDenormMask = 141u << 23;
  static constexpr uint32_t kNormalBits = 121u << 23;    // 2^-6
  static constexpr int kMantShift = 20;
  static constexpr uint32_t kBiasAdjust = uint32_t(7 - 127) << 23;
  static PL_INLINE uint8_t overflow(uint32_t /*abs_bits*/) { return 0x7f; }  // only NaN gets here (clamped)
};
struct E5M2 {
  static constexpr float kMax = 57344.0f;
  static constexpr uint32_t kMaxBits = 143u << 23;       // 65536.0f
  static constexpr uint32_t kDenormMask = 134u << 23;
  static constexpr uint32_t kNormalBits = 113u << 23;    // 2^-14
  static constexpr int kMantShift = 21;
  static constexpr uint32_t kBiasAdjust = uint32_t(15 - 127) << 23;
  static PL_INLINE uint8_t overflow(uint32_t abs_bits) { return abs_bits > 0x7f800000u ? 0x7f : 0x7c; }
};

template <class F>
PL_INLINE uint8_t to_fp8(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= F::kMaxBits) {
    r = F::overflow(u);
  } else if (u < F::kNormalBits) {
    // Subnormal: the FPU's own round-to-nearest-even does the rounding in the float add.
    r = uint8_t(f32_bits(f32_from_bits(u) + f32_from_bits(F::kDenormMask)) - F::kDenormMask);
  } else {
    const uint32_t odd = (u >> F::kMantShift) & 1u;
    u += F::kBiasAdjust + ((1u << (F::kMantShift - 1)) - 1u) + odd;
    r = uint8_t(u >> F::kMantShift);
  }
  return uint8_t(r | (sign >> 24));
}

// NaN-propagating max of |v| into m (m NaN stays NaN: `a > NaN` is false).
PL_INLINE float amax_step(float m, float v) {
  const float a = std::fabs(v);
  return (a > m || a != a) ? a : m;
}

struct Shape {
  int64_t R, C, br, bc, nbc;
};

// One row r: partial amax of each block column into part[0..nbc), cast into out (if out != nullptr).
template <class T, class F>
PL_INLINE void row(const typename T::T* x, uint8_t* out, const float* scale, float* part, const Shape& s,
                   int64_t r) {
  const float* srow = scale ? scale + (r / s.br) * s.nbc : nullptr;
  for (int64_t j = 0; j < s.nbc; ++j) {
    const typename T::T* xb = x + r * s.C + j * s.bc;
    float m = 0.0f;
    if (out) {
      uint8_t* ob = out + r * s.C + j * s.bc;
      const float sc = srow[j];
      for (int64_t k = 0; k < s.bc; ++k) {
        const float v = T::load(xb[k]);
        m = amax_step(m, v);
        float y = v * sc;
        y = y > F::kMax ? F::kMax : (y < -F::kMax ? -F::kMax : y);  // NaN passes through both compares
        ob[k] = to_fp8<F>(y);
      }
    } else {
      for (int64_t k = 0; k < s.bc; ++k) m = amax_step(m, T::load(xb[k]));
    }
    if (part) part[j] = m;
  }
}

// Partial amax per (row, block column) in `part` [R, nbc], then the max over each block's br rows.
void reduce_rows(const std::vector<float>& part, float* amax, const Shape& s) {
  at::parallel_for(0, s.R / s.br, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t j = 0; j < s.nbc; ++j) {
        float m = 0.0f;
        for (int64_t r = i * s.br; r < (i + 1) * s.br; ++r) {
          const float v = part[r * s.nbc + j];
          m = (v > m || v != v) ? v : m;
        }
        amax[i * s.nbc + j] = m;
      }
  });
}

constexpr int64_t kTile = 32;  // rows per task: the transposed copy writes kTile contiguous bytes per column

template <class T, class F>
void run(const at::Tensor& x, const float* scale, uint8_t* out, uint8_t* out_t, float* amax, const Shape& s) {
  const auto* xp = static_cast<const typename T::T*>(x.data_ptr());
  std::vector<float> part(amax ? s.R * s.nbc : 0);
  const int64_t tiles = (s.R + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, s.C * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(s.R, r0 + kTile);
      for (int64_t r = r0; r < r1; ++r) row<T, F>(xp, out, scale, amax ? part.data() + r * s.nbc : nullptr, s, r);
      if (out_t)
        for (int64_t c = 0; c < s.C; ++c)
          for (int64_t r = r0; r < r1; ++r) out_t[c * s.R + r] = out[r * s.C + c];
    }
  });
  if (amax) reduce_rows(part, amax, s);
}

template <class T>
void dispatch_format(const at::Tensor& x, const float* scale, const at::Tensor& out, uint8_t* out_t, float* amax,
                     const Shape& s) {
  auto* o = out.defined() ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
  if (!out.defined() || out.scalar_type() == at::ScalarType::Float8_e4m3fn)
    run<T, E4M3>(x, scale, o, out_t, amax, s);
  else
    run<T, E5M2>(x, scale, o, out_t, amax, s);
}

void launch(const at::Tensor& x, const float* scale, const at::Tensor& out, uint8_t* out_t, float* amax,
            int64_t br, int64_t bc) {
  const Shape s{x.size(0), x.size(1), br, bc, x.size(1) / bc};
  if (s.R == 0 || s.C == 0) {
    // No elements: every block amax is 0 (torch.amax of an empty block would raise; the op defines it).
    return;
  }
  if (x.scalar_type() == at::ScalarType::BFloat16)
    dispatch_format<BF16>(x, scale, out, out_t, amax, s);
  else
    dispatch_format<F32>(x, scale, out, out_t, amax, s);
}

}  // namespace

void fp8_amax(at::Tensor x, at::Tensor amax, int64_t block_rows, int64_t block_cols) {
  launch(x, nullptr, at::Tensor(), nullptr, amax.data_ptr<float>(), block_rows, block_cols);
}

void fp8_cast(at::Tensor x, at::Tensor scale, at::Tensor out, std::optional<at::Tensor> out_t,
              std::optional<at::Tensor> amax, int64_t block_rows, int64_t block_cols) {
  launch(x, scale.data_ptr<float>(), out, out_t ? static_cast<uint8_t*>(out_t->data_ptr()) : nullptr,
         amax ? amax->data_ptr<float>() : nullptr, block_rows, block_cols);
}

}  // namespace pl_cpu
