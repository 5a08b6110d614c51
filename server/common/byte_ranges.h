// Byte ranges [begin, end), merged into disjoint ones in order: the one
// piece behind the checks and copies that take a call's slices together
// (the CUDA backend's outputs-over-inputs check, the worker's copies of a
// link channel's lengths to the host).
#ifndef EMBER_SERVER_COMMON_BYTE_RANGES_H_
#define EMBER_SERVER_COMMON_BYTE_RANGES_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace ember {

using ByteRange = std::pair<uint64_t, uint64_t>;  // [begin, end)

// `ranges` in order of their begin, merged where they overlap or touch.
inline std::vector<ByteRange> MergedRanges(std::vector<ByteRange> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<ByteRange> merged;
  for (const ByteRange& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_BYTE_RANGES_H_
