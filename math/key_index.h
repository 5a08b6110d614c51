// The id index of a dynamic (hash-keyed) shard, as one layout and one
// probe for the host and the device: DynamicIndex
// (server/backend/dynamic/dynamic_index.h) keeps it, and a backend that
// finds ids itself (EmbeddingBackend::FindsKeys: the CUDA backend, on the
// device) reads a copy of it with KeyProbe.
//
// Open addressing with linear probing over a power-of-two number of
// entries (mask = entries - 1), at most half of them used, in 64-byte
// lines of kKeyLineEntries entries: the lines' ids, then their slots
// (slot < 0: an empty entry). An id's home is the first entry of the line
// KeyHome names; the probe walks on entry by entry, across lines, until it
// meets the id or an empty entry. Header-only, no dependencies; under nvcc
// __host__ __device__.
#ifndef EMBER_MATH_KEY_INDEX_H_
#define EMBER_MATH_KEY_INDEX_H_

#include <cstdint>

#include "math/embedding_math.h"

namespace ember {
namespace backend {
namespace math {

constexpr uint64_t kKeyLineEntries = 4;
// The index's placement of ids, apart from the routing's (RouteRow,
// server/common/dynamic_route.h), which mixes the id unsalted.
constexpr uint64_t kKeyIndexSalt = 0x9e3779b97f4a7c15ull;

struct alignas(64) KeyLine {
  int64_t id[kKeyLineEntries];
  int64_t slot[kKeyLineEntries];
};

// Entries of the index of a shard of `capacity` rows: the smallest power
// of two at least twice the capacity (and 16), so it is at most half full.
EMBER_HD uint64_t KeyIndexEntries(int64_t capacity) {
  uint64_t n = 16;
  while (n < static_cast<uint64_t>(capacity) * 2) n <<= 1;
  return n;
}
// What a dynamic shard keeps beside its rows, bytes: its index (16 an
// entry) and each slot's bookkeeping (32 a row; DynamicIndex's Meta).
constexpr int64_t kKeyEntryBytes = 16;
constexpr int64_t kKeySlotMetaBytes = 32;

// The home entry of `id` (the first entry of a line) among mask + 1.
EMBER_HD uint64_t KeyHome(int64_t id, uint64_t mask) {
  return Mix64(static_cast<uint64_t>(id) ^ kKeyIndexSalt) & mask & ~(kKeyLineEntries - 1);
}

// The slot of `id`, probing from entry `at` on, or `missing`. The index
// must have an empty entry (it is at most half full), or this never ends.
EMBER_HD int64_t KeyProbeFrom(const KeyLine* lines, uint64_t mask, uint64_t at, int64_t id,
                              int64_t missing) {
  for (;; at = (at + 1) & mask) {
    const KeyLine& line = lines[at / kKeyLineEntries];
    const int64_t slot = line.slot[at % kKeyLineEntries];
    if (slot < 0) return missing;
    if (line.id[at % kKeyLineEntries] == id) return slot;
  }
}

EMBER_HD int64_t KeyProbe(const KeyLine* lines, uint64_t mask, int64_t id, int64_t missing) {
  return KeyProbeFrom(lines, mask, KeyHome(id, mask), id, missing);
}

}  // namespace math
}  // namespace backend
}  // namespace ember

#endif  // EMBER_MATH_KEY_INDEX_H_
