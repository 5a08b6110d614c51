// AVX-512 (F/BW/VL) row kernels (compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx2 -mfma -mf16c; called only where the CPU has them).
// 16 fp32 lanes; tails of < 16 columns go to the AVX2 kernels.
#include <immintrin.h>

#include "server/backend/cpu_kernel_types.h"

namespace ember {
namespace backend {
namespace {

void AccF32(float* acc, const void* row, int64_t dim, float scale) {
  const float* r = static_cast<const float*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, _mm512_loadu_ps(r + i), _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) kAvx2RowKernels.accumulate[0](acc + i, r + i, dim - i, scale);
}

void AccFp16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) kAvx2RowKernels.accumulate[1](acc + i, r + i, dim - i, scale);
}

void AccBf16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) kAvx2RowKernels.accumulate[2](acc + i, r + i, dim - i, scale);
}

struct Ops {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Set1(float x) { return _mm512_set1_ps(x); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg LoadFp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Reg LoadBf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static AccumulateFn Accumulate(int type) { return kAvx2RowKernels.accumulate[type]; }
};

#include "server/backend/cpu_kernels_impl.h"

}  // namespace

const RowKernels kAvx512RowKernels = {
    "avx512", {AccF32, AccFp16, AccBf16}, {Pool<0>, Pool<1>, Pool<2>}};

}  // namespace backend
}  // namespace ember
