// Re-hashing a dynamic (hash-keyed) table's checkpointed shards into a new
// layout: every row held by any source shard of the table goes to the
// target shard that owns its id now (RouteRow of the id into the target's
// routing rows, server/common/dynamic_route.h), so a checkpoint restores
// onto any worker count. A target offered more rows than it holds keeps
// those its table's eviction would keep (LRU: the most recently updated;
// LFU: the most updated, then the most recent; then the higher id) and
// counts the rest as dropped. Rows keep their weights, optimizer state,
// last update step and update count; the step is the largest source's.
// The admission counts of ids not yet admitted go the same way, by id.
//
// Thread-safe: no shared state.
#ifndef EMBER_SERVER_CHECKPOINT_REHASH_H_
#define EMBER_SERVER_CHECKPOINT_REHASH_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "proto/service.pb.h"
#include "server/backend/embedding_backend.h"
#include "server/checkpoint/checkpoint_files.h"

namespace ember {
namespace checkpoint {

class RehashTarget {
 public:
  // `spec`: the target's dynamic shard spec (rows, row_offset, table_rows =
  // the table's capacity, dim, optimizer, eviction).
  explicit RehashTarget(const backend::ShardSpec& spec);

  // Takes the rows of one source shard of the table whose ids this target
  // owns. DATA_LOSS naming the file when the source is not a dynamic
  // shard of this width, or an id is held twice (nothing taken then).
  absl::Status Take(const ember::v1::CheckpointShard& source, const ShardData& data);

  // The target's contents: the rows kept in slots 0..n-1 by ascending id,
  // the other slots free: weights [rows, dim], state [rows, state_width],
  // slots [rows]. *dropped: rows offered past the target's size.
  void Finish(std::vector<float>* weights, std::vector<float>* state,
              std::vector<backend::EmbeddingBackend::SlotMeta>* slots, int64_t* dropped) const;

  int64_t step() const { return step_; }
  // The admission counts the target owns, (id, count) int64 pairs.
  const std::vector<int64_t>& pending_counts() const { return pending_; }
  // Every source's sketch of the counts past the exact ones, summed
  // (saturating): a sketch cannot be split by id, so each target takes them
  // all, an over-count that admits early, never late. Empty when no source
  // had one.
  const std::vector<uint32_t>& pending_sketch() const { return sketch_; }

 private:
  struct Row {
    int64_t id, last_step, updates, order;
    size_t at;  // its row in weights_ / state_
  };
  const backend::ShardSpec spec_;
  const int64_t state_width_;
  std::vector<Row> rows_;
  std::vector<float> weights_, state_;
  std::vector<int64_t> pending_;
  std::vector<uint32_t> sketch_;
  int64_t step_ = 0;
};

}  // namespace checkpoint
}  // namespace ember

#endif  // EMBER_SERVER_CHECKPOINT_REHASH_H_
