#include "server/backend/cuda/request_plan.h"

#include <algorithm>
#include <cstring>

#include <map>
#include <set>

#include "cuda/kernel_bodies.h"

namespace ember {
namespace backend {


static_assert(cuda::kernels::kFp16 == static_cast<int32_t>(WeightType::kFp16) &&
                  cuda::kernels::kBf16 == static_cast<int32_t>(WeightType::kBf16) &&
                  cuda::kernels::kMean == static_cast<int32_t>(Pooling::kMean) &&
                  cuda::kernels::kNone == static_cast<int32_t>(Pooling::kNone),
              "the cuda::kernels' enum codes");

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
    cuda::LookupDesc& d = p.descs[i];
    d = cuda::LookupDesc{};
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
    p.total_out += backend::OutputSize(f, s.spec->dim);  // packed, whatever the stride
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
    cuda::UpdateDesc u{};
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
    u.guard = s.guard ? 1 : 0;
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
    cuda::GradDesc& d = p.descs[i];
    d = cuda::GradDesc{};
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

cuda::OverflowRecord FreshRecord() {
  cuda::OverflowRecord r{};
  r.first_key = ~0ull;
  r.bad = -1;
  return r;
}

void NoteMaxima(const cuda::OverflowRecord& record, backend::OverflowReport* report) {
  float w, a;
  std::memcpy(&w, &record.max_weight_bits, sizeof(w));
  std::memcpy(&a, &record.max_acc_bits, sizeof(a));
  report->max_weight = std::max(report->max_weight, static_cast<double>(w));
  report->max_acc = std::max(report->max_acc, static_cast<double>(a));
}

backend::OverflowReport ReportOf(const GradientPlan& plan, const cuda::OverflowRecord& record,
                                 backend::ShardId* shard) {
  backend::OverflowReport r;
  const uint64_t key = record.first_key;
  const size_t s =
      std::upper_bound(plan.key_base.begin(), plan.key_base.end(), key) - plan.key_base.begin() - 1;
  *shard = plan.slots[s];
  const int64_t dim = plan.updates[s].dim;
  r.row = static_cast<int64_t>(key - plan.key_base[s]);
  r.state = record.bad >= dim;
  r.col = r.state ? record.bad - dim : record.bad;
  r.value = record.value;
  return r;
}

CallSize SizeOf(const LookupPlan& plan) {
  CallSize s;
  s.requests = static_cast<int64_t>(plan.descs.size());
  s.bags = plan.total_bags;
  s.ids = plan.total_ids;
  s.dense = plan.total_out;
  s.weighted = plan.any_weighted;
  return s;
}

CallSize SizeOf(const GradientPlan& plan) {
  CallSize s;
  s.requests = static_cast<int64_t>(plan.descs.size());
  s.bags = plan.total_bags;
  s.ids = plan.total_ids;
  s.dense = plan.total_grad;
  s.shards = static_cast<int64_t>(plan.slots.size());
  s.max_dim = plan.max_dim;
  s.end_bit = plan.end_bit;
  s.weighted = plan.any_weighted;
  return s;
}

LookupLayout LayOutLookup(const CallSize& size, size_t temp_bytes) {
  LookupLayout l;
  Layout in;
  l.item_begin = in.Add<int64_t>(size.requests + 1);
  l.descs = in.Add<cuda::LookupDesc>(size.requests);
  l.lengths = in.Add<int64_t>(size.bags);
  l.ids = in.Add<int64_t>(size.ids);
  l.weights = in.Add<float>(size.weighted ? size.ids : 0);
  l.in_bytes = in.bytes();
  Layout dev = in, host = in;
  l.offsets = dev.Add<int64_t>(size.bags + 1);
  l.out = dev.Add<float>(size.dense);
  l.temp = dev.Add<char>(static_cast<int64_t>(temp_bytes));
  l.device_bytes = dev.bytes();
  l.host_out = host.Add<float>(size.dense);
  l.host_bytes = host.bytes();
  return l;
}

int64_t MaxHotUnits(int64_t ids) { return 2 * (ids / cuda::kernels::kHotRun) + 1; }

GradientLayout LayOutGradients(const CallSize& size, size_t temp_bytes) {
  GradientLayout l;
  const int64_t n = size.requests, ids = size.ids;
  Layout in;
  l.id_begin = in.Add<int64_t>(n + 1);
  l.descs = in.Add<cuda::GradDesc>(n);
  l.updates = in.Add<cuda::UpdateDesc>(size.shards);
  l.key_base = in.Add<uint64_t>(size.shards + 1);
  l.lengths = in.Add<int64_t>(size.bags);
  l.ids = in.Add<int64_t>(ids);
  l.weights = in.Add<float>(size.weighted ? ids : 0);
  l.grads = in.Add<float>(size.dense);
  l.in_bytes = in.bytes();
  Layout dev = in;
  l.offsets = dev.Add<int64_t>(size.bags + 1);
  l.keys_a = dev.Add<uint64_t>(ids);
  l.keys_b = dev.Add<uint64_t>(ids);
  l.pos_a = dev.Add<int64_t>(ids);
  l.pos_b = dev.Add<int64_t>(ids);
  l.src_off = dev.Add<int64_t>(ids);
  l.scale = dev.Add<float>(ids);
  l.run_id = dev.Add<int64_t>(ids);
  l.run_begin = dev.Add<int64_t>(ids + 1);
  l.max_units = MaxHotUnits(ids);
  l.hot_units = dev.Add<int64_t>(ids);
  l.hot_end = dev.Add<int64_t>(ids);
  l.partials = dev.Add<float>(l.max_units * size.max_dim);
  l.temp = dev.Add<char>(static_cast<int64_t>(temp_bytes));
  l.device_bytes = dev.bytes();
  return l;
}

}  // namespace backend
}  // namespace ember
