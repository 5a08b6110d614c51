// Dynamic (hash-keyed) shards over any backend: WithDynamicShards wraps a
// backend so that a ShardSpec with is_dynamic makes a shard that takes any
// int64 id (dynamic_index.h has the rules).
//
// A dynamic shard of `rows` rows is a fixed shard of the wrapped backend
// with rows + 1 rows: slots 0 .. rows-1 hold the rows of admitted ids,
// contiguous, so the backend's own gather, update and optimizer kernels run
// on them; slot `rows` is kept all zeros (weights and optimizer state) and
// stands in for every id without a row:
//   Lookup   ids are mapped to slots (FindAll, prefetched; or by the backend,
//            below); an id without a row reads the zero slot: a zero
//            vector (pooled: it adds nothing, though MEAN still counts it
//            in the bag's length). Lookups change nothing.
//   Update   DynamicIndex::BeginUpdate (TTL, admission, eviction), the
//            created rows written with their initial values: a function of
//            the table's initializer, seed, the id and the column
//            (InitialValues with the id as the row), the same on every
//            sharding and restore; fresh optimizer state. The ids still
//            without a row then contribute nothing: a pooled feature gets
//            per-id weight 0 for them, a sequence feature (NONE) zero
//            gradient rows, so the zero slot's update is exactly zero for
//            every optimizer. If the wrapped backend refuses the call
//            (bad input, overflow), the index and the overwritten rows are
//            put back: nothing of the call is applied.
//
// Over a backend that finds ids itself (FindsKeys: the CUDA backend, on
// the device), a dynamic shard's index is copied to it at creation and by
// the lines every update, import and restore changed (SyncKeyIndex), and
// lookups pass the ids as keys (FeatureRequest::keyed), in host or device
// memory; a sync that fails leaves the shard's lookups mapping ids here
// until one succeeds. An update's ids and weights must be in host memory
// (FeatureRequest::on_device is refused: INVALID_ARGUMENT), and so must a
// lookup's over any other backend.
//
// A dynamic shard with cache_rows (the key_value and fused_uvm_caching
// kernels, key_value/key_value_backend.h below this wrapper) is a fixed
// shard of that tier: its rows move between the cache and the file (or
// mapped host memory) by use, while this wrapper's index, admission and
// eviction stay in host memory. The wrapped shard is indexed by cache
// slots, not by this shard's, so its ids are always found here (no copy
// of the index is synced, even over a backend that FindsKeys).
//
// Thread-safe: a lookup holds its dynamic shards' locks shared, an update
// exclusive (taken in shard id order); fixed shards pass straight through.
#ifndef EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_BACKEND_H_
#define EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_BACKEND_H_

#include <cstdint>
#include <memory>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct DynamicShardOptions {
  // Ids whose admission count a shard keeps exactly; past it, a count-min
  // sketch (dynamic_index.h).
  int64_t max_pending_ids = int64_t{1} << 20;
};

std::unique_ptr<EmbeddingBackend> WithDynamicShards(std::unique_ptr<EmbeddingBackend> inner,
                                                    const DynamicShardOptions& options = {});

// INVALID_ARGUMENT naming the field for a dynamic spec's bad values.
absl::Status ValidateDynamicSpec(const ShardSpec& spec);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_BACKEND_H_
