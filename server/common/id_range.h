// Where the first id outside a table's rows lies: the one scan behind the
// backend's request validation (backend::CheckIds) and the client's
// (client::CheckFeatureIds), which word their messages differently.
#ifndef EMBER_SERVER_COMMON_ID_RANGE_H_
#define EMBER_SERVER_COMMON_ID_RANGE_H_

#include <cstdint>

#include "absl/types/span.h"

namespace ember {

// Index of the first id outside [0, rows), or -1. One unsigned compare per
// id (negatives wrap to huge values), in blocks of 8 that GCC vectorises at
// -O2; the position is searched for only when some id is out.
inline int64_t FirstIdOutside(absl::Span<const int64_t> ids, int64_t rows) {
  const uint64_t limit = static_cast<uint64_t>(rows);
  const size_t n = ids.size();
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t block = 0;
    for (size_t k = 0; k < 8; ++k) block |= static_cast<uint64_t>(ids[i + k]) >= limit;
    bad |= block;
  }
  for (; i < n; ++i) bad |= static_cast<uint64_t>(ids[i]) >= limit;
  if (bad == 0) return -1;
  for (size_t j = 0; j < n; ++j) {
    if (static_cast<uint64_t>(ids[j]) >= limit) return static_cast<int64_t>(j);
  }
  return -1;
}

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_ID_RANGE_H_
