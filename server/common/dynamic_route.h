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

// x mod d for one divisor d > 0 and any 64-bit x, exactly, without a
// division: with m = ceil(2^128 / d), the low 128 bits of m * x are the
// fraction x / d - floor(x / d) scaled by 2^128, and their product with d,
// shifted down by 128, is the remainder (Lemire, Kaser & Kurz, "Faster
// remainder by direct computation", 2019). A few multiplies where a
// 64-bit divide takes tens of cycles: the client routes every id of a
// dynamic table so. d = 1: m wraps to 0, and so does the remainder.
class ModBy {
 public:
  explicit ModBy(uint64_t d) : d_(d), m_(~static_cast<unsigned __int128>(0) / d + 1) {}
  uint64_t operator()(uint64_t x) const {
    using U128 = unsigned __int128;
    const U128 frac = m_ * x;
    const U128 low = static_cast<U128>(static_cast<uint64_t>(frac)) * d_;
    const U128 high = static_cast<U128>(static_cast<uint64_t>(frac >> 64)) * d_;
    return static_cast<uint64_t>((high + (low >> 64)) >> 64);
  }

 private:
  uint64_t d_;
  unsigned __int128 m_;
};

// RouteRow for one capacity, routing many ids.
class Router {
 public:
  explicit Router(int64_t capacity) : mod_(static_cast<uint64_t>(capacity)) {}
  int64_t Row(int64_t id) const { return static_cast<int64_t>(mod_(MixId(id))); }

 private:
  ModBy mod_;
};

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_DYNAMIC_ROUTE_H_
