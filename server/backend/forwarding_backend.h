// A backend that forwards every call to another one: the dynamic shards'
// wrapper (dynamic/dynamic_backend.h) and tests derive from it and override
// what they change (dynamic shards; a gate, an injected failure).
#ifndef EMBER_SERVER_BACKEND_FORWARDING_BACKEND_H_
#define EMBER_SERVER_BACKEND_FORWARDING_BACKEND_H_

#include <memory>
#include <string>
#include <utility>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

class ForwardingBackend : public EmbeddingBackend {
 public:
  explicit ForwardingBackend(std::unique_ptr<EmbeddingBackend> inner) : inner_(std::move(inner)) {}

  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    return inner_->CreateShard(spec);
  }
  absl::Status DropShard(ShardId id) override { return inner_->DropShard(id); }
  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    return inner_->GetShardSpec(id);
  }
  absl::Status Lookup(absl::Span<const LookupRequest> r) override { return inner_->Lookup(r); }
  absl::StatusOr<int64_t> Prefetch(absl::Span<const FeatureRequest> f) override {
    return inner_->Prefetch(f);
  }
  bool WritesStridedOutputs() const override { return inner_->WritesStridedOutputs(); }
  // A wrapper whose own Lookup reads the ids must say false here.
  bool ChecksIdsWhileGathering() const override { return inner_->ChecksIdsWhileGathering(); }
  Memory OutputMemory() const override { return inner_->OutputMemory(); }
  void ParallelFor(int64_t n, int64_t grain,
                   const std::function<void(int64_t, int64_t)>& fn) override {
    inner_->ParallelFor(n, grain, fn);
  }
  absl::Status ApplyGradients(absl::Span<const GradientRequest> r) override {
    return inner_->ApplyGradients(r);
  }
  int64_t OverflowSkippedRows() const override { return inner_->OverflowSkippedRows(); }
  absl::Status ExportRows(ShardId id, int64_t begin, int64_t end, absl::Span<float> weights,
                          absl::Span<float> state) const override {
    return inner_->ExportRows(id, begin, end, weights, state);
  }
  absl::Status ImportRows(ShardId id, int64_t begin, int64_t end, absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    return inner_->ImportRows(id, begin, end, weights, state);
  }
  absl::Status ExportRowsAt(ShardId id, absl::Span<const int64_t> rows, absl::Span<float> weights,
                            absl::Span<float> state) const override {
    return inner_->ExportRowsAt(id, rows, weights, state);
  }
  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    return inner_->ImportRowsAt(id, rows, weights, state);
  }
  absl::StatusOr<int64_t> ExportStep(ShardId id) const override { return inner_->ExportStep(id); }
  absl::Status ImportStep(ShardId id, int64_t step) override {
    return inner_->ImportStep(id, step);
  }
  absl::Status ExportSlots(ShardId id, int64_t begin, int64_t end,
                           absl::Span<SlotMeta> out) const override {
    return inner_->ExportSlots(id, begin, end, out);
  }
  absl::Status ImportSlots(ShardId id, int64_t begin, int64_t end,
                           absl::Span<const SlotMeta> in) override {
    return inner_->ImportSlots(id, begin, end, in);
  }
  absl::Status ImportIds(ShardId id, absl::Span<const int64_t> ids, absl::Span<const float> weights,
                         absl::Span<const float> state) override {
    return inner_->ImportIds(id, ids, weights, state);
  }
  absl::StatusOr<std::vector<int64_t>> ExportPendingCounts(ShardId id) const override {
    return inner_->ExportPendingCounts(id);
  }
  absl::Status ImportPendingCounts(ShardId id, absl::Span<const int64_t> packed) override {
    return inner_->ImportPendingCounts(id, packed);
  }
  absl::StatusOr<DynamicStats> GetDynamicStats(ShardId id) const override {
    return inner_->GetDynamicStats(id);
  }
  absl::StatusOr<std::vector<uint32_t>> ExportPendingSketch(ShardId id) const override {
    return inner_->ExportPendingSketch(id);
  }
  absl::Status MergePendingSketch(ShardId id, absl::Span<const uint32_t> counters) override {
    return inner_->MergePendingSketch(id, counters);
  }
  absl::StatusOr<TierStats> GetTierStats(ShardId id) const override {
    return inner_->GetTierStats(id);
  }
  bool FindsKeys() const override { return inner_->FindsKeys(); }
  absl::Status SyncKeyIndex(ShardId id, const math::KeyLine* lines, int64_t count,
                            absl::Span<const int64_t> changed) override {
    return inner_->SyncKeyIndex(id, lines, count, changed);
  }
  absl::StatusOr<ChangeMark> MarkChanges(ShardId id) override { return inner_->MarkChanges(id); }
  absl::StatusOr<std::vector<int64_t>> ChangedRowsIn(ShardId id, const ChangeMark& since,
                                                     int64_t begin, int64_t end) const override {
    return inner_->ChangedRowsIn(id, since, begin, end);
  }
  int64_t AvailableBytes() const override { return inner_->AvailableBytes(); }
  bool MapsHostMemory() const override { return inner_->MapsHostMemory(); }
  int64_t AvailableMappedBytes() const override { return inner_->AvailableMappedBytes(); }
  bool CachesOverHostMemory() const override { return inner_->CachesOverHostMemory(); }
  std::string Name() const override { return inner_->Name(); }
  absl::Status Health() const override { return inner_->Health(); }

 protected:
  EmbeddingBackend* inner() const { return inner_.get(); }

 private:
  std::unique_ptr<EmbeddingBackend> inner_;
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_FORWARDING_BACKEND_H_
