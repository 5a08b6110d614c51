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
  // Ids ahead whose row a lookup prefetches while gathering (0: none):
  // every line of the row twice as far ahead goes to the outer caches, its
  // first line this far ahead (at most 16) into L1. kPrefetchByRow (the
  // default): chosen per shard by its row's bytes and its size
  // (LookupPrefetchDistance).
  static constexpr int kPrefetchByRow = -1;
  int prefetch_distance = kPrefetchByRow;
  // The same for the rows (and optimizer state) an update writes; there
  // 4-8 was best and 16 halved the rate.
  int update_prefetch_distance = 4;
  // Upper bound on the bytes of weights + optimizer state held; 0: none.
  // CreateShard beyond it fails with RESOURCE_EXHAUSTED.
  int64_t memory_limit_bytes = 0;
};

// The lookups' prefetch distance for a shard of `rows` rows of `row_bytes`
// bytes. The narrower the row, the less each id takes to gather, and the
// more ids ahead a prefetch must be issued to land in time: 32 ids for rows
// of up to 128 bytes, 16 up to 256, 12 beyond (4-12 had been tuned on
// 256-byte rows). A shard of at most 4 MiB stays in the caches, where a
// short distance is best: 12. Measured on the 2-core AMD EPYC VM of
// docs/benchmarks.md.
int LookupPrefetchDistance(int64_t row_bytes, int64_t rows);

// INVALID_ARGUMENT / FAILED_PRECONDITION for bad options (unknown or
// unsupported ISA, num_threads < 1).
absl::StatusOr<std::unique_ptr<EmbeddingBackend>> CreateCpuBackend(
    const CpuBackendOptions& options);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_BACKEND_H_
