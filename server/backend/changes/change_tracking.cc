#include "server/backend/changes/change_tracking.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/forwarding_backend.h"

namespace ember {
namespace backend {
namespace {

uint64_t NewLineage() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t seed = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }();
  // SplitMix64 of seed + counter: distinct within a process, random across.
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (counter.fetch_add(1) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) | 1;  // never 0: 0 means "no mark"
}

// One shard's generations.
struct Tracked {
  explicit Tracked(int64_t n) : rows(n), version(new std::atomic<uint32_t>[n]) { Reset(); }
  void Reset() {
    lineage = NewLineage();
    generation.store(1, std::memory_order_relaxed);
    whole.store(0, std::memory_order_relaxed);
    for (int64_t r = 0; r < rows; ++r) version[r].store(0, std::memory_order_relaxed);
  }
  uint32_t Now() const { return generation.load(std::memory_order_relaxed); }
  void Stamp(int64_t row, uint32_t g) {
    if (row >= 0 && row < rows) version[row].store(g, std::memory_order_relaxed);
  }
  // Rows [begin, end) clamped to the shard (a refused call's range may be
  // anything).
  void StampRange(int64_t begin, int64_t end, uint32_t g) {
    for (int64_t r = std::max<int64_t>(begin, 0); r < std::min(end, rows); ++r) {
      version[r].store(g, std::memory_order_relaxed);
    }
  }

  const int64_t rows;
  uint64_t lineage = 0;              // changed only by MarkChanges (fenced)
  std::atomic<uint32_t> generation;  // the one changes are stamped with now
  std::atomic<uint32_t> whole;       // every row changed in this generation
  std::unique_ptr<std::atomic<uint32_t>[]> version;  // [rows]
};

class ChangeTrackingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    auto id = inner()->CreateShard(spec);
    if (!id.ok()) return id;
    auto spec_made = inner()->GetShardSpec(*id);  // a wrapper below may add rows
    const int64_t rows = spec_made.ok() ? spec_made->rows : spec.rows;
    auto tracked = std::make_shared<Tracked>(rows);
    absl::MutexLock lock(&mu_);
    shards_[*id] = std::move(tracked);
    return id;
  }
  absl::Status DropShard(ShardId id) override {
    absl::Status s = inner()->DropShard(id);
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      shards_.erase(id);
    }
    return s;
  }

  // Stamped whatever the wrapped backend answers: a call refused after it
  // applied a part (a device error between pieces) must not leave changed
  // rows out, and a superset is always right.
  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    absl::Status s = inner()->ApplyGradients(requests);
    for (const GradientRequest& r : requests) {
      const std::shared_ptr<Tracked> t = Find(r.feature.shard);
      if (t == nullptr) continue;
      const uint32_t g = t->Now();
      if (r.feature.on_device) {
        t->whole.store(g, std::memory_order_relaxed);
        continue;
      }
      for (const int64_t row : r.feature.ids) t->Stamp(row, g);
    }
    return s;
  }

  absl::Status ImportRows(ShardId id, int64_t begin, int64_t end, absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    absl::Status s = inner()->ImportRows(id, begin, end, weights, state);
    if (const std::shared_ptr<Tracked> t = Find(id)) {
      // Stamped even on a refusal: a superset is always right.
      t->StampRange(begin, end, t->Now());
    }
    return s;
  }
  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    absl::Status s = inner()->ImportRowsAt(id, rows, weights, state);
    if (const std::shared_ptr<Tracked> t = Find(id)) {
      const uint32_t g = t->Now();
      for (const int64_t r : rows) t->Stamp(r, g);
    }
    return s;
  }

  absl::StatusOr<ChangeMark> MarkChanges(ShardId id) override {
    const std::shared_ptr<Tracked> t = Find(id);
    if (t == nullptr) return NoShard(id);
    const uint32_t g = t->Now();
    if (g == std::numeric_limits<uint32_t>::max()) {
      // Generations ran out: a new lineage (its next checkpoint is whole),
      // marked at 1 with later changes in 2, as any first mark.
      t->Reset();
      t->generation.store(2, std::memory_order_relaxed);
      return ChangeMark{t->lineage, 1};
    }
    t->generation.store(g + 1, std::memory_order_relaxed);
    return ChangeMark{t->lineage, g};
  }

  absl::StatusOr<std::vector<int64_t>> ChangedRowsIn(ShardId id, const ChangeMark& since,
                                                     int64_t begin, int64_t end) const override {
    const std::shared_ptr<Tracked> t = Find(id);
    if (t == nullptr) return NoShard(id);
    if (begin < 0 || begin > end) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", id, ": row range [", begin, ", ", end, ") is reversed"));
    }
    end = std::min(end, t->rows);
    begin = std::min(begin, end);
    const uint32_t now = t->Now();
    if (since.lineage != t->lineage || since.generation < 1 || since.generation >= now) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", id, ": the mark (lineage ", since.lineage, ", generation ", since.generation,
          ") is not one of this shard's (lineage ", t->lineage, ", generation ", now, ")"));
    }
    std::vector<int64_t> rows;
    const uint32_t after = static_cast<uint32_t>(since.generation);
    if (t->whole.load(std::memory_order_relaxed) > after) {
      rows.resize(end - begin);
      for (int64_t r = begin; r < end; ++r) rows[r - begin] = r;
      return rows;
    }
    for (int64_t r = begin; r < end; ++r) {
      if (t->version[r].load(std::memory_order_relaxed) > after) rows.push_back(r);
    }
    return rows;
  }

 private:
  std::shared_ptr<Tracked> Find(ShardId id) const {
    absl::ReaderMutexLock lock(&mu_);
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second;
  }
  static absl::Status NoShard(ShardId id) {
    return absl::NotFoundError(absl::StrCat("no shard ", id));
  }

  mutable absl::Mutex mu_;
  absl::flat_hash_map<ShardId, std::shared_ptr<Tracked>> shards_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<EmbeddingBackend> WithChangeTracking(std::unique_ptr<EmbeddingBackend> inner) {
  return std::make_unique<ChangeTrackingBackend>(std::move(inner));
}

}  // namespace backend
}  // namespace ember
