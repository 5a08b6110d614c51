#include "server/backend/cpu_kernels.h"

#include <immintrin.h>

#include "absl/strings/str_cat.h"
#include "server/backend/half.h"

namespace ember {
namespace backend {
namespace {

// --- Scalar reference kernels.
void AccF32Scalar(float* acc, const void* row, int64_t dim, float scale) {
  const float* r = static_cast<const float*>(row);
  for (int64_t i = 0; i < dim; ++i) acc[i] += scale * r[i];
}
void AccF16Scalar(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < dim; ++i) acc[i] += scale * Fp16ToFloat(r[i]);
}
void AccBf16Scalar(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < dim; ++i) acc[i] += scale * Bf16ToFloat(r[i]);
}

// --- AVX2 + FMA + F16C: 8 lanes, a 4-lane tail (dim % 4 == 0).
#define EMBER_AVX2 __attribute__((target("avx2,fma,f16c")))

EMBER_AVX2 void AccF32Avx2(float* acc, const void* row, int64_t dim, float scale) {
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

EMBER_AVX2 void AccF16Avx2(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i < dim; i += 4) {
    const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i)));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
}

EMBER_AVX2 void AccBf16Avx2(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i < dim; i += 4) {
    const __m128i w = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i)));
    const __m128 v = _mm_castsi128_ps(_mm_slli_epi32(w, 16));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
}

// --- AVX-512: 16 lanes; the remainder (< 16, a multiple of 4) goes to AVX2.
#define EMBER_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

EMBER_AVX512 void AccF32Avx512(float* acc, const void* row, int64_t dim, float scale) {
  const float* r = static_cast<const float*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, _mm512_loadu_ps(r + i), _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) AccF32Avx2(acc + i, r + i, dim - i, scale);
}

EMBER_AVX512 void AccF16Avx512(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) AccF16Avx2(acc + i, r + i, dim - i, scale);
}

EMBER_AVX512 void AccBf16Avx512(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) AccBf16Avx2(acc + i, r + i, dim - i, scale);
}

const RowKernels kScalar = {"scalar", {AccF32Scalar, AccF16Scalar, AccBf16Scalar}};
const RowKernels kAvx2 = {"avx2", {AccF32Avx2, AccF16Avx2, AccBf16Avx2}};
const RowKernels kAvx512 = {"avx512", {AccF32Avx512, AccF16Avx512, AccBf16Avx512}};

bool HasAvx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool HasAvx512() {
  return HasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace

const RowKernels& BestRowKernels() {
  if (HasAvx512()) return kAvx512;
  if (HasAvx2()) return kAvx2;
  return kScalar;
}

absl::StatusOr<const RowKernels*> RowKernelsFor(const std::string& isa) {
  if (isa == "auto" || isa.empty()) return &BestRowKernels();
  if (isa == "scalar") return &kScalar;
  if (isa == "avx2") {
    if (!HasAvx2()) return absl::FailedPreconditionError("this CPU lacks AVX2/FMA/F16C");
    return &kAvx2;
  }
  if (isa == "avx512") {
    if (!HasAvx512()) return absl::FailedPreconditionError("this CPU lacks AVX-512 F/BW/VL");
    return &kAvx512;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", isa, "' (valid: auto, scalar, avx2, avx512)"));
}

}  // namespace backend
}  // namespace ember
