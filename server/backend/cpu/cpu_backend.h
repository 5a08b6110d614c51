// CpuBackend: embedding shards in host memory, vectorised row kernels
// (AVX2 / AVX-512 chosen at run time) and a thread pool over bags.
//
// Thread-safe: every public call takes an internal mutex, so calls are
// serialised; each call spreads its work over the pool's threads.
#ifndef EMBER_SERVER_BACKEND_CPU_CPU_BACKEND_H_
#define EMBER_SERVER_BACKEND_CPU_CPU_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/cpu/cpu_kernel_types.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct CpuBackendOptions {
  // Threads per call, the caller included (>= 1).
  int num_threads = 1;
  // Instruction set for the row kernels: "auto", "scalar", "avx2", "avx512".
  std::string isa = "auto";
  // Ids ahead whose row a lookup prefetches while gathering (0: none):
  // every line of the row this far ahead to the outer caches and, in the
  // two-stage style, its first line half as far (at most 16) into L1.
  // kPrefetchByRow (the default): chosen per shard by its row's bytes and
  // its size (LookupPrefetchFor).
  static constexpr int kPrefetchByRow = -1;
  int prefetch_distance = kPrefetchByRow;
  // How lookups prefetch: "auto" (by the CPU: DefaultPrefetchStyle),
  // "outer", "two_stage" or "l1" (PrefetchStyle).
  std::string prefetch_style = "auto";
  // Rows ahead an update prefetches the rows (and optimizer state) it
  // writes: their first lines this far ahead into L1, every line twice as
  // far to the outer caches; there 4-8 was best and 16 halved the rate.
  int update_prefetch_distance = 4;
  // Upper bound on the bytes of weights + optimizer state held; 0: none.
  // CreateShard beyond it fails with RESOURCE_EXHAUSTED.
  int64_t memory_limit_bytes = 0;
  // An update row that would overflow (overflow_guard.h) is left as it was
  // and counted, and the rest of the call applies; false: the call is
  // refused whole.
  bool skip_overflow = false;
};

// How lookups prefetch the rows they gather.
enum class PrefetchStyle {
  // Every line of a row to the outer caches (L2), nothing into L1: chosen
  // on Intel's cores, which gathered faster without the L1 stage
  // (docs/lab-notes/2026-11-benchmarks.md).
  kOuterOnly,
  // kOuterOnly and, half as far ahead (at most 16 ids), the row's first
  // line into L1. Tuned on the AMD EPYC (Zen 4) VM of docs/lab-notes/2026-11-benchmarks.md.
  kTwoStage,
  // Every line of a row into L1 (FBGEMM's CPU kernels' way, 16 ids ahead).
  // kOuterOnly chooses it for small shards of narrow rows.
  kIntoL1,
};

// kOuterOnly on Intel CPUs, kTwoStage on the others (measured on AMD's).
PrefetchStyle DefaultPrefetchStyle();

// "auto", "outer", "two_stage", "l1"; INVALID_ARGUMENT for anything else.
absl::StatusOr<PrefetchStyle> ParsePrefetchStyle(const std::string& name);

// The lookups' prefetch for a shard of `rows` rows of `row_bytes` bytes.
// kOuterOnly: every line 64 ids ahead. kTwoStage: the narrower the row,
// the less each id takes to gather, and the further ahead a prefetch must
// go to land in time: every line 64 ids ahead for rows of up to 128 bytes,
// 32 up to 256, 24 beyond; the first line half as far, at most 16, into
// L1. Both: 24 ahead for a shard of at most 4 MiB, which may stay in the
// caches (alone, such a shard gathers fastest with no prefetch at all, but
// many of them read in one call do not stay there:
// docs/lab-notes/2026-11-benchmarks.md). kOuterOnly, before that: rows of at most 512
// bytes, in a call whose shards total at most kIntoL1CallBytes
// (`call_bytes`, this shard's included), have every line 16 ids ahead
// into L1 (faster where the call's rows fit the caches, slower where they
// do not). kIntoL1: every
// line 16 ahead into L1.
constexpr int64_t kIntoL1CallBytes = int64_t{6} << 20;
PrefetchAhead LookupPrefetchFor(PrefetchStyle style, int64_t row_bytes, int64_t rows,
                                int64_t call_bytes);

// The lookups' prefetch for a fixed distance (CpuBackendOptions::
// prefetch_distance >= 0) in a style.
PrefetchAhead FixedPrefetch(PrefetchStyle style, int distance);

// What a shard's lookups prefetch under CpuBackendOptions::prefetch_distance
// (kPrefetchByRow: LookupPrefetchFor; else FixedPrefetch) and a resolved
// style: the backend's own choice, for callers that report it.
PrefetchAhead ShardLookupPrefetch(int prefetch_distance, PrefetchStyle style, int64_t row_bytes,
                                  int64_t rows, int64_t call_bytes);

// INVALID_ARGUMENT / FAILED_PRECONDITION for bad options (unknown or
// unsupported ISA or prefetch style, num_threads < 1, negative distances).
absl::StatusOr<std::unique_ptr<EmbeddingBackend>> CreateCpuBackend(
    const CpuBackendOptions& options);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_CPU_BACKEND_H_
