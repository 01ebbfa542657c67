// Shared machinery of the C++ CPU kernels: dtype tags with exact conversions, runtime ISA dispatch,
// the walk over many tensors seen as one long virtual buffer, and argument checks.
//
// Why not at::vec::Vectorized: the extension is built without -mavx2/-mavx512f, so Vectorized<float>
// compiles to its DEFAULT (scalar-array) flavour. Instead the inner loops are plain element loops that
// GCC auto-vectorises, compiled three times (AVX-512, AVX2, baseline x86-64) through the `target`
// attribute on thin wrappers, and the best one is picked at run time (cpu_isa()).
// The loop bodies are `always_inline` templates so they are inlined -- and vectorised -- inside
// each ISA wrapper. Conversions to/from bf16/fp16 are written with integer bit tricks (the same
// algorithms as c10's scalar conversions) because GCC 12 does not vectorise F16C/_Float16 casts.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#define PL_INLINE inline __attribute__((always_inline))
#define PL_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,prefer-vector-width=512")))
#define PL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))

namespace pl_cpu {

// --------------------------------------------------------------------------------------------
// dtype tags: storage type, exact load to float, round-to-nearest-even store, non-finite test
// --------------------------------------------------------------------------------------------
PL_INLINE uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
PL_INLINE float f32_from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

// Non-finite test without branches or float compares: adding one exponent LSB to an all-ones
// exponent carries into the top bit (bit 31 for float, 15 for the 16-bit types), which a finite value
// never reaches. OR-ing these words over a loop (an integer reduction, which vectorises) and testing
// kBadMask at the end says whether any value was inf or nan.
PL_INLINE uint32_t f32_nonfinite(float y) { return (f32_bits(y) & 0x7f800000u) + 0x00800000u; }

struct F32 {
  using T = float;
  static constexpr const char* name = "float32";
  static PL_INLINE float load(T x) { return x; }
  static PL_INLINE T store(float y) { return y; }
  static constexpr uint32_t kBadMask = 0x80000000u;
  static PL_INLINE uint32_t nonfinite(T x) { return f32_nonfinite(x); }
};

struct BF16 {
  using T = uint16_t;
  static constexpr const char* name = "bfloat16";
  static PL_INLINE float load(T x) { return f32_from_bits(uint32_t(x) << 16); }
  // Round to nearest even, NaN -> quiet NaN (c10::BFloat16's algorithm).
  static PL_INLINE T store(float y) {
    const uint32_t u = f32_bits(y);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return T((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
  }
  static constexpr uint32_t kBadMask = 0x8000u;
  static PL_INLINE uint32_t nonfinite(T x) { return (uint32_t(x) & 0x7f80u) + 0x0080u; }
};

struct F16 {
  using T = uint16_t;
  static constexpr const char* name = "float16";
  // IEEE half -> float, branch-free (fp16_ieee_to_fp32_value from FP16 / c10).
  static PL_INLINE float load(T h) {
    const uint32_t w = uint32_t(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_from_bits(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
  }
  // float -> IEEE half, round to nearest even, overflow -> inf (fp16_ieee_from_fp32_value).
  static PL_INLINE T store(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return T((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }
  static constexpr uint32_t kBadMask = 0x8000u;
  static PL_INLINE uint32_t nonfinite(T x) { return (uint32_t(x) & 0x7c00u) + 0x0400u; }
};

// Calls fn(Tag{}) for the tag matching a float dtype.
template <class Fn>
inline void dispatch_dtype(at::ScalarType t, const char* what, Fn&& fn) {
  switch (t) {
    case at::kFloat: fn(F32{}); break;
    case at::kBFloat16: fn(BF16{}); break;
    case at::kHalf: fn(F16{}); break;
    default: TORCH_CHECK(false, what, " has dtype ", t, "; expected float32, bfloat16 or float16");
  }
}

// --------------------------------------------------------------------------------------------
// ISA dispatch. K::run(args...) is an always_inline static function; run_isa<K>(args...) calls the
// copy of it compiled for the best ISA this CPU supports. PARALLEL_LAYERS_CPU_ISA=avx2|default
// forces a lower one (to test those code paths on an AVX-512 machine).
// --------------------------------------------------------------------------------------------
enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
Isa cpu_isa();
const char* isa_name(Isa isa);

template <class K, class... A> PL_TARGET_AVX512 void run_avx512(A... a) { K::run(a...); }
template <class K, class... A> PL_TARGET_AVX2 void run_avx2(A... a) { K::run(a...); }
template <class K, class... A> void run_default(A... a) { K::run(a...); }

template <class K, class... A>
inline void run_isa(A... a) {
  switch (cpu_isa()) {
    case Isa::kAvx512: run_avx512<K>(a...); break;
    case Isa::kAvx2: run_avx2<K>(a...); break;
    default: run_default<K>(a...); break;
  }
}

// --------------------------------------------------------------------------------------------
// Many tensors as one virtual buffer. Tensor i occupies [start[i], start[i+1]) of the virtual index
// space; a chunk of that space may cover the tail of one tensor, several small tensors and the head
// of another. Work is split by virtual index, so big tensors are cut and tiny ones batched.
// --------------------------------------------------------------------------------------------
struct TensorSpans {
  std::vector<int64_t> start;  // size n+1, start[0] = 0, start[n] = total
  int64_t total() const { return start.back(); }
};

// Index of the tensor holding virtual element b: the last i with start[i] <= b (empty tensors that
// share that start come before it and are thereby skipped). Walk on with next_segment().
PL_INLINE int64_t first_tensor(const int64_t* start, int64_t ntensors, int64_t b) {
  int64_t lo = 0, hi = ntensors;  // invariant: start[lo] <= b, answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (start[mid] <= b) lo = mid; else hi = mid;
  }
  return lo;
}

// The part [lo, hi) of tensor i (local indices) that lies in the virtual range [b, e).
PL_INLINE void segment(const int64_t* start, int64_t i, int64_t b, int64_t e, int64_t& lo, int64_t& hi) {
  lo = (b > start[i] ? b : start[i]) - start[i];
  hi = (e < start[i + 1] ? e : start[i + 1]) - start[i];
}

// Elements per parallel task / per norm chunk: big enough to amortise scheduling, small enough
// that 2,000 tensors of 10k-100k elements spread evenly over the threads.
constexpr int64_t kGrain = 32 * 1024;
constexpr int64_t kNormChunk = 64 * 1024;

// --------------------------------------------------------------------------------------------
// Defensive checks (the Python layer validates first; these keep a direct caller from corrupting
// memory). Every message names the op and the argument.
// --------------------------------------------------------------------------------------------
void check_cpu_contig(const char* op, const std::string& name, const at::Tensor& t);
void check_float_dtype(const char* op, const std::string& name, const at::Tensor& t);
void check_dtype(const char* op, const std::string& name, const at::Tensor& t, at::ScalarType want);
void check_numel(const char* op, const std::string& name, const at::Tensor& t, int64_t n);
// A 1-element float32 CPU tensor; returns its value.
float read_scalar(const char* op, const char* name, const at::Tensor& t);
// Checks a tensor list (CPU, contiguous, one float dtype); returns the spans of the virtual buffer.
TensorSpans check_list(const char* op, const char* name, const std::vector<at::Tensor>& ts);

}  // namespace pl_cpu
