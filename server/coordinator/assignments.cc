#include "server/coordinator/assignments.h"

#include <algorithm>
#include <string>

#include "planner/plan_view.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/table_spec.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

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
    const auto& table = info.spec().tables(t);
    for (const planner::PlacedBlock& b : planner::TableBlocks(
             info.plan().tables(t), table.num_embeddings(), table.embedding_dim())) {
      const bool backup = std::find(b.backups.begin(), b.backups.end(), rank) != b.backups.end();
      if ((b.rank == rank || backup) && b.Held()) {
        out.push_back(MakeAssignment(table, b.index, b.row_offset, b.col_offset, b.rows, b.cols));
        // A replicated shard: the primary forwards its updates to the
        // backups' addresses; a backup takes them from the primary only.
        auto address = [&info](int r) {
          return r >= 0 && r < info.worker_addresses_size() ? info.worker_addresses(r)
                                                            : std::string();
        };
        if (backup) {
          out.back().mutable_replication()->set_primary(address(b.rank));
        } else {
          for (int r : b.backups) out.back().mutable_replication()->add_backups(address(r));
        }
        // A plan made before workers said what they serve (no
        // topology.compute_kernels) names kernels they never checked: none
        // is sent, and the worker serves its shard as it always has.
        if (info.plan().topology().compute_kernels_size() > 0) {
          out.back().set_compute_kernel(info.plan().tables(t).compute_kernel());
          out.back().set_cache_load_factor(info.plan().tables(t).cache_load_factor());
        }
      }
    }
  }
  return out;
}

int RankOf(const CollectionInfo& info, const ember::v1::ShardRef& ref) {
  for (const auto& ts : info.plan().tables()) {
    if (ts.table() == ref.table()) return planner::RankOfBlock(ts, ref.shard_index());
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
      ShardSpecOf(a));
}

}  // namespace coordinator
}  // namespace ember
