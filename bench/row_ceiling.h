// RowCeiling: the machine's limit for the gathers a lookup does, measured
// on the same pattern as the kernel it is set beside: rows of the same
// width in a table of the same size, allocated the same way (2 MiB aligned,
// transparent huge pages requested, as the CPU backend's shards are), the
// same ids in the same order, the same threads splitting the bags, and the
// same software prefetch. It reads one word of every 64-byte line of each
// row (the memory moves whole lines, so the traffic is the kernel's, with
// no conversion, scaling, pooling or checks), so what it reaches is what
// the memory system gives that pattern; a kernel's figure over it says how close to
// the limit the kernel runs. A benchmark tool, not a test.
//
// Thread-compatible: one caller at a time.
#ifndef EMBER_BENCH_ROW_CEILING_H_
#define EMBER_BENCH_ROW_CEILING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"

namespace ember {
namespace bench {

struct CeilingPrefetch {
  int outer = 0;               // every line this many ids ahead (0: none)
  bool outer_into_l1 = false;  // PREFETCHT0 for them, else PREFETCHT2
  int l1 = 0;                  // the first line this many ids ahead into L1
};

class RowCeiling {
 public:
  // A table of `rows` rows of `row_bytes` bytes (a multiple of 8), from
  // the CPU backend's AllocateTableMemory, every byte written (no page is
  // left to the shared zero page). huge_pages false: 4 KiB pages (to show
  // what the TLB costs).
  RowCeiling(int64_t rows, int64_t row_bytes, bool huge_pages = true);
  ~RowCeiling();

  // Seconds per call of gathering every id set in turn, `iters` calls after
  // 3 warm-up ones, call i on sets[i % sets.size()]. Each set holds bags of
  // `pooling` ids; `threads` threads claim chunks of bags as they come free
  // (the CPU backend's grain), without waiting at the end of each call (a
  // bound, not a schedule); a chunk prefetches past its end, as the
  // backend's do.
  double SecondsPerCall(const std::vector<absl::Span<const int64_t>>& sets, int64_t pooling,
                        int threads, CeilingPrefetch prefetch, int iters);

  // A value that depends on every row gathered, so the loads are kept.
  uint64_t checksum() const { return checksum_; }

 private:
  int64_t row_bytes_;
  uint8_t* table_ = nullptr;
  uint64_t checksum_ = 0;
};

// Bytes of this process's anonymous memory on transparent huge pages now
// (/proc/self/smaps_rollup; -1 where it cannot be read): huge pages are a
// request the kernel may refuse, and a table without them misses the TLB.
int64_t ProcessHugePageBytes();

}  // namespace bench
}  // namespace ember

#endif  // EMBER_BENCH_ROW_CEILING_H_
