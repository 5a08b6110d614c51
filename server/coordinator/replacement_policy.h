// Where a recovery or a drain puts the shards of lost ranks: a pure policy
// (no RPC, lock or clock), kept apart from the coordinator's mechanism
// (checkpoints, reload RPCs, state) so that it is tested on its own.
//
// The rule. Lost ranks are taken in ascending order:
// - A lost rank takes the first spare, if there is one. Spares are the
//   candidates that hold no rank of the collection, taken in registration
//   order (`seq`). The spare then reloads everything the rank held.
// - Without a spare, each non-empty shard of the lost rank, in plan order,
//   goes to the candidate rank holding the fewest bytes so far. Ties go to
//   the lowest rank, and the bytes grow as shards arrive. Only ranks that
//   already hold something, or took a spare, can receive shards.
// - A data-parallel table drops its replicas on lost ranks. If none is
//   left, it gets one on the least-loaded rank, copied from its first old
//   replica. Replicas do not add to the bytes.
// It reads shard bytes and registration order only, never capacity,
// device or host.
//
// UNAVAILABLE when no rank can take anything: "no live worker to take the
// shards of <ranks>; start one". INVALID_ARGUMENT for inputs the
// coordinator never makes (ids not one per rank, a lost rank out of range,
// a plan with more tables than its spec, a data-parallel table with no
// replica to lose).
//
// Thread-safe: a pure function.
#ifndef EMBER_SERVER_COORDINATOR_REPLACEMENT_POLICY_H_
#define EMBER_SERVER_COORDINATOR_REPLACEMENT_POLICY_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/service.pb.h"

namespace ember {
namespace coordinator {

// A worker that may receive shards: leased and not draining.
struct ReplacementCandidate {
  std::string id;
  int64_t seq = 0;  // registration order: spares are taken lowest first
  std::string address;
};

struct Replacement {
  // The collection with its new placement: moved shards' ranks, the
  // data-parallel tables' ranks and the spares' addresses.
  ember::v1::CollectionInfo info;
  std::vector<std::string> ids;  // rank -> worker id
  std::set<int> replaced;        // lost ranks given a spare (it loads all it holds)
  std::map<int, int64_t> load;   // bytes per rank able to take shards
  // What each rank loads: (table, shard index; a replica: its rank).
  std::map<int, std::set<std::pair<std::string, int32_t>>> reload;
  // A new data-parallel replica -> the old rank whose replica it copies.
  std::map<std::pair<std::string, int32_t>, int> replica_source;
};

// `info`'s plan and addresses as they were, `ids` the worker of each rank,
// `lost` the ranks to replace, `candidates` the workers that may receive
// shards (any order).
absl::StatusOr<Replacement> PlaceLostShards(const ember::v1::CollectionInfo& info,
                                            const std::vector<std::string>& ids,
                                            const std::set<int>& lost,
                                            const std::vector<ReplacementCandidate>& candidates);

// A replicated collection (CollectionSpec.replicas > 1) loses ranks `lost`
// without rolling anything back: every shard drops its backups on lost
// ranks, and a shard whose primary's rank is lost takes its first backup
// left as primary (every backup holds every update its primary
// acknowledged: worker/replication.cc). Data-parallel tables drop their
// replicas on lost ranks while one is left. Returns the shards promoted;
// what still lies on a lost rank afterwards (a shard with no copy left, a
// data-parallel table's last replica) is the checkpoint's to bring back.
int PromoteCopies(const std::set<int>& lost, ember::v1::ShardingPlan* plan);

// Held shards of a replicated collection with fewer than replicas - 1
// backups (0 for a collection of one copy).
int MissingCopies(const ember::v1::CollectionInfo& info);

// "rank R (ADDRESS), ..." for messages, addresses from `info`.
std::string DescribeRanks(const ember::v1::CollectionInfo& info, const std::set<int>& ranks);

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_REPLACEMENT_POLICY_H_
