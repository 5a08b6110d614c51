#include "cuda/request_plan.h"

#include <map>
#include <set>

namespace ember {
namespace cuda {

using backend::FeatureRequest;
using backend::Pooling;
using backend::ShardId;
using backend::WeightType;

LookupPlan PlanLookup(absl::Span<const backend::LookupRequest> requests,
                      const ShardResolver& shard) {
  LookupPlan p;
  const size_t n = requests.size();
  p.item_begin.resize(n + 1);
  p.descs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const FeatureRequest& f = requests[i].feature;
    const ShardView s = shard(f.shard);
    p.item_begin[i] = p.total_items;
    LookupDesc& d = p.descs[i];
    d = LookupDesc{};
    d.weights = s.weights;
    d.dim = s.spec->dim;
    d.bag_begin = p.total_bags;
    d.id_begin = p.total_ids;
    d.out_begin = p.total_out;
    d.weight_type = static_cast<int32_t>(s.spec->weight_type);
    d.pooling = static_cast<int32_t>(f.pooling);
    d.weighted = f.weights.empty() ? 0 : 1;
    p.total_items +=
        static_cast<int64_t>(f.pooling == Pooling::kNone ? f.ids.size() : f.lengths.size());
    p.total_bags += static_cast<int64_t>(f.lengths.size());
    p.total_ids += static_cast<int64_t>(f.ids.size());
    p.total_out += static_cast<int64_t>(requests[i].output.size());
    p.any_weighted |= !f.weights.empty();
  }
  p.item_begin[n] = p.total_items;
  return p;
}

GradientPlan PlanGradients(absl::Span<const backend::GradientRequest> requests,
                           const ShardResolver& shard) {
  GradientPlan p;
  const size_t n = requests.size();
  std::map<ShardId, int64_t> slot_of;
  std::set<ShardId> named;
  for (const backend::GradientRequest& r : requests) {
    named.insert(r.feature.shard);
    if (!r.feature.ids.empty()) slot_of.emplace(r.feature.shard, 0);
  }
  for (ShardId id : named) {
    if (!slot_of.count(id)) p.idle.push_back(id);
  }
  p.key_base.push_back(0);
  for (auto& [id, slot] : slot_of) {
    slot = static_cast<int64_t>(p.slots.size());
    p.slots.push_back(id);
    const ShardView s = shard(id);
    const backend::ShardSpec& spec = *s.spec;
    UpdateDesc u{};
    u.weights = s.weights;
    u.state = s.state_width > 0 ? s.state : nullptr;
    u.dim = spec.dim;
    u.state_width = s.state_width;
    u.weight_type = static_cast<int32_t>(spec.weight_type);
    u.stochastic = spec.weight_type != WeightType::kFp32 && spec.optimizer.stochastic_rounding;
    u.params = backend::MakeStepParams(spec.optimizer, s.step + 1);
    u.seed = spec.initializer.seed;
    u.step = s.step + 1;
    u.row_offset = spec.row_offset;
    u.col_offset = spec.col_offset;
    p.updates.push_back(u);
    p.key_base.push_back(p.key_base.back() + static_cast<uint64_t>(spec.rows));
    p.max_dim = std::max(p.max_dim, spec.dim);
  }
  // Bits the radix sort looks at: enough for the largest key.
  const uint64_t total_rows = p.key_base.back();
  while (p.end_bit < 64 && total_rows > 0 && ((total_rows - 1) >> p.end_bit) != 0) ++p.end_bit;
  p.id_begin.resize(n + 1);
  p.descs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const FeatureRequest& f = requests[i].feature;
    p.id_begin[i] = p.total_ids;
    GradDesc& d = p.descs[i];
    d = GradDesc{};
    d.dim = shard(f.shard).spec->dim;
    d.bag_begin = p.total_bags;
    d.num_bags = static_cast<int64_t>(f.lengths.size());
    d.grad_begin = p.total_grad;
    d.key_base = f.ids.empty() ? 0 : p.key_base[slot_of.at(f.shard)];
    d.pooling = static_cast<int32_t>(f.pooling);
    d.weighted = f.weights.empty() ? 0 : 1;
    p.total_bags += d.num_bags;
    p.total_ids += static_cast<int64_t>(f.ids.size());
    p.total_grad += static_cast<int64_t>(requests[i].grad.size());
    p.any_weighted |= !f.weights.empty();
  }
  p.id_begin[n] = p.total_ids;
  return p;
}

}  // namespace cuda
}  // namespace ember
