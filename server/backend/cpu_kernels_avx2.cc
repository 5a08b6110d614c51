// AVX2 + FMA + F16C row kernels (compiled with -mavx2 -mfma -mf16c; called
// only where the CPU has them). 8 fp32 lanes; 4-lane tails (dim % 4 == 0).
#include <immintrin.h>

#include "server/backend/cpu_kernel_types.h"

namespace ember {
namespace backend {
namespace {

// 8 and 4 bf16 values (the high halves of fp32) as fp32, and the 16-byte
// and 8-byte loads of 16-bit rows.
inline __m256 Bf16ToFloat(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m128 Bf16ToFloat4(__m128i h) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}
inline __m128i Load128(const uint16_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m128i Load64(const uint16_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

void AccF32(float* acc, const void* row, int64_t dim, float scale) {
  const float* r = static_cast<const float*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, _mm256_loadu_ps(r + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < dim; i += 4) {
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), _mm_loadu_ps(r + i),
                                        _mm_loadu_ps(acc + i)));
  }
}

void AccFp16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = _mm256_cvtph_ps(Load128(r + i));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i < dim; i += 4) {
    const __m128 v = _mm_cvtph_ps(Load64(r + i));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
}

void AccBf16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = Bf16ToFloat(Load128(r + i));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i < dim; i += 4) {
    const __m128 v = Bf16ToFloat4(Load64(r + i));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
}

void WidenF32(float* out, const void* row, int64_t dim) {
  const float* r = static_cast<const float*>(row);
  for (int64_t i = 0; i < dim; i += 4) _mm_storeu_ps(out + i, _mm_loadu_ps(r + i));
}

// A 16-bit row (T 1 fp16, 2 bf16) widened to fp32.
template <int T>
void Widen16(float* out, const void* row, int64_t dim) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m128i h = Load128(r + i);
    _mm256_storeu_ps(out + i, T == 1 ? _mm256_cvtph_ps(h) : Bf16ToFloat(h));
  }
  for (; i < dim; i += 4) {
    const __m128i h = Load64(r + i);
    _mm_storeu_ps(out + i, T == 1 ? _mm_cvtph_ps(h) : Bf16ToFloat4(h));
  }
}

struct Ops {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxAccumulators = 8;  // of 16 registers
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Set1(float x) { return _mm256_set1_ps(x); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg LoadFp16(const uint16_t* p) { return _mm256_cvtph_ps(Load128(p)); }
  static Reg LoadBf16(const uint16_t* p) { return Bf16ToFloat(Load128(p)); }
  static constexpr bool kPairLoads = false;  // LoadRowPair: two LoadRow's
  static void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static AccumulateFn Accumulate(int type) {
    return type == 1 ? AccFp16 : type == 2 ? AccBf16 : AccF32;
  }
};

#include "server/backend/cpu_kernels_impl.h"

}  // namespace

const RowKernels kAvx2RowKernels = {"avx2",
                                    {AccF32, AccFp16, AccBf16},
                                    {Pool<0>, Pool<1>, Pool<2>},
                                    {WidenF32, Widen16<1>, Widen16<2>},
                                    {nullptr, NarrowOneByOne<1>, NarrowOneByOne<2>},
                                    {nullptr, NarrowNearestOneByOne<1>,
                                     NarrowNearestOneByOne<2>}};

}  // namespace backend
}  // namespace ember
