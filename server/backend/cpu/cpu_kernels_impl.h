// ISA-generic bodies of the CPU row kernels. Included, inside a namespace of
// its own, by cpu_kernels_avx2.cc and cpu_kernels_avx512.cc, each compiled
// with its ISA's flags, after defining `struct Ops`:
//   using Reg;  static constexpr int kLanes;
//   Reg Zero(); Reg Set1(float); Reg Mul(Reg, Reg); Reg Fma(Reg a, Reg b, Reg c) (a*b+c);
//   Reg Load(const float*); Reg LoadFp16(const uint16_t*); Reg LoadBf16(const uint16_t*);
//   static constexpr bool kPairLoads; with it true, also
//   void LoadFp16Pair / LoadBf16Pair(const uint16_t*, Reg* lo, Reg* hi)  (2 * kLanes columns);
//   void Store(float*, Reg);
//   AccumulateFn Accumulate(int type)  (memory-accumulator kernel for column tails)
// Only <cstdint>/<immintrin.h> may be used here: anything instantiated in
// these translation units is compiled for the wider ISA.

// Loads kLanes columns of a row stored as weight type T, as fp32.
template <int T>
inline typename Ops::Reg LoadRow(const uint8_t* row, int64_t col) {
  if (T == 1) return Ops::LoadFp16(reinterpret_cast<const uint16_t*>(row) + col);
  if (T == 2) return Ops::LoadBf16(reinterpret_cast<const uint16_t*>(row) + col);
  return Ops::Load(reinterpret_cast<const float*>(row) + col);
}

// Loads 2 * kLanes columns into *lo and *hi: one paired load where the ISA
// has it (Ops::kPairLoads), else two LoadRow's. (O is Ops, a template
// parameter so that the branch not taken is never compiled.)
template <int T, typename O = Ops>
inline void LoadRowPair(const uint8_t* row, int64_t col, typename O::Reg* lo,
                        typename O::Reg* hi) {
  if constexpr (O::kPairLoads && T == 1) {
    O::LoadFp16Pair(reinterpret_cast<const uint16_t*>(row) + col, lo, hi);
  } else if constexpr (O::kPairLoads && T == 2) {
    O::LoadBf16Pair(reinterpret_cast<const uint16_t*>(row) + col, lo, hi);
  } else {
    *lo = LoadRow<T>(row, col);
    *hi = LoadRow<T>(row, col + O::kLanes);
  }
}

// Where the row of ids[k] starts, for a prefetch: the id read once and,
// out of range, taken as row 0 (CheckedId's rule), so that the rows
// prefetched are the table's whatever the ids hold.
inline const char* PrefetchAddress(const uint8_t* table, int64_t row_bytes, uint64_t rows,
                                   const int64_t* ids, int64_t k) {
  bool ignored = false;
  return reinterpret_cast<const char*>(table + CheckedId(ids, k, rows, &ignored) * row_bytes);
}

// A line towards the outer caches (PREFETCHT2), or into L1 (PREFETCHT0).
// Asm statements the compiler keeps, in order: with _mm_prefetch GCC issued
// an unrolled row's lines out of order (the last two first), and may drop
// them altogether.
inline void PrefetchOuter(const char* p) { asm volatile("prefetcht2 %0" : : "m"(*p)); }
inline void PrefetchL1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

// Every line of a kBytes-byte row at p, in order, each at a constant
// offset from the one register holding p (PREFETCHT0 with kIntoL1, else
// PREFETCHT2). Lines at offsets the compiler computed itself took a
// register each, and the loop around them spilled its own.
template <bool kIntoL1, int64_t kBytes, int64_t kOffset = 0>
inline void PrefetchRowLines(const char* p) {
  if constexpr (kOffset < kBytes) {
    if constexpr (kIntoL1) {
      asm volatile("prefetcht0 %c1(%0)" : : "r"(p), "i"(kOffset));
    } else {
      asm volatile("prefetcht2 %c1(%0)" : : "r"(p), "i"(kOffset));
    }
    PrefetchRowLines<kIntoL1, kBytes, kOffset + 64>(p);
  }
}

// A compile-time flag for a generic lambda's argument.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};

// Pools columns [col, col + NR * kLanes) of the bag into out, keeping the
// NR accumulators in registers across the bag's rows.
// Ids are read once each and checked (CheckedId); returns false if one
// was out of range. kWeighted: weights[k] scale the rows (else all 1).
// kWholeRow: the row is exactly this block (row_bytes == its bytes, the
// usual case), so the row stride is a constant (a shift, not a multiply)
// and its lines are prefetched unrolled.
template <int T, int NR, bool kWeighted, bool kWholeRow>
inline bool PoolColumns(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                        const int64_t* ids, const float* weights, int64_t n, int64_t ids_avail,
                        int64_t col, float out_scale, PrefetchAhead prefetch) {
  bool bad = false;
  // The j loops are unrolled so that acc[] lives in registers: GCC's -O2
  // keeps it on the stack otherwise, a load and a store around every FMA
  // (docs/lab-notes/2026-11-benchmarks.md).
  typename Ops::Reg acc[NR];
  constexpr int64_t kBlockBytes = NR * Ops::kLanes * (T == 0 ? 4 : 2);
  const int64_t stride = kWholeRow ? kBlockBytes : row_bytes;
  const uint8_t* cols = table + col * (T == 0 ? 4 : 2);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) acc[j] = Ops::Zero();
  // One id: its row's columns added in (their loads at constant offsets
  // from the row, which leaves the compiler its registers).
  auto add_row = [&](int64_t k) {
    const uint8_t* row = cols + CheckedId(ids, k, rows, &bad) * stride;
    const typename Ops::Reg s = Ops::Set1(kWeighted ? weights[k] : 1.0f);
    if constexpr (NR % 2 == 0) {
#pragma GCC unroll 16
      for (int j = 0; j < NR; j += 2) {
        typename Ops::Reg lo, hi;
        LoadRowPair<T>(row, j * Ops::kLanes, &lo, &hi);
        acc[j] = Ops::Fma(s, lo, acc[j]);
        acc[j + 1] = Ops::Fma(s, hi, acc[j + 1]);
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[j] = Ops::Fma(s, LoadRow<T>(row, j * Ops::kLanes), acc[j]);
    }
  };
  // First the ids whose prefetch target (prefetch.outer ahead) is among the
  // ids available, with no test of that per id; then the rest without. Each
  // prefetches the row's first line into L1 (a stage Intel's cores do
  // better without), and every line of a row further ahead towards the
  // outer caches, or into L1 for calls that stay in the caches
  // (docs/lab-notes/2026-11-benchmarks.md).
  int64_t k = 0;
  auto with_prefetch = [&](int64_t with, auto into_l1) {
    for (; k < with; ++k) {
      if (prefetch.l1 > 0 && k + prefetch.l1 < ids_avail) {
        _mm_prefetch(PrefetchAddress(table, stride, rows, ids, k + prefetch.l1), _MM_HINT_T0);
      }
      const char* far = PrefetchAddress(table, stride, rows, ids, k + prefetch.outer);
      constexpr bool kIntoL1 = decltype(into_l1)::value;
      if constexpr (kWholeRow) {
        PrefetchRowLines<kIntoL1, kBlockBytes>(far);
      } else {
        for (int64_t line = 0; line < row_bytes; line += 64) {
          if constexpr (kIntoL1) {
            PrefetchL1(far + line);
          } else {
            PrefetchOuter(far + line);
          }
        }
      }
      add_row(k);
    }
  };
  if (prefetch.outer > 0) {
    const int64_t last = ids_avail - prefetch.outer;  // ids before it prefetch
    const int64_t with = last < 0 ? 0 : (last < n ? last : n);
    if (prefetch.outer_into_l1) {
      with_prefetch(with, Flag<true>());
    } else {
      with_prefetch(with, Flag<false>());
    }
  }
  for (; k < n; ++k) {
    if (prefetch.l1 > 0 && k + prefetch.l1 < ids_avail) {
      _mm_prefetch(PrefetchAddress(table, stride, rows, ids, k + prefetch.l1), _MM_HINT_T0);
    }
    add_row(k);
  }
  const typename Ops::Reg scale = Ops::Set1(out_scale);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) Ops::Store(out + col + j * Ops::kLanes, Ops::Mul(acc[j], scale));
  return !bad;
}

// PoolColumns for the block of NR registers at col, its template
// arguments chosen at run time.
template <int T, int NR>
inline bool PoolBlock(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                      const int64_t* ids, const float* weights, int64_t n, int64_t ids_avail,
                      int64_t col, float out_scale, PrefetchAhead prefetch) {
  constexpr int64_t kBlockBytes = NR * Ops::kLanes * (T == 0 ? 4 : 2);
  if (row_bytes == kBlockBytes) {
    return weights == nullptr
               ? PoolColumns<T, NR, false, true>(out, table, row_bytes, rows, ids, weights, n,
                                                 ids_avail, col, out_scale, prefetch)
               : PoolColumns<T, NR, true, true>(out, table, row_bytes, rows, ids, weights, n,
                                                ids_avail, col, out_scale, prefetch);
  }
  return weights == nullptr
             ? PoolColumns<T, NR, false, false>(out, table, row_bytes, rows, ids, weights, n,
                                                ids_avail, col, out_scale, prefetch)
             : PoolColumns<T, NR, true, false>(out, table, row_bytes, rows, ids, weights, n,
                                               ids_avail, col, out_scale, prefetch);
}

// out[0, dim) = out_scale * sum_k w_k * row(ids[k]); blocks of 16 registers
// (where the ISA has 32: 256 columns in one pass over the bag, +8-10% on
// fp32 rows of 1 KiB, docs/lab-notes/2026-11-benchmarks.md), 8, 4, 2, 1, then a
// memory-accumulated tail of < kLanes columns.
template <int T>
bool Pool(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows, const int64_t* ids,
          const float* weights, int64_t n, int64_t ids_avail, int64_t dim, float out_scale,
          PrefetchAhead prefetch) {
  int64_t col = 0;
  bool ok = true;
  constexpr int L = Ops::kLanes;
  if constexpr (Ops::kMaxAccumulators >= 16) {
    for (; col + 16 * L <= dim; col += 16 * L) {
      ok &= PoolBlock<T, 16>(out, table, row_bytes, rows, ids, weights, n, ids_avail, col,
                               out_scale, prefetch);
      prefetch = PrefetchAhead();
    }
  }
  for (; col + 8 * L <= dim; col += 8 * L) {
    ok &= PoolBlock<T, 8>(out, table, row_bytes, rows, ids, weights, n, ids_avail, col,
                            out_scale, prefetch);
    prefetch = PrefetchAhead();  // the first pass brought the rows in
  }
  if (col + 4 * L <= dim) {
    ok &= PoolBlock<T, 4>(out, table, row_bytes, rows, ids, weights, n, ids_avail, col,
                            out_scale, prefetch);
    prefetch = PrefetchAhead();
    col += 4 * L;
  }
  if (col + 2 * L <= dim) {
    ok &= PoolBlock<T, 2>(out, table, row_bytes, rows, ids, weights, n, ids_avail, col,
                            out_scale, prefetch);
    prefetch = PrefetchAhead();
    col += 2 * L;
  }
  if (col + L <= dim) {
    ok &= PoolBlock<T, 1>(out, table, row_bytes, rows, ids, weights, n, ids_avail, col,
                            out_scale, prefetch);
    col += L;
  }
  if (col < dim) {
    const int elem = T == 0 ? 4 : 2;
    float* tail = out + col;
    bool bad = false;
    for (int64_t c = 0; c < dim - col; ++c) tail[c] = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      Ops::Accumulate(T)(tail, table + CheckedId(ids, k, rows, &bad) * row_bytes + col * elem,
                         dim - col, weights == nullptr ? 1.0f : weights[k]);
    }
    for (int64_t c = 0; c < dim - col; ++c) tail[c] *= out_scale;
    ok &= !bad;
  }
  return ok;
}
