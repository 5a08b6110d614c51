#include "server/coordinator/state_store.h"

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "leveldb/db.h"
#include "leveldb/write_batch.h"

namespace ember {
namespace coordinator {
namespace {

constexpr char kEpoch[] = "meta/epoch";
constexpr char kNextWorker[] = "meta/next_worker";
constexpr char kWorker[] = "worker/";
constexpr char kCollection[] = "collection/";
constexpr char kCheckpoint[] = "checkpoint/";

absl::Status FromLevelDb(const leveldb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  const std::string message = absl::StrCat("state store: ", what, ": ", s.ToString());
  if (s.IsCorruption()) return absl::DataLossError(message);
  if (s.IsIOError()) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

// Checkpoints sort by creation time, then path.
std::string CheckpointKey(const ember::v1::CheckpointInfo& c) {
  char ms[24];
  std::snprintf(ms, sizeof(ms), "%020lld", static_cast<long long>(c.created_unix_ms()));
  return absl::StrCat(kCheckpoint, ms, "/", c.path());
}

}  // namespace

StateStore::StateStore(leveldb::DB* db) : db_(db) {}
StateStore::~StateStore() = default;

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("state_dir is empty");
  leveldb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;
  leveldb::DB* db = nullptr;
  if (absl::Status s = FromLevelDb(leveldb::DB::Open(o, dir, &db), "opening " + dir); !s.ok()) {
    return s;
  }
  return std::unique_ptr<StateStore>(new StateStore(db));
}

absl::StatusOr<StateStore::State> StateStore::Load() const {
  State state;
  leveldb::ReadOptions ro;
  ro.verify_checksums = true;
  std::unique_ptr<leveldb::Iterator> it(db_->NewIterator(ro));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString();
    const std::string value = it->value().ToString();
    bool ok = true;
    if (key == kEpoch) {
      ok = absl::SimpleAtoi(value, &state.epoch);
    } else if (key == kNextWorker) {
      ok = absl::SimpleAtoi(value, &state.next_worker);
    } else if (absl::StartsWith(key, kWorker)) {
      ok = state.workers.emplace_back().ParseFromString(value);
    } else if (absl::StartsWith(key, kCollection)) {
      ok = state.collections.emplace_back().ParseFromString(value);
    } else if (absl::StartsWith(key, kCheckpoint)) {
      ok = state.checkpoints.emplace_back().ParseFromString(value);
    }
    if (!ok) return absl::DataLossError(absl::StrCat("state store: bad record '", key, "'"));
  }
  if (absl::Status s = FromLevelDb(it->status(), "reading"); !s.ok()) return s;
  return state;
}

StateStore::Batch& StateStore::Batch::Epoch(int64_t epoch) {
  puts_.emplace_back(kEpoch, absl::StrCat(epoch));
  return *this;
}
StateStore::Batch& StateStore::Batch::NextWorker(int64_t seq) {
  puts_.emplace_back(kNextWorker, absl::StrCat(seq));
  return *this;
}
StateStore::Batch& StateStore::Batch::PutWorker(const ember::v1::StoredWorker& w) {
  puts_.emplace_back(absl::StrCat(kWorker, w.worker_id()), w.SerializeAsString());
  return *this;
}
StateStore::Batch& StateStore::Batch::DeleteWorker(const std::string& worker_id) {
  deletes_.push_back(absl::StrCat(kWorker, worker_id));
  return *this;
}
StateStore::Batch& StateStore::Batch::PutCollection(const ember::v1::StoredCollection& c) {
  puts_.emplace_back(absl::StrCat(kCollection, c.info().spec().name()), c.SerializeAsString());
  return *this;
}
StateStore::Batch& StateStore::Batch::DeleteCollection(const std::string& name) {
  deletes_.push_back(absl::StrCat(kCollection, name));
  return *this;
}
StateStore::Batch& StateStore::Batch::PutCheckpoint(const ember::v1::CheckpointInfo& c) {
  puts_.emplace_back(CheckpointKey(c), c.SerializeAsString());
  return *this;
}
StateStore::Batch& StateStore::Batch::DeleteCheckpoint(const ember::v1::CheckpointInfo& c) {
  deletes_.push_back(CheckpointKey(c));
  return *this;
}

absl::Status StateStore::Write(const Batch& batch) {
  leveldb::WriteBatch b;
  for (const std::string& k : batch.deletes_) b.Delete(k);
  for (const auto& [k, v] : batch.puts_) b.Put(k, v);
  leveldb::WriteOptions wo;
  wo.sync = true;  // durable before the coordinator answers
  return FromLevelDb(db_->Write(wo, &b), "writing");
}

}  // namespace coordinator
}  // namespace ember
