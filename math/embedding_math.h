// The arithmetic both embedding backends apply, written once: bag scales,
// the optimizer steps with their weight decay, and the stochastic rounding
// of half-precision weights. Every function is __host__ __device__ under
// nvcc and plain inline C++ elsewhere, so the CPU backend, the CUDA kernels
// and the unit tests (embedding_math_test.cc, hand-computed values and bit
// patterns) run the same code.
//
// Rounding. Device code spells each operation with a _rn intrinsic so that
// nvcc cannot contract a*b+c into an FMA; host code is compiled in ISO C++
// mode, where GCC does not contract either. Given the same inputs both
// backends therefore produce the same bits.
//
// Thread-safe: pure functions.
#ifndef EMBER_MATH_EMBEDDING_MATH_H_
#define EMBER_MATH_EMBEDDING_MATH_H_

#include <cstdint>
#include <string_view>

#include "math/half.h"
#include "math/noise_hash.h"

namespace ember {
namespace backend {
namespace math {

// --- fp32 operations, never contracted --------------------------------------

EMBER_HD float Add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
EMBER_HD float Sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
EMBER_HD float Mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
EMBER_HD float Div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
EMBER_HD float Sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

// --- Limits --------------------------------------------------------------------

// The largest finite value a weight type holds (StepParams' weight type
// codes, as UpdateDesc carries them: 0 fp32, 1 fp16, 2 bf16). An fp32
// result at most this large rounds to a finite value of the type whether to
// nearest or stochastically (the stochastic round-up of the largest value
// carries into no exponent).
EMBER_HD float WeightLimit(int32_t weight_type) {
  // (3 and 4, INT8 and INT4: a quantized row's fp16 scale and bias.)
  return weight_type == 1 || weight_type >= 3 ? 65504.0f
         : weight_type == 2                   ? 3.38953139e38f
                                              : 3.40282347e38f;
}
// Optimizer state is fp32.
constexpr float kStateLimit = 3.40282347e38f;

// Whether x is a number of magnitude at most `limit` (false for NaN).
EMBER_HD bool Fits(float x, float limit) { return x <= limit && x >= -limit; }

// --- Bag scales ---------------------------------------------------------------

// The factor a MEAN bag of `len` ids applies to its sum (forward) and to each
// id's gradient (backward): 1/len, 1 for an empty bag (whose sum is 0).
EMBER_HD float MeanScale(int64_t len) {
  return len > 0 ? Div(1.0f, static_cast<float>(len)) : 1.0f;
}

// The factor on an id's gradient row: its per-id weight (1 when unweighted)
// times the bag's MEAN scale (1 for SUM and NONE).
EMBER_HD float IdScale(bool weighted, float weight, float mean_scale) {
  return weighted ? Mul(weight, mean_scale) : mean_scale;
}

// --- Optimizers -----------------------------------------------------------------

// Codes as stored in StepParams (device code sees plain ints).
enum StepOptimizer : int32_t { kStepSgd = 0, kStepAdagrad = 1, kStepRowwiseAdagrad = 2, kStepAdam = 3 };
enum StepDecay : int32_t { kDecayNone = 0, kDecayL2 = 1, kDecayDecouple = 2 };

// The fp32 optimizer state one row of `dim` columns holds, in floats: SGD
// none, Adagrad one per column, row-wise Adagrad one per row, Adam two per
// column (the moments). The one layout the backends, the checkpoint files
// and the planner size a table by.
constexpr int64_t StateFloatsPerRow(StepOptimizer optimizer, int64_t dim) {
  return optimizer == kStepAdagrad          ? dim
         : optimizer == kStepRowwiseAdagrad ? 1
         : optimizer == kStepAdam           ? 2 * dim
                                            : 0;
}

// A key_value shard (server/backend/key_value/) caches
// ceil(rows * cache_load_factor) of its rows, and at least this many (or
// all of a smaller shard): one call's distinct rows of a shard must fit in
// its cache, and a training batch of 2,048 bags x 20 ids names up to 40,960.
// The worker sizes the cache by it and the planner prices it so.
constexpr int64_t kKeyValueMinCacheRows = 65536;

// Whether a compute kernel (TorchRec's name) keeps a cache of its rows over
// a lower tier: "key_value" (rows on SSD) and "fused_uvm_caching" (rows in
// host memory). Their shards get cache_rows, tier counters and prefetches.
inline bool KernelCachesRows(std::string_view kernel) {
  return kernel == "key_value" || kernel == "fused_uvm_caching";
}

// A key_value shard's file (server/backend/key_value/row_file.h): each
// record a row's fp32 weights and state, padded to the drives' 512-byte
// sector so that it is read and written with direct I/O; the bytes one
// takes.
constexpr int64_t kKeyValueSectorBytes = 512;
constexpr int64_t KeyValueRecordStride(int64_t record_bytes) {
  return (record_bytes + kKeyValueSectorBytes - 1) / kKeyValueSectorBytes * kKeyValueSectorBytes;
}
// The records such a file has beyond the shard's rows (it is a log of row
// versions): half the rows, at least the cache's, at most the rows.
constexpr int64_t KeyValueSlackRows(int64_t rows, int64_t cache_rows) {
  const int64_t half = (rows + 1) / 2;
  const int64_t want = half > cache_rows ? half : cache_rows;
  return want < rows ? want : rows;
}

// One shard's hyper-parameters for one ApplyGradients call, resolved on the
// host (MakeStepParams in embedding_backend.h): plain data, copied to the
// device as it is.
struct StepParams {
  int32_t optimizer;   // StepOptimizer
  int32_t decay;       // StepDecay (kDecayNone when weight_decay is 0)
  float lr, eps;
  float beta1, beta2;  // Adam
  float one_minus_beta1, one_minus_beta2;
  float bias1, bias2;  // Adam: 1 - beta1^t, 1 - beta2^t for this call's t
  float weight_decay;
  float decay_keep;    // kDecayDecouple, Adagrad variants: 1 - lr * weight_decay
};

// L2 decay enters the gradient (and so the optimizer state): g + wd * w.
EMBER_HD float L2Gradient(const StepParams& p, float g, float w) {
  return p.decay == kDecayL2 ? Add(g, Mul(p.weight_decay, w)) : g;
}

// w minus an Adagrad-family update; decoupled decay shrinks w first, as
// FBGEMM's rowwise Adagrad does: (1 - lr * wd) * w - update.
EMBER_HD float ApplyUpdate(const StepParams& p, float w, float update) {
  return p.decay == kDecayDecouple ? Sub(Mul(p.decay_keep, w), update) : Sub(w, update);
}

// EXACT_SGD: w - lr * g (SGD takes no weight decay).
EMBER_HD float SgdStep(const StepParams& p, float w, float g) { return Sub(w, Mul(p.lr, g)); }

// EXACT_ADAGRAD, one element: G += g^2; w -= lr * g / (sqrt(G) + eps).
// `g` already carries L2 decay.
EMBER_HD float AdagradStep(const StepParams& p, float w, float g, float* acc) {
  *acc = Add(*acc, Mul(g, g));
  return ApplyUpdate(p, w, Div(Mul(p.lr, g), Add(Sqrt(*acc), p.eps)));
}

// EXACT_ROWWISE_ADAGRAD, the row part: G += mean(g^2) (computed by the caller
// in double over the L2-decayed gradient); returns lr / (sqrt(G) + eps).
EMBER_HD float RowwiseMultiplier(const StepParams& p, float* acc, float mean_square) {
  *acc = Add(*acc, mean_square);
  return Div(p.lr, Add(Sqrt(*acc), p.eps));
}

// EXACT_ROWWISE_ADAGRAD, one element: w - multiplier * g.
EMBER_HD float RowwiseStep(const StepParams& p, float w, float g, float multiplier) {
  return ApplyUpdate(p, w, Mul(multiplier, g));
}

// ADAM, one element (FBGEMM's form): m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2; w -= lr * (m^ / (sqrt(v^) + eps) + wd * w) with
// decoupled decay, which never enters m or v; with L2 decay `g` carries it.
EMBER_HD float AdamStep(const StepParams& p, float w, float g, float* m, float* v) {
  *m = Add(Mul(p.beta1, *m), Mul(p.one_minus_beta1, g));
  *v = Add(Mul(p.beta2, *v), Mul(Mul(p.one_minus_beta2, g), g));
  float u = Div(Div(*m, p.bias1), Add(Sqrt(Div(*v, p.bias2)), p.eps));
  if (p.decay == kDecayDecouple) u = Add(u, Mul(p.weight_decay, w));
  return Sub(w, Mul(p.lr, u));
}

// One element of an element-wise optimizer (SGD, Adagrad, Adam): `g` is the
// merged gradient before decay; acc / m / v are the element's state.
EMBER_HD float ElementStep(const StepParams& p, float w, float g, float* acc, float* m, float* v) {
  g = L2Gradient(p, g, w);
  switch (p.optimizer) {
    case kStepAdagrad:
      return AdagradStep(p, w, g, acc);
    case kStepAdam:
      return AdamStep(p, w, g, m, v);
    default:
      return SgdStep(p, w, g);
  }
}

// --- Stochastic rounding of fp16 / bf16 weights ----------------------------------
//
// An updated weight is rounded up with probability equal to its distance from
// the value below, in units of the gap (FBGEMM's TBE default), so updates
// smaller than half an ulp are not lost on average. The random bits are
// counter-based: a hash of (seed, step, global row, global column), so both
// backends and every sharding of a table draw the same bits.

EMBER_HD uint64_t Mix64(uint64_t x) {  // SplitMix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Per (seed, step, row): hashed once per row.
EMBER_HD uint64_t RowNoiseKey(uint64_t seed, int64_t step, int64_t global_row) {
  const uint64_t s = Mix64(seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(step));
  return Mix64(s ^ static_cast<uint64_t>(global_row));
}

// 32 random bits for one element of the row: noise_hash.h's Fmix32 of its
// ElementNoiseInput, two 32-bit multiplies. (SplitMix64 per element, as
// before, took two 64-bit ones: four AVX-512 multiplies for 16 columns
// where these take two, and nearly half of an fp16 update's time;
// docs/lab-notes/2026-11-benchmarks.md.)
EMBER_HD uint32_t ElementNoise(uint64_t row_key, int64_t global_col) {
  return Fmix32(ElementNoiseInput(row_key, global_col));
}

// bf16: add 16 random bits below the kept ones, then truncate. NaN and Inf
// round to nearest (unchanged). A carry into the exponent is the round-up.
EMBER_HD uint16_t FloatToBf16Stochastic(float f, uint32_t noise) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return FloatToBf16(f);
  return static_cast<uint16_t>((u + (noise & 0xffffu)) >> 16);
}

// fp16: the same over the 13 dropped mantissa bits of a normal half; for
// half subnormals (more bits dropped) the round-up happens when the noise
// under the dropped-bit mask is below the dropped bits. Magnitudes under
// 2^-25 become 0, at or above 65536 Inf; NaN and Inf as FloatToFp16.
EMBER_HD uint16_t FloatToFp16Stochastic(float f, uint32_t noise) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return FloatToFp16(f);           // Inf, NaN
  if (abs >= 0x47800000u) return sign | 0x7c00u;           // >= 65536: Inf
  if (abs < 0x38800000u) {                                 // half subnormal or zero
    if (abs < 0x33000000u) return sign;                    // < 2^-25
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);   // 14 .. 24
    const uint32_t mask = (1u << shift) - 1;
    uint32_t half = mant >> shift;
    if ((noise & mask) < (mant & mask)) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  const uint32_t r = abs - 0x38000000u + (noise & 0x1fffu);  // rebias 127 -> 15
  return sign | static_cast<uint16_t>(r >> 13);             // at most 0x7c00 (Inf)
}

}  // namespace math
}  // namespace backend
}  // namespace ember

#endif  // EMBER_MATH_EMBEDDING_MATH_H_
