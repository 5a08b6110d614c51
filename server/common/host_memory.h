// How much host memory this process may really use: the tighter of the
// memory cgroup's limit (v2 memory.max or v1 memory.limit_in_bytes of the
// process's own cgroup, where there is one) and the kernel's MemAvailable.
// A CPU worker advertises (and enforces) a share of this by default, so the
// planner never places more on it than the machine can hold.
//
// Thread-safe: pure functions and reads of /proc and /sys.
#ifndef EMBER_SERVER_COMMON_HOST_MEMORY_H_
#define EMBER_SERVER_COMMON_HOST_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace ember {

// Bytes from the texts of /proc/meminfo and of the cgroup limit files
// ("" where absent; "max" or a huge value means no limit). 0 if nothing
// could be read.
int64_t HostMemoryBytesFrom(const std::string& meminfo, const std::string& cgroup_v2_max,
                            const std::string& cgroup_v1_limit);

// The same, read from this machine.
int64_t HostMemoryBytes();

// Allocator policy for a server process (glibc): allocations under 32 MiB
// come from the heap, and up to `keep_bytes` of freed heap is kept for
// reuse instead of being handed back to the kernel at once. A worker builds
// and frees megabytes per call (request copies, response buffers); with
// glibc's defaults those were faulted in and zeroed afresh each call
// (measured: docs/lab-notes/2026-11-benchmarks.md). Shards of
// 32 MiB or more are still mapped apart and go back to the system on
// drop; smaller ones go back to the heap. keep_bytes 0 leaves the
// defaults. False where the allocator refused.
bool KeepFreedHeapMemory(int64_t keep_bytes);

// Memory for a table of `bytes` that rows are gathered from at random:
// 64-byte aligned, and for 2 MiB or more, 2 MiB aligned with transparent
// huge pages requested (random row gathers over a large table otherwise
// miss the TLB on nearly every id; the kernel may still refuse them). Not
// touched. nullptr when the memory cannot be had; free with std::free.
void* AllocateTableMemory(size_t bytes);

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_HOST_MEMORY_H_
