// Row kernels of the CPU backend, vectorised per instruction set and chosen
// at run time, so one binary runs on any x86-64 CPU.
//
// Thread-safe: pure functions; Select* return references to constants.
#ifndef EMBER_SERVER_BACKEND_CPU_KERNELS_H_
#define EMBER_SERVER_BACKEND_CPU_KERNELS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

// acc[0, dim) += scale * row[0, dim), the row stored as one weight type.
// dim is a multiple of 4.
using AccumulateFn = void (*)(float* acc, const void* row, int64_t dim, float scale);

struct RowKernels {
  const char* isa;         // "scalar", "avx2", "avx512"
  AccumulateFn accumulate[3];  // indexed by WeightType
};

// The best kernels this CPU supports.
const RowKernels& BestRowKernels();

// Kernels for a named ISA ("auto", "scalar", "avx2", "avx512");
// FAILED_PRECONDITION if this CPU lacks it, INVALID_ARGUMENT if unknown.
absl::StatusOr<const RowKernels*> RowKernelsFor(const std::string& isa);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_KERNELS_H_
