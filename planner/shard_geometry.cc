#include "planner/shard_geometry.h"

#include <algorithm>

namespace ember {
namespace planner {

std::vector<ShardBlock> RowWiseBlocks(int64_t rows, int64_t cols,
                                      int num_shards) {
  std::vector<ShardBlock> blocks(num_shards);
  const int64_t block = (rows + num_shards - 1) / num_shards;
  int64_t offset = 0;
  for (int i = 0; i < num_shards; ++i) {
    const int64_t size = std::min(block, rows - offset);
    blocks[i].row_offset = offset;
    blocks[i].rows = size;
    blocks[i].cols = cols;
    offset += size;
  }
  return blocks;
}

int64_t ColumnShardWidth(int64_t cols, int min_partition, int num_workers) {
  if (min_partition > 0) {
    for (int64_t w = min_partition; w < cols; ++w) {
      if (cols % w == 0 && w % 4 == 0) return w;
    }
    return cols;
  }
  for (int64_t k = std::min<int64_t>(num_workers, cols); k > 1; --k) {
    if (cols % k == 0 && (cols / k) % 4 == 0) return cols / k;
  }
  return cols;
}

std::vector<ShardBlock> ColumnWiseBlocks(int64_t rows, int64_t cols,
                                         int min_partition, int num_workers) {
  return ColumnBlocksOfWidth(rows, cols, ColumnShardWidth(cols, min_partition, num_workers));
}

std::vector<int64_t> FreeColumnWidths(int64_t cols, int num_workers) {
  std::vector<int64_t> widths;
  for (int64_t k = 2; k <= std::min<int64_t>(num_workers, cols); ++k) {
    const int64_t w = cols / k;
    if (cols % k == 0 && w % 4 == 0 && w >= kMinFreeColumnWidth) widths.push_back(w);
  }
  const int64_t even = ColumnShardWidth(cols, 0, num_workers);
  if (even < cols && std::find(widths.begin(), widths.end(), even) == widths.end()) {
    widths.push_back(even);
  }
  return widths;
}

std::vector<ShardBlock> ColumnBlocksOfWidth(int64_t rows, int64_t cols, int64_t width) {
  std::vector<ShardBlock> blocks;
  for (int64_t c = 0; c < cols; c += width) {
    ShardBlock b;
    b.col_offset = c;
    b.rows = rows;
    b.cols = std::min(width, cols - c);
    blocks.push_back(b);
  }
  return blocks;
}

}  // namespace planner
}  // namespace ember
