// The stochastic rounding noise's hash (embedding_math.h's ElementNoise): the
// noise of column c of a row with key k (64 bits, RowNoiseKey) is
//   Fmix32(uint32(k ^ (k >> 32)) + uint32(c) * kNoiseColumnStep),
// Fmix32 being MurmurHash3's 32-bit finaliser.
//
// No library headers, and on the host every function has internal linkage
// (static): the per-ISA kernel translation units (cpu_kernels_avx2.cc,
// cpu_kernels_avx512.cc) include it for their vector forms, and no copy of
// a function compiled with a wider ISA may be left for the linker to pick
// for other code (cpu_kernel_types.h). Under nvcc, __host__ __device__.
#ifndef EMBER_MATH_NOISE_HASH_H_
#define EMBER_MATH_NOISE_HASH_H_

#include <cstdint>

#ifdef __CUDACC__
#define EMBER_NOISE_HD __host__ __device__ __forceinline__
#else
#define EMBER_NOISE_HD static inline
#endif

namespace ember {
namespace backend {

constexpr uint32_t kNoiseColumnStep = 0x9e3779b9u;  // 2^32 / golden ratio
constexpr uint32_t kFmix32Mul1 = 0x85ebca6bu;
constexpr uint32_t kFmix32Mul2 = 0xc2b2ae35u;

// What column `col`'s noise hashes: the row key's halves folded, plus the
// column times kNoiseColumnStep, so consecutive columns are far apart. The
// vector kernels add lane * kNoiseColumnStep to the first column's for 8
// or 16 columns at once.
EMBER_NOISE_HD uint32_t ElementNoiseInput(uint64_t row_key, int64_t col) {
  return static_cast<uint32_t>(row_key ^ (row_key >> 32)) +
         static_cast<uint32_t>(col) * kNoiseColumnStep;
}

// MurmurHash3's 32-bit finaliser (fmix32): a bijection whose every output
// bit depends on every input bit.
EMBER_NOISE_HD uint32_t Fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= kFmix32Mul1;
  x ^= x >> 13;
  x *= kFmix32Mul2;
  return x ^ (x >> 16);
}

}  // namespace backend
}  // namespace ember

#undef EMBER_NOISE_HD

#endif  // EMBER_MATH_NOISE_HASH_H_
