// Re-cutting checkpointed shards into a new layout: a target shard (a row
// range and a column range of its table) is filled from every source shard
// of the same table that overlaps it, so a checkpoint restores onto any
// worker count and any sharding.
//
// Optimizer state follows its weights: Adagrad's per-element accumulator and
// Adam's m and v are cut by column like the weights. Row-wise Adagrad keeps
// one accumulator per row per column shard (as TorchRec does, each column
// shard being its own table), so a target column shard gets the mean of the
// overlapping sources' accumulators weighted by the columns they share:
// exact whenever the column layout is unchanged (or the accumulators agree).
// The step is the largest of the sources' (they agree for one table).
//
// Thread-safe: no shared state.
#ifndef EMBER_SERVER_CHECKPOINT_RECUT_H_
#define EMBER_SERVER_CHECKPOINT_RECUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "proto/service.pb.h"
#include "server/backend/embedding_backend.h"
#include "server/checkpoint/checkpoint_files.h"

namespace ember {
namespace checkpoint {

struct RecutTarget {
  RecutTarget(backend::OptimizerType type, int64_t row_offset, int64_t col_offset, int64_t rows,
              int64_t cols);

  backend::OptimizerType type;
  int64_t row_offset, col_offset, rows, cols, state_width;
  std::vector<float> weights;  // [rows, cols]
  std::vector<float> state;    // [rows, state_width]
  int64_t step = 0;
  int64_t covered = 0;         // cells filled so far
  // The blocks filled so far, in the table's coordinates, and the files
  // they came from: a source overlapping one of them is refused.
  std::vector<std::pair<CellBlock, std::string>> filled;

  CellBlock block() const { return {row_offset, row_offset + rows, col_offset, col_offset + cols}; }
  // Row-wise Adagrad: sum of accumulator x shared columns per row, in double
  // so that an unchanged layout restores the accumulator bit for bit.
  std::vector<double> rowwise_sum;
};

// True when `source` (a manifest entry) overlaps the target's rows and columns.
bool Overlaps(const ember::v1::CheckpointShard& source, const RecutTarget& target);

// Copies the overlap of one source shard into the target. DATA_LOSS when
// the source's shape does not fit the optimizer type, or when it covers
// cells another source already filled (nothing is copied then).
absl::Status CopyOverlap(const ember::v1::CheckpointShard& source, const ShardData& data,
                         RecutTarget* target);

// After every overlapping source: DATA_LOSS unless every cell was filled
// (each exactly once: CopyOverlap refuses a second); finishes the row-wise
// accumulator means.
absl::Status FinishTarget(const std::string& table, RecutTarget* target);

}  // namespace checkpoint
}  // namespace ember

#endif  // EMBER_SERVER_CHECKPOINT_RECUT_H_
