// ShardRegistry: the shards a backend holds, by the ShardId it handed out
// for each, shared by the CPU and CUDA backends (each with its own Shard
// type). It owns the shards and answers the calls every backend answers
// the same way: NOT_FOUND for an id it does not hold (ShardNotFound), a
// shard's spec, and its optimizer step out (ExportStep) and in
// (ImportStep). The backend's memory budget stays the backend's: it
// reserves a shard's bytes before allocating, outside its lock.
//
// `Shard` has `ShardSpec spec` and `int64_t step`. Not thread-safe: the
// backend's mutex guards it.
#ifndef EMBER_SERVER_BACKEND_SHARD_REGISTRY_H_
#define EMBER_SERVER_BACKEND_SHARD_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

template <typename Shard>
class ShardRegistry {
 public:
  // Shard `id`, or nullptr.
  Shard* Find(ShardId id) const {
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second.get();
  }
  // Holds `shard` under a new id (never one handed out before).
  ShardId Add(std::unique_ptr<Shard> shard) {
    const ShardId id = next_id_++;
    shards_.emplace(id, std::move(shard));
    return id;
  }
  // Lets go of shard `id`, handing it back (NOT_FOUND).
  absl::StatusOr<std::unique_ptr<Shard>> Remove(ShardId id) {
    auto it = shards_.find(id);
    if (it == shards_.end()) return ShardNotFound(id);
    std::unique_ptr<Shard> shard = std::move(it->second);
    shards_.erase(it);
    return shard;
  }
  void Clear() { shards_.clear(); }

  absl::StatusOr<ShardSpec> Spec(ShardId id) const {
    const Shard* s = Find(id);
    if (s == nullptr) return ShardNotFound(id);
    return s->spec;
  }
  // EmbeddingBackend::ExportStep and ImportStep (INVALID_ARGUMENT for a
  // step < 0, after NOT_FOUND).
  absl::StatusOr<int64_t> Step(ShardId id) const {
    const Shard* s = Find(id);
    if (s == nullptr) return ShardNotFound(id);
    return s->step;
  }
  absl::Status SetStep(ShardId id, int64_t step) {
    Shard* s = Find(id);
    if (s == nullptr) return ShardNotFound(id);
    if (step < 0) return absl::InvalidArgumentError("step must be >= 0");
    s->step = step;
    return absl::OkStatus();
  }

 private:
  std::map<ShardId, std::unique_ptr<Shard>> shards_;
  ShardId next_id_ = 0;
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_SHARD_REGISTRY_H_
