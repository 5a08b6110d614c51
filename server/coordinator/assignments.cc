#include "server/coordinator/assignments.h"

#include "server/backend/embedding_backend.h"
#include "server/backend/table_spec.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

std::set<int> RanksWithShards(const ember::v1::ShardingPlan& plan) {
  std::set<int> ranks;
  for (const auto& ts : plan.tables()) {
    if (ts.shards_size() == 0) ranks.insert(ts.ranks().begin(), ts.ranks().end());
    for (const auto& sh : ts.shards()) {
      if (sh.rows() > 0) ranks.insert(sh.rank());
    }
  }
  return ranks;
}

ShardAssignment MakeAssignment(const ember::v1::TableConfig& table, int index, int64_t row_offset,
                               int64_t col_offset, int64_t rows, int64_t cols) {
  ShardAssignment a;
  a.mutable_ref()->set_table(table.name());
  a.mutable_ref()->set_shard_index(index);
  *a.mutable_table() = table;
  a.set_row_offset(row_offset);
  a.set_col_offset(col_offset);
  a.set_rows(rows);
  a.set_cols(cols);
  return a;
}

std::vector<ShardAssignment> AssignmentsOf(const CollectionInfo& info, int rank) {
  std::vector<ShardAssignment> out;
  for (int t = 0; t < info.plan().tables_size(); ++t) {
    const auto& ts = info.plan().tables(t);
    const auto& table = info.spec().tables(t);
    if (ts.shards_size() == 0) {  // data_parallel: a replica per rank
      for (int r : ts.ranks()) {
        if (r == rank) {
          out.push_back(MakeAssignment(table, r, 0, 0, table.num_embeddings(),
                                       table.embedding_dim()));
        }
      }
    }
    for (int i = 0; i < ts.shards_size(); ++i) {
      const auto& sh = ts.shards(i);
      // An empty trailing row-wise shard holds nothing.
      if (sh.rows() > 0 && sh.rank() == rank) {
        out.push_back(MakeAssignment(table, i, sh.row_offset(), sh.col_offset(), sh.rows(),
                                     sh.cols()));
      }
    }
  }
  return out;
}

int RankOf(const CollectionInfo& info, const ember::v1::ShardRef& ref) {
  for (const auto& ts : info.plan().tables()) {
    if (ts.table() != ref.table()) continue;
    if (ts.shards_size() == 0) return ref.shard_index();
    if (ref.shard_index() >= 0 && ref.shard_index() < ts.shards_size()) {
      return ts.shards(ref.shard_index()).rank();
    }
  }
  return -1;
}

std::optional<ShardAssignment> AssignmentOf(const CollectionInfo& info,
                                            const ember::v1::ShardRef& ref) {
  for (const ShardAssignment& a : AssignmentsOf(info, RankOf(info, ref))) {
    if (a.ref().table() == ref.table() && a.ref().shard_index() == ref.shard_index()) return a;
  }
  return std::nullopt;
}

int64_t AssignmentBytes(const ShardAssignment& a) {
  return backend::ShardBytes(
      ShardSpecFromTable(a.table(), a.row_offset(), a.col_offset(), a.rows(), a.cols()));
}

}  // namespace coordinator
}  // namespace ember
