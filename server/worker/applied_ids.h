// AppliedIds: the exactly-once record of one shard: which update request ids
// it has applied, for at least `ttl` (and at most `window` ids: past that the
// oldest are forgotten early, and the caller counts them). Kept per shard,
// not per worker, so that a shard moved to another worker (drain) takes its
// record along (Entries / Merge): a retried update is then applied to each
// shard exactly once wherever the shard lives.
//
// Ids are kept as a stable 64-bit hash of the request id (RequestIdHash),
// the same on every worker, with the update's digest where the client sent
// one (WorkerApplyGradientsRequest.request_digest): an id reused for other
// content is told apart from a retry. A record moved with its shard (Entries,
// Merge: drains, checkpoints) keeps the ids, not the digests.
//
// Thread-compatible: the worker guards it with the collection's apply mutex.
#ifndef EMBER_SERVER_WORKER_APPLIED_IDS_H_
#define EMBER_SERVER_WORKER_APPLIED_IDS_H_

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

namespace ember {
namespace worker {

// FNV-1a over the bytes, then a SplitMix64 finaliser: stable across
// processes and builds (absl::Hash is not).
uint64_t RequestIdHash(const std::string& request_id);

class AppliedIds {
 public:
  bool Contains(uint64_t id) const { return ids_.contains(id); }
  // True when `id` was applied with a digest other than `digest` (both
  // known, i.e. non-zero).
  bool Conflicts(uint64_t id, uint64_t digest) const;
  // Records `id` (with the update's digest, 0: none) applied at `now`, then
  // forgets ids older than `ttl` and the oldest beyond `window`; returns how
  // many of those were younger than ttl.
  int64_t Add(uint64_t id, absl::Time now, absl::Duration ttl, int window, uint64_t digest = 0);
  // Every remembered id with when it was applied, oldest first.
  std::vector<std::pair<uint64_t, absl::Time>> Entries() const;
  // Adds another shard's record (oldest first), as Add does.
  int64_t Merge(const std::vector<std::pair<uint64_t, absl::Time>>& entries, absl::Time now,
                absl::Duration ttl, int window);
  size_t size() const { return ids_.size(); }

 private:
  int64_t Trim(absl::Time now, absl::Duration ttl, int window);

  absl::flat_hash_map<uint64_t, uint64_t> ids_;  // id -> digest (0: unknown)
  std::deque<std::pair<uint64_t, absl::Time>> order_;  // oldest first
};

// A record that holds for rows [begin, end) of a shard only: a shard a live
// move filled from several (each source's record came with the rows it
// gave). A request one source applied and another did not (in flight as the
// move's fence came) is then sent again for the rows that lack it alone.
struct RowsRecord {
  int64_t begin = 0, end = 0;
  AppliedIds applied;
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_APPLIED_IDS_H_
