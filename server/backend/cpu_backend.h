// CpuBackend: embedding shards in host memory, vectorised row kernels
// (AVX2 / AVX-512 chosen at run time) and a thread pool over bags.
//
// Thread-safe: every public call takes an internal mutex, so calls are
// serialised; each call spreads its work over the pool's threads.
#ifndef EMBER_SERVER_BACKEND_CPU_BACKEND_H_
#define EMBER_SERVER_BACKEND_CPU_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct CpuBackendOptions {
  // Threads per call, the caller included (>= 1).
  int num_threads = 1;
  // Instruction set for the row kernels: "auto", "scalar", "avx2", "avx512".
  std::string isa = "auto";
  // Rows ahead to prefetch while gathering (0 disables prefetching). 4 was
  // best on the 2-core Xeon VM of docs/benchmarks.md at dim 64 and 128.
  int prefetch_distance = 4;
  // Upper bound on the bytes of weights + optimizer state held; 0: none.
  // CreateShard beyond it fails with RESOURCE_EXHAUSTED.
  int64_t memory_limit_bytes = 0;
};

// INVALID_ARGUMENT / FAILED_PRECONDITION for bad options (unknown or
// unsupported ISA, num_threads < 1).
absl::StatusOr<std::unique_ptr<EmbeddingBackend>> CreateCpuBackend(
    const CpuBackendOptions& options);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_BACKEND_H_
