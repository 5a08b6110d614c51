#include "server/common/host_memory.h"

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ember {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A limit file's value, or INT64_MAX for none ("max", unreadable, or the
// kernel's "unlimited" near 2^63).
int64_t LimitOf(const std::string& text) {
  int64_t v;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) || v <= 0 ||
      v >= (int64_t{1} << 60)) {
    return std::numeric_limits<int64_t>::max();
  }
  return v;
}

// The cgroup path of `controller` ("" for v2) in /proc/self/cgroup.
std::string CgroupPath(const std::string& self_cgroup, const std::string& controller) {
  for (absl::string_view line : absl::StrSplit(self_cgroup, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (controller.empty() ? (f[0] == "0" && f[1].empty())
                           : absl::StrContains(f[1], controller)) {
      return f[2];
    }
  }
  return "";
}

// The limit file of the process's own cgroup, else the mount's root one
// (inside a container the root is the container's cgroup).
std::string CgroupFile(const std::string& mount, const std::string& path, const std::string& file) {
  if (!path.empty() && path != "/") {
    const std::string own = ReadText(mount + path + "/" + file);
    if (!own.empty()) return own;
  }
  return ReadText(mount + "/" + file);
}

}  // namespace

int64_t HostMemoryBytesFrom(const std::string& meminfo, const std::string& cgroup_v2_max,
                            const std::string& cgroup_v1_limit) {
  int64_t available = std::numeric_limits<int64_t>::max();
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
    line = absl::StripAsciiWhitespace(line);
    int64_t kib;
    if (absl::ConsumeSuffix(&line, " kB") && absl::SimpleAtoi(line, &kib) && kib > 0) {
      available = kib * 1024;
    }
  }
  const int64_t bytes = std::min({available, LimitOf(cgroup_v2_max), LimitOf(cgroup_v1_limit)});
  return bytes == std::numeric_limits<int64_t>::max() ? 0 : bytes;
}

int64_t HostMemoryBytes() {
  const std::string self = ReadText("/proc/self/cgroup");
  return HostMemoryBytesFrom(
      ReadText("/proc/meminfo"),
      CgroupFile("/sys/fs/cgroup", CgroupPath(self, ""), "memory.max"),
      CgroupFile("/sys/fs/cgroup/memory", CgroupPath(self, "memory"), "memory.limit_in_bytes"));
}

bool KeepFreedHeapMemory(int64_t keep_bytes) {
  if (keep_bytes <= 0) return true;
  constexpr int kHeapBelow = 32 << 20;
  const int keep = static_cast<int>(std::min<int64_t>(keep_bytes, int64_t{1} << 30));
  return mallopt(M_MMAP_THRESHOLD, kHeapBelow) == 1 && mallopt(M_TRIM_THRESHOLD, keep) == 1;
}

void* AllocateTableMemory(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p != nullptr && align == kHuge) madvise(p, rounded, MADV_HUGEPAGE);  // a hint only
  return p;
}

}  // namespace ember
