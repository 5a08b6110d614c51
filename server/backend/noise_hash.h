// The constants of the stochastic rounding noise's hash (embedding_math.h's
// ElementNoise): constants only, no functions, so the per-ISA kernel
// translation units (cpu_kernels_avx2.cc, cpu_kernels_avx512.cc) can take
// them without emitting anything inline that the linker could pick for
// other code (cpu_kernel_types.h), and nvcc can compile them as they are.
//
// The noise of column c of a row with key k (64 bits, RowNoiseKey) is
//   Fmix32(uint32(k ^ (k >> 32)) + uint32(c) * kNoiseColumnStep),
// Fmix32 being MurmurHash3's 32-bit finaliser with kFmix32Mul1/2.
#ifndef EMBER_SERVER_BACKEND_NOISE_HASH_H_
#define EMBER_SERVER_BACKEND_NOISE_HASH_H_

#include <cstdint>

namespace ember {
namespace backend {

constexpr uint32_t kNoiseColumnStep = 0x9e3779b9u;  // 2^32 / golden ratio
constexpr uint32_t kFmix32Mul1 = 0x85ebca6bu;
constexpr uint32_t kFmix32Mul2 = 0xc2b2ae35u;

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_NOISE_HASH_H_
