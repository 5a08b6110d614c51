// Request planning for the CUDA backend, CUDA-free: from a Lookup or
// ApplyGradients call (already validated) to the descriptor tables the
// kernels read (kernel_descs.h), the totals that size the buffers, and the
// radix sort's bit count. Both the CUDA backend and the emulated one use it;
// request_plan_test pins it on the CPU.
#ifndef EMBER_SERVER_BACKEND_CUDA_REQUEST_PLAN_H_
#define EMBER_SERVER_BACKEND_CUDA_REQUEST_PLAN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/types/span.h"
#include "cuda/kernel_descs.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/overflow_guard.h"

namespace ember {
namespace backend {

// What a plan needs to know of a shard: where its weights and state live
// (device or host), its spec and its Adam step before this call.
struct ShardView {
  void* weights = nullptr;
  float* state = nullptr;
  const backend::ShardSpec* spec = nullptr;
  int64_t state_width = 0;
  int64_t step = 0;
  bool guard = false;  // this call checks its rows first (cuda::UpdateDesc::guard)
};
using ShardResolver = std::function<ShardView(backend::ShardId)>;

struct LookupPlan {
  std::vector<int64_t> item_begin;  // [requests + 1]: work items per request, scanned
  std::vector<cuda::LookupDesc> descs;    // [requests]
  int64_t total_items = 0;          // bags of pooled features + ids of NONE ones
  int64_t total_bags = 0;
  int64_t total_ids = 0;
  int64_t total_out = 0;            // floats
  bool any_weighted = false;
};

LookupPlan PlanLookup(absl::Span<const backend::LookupRequest> requests,
                      const ShardResolver& shard);

struct GradientPlan {
  // Shards with at least one id, in id order (their slot); only these take
  // an update, with key range [key_base[s], key_base[s + 1]).
  std::vector<backend::ShardId> slots;
  std::vector<cuda::UpdateDesc> updates;  // [slots], with this call's step (old + 1)
  std::vector<uint64_t> key_base;   // [slots + 1]
  // Shards the call names without any id: they take an Adam step only.
  std::vector<backend::ShardId> idle;
  std::vector<int64_t> id_begin;    // [requests + 1]
  std::vector<cuda::GradDesc> descs;      // [requests]
  int64_t total_bags = 0;
  int64_t total_ids = 0;
  int64_t total_grad = 0;           // floats
  int64_t max_dim = 4;              // over the updated shards
  int end_bit = 1;                  // sort key bits: keys < 2^end_bit
  bool any_weighted = false;
};

GradientPlan PlanGradients(absl::Span<const backend::GradientRequest> requests,
                           const ShardResolver& shard);

// Decides, for each shard with ids in the call, whether its rows must be
// checked before they are applied (overflow_guard.h's GuardStep, at the
// shard's next step), setting its guard and (when not) its bounds after
// the call; returns whether any must. Each request's merged gradients are
// bounded from grad_max[i] (its largest |gradient|) or, for inputs on the
// device, from device_max: the call's largest |gradient| and |weight|.
// `find` gives a backend's shard (spec, step, bounds, guard, after) and
// `measure(shard)` its measured bounds.
template <typename Find, typename Measure>
bool DecideGuards(absl::Span<const backend::GradientRequest> requests,
                  absl::Span<const float> grad_max, const float* device_max, Find&& find,
                  Measure&& measure) {
  std::map<backend::ShardId, double> merged;
  for (size_t i = 0; i < requests.size(); ++i) {
    const backend::FeatureRequest& f = requests[i].feature;
    if (f.ids.empty()) continue;
    const double n = static_cast<double>(f.ids.size());
    // On the device each id's scale is at most the largest |weight| (MEAN's
    // 1/length is at most 1).
    merged[f.shard] += device_max == nullptr
                           ? backend::MergedGradientBound(f, grad_max[i])
                           : backend::MergedBound(n * (f.weights.empty() ? 1.0 : device_max[1]),
                                                  n, device_max[0]);
  }
  bool any = false;
  for (auto& [id, bound] : merged) {
    auto* s = find(id);
    const backend::math::StepParams p = backend::MakeStepParams(s->spec.optimizer, s->step + 1);
    s->guard = !backend::GuardStep(s->spec, p, &s->bounds, bound, &s->after,
                                   [&measure, s] { return measure(*s); });
    any |= s->guard;
  }
  return any;
}

// The end of an applied ApplyGradients call: every shard it names takes its
// step (ids or not: the interface rule), and each updated one its bounds
// after it (overflow_guard.h): the decision's, or from what the checks saw
// for a guarded one. `find` gives a backend's shard (with step, bounds,
// guard and after).
template <typename Find>
void FinishGradients(const GradientPlan& plan, const backend::OverflowReport& seen, Find&& find) {
  for (backend::ShardId id : plan.idle) ++find(id)->step;
  for (backend::ShardId id : plan.slots) {
    auto* s = find(id);
    ++s->step;
    s->bounds = s->guard ? backend::BoundsAfterCheck(s->spec, s->bounds, seen) : s->after;
    s->guard = false;
  }
}

// A record ready for a check launch: first_key UINT64_MAX, the rest 0.
cuda::OverflowRecord FreshRecord();
// The largest values a record saw, as overflow_guard.h's report holds them.
void NoteMaxima(const cuda::OverflowRecord& record, backend::OverflowReport* report);
// The misfit a kReportRow launch of `plan` filled `record` with: its shard
// (*shard) and row, element and value.
backend::OverflowReport ReportOf(const GradientPlan& plan, const cuda::OverflowRecord& record,
                                 backend::ShardId* shard);

// Byte offsets of arrays carved out of one buffer, each 256-byte aligned.
class Layout {
 public:
  template <typename T>
  size_t Add(int64_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    const size_t at = offset_;
    offset_ += static_cast<size_t>(count) * sizeof(T);
    return at;
  }
  size_t bytes() const { return offset_; }

 private:
  size_t offset_ = 0;
};

// The sizes that decide how much scratch (device) and staging (pinned host)
// memory a call needs.
struct CallSize {
  int64_t requests = 0;
  int64_t bags = 0;
  int64_t ids = 0;
  int64_t dense = 0;    // floats: the outputs of a lookup, the gradients
  int64_t shards = 0;   // gradients: the shards updated
  int64_t max_dim = 4;  // gradients: over the shards updated
  int end_bit = 1;      // gradients: the sort's key bits
  bool weighted = false;
};
CallSize SizeOf(const LookupPlan& plan);
CallSize SizeOf(const GradientPlan& plan);

// Where a lookup's arrays live. The inputs come first and are laid out alike
// in staging and scratch (so they upload as one block); the scratch goes on
// with the bag offsets, the output and the scan's temporary storage, the
// staging with the output as it comes back.
struct LookupLayout {
  size_t item_begin, descs, lengths, ids, weights, in_bytes;
  size_t offsets, out, temp, device_bytes;
  size_t host_out, host_bytes;
};
LookupLayout LayOutLookup(const CallSize& size, size_t temp_bytes);

// Where a backward pass's arrays live: inputs as for a lookup (staging holds
// only those), then the sort's pairs, runs, hot-row chunks and their partial
// sums, and the scans' and sort's temporary storage.
struct GradientLayout {
  size_t id_begin, descs, updates, key_base, lengths, ids, weights, grads, in_bytes;
  size_t offsets, keys_a, keys_b, pos_a, pos_b, src_off, scale, run_id, run_begin;
  size_t hot_units, hot_end, partials, temp, device_bytes;
  int64_t max_units;  // hot-row chunks at most: runs longer than kHotRun
};
GradientLayout LayOutGradients(const CallSize& size, size_t temp_bytes);

// Hot-row chunks a backward pass over `ids` ids can have at most: runs
// longer than kHotRun are cut into chunks of kHotRun, so 2 * ids / kHotRun.
int64_t MaxHotUnits(int64_t ids);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CUDA_REQUEST_PLAN_H_
