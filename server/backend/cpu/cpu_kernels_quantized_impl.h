// ISA-generic pooling of row-wise quantized rows (T 3 INT8, 4 INT4;
// math/rowwise_quant.h). Included after cpu_kernels_impl.h, in the same
// namespace, by cpu_kernels_avx2.cc and cpu_kernels_avx512.cc, whose Ops
// also give
//   Reg LoadU8(const uint8_t*)  (kLanes bytes as fp32),
//   Reg LoadU4(const uint8_t*)  (kLanes nibbles, low nibble first, from kLanes / 2 bytes),
//   Reg Add(Reg, Reg).
// A bag is out_scale * (sum_k (w_k s_k) q_k + sum_k w_k b_k): each row's
// scale times its weight multiplies the values in the registers, and the
// biases, the same for every column, are summed once apart. Only
// <cstdint>/<immintrin.h> here (cpu_kernels_impl.h says why).

// A quantized row's fp16 scale and bias as fp32 (F16C).
inline void QuantHeader(const uint8_t* row, float* scale, float* bias) {
  uint16_t h[2];
  __builtin_memcpy(h, row, sizeof(h));
  *scale = _cvtsh_ss(h[0]);
  *bias = _cvtsh_ss(h[1]);
}

// kLanes values from column col (a multiple of kLanes) of a row's values.
template <int T>
inline typename Ops::Reg LoadQuantized(const uint8_t* values, int64_t col) {
  if constexpr (T == 3) {
    return Ops::LoadU8(values + col);
  } else {
    return Ops::LoadU4(values + col / 2);
  }
}

// Value c of a row's values, as fp32.
template <int T>
inline float QuantizedAt(const uint8_t* values, int64_t c) {
  if constexpr (T == 3) {
    return static_cast<float>(values[c]);
  } else {
    return static_cast<float>((values[c / 2] >> ((c % 2) * 4)) & 0xf);
  }
}

// Columns [col, col + NR * kLanes) of the bag, the NR accumulators in
// registers; every line of the row prefetch.outer ids ahead fetched first.
// Quantized rows are not a whole number of lines (an INT8 row of 32
// columns is 36 bytes), so about half of them straddle two: the line of
// the row's last byte is fetched too (without it, rows from memory ran at
// the speed of no prefetch at all).
template <int T, int NR>
inline bool PoolQuantizedColumns(float* out, const uint8_t* table, int64_t row_bytes,
                                 uint64_t rows, const int64_t* ids, const float* weights,
                                 int64_t n, int64_t ids_avail, int64_t col, float out_scale,
                                 PrefetchAhead prefetch) {
  bool bad = false;
  typename Ops::Reg acc[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) acc[j] = Ops::Zero();
  float bias_sum = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    if (prefetch.outer > 0 && k + prefetch.outer < ids_avail) {
      const char* far = PrefetchAddress(table, row_bytes, rows, ids, k + prefetch.outer);
      for (int64_t line = 0; line < row_bytes; line += 64) {
        if (prefetch.outer_into_l1) {
          PrefetchL1(far + line);
        } else {
          PrefetchOuter(far + line);
        }
      }
      if (prefetch.outer_into_l1) {
        PrefetchL1(far + row_bytes - 1);
      } else {
        PrefetchOuter(far + row_bytes - 1);
      }
    }
    const uint8_t* row = table + CheckedId(ids, k, rows, &bad) * row_bytes;
    float s, b;
    QuantHeader(row, &s, &b);
    const float w = weights == nullptr ? 1.0f : weights[k];
    bias_sum += w * b;
    const typename Ops::Reg ws = Ops::Set1(w * s);
    const uint8_t* values = row + 4;
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      acc[j] = Ops::Fma(ws, LoadQuantized<T>(values, col + j * Ops::kLanes), acc[j]);
    }
  }
  const typename Ops::Reg bias = Ops::Set1(bias_sum), scale = Ops::Set1(out_scale);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    Ops::Store(out + col + j * Ops::kLanes, Ops::Mul(Ops::Add(acc[j], bias), scale));
  }
  return !bad;
}

// PoolFn for quantized rows: blocks of 8, 4, 2 and 1 registers (only the
// first pass over the bag prefetches: it brings the rows in), then the
// last dim % kLanes columns one by one.
template <int T>
bool PoolQuantized(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                   const int64_t* ids, const float* weights, int64_t n, int64_t ids_avail,
                   int64_t dim, float out_scale, PrefetchAhead prefetch) {
  constexpr int L = Ops::kLanes;
  int64_t col = 0;
  bool ok = true;
  for (; col + 8 * L <= dim; col += 8 * L) {
    ok &= PoolQuantizedColumns<T, 8>(out, table, row_bytes, rows, ids, weights, n, ids_avail,
                                     col, out_scale, prefetch);
    prefetch = PrefetchAhead();
  }
  if (col + 4 * L <= dim) {
    ok &= PoolQuantizedColumns<T, 4>(out, table, row_bytes, rows, ids, weights, n, ids_avail,
                                     col, out_scale, prefetch);
    prefetch = PrefetchAhead();
    col += 4 * L;
  }
  if (col + 2 * L <= dim) {
    ok &= PoolQuantizedColumns<T, 2>(out, table, row_bytes, rows, ids, weights, n, ids_avail,
                                     col, out_scale, prefetch);
    prefetch = PrefetchAhead();
    col += 2 * L;
  }
  if (col + L <= dim) {
    ok &= PoolQuantizedColumns<T, 1>(out, table, row_bytes, rows, ids, weights, n, ids_avail,
                                     col, out_scale, prefetch);
    col += L;
  }
  if (col < dim) {
    float tail[Ops::kLanes] = {};
    float bias_sum = 0.0f;
    bool bad = false;
    for (int64_t k = 0; k < n; ++k) {
      const uint8_t* row = table + CheckedId(ids, k, rows, &bad) * row_bytes;
      float s, b;
      QuantHeader(row, &s, &b);
      const float w = weights == nullptr ? 1.0f : weights[k];
      bias_sum += w * b;
      for (int64_t c = col; c < dim; ++c) tail[c - col] += w * s * QuantizedAt<T>(row + 4, c);
    }
    for (int64_t c = col; c < dim; ++c) out[c] = (tail[c - col] + bias_sum) * out_scale;
    ok &= !bad;
  }
  return ok;
}
