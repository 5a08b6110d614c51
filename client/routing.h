// A collection's plan prepared for routing (Client::Routing): its tables'
// shards and replicas in the order the plan gives them (planner/
// plan_view.h), which features go to which table, and the token the
// workers take. Built once per plan and shared by every call until the plan
// changes. Private to //client:client.
//
// Thread-safe: a Routing is immutable once built.
#ifndef EMBER_CLIENT_ROUTING_H_
#define EMBER_CLIENT_ROUTING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "proto/service.pb.h"

namespace ember {
namespace client {

struct Client::Routing {
  struct Shard {
    int rank = 0;
    int32_t index = 0;  // ShardRef.shard_index
    int64_t row_offset = 0, rows = 0, col_offset = 0, cols = 0;
    // A replicated collection's shard: the ranks of its backups. Lookups
    // go to any copy; updates to `rank`, the primary, only.
    std::vector<int> backups;
  };
  struct Table {
    const ember::v1::TableConfig* config = nullptr;
    std::vector<Shard> shards;    // sharded tables
    std::vector<Shard> replicas;  // data_parallel: one full copy per rank
    bool row_split = false;       // some shard holds only part of the rows
    bool caches_rows = false;     // its kernel caches rows (planner::CachesRows): prefetched
  };
  ember::v1::CollectionInfo info;
  std::vector<Table> tables;
  // feature -> (table index, position in the collection's feature order)
  std::map<std::string, std::pair<int, int>> features;
  std::string auth_token;  // ClientOptions::auth_token, for the workers
};

// `shards` with each replicated shard's backups after it, as shards of
// their own (the same block on the backup's rank): what a write that
// bypasses the primary's forwarding (an import) must reach.
std::vector<Client::Routing::Shard> WithEveryCopy(const std::vector<Client::Routing::Shard>& shards);

// The routing of `info` (a collection's spec, plan and worker addresses);
// INTERNAL if the plan and the spec disagree or a rank is out of range.
absl::StatusOr<std::shared_ptr<const Client::Routing>> BuildRouting(ember::v1::CollectionInfo info,
                                                                    const std::string& token);

// A table of the routed collection; NOT_FOUND if it has none of that name.
absl::StatusOr<const Client::Routing::Table*> FindTable(const Client::Routing& r,
                                                       const std::string& collection,
                                                       const std::string& table);

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_ROUTING_H_
