// RehashTarget (rehash.h).
#include "server/checkpoint/rehash.h"

#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/common/dynamic_route.h"

namespace ember {
namespace checkpoint {

RehashTarget::RehashTarget(const backend::ShardSpec& spec)
    : spec_(spec), state_width_(backend::OptimizerStateWidth(spec.optimizer.type, spec.dim)) {}

absl::Status RehashTarget::Take(const ember::v1::CheckpointShard& source, const ShardData& data) {
  const std::string what = absl::StrCat("checkpoint file ", source.file());
  if (!source.dynamic() || static_cast<int64_t>(data.slot_meta.size()) !=
                               data.rows * backend::EmbeddingBackend::kSlotMetaFields) {
    return absl::DataLossError(absl::StrCat(what, ": not a dynamic table's shard"));
  }
  if (data.cols != spec_.dim || data.state_width != state_width_) {
    return absl::DataLossError(absl::StrCat(what, ": rows of ", data.cols, " + ",
                                            data.state_width, " state; the table's are ",
                                            spec_.dim, " + ", state_width_));
  }
  auto slots = backend::EmbeddingBackend::UnpackSlots(data.slot_meta);
  if (!slots.ok()) return absl::DataLossError(absl::StrCat(what, ": ", slots.status().message()));
  absl::flat_hash_set<int64_t> held;
  for (const Row& r : rows_) held.insert(r.id);
  std::vector<Row> taken;
  const Router router(spec_.table_rows);
  for (int64_t s = 0; s < data.rows; ++s) {
    const backend::EmbeddingBackend::SlotMeta& m = (*slots)[s];
    if (!m.held) continue;
    const int64_t row = router.Row(m.id);
    if (row < spec_.row_offset || row >= spec_.row_offset + spec_.rows) continue;
    if (!held.insert(m.id).second) {
      return absl::DataLossError(absl::StrCat(what, ": id ", m.id, " is held twice"));
    }
    taken.push_back(Row{m.id, m.last_step, m.updates, m.order, static_cast<size_t>(s)});
  }
  std::vector<int64_t> pending;  // the admission counts this target owns
  if (absl::Status s = backend::EmbeddingBackend::CheckPendingCounts(data.pending_counts);
      !s.ok()) {
    return absl::DataLossError(absl::StrCat(what, ": ", s.message()));
  }
  for (size_t k = 0; k < data.pending_counts.size(); k += 2) {
    const int64_t id = data.pending_counts[k], count = data.pending_counts[k + 1];
    const int64_t row = router.Row(id);
    if (row < spec_.row_offset || row >= spec_.row_offset + spec_.rows) continue;
    pending.push_back(id);
    pending.push_back(count);
  }
  if (absl::Status s = backend::EmbeddingBackend::AddPendingSketch(data.pending_sketch, &sketch_);
      !s.ok()) {  // (checked before it adds anything)
    return absl::DataLossError(absl::StrCat(what, ": pending sketch: ", s.message()));
  }
  pending_.insert(pending_.end(), pending.begin(), pending.end());
  for (Row& r : taken) {
    const size_t s = r.at;
    r.at = rows_.size();
    weights_.insert(weights_.end(), data.weights.begin() + s * data.cols,
                    data.weights.begin() + (s + 1) * data.cols);
    state_.insert(state_.end(), data.state.begin() + s * state_width_,
                  data.state.begin() + (s + 1) * state_width_);
    rows_.push_back(r);
  }
  step_ = std::max(step_, data.step);
  return absl::OkStatus();
}

void RehashTarget::Finish(std::vector<float>* weights, std::vector<float>* state,
                          std::vector<backend::EmbeddingBackend::SlotMeta>* slots,
                          int64_t* dropped) const {
  std::vector<Row> kept = rows_;
  const bool lfu = spec_.dynamic.eviction == backend::Eviction::kLfu;
  auto key = [&](const Row& r) {
    return std::make_tuple(lfu ? r.updates : 0, r.last_step, r.id);
  };
  *dropped = 0;
  if (static_cast<int64_t>(kept.size()) > spec_.rows) {
    // The rows the eviction rule keeps: the largest keys.
    std::sort(kept.begin(), kept.end(), [&](const Row& a, const Row& b) { return key(a) > key(b); });
    *dropped = static_cast<int64_t>(kept.size()) - spec_.rows;
    kept.resize(spec_.rows);
  }
  std::sort(kept.begin(), kept.end(), [](const Row& a, const Row& b) { return a.id < b.id; });
  weights->assign(spec_.rows * spec_.dim, 0.0f);
  state->assign(spec_.rows * state_width_, 0.0f);
  slots->assign(spec_.rows, backend::EmbeddingBackend::SlotMeta{});
  for (size_t k = 0; k < kept.size(); ++k) {
    const Row& r = kept[k];
    std::copy_n(weights_.begin() + r.at * spec_.dim, spec_.dim, weights->begin() + k * spec_.dim);
    std::copy_n(state_.begin() + r.at * state_width_, state_width_,
                state->begin() + k * state_width_);
    (*slots)[k] = backend::EmbeddingBackend::SlotMeta{r.id, r.last_step, r.updates, true, r.order};
  }
}

}  // namespace checkpoint
}  // namespace ember
