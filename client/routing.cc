#include "client/routing.h"

#include "absl/strings/str_cat.h"
#include "planner/plan_view.h"

namespace ember {
namespace client {

using ember::v1::CollectionInfo;

absl::StatusOr<std::shared_ptr<const Client::Routing>> BuildRouting(CollectionInfo info,
                                                                    const std::string& token) {
  auto r = std::make_shared<Client::Routing>();
  r->info = std::move(info);
  r->auth_token = token;
  const auto& spec = r->info.spec();
  const auto& plan = r->info.plan();
  if (plan.tables_size() != spec.tables_size()) {
    return absl::InternalError("the plan and the spec disagree on the tables");
  }
  const int world = r->info.worker_addresses_size();
  int order = 0;
  for (int t = 0; t < spec.tables_size(); ++t) {
    Client::Routing::Table table;
    table.config = &spec.tables(t);
    const auto& ts = plan.tables(t);
    table.caches_rows = planner::CachesRows(ts);
    for (const planner::PlacedBlock& b : planner::TableBlocks(
             ts, table.config->num_embeddings(), table.config->embedding_dim())) {
      if (!b.Held()) continue;  // an empty trailing row-wise shard
      if (b.rank < 0 || b.rank >= world) return absl::InternalError("plan rank out of range");
      Client::Routing::Shard shard{b.rank, b.index, b.row_offset, b.rows, b.col_offset, b.cols};
      for (int backup : b.backups) {
        if (backup < 0 || backup >= world) return absl::InternalError("plan rank out of range");
        shard.backups.push_back(backup);
      }
      if (b.replica) {
        table.replicas.push_back(shard);
      } else {
        table.shards.push_back(shard);
        table.row_split |= b.rows < table.config->num_embeddings();
      }
    }
    for (const std::string& f : table.config->feature_names()) r->features[f] = {t, order++};
    r->tables.push_back(std::move(table));
  }
  return std::shared_ptr<const Client::Routing>(std::move(r));
}

std::vector<Client::Routing::Shard> WithEveryCopy(
    const std::vector<Client::Routing::Shard>& shards) {
  std::vector<Client::Routing::Shard> out;
  for (const Client::Routing::Shard& s : shards) {
    out.push_back(s);
    out.back().backups.clear();
    for (int b : s.backups) {
      out.push_back(s);
      out.back().rank = b;
      out.back().backups.clear();
    }
  }
  return out;
}

absl::StatusOr<const Client::Routing::Table*> FindTable(const Client::Routing& r,
                                                       const std::string& collection,
                                                       const std::string& table) {
  for (const auto& candidate : r.tables) {
    if (candidate.config->name() == table) return &candidate;
  }
  return absl::NotFoundError(
      absl::StrCat("no table '", table, "' in collection '", collection, "'"));
}

}  // namespace client
}  // namespace ember
