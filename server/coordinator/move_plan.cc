#include "server/coordinator/move_plan.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "planner/plan_view.h"
#include "planner/shard_geometry.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/table_spec.h"
#include "server/coordinator/assignments.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

namespace {

// The same shard, whatever part in its replication each plan gives it (a
// promoted backup, a primary with a new backup, stays where it is).
bool Same(const ShardAssignment& a, const ShardAssignment& b) {
  google::protobuf::util::MessageDifferencer d;
  d.IgnoreField(ShardAssignment::descriptor()->FindFieldByName("replication"));
  return d.Compare(a, b);
}

// Bytes of fp32 weights and optimizer state a row of `cols` columns of
// `table` takes in a copy.
int64_t RowBytes(const ember::v1::TableConfig& table, int64_t cols) {
  const backend::ShardSpec spec = ShardSpecFromTable(table, 0, 0, 1, cols);
  return 4 * (cols + backend::OptimizerStateWidth(spec.optimizer.type, cols));
}

// A replicated shard's copies on the new ranks (`n` has the primary's, -1
// if its rank leaves): the backups whose workers stay keep their copies,
// and a backup takes over from a primary that leaves (CheckPlan places the
// backups missing).
void KeepBackups(const ember::v1::Shard& old, const std::vector<int>& new_rank,
                 ember::v1::Shard* n) {
  n->clear_backups();
  for (int b : old.backups()) {
    const int to = b >= 0 && b < static_cast<int>(new_rank.size()) ? new_rank[b] : -1;
    if (to < 0 || to == n->rank()) continue;
    if (n->rank() < 0) {
      n->set_rank(to);
    } else {
      n->add_backups(to);
    }
  }
}

struct OldShard {
  std::string address;
  ShardAssignment a;
};

}  // namespace

absl::StatusOr<MovePlan> PlanMove(const CollectionInfo& before, const CollectionInfo& after) {
  MovePlan plan;
  // What each worker holds now, by address, and each table's old shards.
  std::map<std::string, std::map<std::pair<std::string, int32_t>, ShardAssignment>> held;
  std::map<std::string, std::vector<OldShard>> old_shards;
  for (int r : planner::HoldingRanks(before.plan())) {
    const std::string& address = before.worker_addresses(r);
    for (const ShardAssignment& a : AssignmentsOf(before, r)) {
      held[address][{a.ref().table(), a.ref().shard_index()}] = a;
      // A replicated shard's rows come from its primary (every copy holds
      // them alike: one source per row).
      if (a.replication().primary().empty()) old_shards[a.ref().table()].push_back({address, a});
    }
  }
  std::set<std::string> replicated;  // data-parallel tables
  for (const auto& ts : after.plan().tables()) {
    if (planner::IsReplicated(ts)) replicated.insert(ts.table());
  }
  std::set<std::string> holding_after;
  for (int r : planner::HoldingRanks(after.plan())) {
    const std::string& address = after.worker_addresses(r);
    holding_after.insert(address);
    const bool holds = held.count(address) > 0;
    std::vector<ShardAssignment>& made = holds ? plan.stage[address] : plan.create[address];
    if (holds) plan.after[address] = AssignmentsOf(after, r);
    for (const ShardAssignment& a : AssignmentsOf(after, r)) {
      const std::pair<std::string, int32_t> key{a.ref().table(), a.ref().shard_index()};
      if (holds) {
        auto it = held[address].find(key);
        if (it != held[address].end() && Same(it->second, a)) continue;  // stays as it is
      }
      made.push_back(a);
      const std::vector<OldShard>& sources = old_shards[a.ref().table()];
      const bool dynamic = a.table().has_dynamic();
      const int64_t row_bytes = RowBytes(a.table(), a.cols());
      auto add = [&](const OldShard& from, int64_t first, int64_t end) {
        RowCopy c;
        c.from = from.address;
        c.to = address;
        c.from_ref = from.a.ref();
        c.to_ref = a.ref();
        c.from_row = first - from.a.row_offset();
        c.to_row = first - a.row_offset();
        c.rows = end - first;
        c.dynamic = dynamic;
        plan.bytes += c.rows * row_bytes;
        if (c.from != c.to) plan.bytes_between_workers += c.rows * row_bytes;
        plan.copies.push_back(std::move(c));
      };
      if (replicated.count(a.ref().table())) {
        // A replica: one old replica, this worker's own if it has one.
        const OldShard* pick = nullptr;
        for (const OldShard& s : sources) {
          if (pick == nullptr || s.address == address) pick = &s;
        }
        if (pick == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("table '", a.ref().table(), "': no replica to copy a new one from"));
        }
        add(*pick, 0, a.rows());
        continue;
      }
      int64_t covered = 0;
      for (const OldShard& s : sources) {
        const int64_t first = std::max(a.row_offset(), s.a.row_offset());
        const int64_t end = std::min(a.row_offset() + a.rows(), s.a.row_offset() + s.a.rows());
        const bool cols_overlap = a.col_offset() < s.a.col_offset() + s.a.cols() &&
                                  s.a.col_offset() < a.col_offset() + a.cols();
        if (first >= end || !cols_overlap) continue;
        if (s.a.col_offset() != a.col_offset() || s.a.cols() != a.cols()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "table '", a.ref().table(), "' shard ", a.ref().shard_index(),
              ": its columns changed (a live move re-cuts rows, never columns)"));
        }
        if (dynamic && (first != a.row_offset() || end - first != a.rows() ||
                        s.a.rows() != a.rows())) {
          return absl::InvalidArgumentError(
              absl::StrCat("dynamic table '", a.ref().table(),
                           "': its shards would be re-cut, which re-hashes them (not done live; "
                           "checkpoint and restore it instead)"));
        }
        add(s, first, end);
        covered += end - first;
      }
      if (covered != a.rows()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "table '", a.ref().table(), "' shard ", a.ref().shard_index(), ": old shards cover ",
            covered, " of its ", a.rows(), " rows"));
      }
    }
  }
  for (const auto& [address, shards] : held) {
    if (!holding_after.count(address)) plan.emptied.insert(address);
  }
  return plan;
}

absl::StatusOr<ember::v1::ShardingPlan> RescalePlan(const CollectionInfo& before,
                                                    const std::vector<int>& from) {
  const int world = static_cast<int>(from.size());
  const int old_world = before.worker_addresses_size();
  if (world < 1) return absl::InvalidArgumentError("a plan needs at least one rank");
  std::vector<int> new_rank(std::max(old_world, 0), -1);  // old rank -> new, -1: leaves
  for (int i = 0; i < world; ++i) {
    if (from[i] < 0) continue;
    if (from[i] >= old_world || new_rank[from[i]] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("old rank ", from[i], " is out of range or named twice"));
    }
    new_rank[from[i]] = i;
  }
  ember::v1::ShardingPlan plan;
  plan.set_collection(before.plan().collection());
  std::vector<int64_t> load(world, 0);
  // Shards still to place (their rank left), and those that may move to
  // even the load: (table index, shard index).
  std::vector<std::pair<int, int>> homeless, movable;
  auto bytes = [&](const std::pair<int, int>& at) {  // a placed shard's
    const ember::v1::Shard& sh = plan.tables(at.first).shards(at.second);
    return sh.rows() * RowBytes(before.spec().tables(at.first), sh.cols());
  };
  for (int t = 0; t < before.plan().tables_size(); ++t) {
    const ember::v1::TableSharding& old = before.plan().tables(t);
    const ember::v1::TableConfig& tc = before.spec().tables(t);
    ember::v1::TableSharding* ts = plan.add_tables();
    ts->set_table(old.table());
    ts->set_sharding_type(old.sharding_type());
    ts->set_compute_kernel(old.compute_kernel());
    ts->set_cache_load_factor(old.cache_load_factor());
    if (planner::IsReplicated(old)) {
      for (int r = 0; r < world; ++r) {
        ts->add_ranks(r);
        load[r] += tc.num_embeddings() * RowBytes(tc, tc.embedding_dim());
      }
      continue;
    }
    if (old.sharding_type() == "row_wise") {
      if (tc.has_dynamic()) {
        if (world != old.shards_size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "dynamic table '", tc.name(), "' is row_wise: serving it from ", world,
              " workers re-hashes its rows, which is not done live yet; checkpoint the "
              "collection and restore it onto ", world, " workers instead"));
        }
        // As many blocks as before: each stays whole, on its worker's rank.
        for (const ember::v1::Shard& sh : old.shards()) {
          ember::v1::Shard* n = ts->add_shards();
          *n = sh;
          n->set_rank(new_rank[sh.rank()] >= 0 ? new_rank[sh.rank()] : -1);
          KeepBackups(sh, new_rank, n);
          const std::pair<int, int> at{t, ts->shards_size() - 1};
          if (n->rank() < 0) homeless.push_back(at);
          else load[n->rank()] += bytes(at);
        }
        continue;
      }
      const std::vector<planner::ShardBlock> blocks =
          planner::RowWiseBlocks(tc.num_embeddings(), tc.embedding_dim(), world);
      for (int i = 0; i < world; ++i) {
        ember::v1::Shard* n = ts->add_shards();
        n->set_row_offset(blocks[i].row_offset);
        n->set_col_offset(blocks[i].col_offset);
        n->set_rows(blocks[i].rows);
        n->set_cols(blocks[i].cols);
        n->set_rank(i);
        ts->add_ranks(i);
        load[i] += bytes({t, i});
      }
      continue;
    }
    for (const ember::v1::Shard& sh : old.shards()) {
      ember::v1::Shard* n = ts->add_shards();
      *n = sh;
      n->set_rank(new_rank[sh.rank()]);
      KeepBackups(sh, new_rank, n);
      const std::pair<int, int> at{t, ts->shards_size() - 1};
      if (n->rank() < 0) {
        homeless.push_back(at);
      } else {
        load[n->rank()] += bytes(at);
      }
      if (old.sharding_type() == "table_wise" || old.sharding_type() == "column_wise") {
        movable.push_back(at);
      }
    }
  }
  // The rank holding least; of equals, a worker new to the collection
  // first (it is there to take load), then the lowest rank.
  auto emptiest = [&] {
    int best = 0;
    for (int r = 1; r < world; ++r) {
      if (load[r] < load[best] || (load[r] == load[best] && from[r] < 0 && from[best] >= 0)) {
        best = r;
      }
    }
    return best;
  };
  std::stable_sort(homeless.begin(), homeless.end(),
            [&](const auto& a, const auto& b) { return bytes(a) > bytes(b); });
  for (const auto& at : homeless) {  // largest first, each to the emptiest rank
    const int r = emptiest();
    ember::v1::Shard* placed = plan.mutable_tables(at.first)->mutable_shards(at.second);
    placed->set_rank(r);
    auto* backups = placed->mutable_backups();
    backups->erase(std::remove(backups->begin(), backups->end(), r), backups->end());
    load[r] += bytes(at);
  }
  // Evening out: the largest movable shard of the fullest rank that leaves
  // both ranks below the fullest's load moves to the emptiest.
  for (size_t round = 0; round < movable.size(); ++round) {
    const int full = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    const int empty = emptiest();
    const std::pair<int, int>* best = nullptr;
    for (const auto& at : movable) {
      if (plan.tables(at.first).shards(at.second).rank() != full) continue;
      if (load[empty] + bytes(at) >= load[full]) continue;
      if (best == nullptr || bytes(at) > bytes(*best)) best = &at;
    }
    if (best == nullptr) break;
    ember::v1::Shard* moved = plan.mutable_tables(best->first)->mutable_shards(best->second);
    moved->set_rank(empty);
    // Not its own backup (CheckPlan places another).
    auto* backups = moved->mutable_backups();
    backups->erase(std::remove(backups->begin(), backups->end(), empty), backups->end());
    load[full] -= bytes(*best);
    load[empty] += bytes(*best);
  }
  for (ember::v1::TableSharding& ts : *plan.mutable_tables()) {
    if (!ts.shards().empty() && ts.ranks_size() == 0) {
      for (const ember::v1::Shard& sh : ts.shards()) ts.add_ranks(sh.rank());
    }
  }
  return plan;
}

}  // namespace coordinator
}  // namespace ember
