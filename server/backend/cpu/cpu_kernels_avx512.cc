// AVX-512 (F/BW/DQ/VL) row kernels (compiled with -mavx512f -mavx512bw
// -mavx512dq -mavx512vl -mavx2 -mfma -mf16c; called only where the CPU has them).
// 16 fp32 lanes; tails of < 16 columns go to the AVX2 kernels.
#include <immintrin.h>

#include "math/noise_hash.h"
#include "server/backend/cpu/cpu_kernel_types.h"

namespace ember {
namespace backend {
namespace {

// 16 bf16 values (the high halves of fp32) as fp32, and the 32-byte load
// of a 16-bit row.
inline __m512 Bf16ToFloat(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256i Load256(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

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
    const __m512 v = _mm512_cvtph_ps(Load256(r + i));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) kAvx2RowKernels.accumulate[1](acc + i, r + i, dim - i, scale);
}

void AccBf16(float* acc, const void* row, int64_t dim, float scale) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512 v = Bf16ToFloat(Load256(r + i));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc + i)));
  }
  if (i < dim) kAvx2RowKernels.accumulate[2](acc + i, r + i, dim - i, scale);
}

void WidenF32(float* out, const void* row, int64_t dim) {
  const float* r = static_cast<const float*>(row);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) _mm512_storeu_ps(out + i, _mm512_loadu_ps(r + i));
  if (i < dim) kAvx2RowKernels.widen[0](out + i, r + i, dim - i);
}

// A 16-bit row (T 1 fp16, 2 bf16) widened to fp32; tails of < 16 columns
// to the AVX2 kernel.
template <int T>
void Widen16(float* out, const void* row, int64_t dim) {
  const uint16_t* r = static_cast<const uint16_t*>(row);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m256i h = Load256(r + i);
    _mm512_storeu_ps(out + i, T == 1 ? _mm512_cvtph_ps(h) : Bf16ToFloat(h));
  }
  if (i < dim) kAvx2RowKernels.widen[T](out + i, r + i, dim - i);
}

// Sixteen columns' noise, columns col .. col + 15 of the row:
// embedding_math.h's ElementNoise: noise_hash.h's Fmix32 of the first
// column's input plus lane * kNoiseColumnStep.
inline __m512i Noise16(uint64_t row_key, int64_t col) {
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(kNoiseColumnStep)));
  __m512i x = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(ElementNoiseInput(row_key, col))), lanes);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kFmix32Mul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kFmix32Mul2)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Sixteen lanes of embedding_math.h's FloatToFp16Stochastic (kStochastic)
// or half.h's FloatToFp16 (to nearest even), every case in vector form and
// integer operations, bit for bit. (A lane handed to the scalar function
// cost a mispredicted branch and a call that spilled the loop's registers,
// and TorchRec's initial weights, uniform within +-1/sqrt(rows), are half
// subnormals for 1 in 16 values of a 1M-row table. VCVTPS2PH would round
// to nearest the same, but keeps a NaN's payload where FloatToFp16 gives
// one quiet NaN.)
template <bool kStochastic>
inline __m256i Fp16Round16(__m512i u, __m512i noise) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000));
  const __m512i one = _mm512_set1_epi32(1);
  // Normal halves: rebias 127 -> 15, add below the 13 dropped bits the
  // noise (stochastic) or half their unit less one plus the kept bit's
  // parity (ties to even), shift (a carry out of the mantissa rounds up).
  const __m512i r = _mm512_sub_epi32(abs, _mm512_set1_epi32(0x38000000));
  const __m512i add =
      kStochastic ? _mm512_and_si512(noise, _mm512_set1_epi32(0x1fff))
                  : _mm512_add_epi32(_mm512_set1_epi32(0xfff),
                                     _mm512_and_si512(_mm512_srli_epi32(r, 13), one));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(r, add), 13);
  // Half subnormals (2^-25 <= |w| < 2^-14): 14 to 24 bits dropped; up when
  // the noise under them is below them (stochastic), or when they are
  // above the midpoint or at it with the kept bits odd (nearest).
  const __m512i mant = _mm512_or_si512(_mm512_and_si512(abs, _mm512_set1_epi32(0x7fffff)),
                                       _mm512_set1_epi32(0x800000));
  const __m512i shift = _mm512_sub_epi32(_mm512_set1_epi32(126), _mm512_srli_epi32(abs, 23));
  const __m512i kept = _mm512_srlv_epi32(mant, shift);
  const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(one, shift), one);
  const __m512i rem = _mm512_and_si512(mant, mask);
  __mmask16 up;
  if (kStochastic) {
    up = _mm512_cmplt_epu32_mask(_mm512_and_si512(noise, mask), rem);
  } else {
    const __m512i mid = _mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one));
    up = _mm512_cmpgt_epu32_mask(rem, mid) |
         (_mm512_cmpeq_epi32_mask(rem, mid) & _mm512_test_epi32_mask(kept, one));
  }
  h = _mm512_mask_mov_epi32(h, _mm512_cmplt_epu32_mask(abs, _mm512_set1_epi32(0x38800000)),
                            _mm512_mask_add_epi32(kept, up, kept, one));
  // Under 2^-25: zero (the sign alone).
  h = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(0x33000000)), h);
  // Overflow to Inf (stochastic: from 65536; nearest: from 65520, which
  // rounds up to 2^16), Inf itself; NaN: the one quiet NaN.
  h = _mm512_mask_mov_epi32(
      h, _mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(kStochastic ? 0x47800000 : 0x477ff000)),
      _mm512_set1_epi32(0x7c00));
  h = _mm512_mask_mov_epi32(h, _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000)),
                            _mm512_set1_epi32(0x7e00));
  return _mm512_cvtepi32_epi16(_mm512_or_si512(sign, h));
}

// Sixteen lanes of FloatToBf16Stochastic (kStochastic: add 16 noise bits,
// truncate) or FloatToBf16 (ties to even); NaN quietened. Inf needs no
// case of its own: its low 16 bits are zero, so nothing added carries.
template <bool kStochastic>
inline __m256i Bf16Round16(__m512i u, __m512i noise) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i add =
      kStochastic ? _mm512_and_si512(noise, _mm512_set1_epi32(0xffff))
                  : _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                     _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, add), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000)),
                            _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(h);
}

// A row of fp16 (T 1) or bf16 (T 2) from fp32, rounded stochastically
// (NarrowFn) or to nearest even (NarrowNearestFn); tails of < 16 columns
// one by one.
template <int T, bool kStochastic>
void Narrow(uint16_t* out, const float* w, int64_t dim, uint64_t row_key, int64_t col_offset) {
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(w + c));
    const __m512i noise =
        kStochastic ? Noise16(row_key, col_offset + c) : _mm512_setzero_si512();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                        T == 1 ? Fp16Round16<kStochastic>(u, noise)
                               : Bf16Round16<kStochastic>(u, noise));
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

// The AVX-512 operations but how 16-bit rows are loaded (paired::Ops,
// from_memory::Ops below).
struct OpsCommon {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  // 32 registers: a bag's 16 accumulators (256 fp32 columns) fit beside
  // the loads' temporaries.
  static constexpr int kMaxAccumulators = 16;
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Set1(float x) { return _mm512_set1_ps(x); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg LoadFp16(const uint16_t* p) { return _mm512_cvtph_ps(Load256(p)); }
  static Reg LoadBf16(const uint16_t* p) { return Bf16ToFloat(Load256(p)); }
  static void LoadFp16Pair(const uint16_t* p, Reg* lo, Reg* hi) {
    const __m512i v = _mm512_loadu_si512(p);
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
  }
  static void LoadBf16Pair(const uint16_t* p, Reg* lo, Reg* hi) {
    const __m512i v = _mm512_loadu_si512(p);
    *lo = Bf16ToFloat(_mm512_castsi512_si256(v));
    *hi = Bf16ToFloat(_mm512_extracti64x4_epi64(v, 1));
  }
  static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static AccumulateFn Accumulate(int type) { return kAvx2RowKernels.accumulate[type]; }
  static Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  // 16 bytes, and 16 nibbles of 8 bytes (low nibble first), as fp32.
  static Reg LoadU8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg LoadU4(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
  }
};

// Two registers' worth (32 columns, one cache line) of a 16-bit row from
// one 64-byte load, widened from registers, rather than two 32-byte
// memory-operand conversions (chosen by measurement on AMD's cores:
// docs/lab-notes/2026-11-benchmarks.md).
namespace paired {
struct Ops : OpsCommon {
  static constexpr bool kPairLoads = true;
};
#include "server/backend/cpu/cpu_kernels_impl.h"
// (Quantized rows have no 16-bit loads to pair: one copy serves both tables.)
#include "server/backend/cpu/cpu_kernels_quantized_impl.h"
}  // namespace paired

// Each 32-byte half converted straight from memory: fewer micro-ops a row,
// chosen by measurement on Intel's cores (docs/lab-notes/2026-11-benchmarks.md).
namespace from_memory {
struct Ops : OpsCommon {
  static constexpr bool kPairLoads = false;
};
#include "server/backend/cpu/cpu_kernels_impl.h"
}  // namespace from_memory

}  // namespace

const RowKernels kAvx512RowKernels = {
    "avx512",
    {AccF32, AccFp16, AccBf16, AccQuantized<3>, AccQuantized<4>},
    {paired::Pool<0>, paired::Pool<1>, paired::Pool<2>, paired::PoolQuantized<3>,
     paired::PoolQuantized<4>},
    {WidenF32, Widen16<1>, Widen16<2>, DequantizeRowOf<3>, DequantizeRowOf<4>},
    {nullptr, NarrowStochastic<1>, NarrowStochastic<2>, nullptr, nullptr},
    {nullptr, NarrowNearest<1>, NarrowNearest<2>, QuantizeRowNearest<3>, QuantizeRowNearest<4>}};

const RowKernels kAvx512IntelRowKernels = {
    "avx512",
    {AccF32, AccFp16, AccBf16, AccQuantized<3>, AccQuantized<4>},
    {from_memory::Pool<0>, from_memory::Pool<1>, from_memory::Pool<2>, paired::PoolQuantized<3>,
     paired::PoolQuantized<4>},
    {WidenF32, Widen16<1>, Widen16<2>, DequantizeRowOf<3>, DequantizeRowOf<4>},
    {nullptr, NarrowStochastic<1>, NarrowStochastic<2>, nullptr, nullptr},
    {nullptr, NarrowNearest<1>, NarrowNearest<2>, QuantizeRowNearest<3>, QuantizeRowNearest<4>}};

}  // namespace backend
}  // namespace ember
