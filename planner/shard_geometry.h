// Shard geometry: how a [rows, cols] table is cut, with TorchRec's rules
// (torchrec/distributed/sharding_plan.py, calculate_shard_sizes_and_offsets).
//
// Thread-safe: pure functions.
#ifndef EMBER_PLANNER_SHARD_GEOMETRY_H_
#define EMBER_PLANNER_SHARD_GEOMETRY_H_

#include <cstdint>
#include <vector>

namespace ember {
namespace planner {

// A [rows, cols] block of a table whose top-left element is at
// [row_offset, col_offset].
struct ShardBlock {
  int64_t row_offset = 0;
  int64_t col_offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

// Row-wise split into `num_shards` blocks of ceil(rows / num_shards) rows.
// Trailing shards may be short or empty: 10 rows over 4 -> 3, 3, 3, 1;
// 5 rows over 4 -> 2, 2, 1, 0. Requires rows >= 0, num_shards >= 1.
std::vector<ShardBlock> RowWiseBlocks(int64_t rows, int64_t cols,
                                      int num_shards);

// Width of one column shard.
//  - min_partition > 0 (TorchRec): the smallest width w in
//    [min_partition, cols) with cols % w == 0 and w % 4 == 0; cols if none.
//  - min_partition == 0 (the seed tutorial's forced split): the dimension is
//    divided evenly over `num_workers`: the largest k <= num_workers with
//    cols % k == 0 and (cols / k) % 4 == 0 gives width cols / k
//    (dim 64 on 2 workers -> 32). Columns narrower than 4 are never made.
// Requires cols > 0 and num_workers >= 1.
int64_t ColumnShardWidth(int64_t cols, int min_partition, int num_workers);

// Column-wise split into blocks of ColumnShardWidth(...) columns, all rows.
std::vector<ShardBlock> ColumnWiseBlocks(int64_t rows, int64_t cols,
                                         int min_partition, int num_workers);

// The column widths the planner weighs when it chooses freely (no
// min_partition, no forced sharding type): the even split over
// `num_workers` (ColumnShardWidth(cols, 0, num_workers)) and every wider
// width of at least kMinFreeColumnWidth columns that divides `cols` into 2
// to `num_workers` shards (TorchRec's 128-column blocks among them), widest
// first. Empty when no split of at least 2 shards exists.
constexpr int64_t kMinFreeColumnWidth = 32;
std::vector<int64_t> FreeColumnWidths(int64_t cols, int num_workers);

// Blocks of `width` columns (the last may be narrower), all rows.
std::vector<ShardBlock> ColumnBlocksOfWidth(int64_t rows, int64_t cols, int64_t width);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_SHARD_GEOMETRY_H_
