// Row-wise quantized weights (data types INT8 and INT4): FBGEMM's fused
// n-bit rows, laid out as its inference TBE lays them out. A row is
//
//   [fp16 scale][fp16 bias][values: dim of `bits` bits each]
//
// element c being scale * q[c] + bias, q[c] in [0, 2^bits). INT4 packs two
// values a byte, the even column in the low nibble. A row describes itself,
// so a row is read, copied or moved with nothing beside it.
//
// Quantization (QuantizeRow) is FBGEMM's
// FloatToFusedNBitRowwiseQuantizedSBHalf, bit for bit
// (python/tests/test_quantized.py compares them): the bias is the row's
// minimum rounded to fp16; the scale is (max - bias) / (2^bits - 1) rounded
// to fp16 (1 for a row whose values are all equal, or where that scale
// underflows or its inverse overflows); each value is
// round-to-nearest-even((w - bias) * (1 / scale)), clamped to the range.
// An element's error is at most half a step (scale / 2), plus, near the
// top of the row where values clamp, 2^bits - 1 times the scale's fp16
// rounding error (relative 2^-11, more for scales among fp16's subnormals,
// below 2^-14), plus the bias's fp16 rounding. FBGEMM's quantization of a
// dequantized row (an export and an import: checkpoints, moves) changes
// about 0.5% of rows; QuantizeRowKeeping, which the backends use, gives
// their values back exactly (rowwise_quant_test).
//
// Thread-safe: pure functions. Host code only (the row kernels load rows
// with their own instructions; cpu_kernel_types.h says why).
#ifndef EMBER_MATH_ROWWISE_QUANT_H_
#define EMBER_MATH_ROWWISE_QUANT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "math/half.h"

namespace ember {
namespace backend {
namespace math {

// Bytes before a row's values: its fp16 scale and bias.
inline constexpr int64_t kQuantHeaderBytes = 4;

// Bytes of a row of `dim` values of `bits` (8 or 4) bits.
inline int64_t QuantizedRowBytes(int bits, int64_t dim) {
  return kQuantHeaderBytes + (dim * bits + 7) / 8;
}

// The row's scale and bias, as fp32 (exact).
inline void QuantScaleBias(const uint8_t* row, float* scale, float* bias) {
  uint16_t h[2];
  std::memcpy(h, row, sizeof(h));
  *scale = Fp16ToFloat(h[0]);
  *bias = Fp16ToFloat(h[1]);
}

// q[c] of a row.
inline uint32_t QuantValue(int bits, const uint8_t* row, int64_t c) {
  const uint8_t* v = row + kQuantHeaderBytes;
  if (bits == 8) return v[c];
  return (v[c / 2] >> ((c % 2) * 4)) & 0xfu;
}

namespace internal {

inline void MinMax(const float* w, int64_t dim, float* lo, float* hi) {
  *lo = *hi = dim > 0 ? w[0] : 0.0f;
  for (int64_t c = 1; c < dim; ++c) {
    *lo = w[c] < *lo ? w[c] : *lo;
    *hi = w[c] > *hi ? w[c] : *hi;
  }
}

// FBGEMM's scale and bias for values in [lo, hi] (the file's comment).
inline void FbgemmScaleBias(int bits, float lo, float hi, float* scale, float* bias) {
  *bias = Fp16ToFloat(FloatToFp16(lo));
  const float range = hi - *bias;
  const float top = static_cast<float>((1 << bits) - 1);
  *scale = Fp16ToFloat(FloatToFp16(range == 0.0f ? 1.0f : range / top));
  if (*scale == 0.0f || std::isinf(1.0f / *scale)) *scale = 1.0f;
}

// A value's q: round-to-nearest-even((w - bias) * inverse), clamped to
// [0, top]. To nearest even as lrintf in the default rounding mode: adding
// and taking away 1.5 * 2^23 leaves no fraction bits (|x| < 2^22 here: x is
// at most about 2^bits; a call of nearbyint per value ran at a third of the
// speed, as the baseline x86-64 has no ROUNDSS).
inline float QuantOf(float w, float bias, float inverse, float top) {
  const float x = (w - bias) * inverse;
  const float r = (x + 0x1.8p23f) - 0x1.8p23f;
  return r < 0.0f ? 0.0f : r > top ? top : r;
}

// `row` with the given scale and bias (fp16 values), each value QuantOf.
inline void WriteQuantized(int bits, const float* w, int64_t dim, float scale, float bias,
                           uint8_t* row) {
  const uint16_t h[2] = {FloatToFp16(scale), FloatToFp16(bias)};
  std::memcpy(row, h, sizeof(h));
  uint8_t* v = row + kQuantHeaderBytes;
  if (bits == 4) std::memset(v, 0, static_cast<size_t>((dim + 1) / 2));
  const float top = static_cast<float>((1 << bits) - 1), inverse = 1.0f / scale;
  for (int64_t c = 0; c < dim; ++c) {
    const uint32_t q = static_cast<uint32_t>(QuantOf(w[c], bias, inverse, top));
    if (bits == 8) {
      v[c] = static_cast<uint8_t>(q);
    } else {
      v[c / 2] = static_cast<uint8_t>(v[c / 2] | (q << ((c % 2) * 4)));
    }
  }
}

// Whether the row WriteQuantized would write with this scale and bias
// dequantizes to w[0, dim) exactly (DequantizeRow's formula).
inline bool Reproduces(int bits, const float* w, int64_t dim, float scale, float bias) {
  const float top = static_cast<float>((1 << bits) - 1), inverse = 1.0f / scale;
  for (int64_t c = 0; c < dim; ++c) {
    if (scale * QuantOf(w[c], bias, inverse, top) + bias != w[c]) return false;
  }
  return true;
}

}  // namespace internal

// w[0, dim) (finite) into `row` (QuantizedRowBytes(bits, dim) bytes):
// FBGEMM's quantization.
inline void QuantizeRow(int bits, const float* w, int64_t dim, uint8_t* row) {
  float lo, hi, scale, bias;
  internal::MinMax(w, dim, &lo, &hi);
  internal::FbgemmScaleBias(bits, lo, hi, &scale, &bias);
  internal::WriteQuantized(bits, w, dim, scale, bias, row);
}

// QuantizeRow, except for values that are already a quantized row's (an
// export of one: a checkpoint, a move): that row's scale and bias again,
// so that such a round trip changes no value. FBGEMM's quantization of them
// can differ: for about 0.5% of rows the fp16 scale it computes from the
// dequantized values is a neighbour of the row's own, and where the scale
// is far below the bias's fp16 step the smallest value is not the bias.
// So when FBGEMM's row does not reproduce the values, biases at and beside
// the fp16 value of their minimum and scales at and beside the fp16 value
// of (max - bias) / q_max (q_max the top value or up to 3 below) are tried,
// and the first pair that reproduces every value is kept. Fresh fp32
// values fail each try at their first or second value, so they cost little
// more than FBGEMM's quantization.
inline void QuantizeRowKeeping(int bits, const float* w, int64_t dim, uint8_t* row) {
  float lo, hi, scale, bias;
  internal::MinMax(w, dim, &lo, &hi);
  internal::FbgemmScaleBias(bits, lo, hi, &scale, &bias);
  if (dim > 0 && !internal::Reproduces(bits, w, dim, scale, bias)) {
    const int32_t top = (1 << bits) - 1;
    const uint16_t lo_h = FloatToFp16(lo);
    for (int db = -1; db <= 1; ++db) {
      const float b = Fp16ToFloat(static_cast<uint16_t>(lo_h + db));
      if (!(b <= lo) || std::isinf(b)) continue;
      for (int32_t q_max = top; q_max >= top - 3 && q_max > 0; --q_max) {
        const uint16_t near = FloatToFp16((hi - b) / static_cast<float>(q_max));
        for (int ds = -2; ds <= 2; ++ds) {
          const float s = Fp16ToFloat(static_cast<uint16_t>(near + ds));
          if (!(s > 0.0f) || std::isinf(s) || std::isinf(1.0f / s)) continue;
          if (internal::Reproduces(bits, w, dim, s, b)) {
            internal::WriteQuantized(bits, w, dim, s, b, row);
            return;
          }
        }
      }
    }
  }
  internal::WriteQuantized(bits, w, dim, scale, bias, row);
}

// out[0, dim) = scale * q[c] + bias: a product, then a sum (callers build
// with -ffp-contract=off, or for a CPU without FMA, so that every build
// gives the same bits).
inline void DequantizeRow(int bits, const uint8_t* row, int64_t dim, float* out) {
  float scale, bias;
  QuantScaleBias(row, &scale, &bias);
  for (int64_t c = 0; c < dim; ++c) {
    out[c] = scale * static_cast<float>(QuantValue(bits, row, c)) + bias;
  }
}

}  // namespace math
}  // namespace backend
}  // namespace ember

#endif  // EMBER_MATH_ROWWISE_QUANT_H_
