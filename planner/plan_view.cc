#include "planner/plan_view.h"

#include "math/embedding_math.h"

namespace ember {
namespace planner {

bool CachesRows(const ember::v1::TableSharding& ts) {
  return backend::math::KernelCachesRows(ts.compute_kernel());
}

bool IsReplicated(const ember::v1::TableSharding& ts) { return ts.shards_size() == 0; }

std::vector<PlacedBlock> TableBlocks(const ember::v1::TableSharding& ts, int64_t table_rows,
                                     int64_t table_cols) {
  std::vector<PlacedBlock> out;
  if (IsReplicated(ts)) {
    for (int r : ts.ranks()) out.push_back({r, r, 0, 0, table_rows, table_cols, true});
    return out;
  }
  for (int i = 0; i < ts.shards_size(); ++i) {
    const ember::v1::Shard& s = ts.shards(i);
    out.push_back({s.rank(), i, s.row_offset(), s.col_offset(), s.rows(), s.cols(), false,
                   std::vector<int>(s.backups().begin(), s.backups().end())});
  }
  return out;
}

std::set<int> HoldingRanks(const ember::v1::ShardingPlan& plan) {
  std::set<int> ranks;
  for (const auto& ts : plan.tables()) {
    for (const PlacedBlock& b : TableBlocks(ts, 0, 0)) {
      if (!b.Held()) continue;
      ranks.insert(b.rank);
      ranks.insert(b.backups.begin(), b.backups.end());
    }
  }
  return ranks;
}

int RankOfBlock(const ember::v1::TableSharding& ts, int32_t index) {
  if (IsReplicated(ts)) return index;
  if (index >= 0 && index < ts.shards_size()) return ts.shards(index).rank();
  return -1;
}

}  // namespace planner
}  // namespace ember
