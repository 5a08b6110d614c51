// Function types and tables of the CPU row kernels. Plain C++ with no
// library headers: the per-ISA translation units (compiled with -mavx2 /
// -mavx512f) include it, and nothing inline from a library may be emitted
// there (the linker could pick that wider-ISA copy for every caller).
#ifndef EMBER_SERVER_BACKEND_CPU_CPU_KERNEL_TYPES_H_
#define EMBER_SERVER_BACKEND_CPU_CPU_KERNEL_TYPES_H_

#include <cstdint>

namespace ember {
namespace backend {

// acc[0, dim) += scale * row[0, dim), the row stored as one weight type.
// Any dim >= 0: rows are unaligned and need not be a multiple of 4 columns.
using AccumulateFn = void (*)(float* acc, const void* row, int64_t dim, float scale);

// How far ahead a PoolFn prefetches the rows it will gather, in ids: every
// line of the row `outer` ids ahead towards the outer caches (PREFETCHT2;
// with outer_into_l1, into L1: PREFETCHT0), and the row's first line `l1`
// ids ahead into L1 (PREFETCHT0). 0 turns a stage off.
struct PrefetchAhead {
  int outer = 0;
  int l1 = 0;
  bool outer_into_l1 = false;
};

// One bag: out[0, dim) = out_scale * sum_k weights[k] * row(ids[k]) over
// k < n (weights == nullptr: all 1), rows at table + id * row_bytes.
// Prefetches rows as `prefetch` says, reading ahead past the bag into the
// following bags: ids[0, ids_avail) must be readable, ids_avail >= n. out
// is written, not accumulated; n == 0 writes zeros.
//
// Ids are checked as they are gathered: each read once (a relaxed atomic
// load, which the compiler may not repeat) and compared with `rows`; one
// outside [0, rows) reads row 0 instead and makes the call return false.
// So the kernel never reads outside the table, even when another process
// rewrites the ids during the call (a channel's region). Returns true when
// every id was in range.
using PoolFn = bool (*)(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                        const int64_t* ids, const float* weights, int64_t n, int64_t ids_avail,
                        int64_t dim, float out_scale, PrefetchAhead prefetch);

// One id of a PoolFn, read once and checked: ids[k] when below `rows`,
// else 0 with *bad set.
inline uint64_t CheckedId(const int64_t* ids, int64_t k, uint64_t rows, bool* bad) {
  const uint64_t id = static_cast<uint64_t>(__atomic_load_n(ids + k, __ATOMIC_RELAXED));
  const bool in = id < rows;
  *bad |= !in;
  return in ? id : 0;
}

// out[0, dim) = a row stored as one weight type, as fp32 (exact: fp16 and
// bf16 widen without loss). Any dim >= 0.
using WidenFn = void (*)(float* out, const void* row, int64_t dim);

// A row of fp16 (type 1) or bf16 (type 2) weights from fp32 w[0, dim),
// rounded stochastically: element c as embedding_math.h's
// FloatToFp16Stochastic / FloatToBf16Stochastic with the noise
// ElementNoise(row_key, col_offset + c), bit for bit. Any dim >= 0.
using NarrowFn = void (*)(void* row, const float* w, int64_t dim, uint64_t row_key,
                          int64_t col_offset);

// A row of fp16 (type 1) or bf16 (type 2) weights from fp32 w[0, dim),
// rounded to nearest even: element c as half.h's FloatToFp16 /
// FloatToBf16, bit for bit. Any dim >= 0.
using NarrowNearestFn = void (*)(void* row, const float* w, int64_t dim);

// Indexed by WeightType: fp32, fp16, bf16, INT8, INT4. For the quantized
// types (math/rowwise_quant.h) widen dequantizes, narrow_nearest quantizes
// (both the scalar functions below, on every ISA: the same bits
// everywhere), and there is no stochastic narrowing (they take no
// updates).
inline constexpr int kRowKernelTypes = 5;
struct RowKernels {
  const char* isa;  // "scalar", "avx2", "avx512"
  AccumulateFn accumulate[kRowKernelTypes];
  PoolFn pool[kRowKernelTypes];
  WidenFn widen[kRowKernelTypes];
  NarrowFn narrow_stochastic[kRowKernelTypes];  // fp32's, INT8's and INT4's are null
  NarrowNearestFn narrow_nearest[kRowKernelTypes];  // fp32's is null
};

// Row-wise quantized rows (T 3 INT8, 4 INT4), in scalar code built
// without the wider ISAs (quantized_rows.cc): NarrowNearestFn (FBGEMM's
// quantization), WidenFn (scale * q + bias), AccumulateFn and PoolFn (the
// scalar table's; each bag's bias terms summed apart:
// out = out_scale * (sum_k w_k s_k q_k + sum_k w_k b_k)).
template <int T>
void QuantizeRowNearest(void* row, const float* w, int64_t dim);
template <int T>
void DequantizeRowOf(float* out, const void* row, int64_t dim);
template <int T>
void AccQuantized(float* acc, const void* row, int64_t dim, float scale);
template <int T>
bool PoolQuantizedScalar(float* out, const uint8_t* table, int64_t row_bytes, uint64_t rows,
                         const int64_t* ids, const float* weights, int64_t n, int64_t ids_avail,
                         int64_t dim, float out_scale, PrefetchAhead prefetch);
extern template void QuantizeRowNearest<3>(void*, const float*, int64_t);
extern template void QuantizeRowNearest<4>(void*, const float*, int64_t);
extern template void DequantizeRowOf<3>(float*, const void*, int64_t);
extern template void DequantizeRowOf<4>(float*, const void*, int64_t);
extern template void AccQuantized<3>(float*, const void*, int64_t, float);
extern template void AccQuantized<4>(float*, const void*, int64_t, float);
extern template bool PoolQuantizedScalar<3>(float*, const uint8_t*, int64_t, uint64_t,
                                            const int64_t*, const float*, int64_t, int64_t,
                                            int64_t, float, PrefetchAhead);
extern template bool PoolQuantizedScalar<4>(float*, const uint8_t*, int64_t, uint64_t,
                                            const int64_t*, const float*, int64_t, int64_t,
                                            int64_t, float, PrefetchAhead);

// One element of NarrowFn (type 1 fp16, 2 bf16), compiled without the
// wider ISAs (stochastic_round.cc).
uint16_t StochasticRoundOne(int type, float w, uint64_t row_key, int64_t col);

// NarrowFn element by element through StochasticRoundOne (T 1 fp16, 2
// bf16): the scalar table's narrowing, and the vector tables' tails.
template <int T>
void NarrowOneByOne(void* row, const float* w, int64_t dim, uint64_t row_key, int64_t col_offset);
extern template void NarrowOneByOne<1>(void*, const float*, int64_t, uint64_t, int64_t);
extern template void NarrowOneByOne<2>(void*, const float*, int64_t, uint64_t, int64_t);

// NarrowNearestFn element by element (half.h; stochastic_round.cc): the
// scalar table's rounding to nearest, and the vector tables' tails.
template <int T>
void NarrowNearestOneByOne(void* row, const float* w, int64_t dim);
extern template void NarrowNearestOneByOne<1>(void*, const float*, int64_t);
extern template void NarrowNearestOneByOne<2>(void*, const float*, int64_t);

// Defined in cpu_kernels_avx2.cc / cpu_kernels_avx512.cc; use them only
// where the CPU has the ISA (RowKernelsFor checks). The two AVX-512 tables
// differ only in how the pooling loads 16-bit rows: a 64-byte load widened
// from registers (kAvx512RowKernels, the AMD choice) or each half converted
// from memory (kAvx512IntelRowKernels, chosen on Intel CPUs).
extern const RowKernels kAvx2RowKernels;
extern const RowKernels kAvx512RowKernels;
extern const RowKernels kAvx512IntelRowKernels;

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_CPU_KERNEL_TYPES_H_
