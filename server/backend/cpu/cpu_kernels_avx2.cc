// AVX2 + FMA + F16C row kernels (compiled with -mavx2 -mfma -mf16c; called
// only where the CPU has them). 8 fp32 lanes, then a 4-lane step, then
// column by column (any dim).
#include <immintrin.h>

#include "math/noise_hash.h"
#include "server/backend/cpu/cpu_kernel_types.h"

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

// One stored element as fp32 (T 0 fp32, 1 fp16, 2 bf16), for the last
// dim % 4 columns.
template <int T>
inline float LoadOne(const void* row, int64_t i) {
  if (T == 0) return static_cast<const float*>(row)[i];
  const uint16_t h = static_cast<const uint16_t*>(row)[i];
  if (T == 1) return _cvtsh_ss(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// acc[i, dim) += scale * row[i, dim) one column at a time, fused as the
// vector lanes are (the same rounding whichever lane a column falls in).
template <int T>
inline void AccTail(float* acc, const void* row, int64_t i, int64_t dim, float scale) {
  for (; i < dim; ++i) {
    acc[i] = _mm_cvtss_f32(
        _mm_fmadd_ss(_mm_set_ss(scale), _mm_set_ss(LoadOne<T>(row, i)), _mm_set_ss(acc[i])));
  }
}

void AccF32(float* acc, const void* row, int64_t dim, float scale) {
  const float* r = static_cast<const float*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, _mm256_loadu_ps(r + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i + 4 <= dim; i += 4) {
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), _mm_loadu_ps(r + i),
                                        _mm_loadu_ps(acc + i)));
  }
  AccTail<0>(acc, row, i, dim, scale);
}

void AccFp16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = _mm256_cvtph_ps(Load128(r + i));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i + 4 <= dim; i += 4) {
    const __m128 v = _mm_cvtph_ps(Load64(r + i));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
  AccTail<1>(acc, row, i, dim, scale);
}

void AccBf16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = Bf16ToFloat(Load128(r + i));
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(acc + i)));
  }
  for (; i + 4 <= dim; i += 4) {
    const __m128 v = Bf16ToFloat4(Load64(r + i));
    _mm_storeu_ps(acc + i, _mm_fmadd_ps(_mm256_castps256_ps128(s), v, _mm_loadu_ps(acc + i)));
  }
  AccTail<2>(acc, row, i, dim, scale);
}

void WidenF32(float* out, const void* row, int64_t dim) {
  const float* r = static_cast<const float*>(row);
  int64_t i = 0;
  for (; i + 4 <= dim; i += 4) _mm_storeu_ps(out + i, _mm_loadu_ps(r + i));
  for (; i < dim; ++i) out[i] = r[i];
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
  for (; i + 4 <= dim; i += 4) {
    const __m128i h = Load64(r + i);
    _mm_storeu_ps(out + i, T == 1 ? _mm_cvtph_ps(h) : Bf16ToFloat4(h));
  }
  for (; i < dim; ++i) out[i] = LoadOne<T>(row, i);
}

// Eight columns' noise, columns col .. col + 7 of the row:
// embedding_math.h's ElementNoise: noise_hash.h's Fmix32 of the first
// column's input plus lane * kNoiseColumnStep.
inline __m256i Noise8(uint64_t row_key, int64_t col) {
  const __m256i lanes =
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                         _mm256_set1_epi32(static_cast<int>(kNoiseColumnStep)));
  __m256i x = _mm256_add_epi32(
      _mm256_set1_epi32(static_cast<int>(ElementNoiseInput(row_key, col))), lanes);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kFmix32Mul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kFmix32Mul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// 32-bit lane tests as all-ones masks. The magnitudes (|w|'s bits) are
// below 2^31, so signed comparisons order them as unsigned ones would.
inline __m256i Below(__m256i abs, int32_t bound) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(bound), abs);
}
inline __m256i Above(__m256i abs, int32_t bound) {
  return _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(bound));
}

// Eight 32-bit lanes (each < 2^16) as eight 16-bit values, in order.
inline __m128i Pack16(__m256i h) {
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Half subnormals (2^-25 <= |w| < 2^-14): the kept bits of the mantissa
// and, per lane, whether the dropped ones round up, as embedding_math.h's
// FloatToFp16Stochastic (noise under the dropped bits below them) or
// half.h's FloatToFp16 (above the midpoint, or at it with the kept bits
// odd). The lanes out of that range hold garbage.
template <bool kStochastic>
inline __m256i Fp16Subnormal8(__m256i abs, __m256i noise) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(abs, _mm256_set1_epi32(0x7fffff)),
                                       _mm256_set1_epi32(0x800000));
  const __m256i shift = _mm256_sub_epi32(_mm256_set1_epi32(126), _mm256_srli_epi32(abs, 23));
  const __m256i kept = _mm256_srlv_epi32(mant, shift);
  const __m256i mask = _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one);
  const __m256i rem = _mm256_and_si256(mant, mask);  // < 2^24: signed compares are fine
  __m256i up;
  if (kStochastic) {
    up = _mm256_cmpgt_epi32(rem, _mm256_and_si256(noise, mask));
  } else {
    const __m256i mid = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
    const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(kept, one), one);
    up = _mm256_or_si256(_mm256_cmpgt_epi32(rem, mid),
                         _mm256_and_si256(_mm256_cmpeq_epi32(rem, mid), odd));
  }
  return _mm256_sub_epi32(kept, up);  // up is -1 where it rounds up
}

// Eight lanes of FloatToFp16Stochastic (kStochastic) or FloatToFp16, every
// case in vector form, bit for bit.
template <bool kStochastic>
inline __m128i Fp16Round8(__m256i u, __m256i noise) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
  // Normal halves: rebias 127 -> 15, add below the 13 dropped bits the noise
  // (stochastic) or half their unit less one plus the kept bit's parity
  // (nearest even), shift.
  const __m256i r = _mm256_sub_epi32(abs, _mm256_set1_epi32(0x38000000));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i add =
      kStochastic ? _mm256_and_si256(noise, _mm256_set1_epi32(0x1fff))
                  : _mm256_add_epi32(_mm256_set1_epi32(0xfff),
                                     _mm256_and_si256(_mm256_srli_epi32(r, 13), one));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(r, add), 13);
  h = _mm256_blendv_epi8(h, Fp16Subnormal8<kStochastic>(abs, noise), Below(abs, 0x38800000));
  h = _mm256_andnot_si256(Below(abs, 0x33000000), h);  // under 2^-25: zero
  // Overflow to Inf (stochastic: from 65536; nearest: from 65520, which
  // rounds up to 2^16), Inf itself; NaN: the one quiet NaN.
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7c00),
                         Above(abs, kStochastic ? 0x477fffff : 0x477fefff));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7e00), Above(abs, 0x7f800000));
  return Pack16(_mm256_or_si256(sign, h));
}

// Eight lanes of FloatToBf16Stochastic (kStochastic: add 16 noise bits,
// truncate) or FloatToBf16 (ties to even); NaN quietened. (Inf needs no
// case of its own: its low 16 bits are zero, so nothing added carries.)
template <bool kStochastic>
inline __m128i Bf16Round8(__m256i u, __m256i noise) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i add =
      kStochastic ? _mm256_and_si256(noise, _mm256_set1_epi32(0xffff))
                  : _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                     _mm256_and_si256(high, _mm256_set1_epi32(1)));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, add), 16);
  h = _mm256_blendv_epi8(h, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), Above(abs, 0x7f800000));
  return Pack16(h);
}

// A row of fp16 (T 1) or bf16 (T 2) from fp32, rounded stochastically
// (NarrowFn) or to nearest even (NarrowNearestFn); tails of < 8 columns
// one by one.
template <int T, bool kStochastic>
void Narrow(uint16_t* out, const float* w, int64_t dim, uint64_t row_key, int64_t col_offset) {
  int64_t c = 0;
  for (; c + 8 <= dim; c += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(w + c));
    const __m256i noise = kStochastic ? Noise8(row_key, col_offset + c) : _mm256_setzero_si256();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c),
                     T == 1 ? Fp16Round8<kStochastic>(u, noise)
                            : Bf16Round8<kStochastic>(u, noise));
  }
  if (c == dim) return;
  if (kStochastic) {
    NarrowOneByOne<T>(out + c, w + c, dim - c, row_key, col_offset + c);
  } else {
    NarrowNearestOneByOne<T>(out + c, w + c, dim - c);
  }
}
template <int T>
void NarrowStochastic(void* row, const float* w, int64_t dim, uint64_t row_key,
                      int64_t col_offset) {
  Narrow<T, true>(static_cast<uint16_t*>(row), w, dim, row_key, col_offset);
}
template <int T>
void NarrowNearest(void* row, const float* w, int64_t dim) {
  Narrow<T, false>(static_cast<uint16_t*>(row), w, dim, 0, 0);
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
  static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  // 8 bytes, and 8 nibbles of 4 bytes (low nibble first), as fp32.
  static Reg LoadU8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg LoadU4(const uint8_t* p) {
    int32_t four;
    __builtin_memcpy(&four, p, 4);
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
  }
  static AccumulateFn Accumulate(int type) {
    return type == 1 ? AccFp16 : type == 2 ? AccBf16 : AccF32;
  }
};

#include "server/backend/cpu/cpu_kernels_impl.h"
#include "server/backend/cpu/cpu_kernels_quantized_impl.h"

}  // namespace

const RowKernels kAvx2RowKernels = {
    "avx2",
    {AccF32, AccFp16, AccBf16, AccQuantized<3>, AccQuantized<4>},
    {Pool<0>, Pool<1>, Pool<2>, PoolQuantized<3>, PoolQuantized<4>},
    {WidenF32, Widen16<1>, Widen16<2>, DequantizeRowOf<3>, DequantizeRowOf<4>},
    {nullptr, NarrowStochastic<1>, NarrowStochastic<2>, nullptr, nullptr},
    {nullptr, NarrowNearest<1>, NarrowNearest<2>, QuantizeRowNearest<3>, QuantizeRowNearest<4>}};

}  // namespace backend
}  // namespace ember
