// Where a dynamic (hash-keyed) table's id lives: the one routing rule the
// client (which row_wise shard to send an id to), the worker and the
// checkpoint restore (which shard a restored row goes to) share.
#ifndef EMBER_SERVER_COMMON_DYNAMIC_ROUTE_H_
#define EMBER_SERVER_COMMON_DYNAMIC_ROUTE_H_

#include <cstdint>

namespace ember {

// The fixed 64-bit mix of an id: SplitMix64's finaliser of its bits.
inline uint64_t MixId(int64_t id) {
  uint64_t x = static_cast<uint64_t>(id);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The routing row of `id` in a dynamic table of `capacity` (> 0) rows:
// MixId(id) mod capacity. A row_wise shard of rows [row_offset, row_offset +
// rows) owns the ids whose routing row falls there (the capacity split as
// the plan splits rows); a table_wise shard owns every id.
inline int64_t RouteRow(int64_t id, int64_t capacity) {
  return static_cast<int64_t>(MixId(id) % static_cast<uint64_t>(capacity));
}

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_DYNAMIC_ROUTE_H_
