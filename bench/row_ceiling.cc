#include "bench/row_ceiling.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/common/host_memory.h"

namespace ember {
namespace bench {
namespace {

// PREFETCHT0 (into L1) or PREFETCHT2 (towards the outer caches), as the
// CPU backend's kernels issue them (asm, so the compiler keeps each one).
inline void PrefetchLine(const uint8_t* p, bool into_l1) {
  if (into_l1) {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  } else {
    asm volatile("prefetcht2 %0" : : "m"(*p));
  }
}

// Ids [begin, end) of one set: reads one word of every 64-byte line of
// every row (the memory moves whole lines, so the traffic is the kernel's;
// the work per line is one load and one add), prefetching ahead across bags
// and past `end` up to `avail` (the set's end) as the CPU backend's kernels
// do. Returns the words' sum.
uint64_t GatherIds(const uint8_t* table, int64_t row_bytes, const int64_t* ids, int64_t begin,
                   int64_t end, int64_t avail, CeilingPrefetch pf) {
  uint64_t sum = 0;
  auto read_row = [&](int64_t k) {
    const uint8_t* row = table + ids[k] * row_bytes;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      sum += *reinterpret_cast<const uint64_t*>(row + line);
    }
  };
  auto prefetch_row = [&](int64_t k) {
    if (pf.l1 > 0) PrefetchLine(table + ids[k + pf.l1] * row_bytes, true);
    const uint8_t* far = table + ids[k + pf.outer] * row_bytes;
    for (int64_t line = 0; line < row_bytes; line += 64) PrefetchLine(far + line, pf.outer_into_l1);
  };
  int64_t k = begin;
  // The ids whose prefetch targets are in range, with no test per id; then
  // the rest (the first line into L1 while that is in range).
  const int64_t ahead = std::max(pf.outer, pf.l1);
  if (pf.outer > 0) {
    for (; k < end && k + ahead < avail; ++k) {
      prefetch_row(k);
      read_row(k);
    }
  }
  for (; k < end; ++k) {
    if (pf.l1 > 0 && k + pf.l1 < avail) PrefetchLine(table + ids[k + pf.l1] * row_bytes, true);
    read_row(k);
  }
  return sum;
}

}  // namespace

RowCeiling::RowCeiling(int64_t rows, int64_t row_bytes, bool huge_pages)
    : row_bytes_(row_bytes) {
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(row_bytes);
  // The CPU backend's own allocation; without huge pages, their request
  // withdrawn before any page is touched.
  table_ = static_cast<uint8_t*>(AllocateTableMemory(bytes));
  if (table_ == nullptr) std::abort();
  if (!huge_pages) madvise(table_, bytes, MADV_NOHUGEPAGE);
  // Every byte written, each row different.
  for (size_t i = 0; i < bytes / 8; ++i) {
    reinterpret_cast<uint64_t*>(table_)[i] = i * 0x9E3779B97F4A7C15ULL;
  }
}

RowCeiling::~RowCeiling() { std::free(table_); }

int64_t ProcessHugePageBytes() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(rollup, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) {
      int64_t kib = 0;
      std::istringstream(line.substr(14)) >> kib;
      return kib * 1024;
    }
  }
  return -1;
}

double RowCeiling::SecondsPerCall(const std::vector<absl::Span<const int64_t>>& sets,
                                  int64_t pooling, int threads, CeilingPrefetch prefetch,
                                  int iters) {
  const int64_t bags = static_cast<int64_t>(sets[0].size()) / pooling;
  // Chunks of bags claimed by whichever thread is free, as the CPU
  // backend's ParallelFor hands them out (same grain).
  const int64_t grain = std::clamp<int64_t>(bags / (2 * threads), 64, 256);
  const int64_t chunks = (bags + grain - 1) / grain;
  // Calls [first, first + count), every thread claiming (call, chunk) items
  // in call order; the wall time from the start to the last item done.
  auto run_calls = [&](int first, int count) {
    std::atomic<int64_t> next{0};
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<uint64_t> sums(threads, 0);
    auto worker = [&](int t) {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      for (int64_t item; (item = next.fetch_add(1)) < count * chunks;) {
        const int call = first + static_cast<int>(item / chunks);
        const int64_t b0 = item % chunks * grain, b1 = std::min(bags, b0 + grain);
        sums[t] += GatherIds(table_, row_bytes_, sets[call % sets.size()].data(), b0 * pooling,
                             b1 * pooling, bags * pooling, prefetch);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
    while (ready.load() < threads - 1) {
    }
    const absl::Time start = absl::Now();
    go.store(true, std::memory_order_release);
    worker(0);
    for (std::thread& th : pool) th.join();
    for (uint64_t v : sums) checksum_ += v;
    return absl::ToDoubleSeconds(absl::Now() - start);
  };
  run_calls(0, 3);
  return run_calls(3, iters) / iters;
}

}  // namespace bench
}  // namespace ember
