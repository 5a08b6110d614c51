// Row kernels of the CPU backend, vectorised per instruction set and chosen
// at run time, so one binary runs on any x86-64 CPU. The kernel types are in
// cpu_kernel_types.h; the AVX2 and AVX-512 bodies in cpu_kernels_avx2.cc and
// cpu_kernels_avx512.cc (each built with its ISA's flags).
//
// Thread-safe: pure functions; the lookups return pointers to constants.
#ifndef EMBER_SERVER_BACKEND_CPU_CPU_KERNELS_H_
#define EMBER_SERVER_BACKEND_CPU_CPU_KERNELS_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/backend/cpu/cpu_kernel_types.h"

namespace ember {
namespace backend {

// The best kernels this CPU supports.
const RowKernels& BestRowKernels();

// Whether this CPU is Intel's (CPUID vendor "GenuineIntel"): the prefetch
// that suits its caches differs from AMD's (cpu_backend.h, PrefetchStyle).
bool CpuIsIntel();

// Kernels for a named ISA ("auto", "scalar", "avx2", "avx512");
// FAILED_PRECONDITION if this CPU lacks it, INVALID_ARGUMENT if unknown.
absl::StatusOr<const RowKernels*> RowKernelsFor(const std::string& isa);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_CPU_KERNELS_H_
