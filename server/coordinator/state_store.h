// StateStore: the coordinator's durable state under --state_dir, in LevelDB
// (Debian's libleveldb; chosen over SQLite because the state is a handful of
// keyed records written whole, and LevelDB's synced WriteBatch gives the one
// thing needed: several records replaced atomically and durably before the
// coordinator answers). Records: the epoch counter, the worker registry,
// every collection (spec, plan, addresses, state, the worker id per rank)
// and the checkpoint catalogue.
//
// Thread-safe: LevelDB serialises writers; callers order their own updates.
#ifndef EMBER_SERVER_COORDINATOR_STATE_STORE_H_
#define EMBER_SERVER_COORDINATOR_STATE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/service.pb.h"

namespace leveldb {
class DB;
}

namespace ember {
namespace coordinator {

class StateStore {
 public:
  // Opens (creating if needed) the store in `dir`. UNAVAILABLE if another
  // process holds it; DATA_LOSS if it is corrupt.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& dir);
  ~StateStore();

  struct State {
    int64_t epoch = 0;        // the last plan epoch handed out
    int64_t next_worker = 0;  // the last worker sequence number
    std::vector<ember::v1::StoredWorker> workers;
    std::vector<ember::v1::StoredCollection> collections;
    std::vector<ember::v1::CheckpointInfo> checkpoints;  // oldest first
  };
  absl::StatusOr<State> Load() const;

  // One atomic, synced write: the records to put and the keys to delete.
  class Batch {
   public:
    Batch& Epoch(int64_t epoch);
    Batch& NextWorker(int64_t seq);
    Batch& PutWorker(const ember::v1::StoredWorker& w);
    Batch& DeleteWorker(const std::string& worker_id);
    Batch& PutCollection(const ember::v1::StoredCollection& c);
    Batch& DeleteCollection(const std::string& name);
    Batch& PutCheckpoint(const ember::v1::CheckpointInfo& c);
    Batch& DeleteCheckpoint(const ember::v1::CheckpointInfo& c);

   private:
    friend class StateStore;
    std::vector<std::pair<std::string, std::string>> puts_;
    std::vector<std::string> deletes_;
  };
  absl::Status Write(const Batch& batch);

 private:
  explicit StateStore(leveldb::DB* db);
  std::unique_ptr<leveldb::DB> db_;
};

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_STATE_STORE_H_
