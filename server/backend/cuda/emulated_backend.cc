#include "server/backend/cuda/emulated_backend.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cuda/host_kernels.h"
#include "cuda/kernel_bodies.h"
#include "math/half.h"
#include "server/backend/cuda/call_split.h"
#include "server/backend/cuda/request_plan.h"
#include "server/backend/overflow_guard.h"

namespace ember {
namespace backend {
namespace {


struct Shard {
  ShardSpec spec;
  int elem_bytes = 4;
  int64_t state_width = 0;
  std::vector<uint16_t> half;  // fp16 / bf16 weights
  std::vector<float> full;     // fp32 weights
  std::vector<float> state;
  int64_t step = 0;
  backend::ValueBounds bounds;  // overflow_guard.h
  bool guard = false;           // this call's rows are checked first
  backend::ValueBounds after;   // the bounds after this call, when not
  std::vector<backend::math::KeyLine> key_lines;  // a dynamic shard's key index (SyncKeyIndex)

  void* weights() { return spec.weight_type == WeightType::kFp32 ? static_cast<void*>(full.data())
                                                                 : static_cast<void*>(half.data()); }
};

class EmulatedBackend : public backend::EmbeddingBackend {
 public:
  explicit EmulatedBackend(const EmulatedCudaOptions& options)
      : skip_overflow_(options.skip_overflow),
        limited_(options.memory_limit_bytes > 0),
        mapped_limited_(options.mapped_memory_limit_bytes > 0),
        budget_(options.memory_limit_bytes),
        mapped_budget_(options.mapped_memory_limit_bytes) {
    const size_t bytes = options.scratch_bytes == 0 ? std::numeric_limits<size_t>::max()
                                                    : options.scratch_bytes;
    scratch_.device_bytes = scratch_.host_bytes = bytes;
    scratch_.lookup_temp = [](const CallSize& s) { return cuda::HostTempBytes(s.bags); };
    scratch_.gradient_temp = [](const CallSize& s) {
      return cuda::HostTempBytes(std::max(s.bags, s.ids));
    };
  }

  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    absl::Status s = backend::ValidateShardSpec(spec, backend::kCudaColumnMultiple,
                                                /*maps_host_memory=*/true);
    if (!s.ok()) return s;
    if (backend::IsQuantized(spec.weight_type)) {
      return absl::UnimplementedError(absl::StrCat(
          "shard of table '", spec.table, "': ", backend::WeightTypeName(spec.weight_type),
          " tables are served by CPU workers (the CUDA kernels have no quantized rows yet)"));
    }
    backend::MemoryBudget& budget = spec.host_mapped ? mapped_budget_ : budget_;
    if (absl::Status s = budget.Reserve(backend::ShardBytes(spec), spec.table); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    auto shard = std::make_unique<Shard>();
    shard->spec = spec;
    shard->state_width = backend::OptimizerStateWidth(spec.optimizer.type, spec.dim);
    shard->bounds = backend::InitialBounds(spec);
    const int64_t n = spec.rows * spec.dim;
    std::vector<float> values(n);
    for (int64_t r = 0; r < spec.rows; ++r) {
      for (int64_t c = 0; c < spec.dim; ++c) {
        values[r * spec.dim + c] = backend::InitialValue(spec.initializer, spec.table_rows,
                                                         spec.row_offset + r, spec.col_offset + c);
      }
    }
    Store(shard.get(), 0, values.data(), n);
    const bool adagrad = spec.optimizer.type == OptimizerType::kAdagrad ||
                         spec.optimizer.type == OptimizerType::kRowwiseAdagrad;
    shard->state.assign(spec.rows * shard->state_width,
                        adagrad ? spec.optimizer.initial_accumulator_value : 0.0f);
    const ShardId id = next_id_++;
    shards_.emplace(id, std::move(shard));
    return id;
  }

  absl::Status DropShard(ShardId id) override {
    absl::MutexLock lock(&mu_);
    auto it = shards_.find(id);
    if (it == shards_.end()) return backend::ShardNotFound(id);
    const ShardSpec& spec = it->second->spec;
    (spec.host_mapped ? mapped_budget_ : budget_).Release(backend::ShardBytes(spec));
    shards_.erase(it);
    return absl::OkStatus();
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = Find(id);
    if (s == nullptr) return backend::ShardNotFound(id);
    return s->spec;
  }

  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = backend::ValidateRequests(requests, FindSpec(), backend::Checks::kAll,
                                                   /*strided_outputs=*/false,
                                                   /*device_memory=*/false, /*finds_keys=*/true);
        !s.ok()) {
      return s;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      const Shard* shard = Find(requests[i].feature.shard);
      if (requests[i].feature.keyed && shard->key_lines.empty()) {
        return backend::NoKeyIndex(backend::RequestWhat("lookup", i, shard->spec));
      }
    }
    const LookupPlan plan = PlanLookup(requests, Resolver());
    if (plan.total_items == 0) return absl::OkStatus();
    return ForEachLookupPiece(requests, plan, Resolver(), scratch_,
                              [this](absl::Span<const LookupRequest> piece)
                                  ABSL_NO_THREAD_SAFETY_ANALYSIS { return LookupPiece(piece); });
  }

  // The CUDA backend's overflow guard (overflow_guard.h), over the same
  // kernel bodies: shards whose bounds cannot rule an overflow out have
  // their rows checked in a launch of their own before any piece applies
  // (or, with skip_overflow, each such row checked as it is applied).
  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    absl::MutexLock lock(&mu_);
    std::vector<float> grad_max(requests.size());
    if (absl::Status s = backend::ValidateRequests(requests, FindSpec(), backend::Checks::kAll,
                                                   false, absl::MakeSpan(grad_max));
        !s.ok()) {
      return s;
    }
    const bool any_guard = DecideGuards(
        requests, grad_max, nullptr,
        [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS { return Find(id); },
        [](const Shard& s) { return Measure(s); });
    const GradientPlan plan = PlanGradients(requests, Resolver());
    backend::OverflowReport seen;
    if (plan.total_ids > 0 && any_guard && !skip_overflow_) {
      if (absl::Status s = ForEachGradientPiece(
              requests, plan, Resolver(), scratch_,
              [&](absl::Span<const GradientRequest> piece) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return CheckPiece(piece, &seen);
              });
          !s.ok()) {
        return s;
      }
    }
    cuda::OverflowRecord applied = FreshRecord();
    if (plan.total_ids > 0) {
      if (absl::Status s = ForEachGradientPiece(
              requests, plan, Resolver(), scratch_,
              [&](absl::Span<const GradientRequest> piece) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return GradientPiece(piece, cuda::kApplyRows, skip_overflow_ && any_guard, &applied);
              });
          !s.ok()) {
        return s;
      }
    }
    NoteMaxima(applied, &seen);
    skipped_rows_ += static_cast<int64_t>(applied.skipped);
    FinishGradients(plan, seen, [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return Find(id);
    });
    return absl::OkStatus();
  }

  int64_t OverflowSkippedRows() const override {
    absl::MutexLock lock(&mu_);
    return skipped_rows_;
  }

  absl::Status ExportRows(ShardId id, int64_t b, int64_t e, absl::Span<float> weights,
                          absl::Span<float> state) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = Find(id);
    if (s == nullptr) return backend::ShardNotFound(id);
    if (absl::Status st = backend::ValidateRowRange(s->spec, b, e, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    const int64_t dim = s->spec.dim;
    for (int64_t i = 0; i < (e - b) * dim; ++i) weights[i] = Get(*s, b * dim + i);
    std::copy(s->state.begin() + b * s->state_width, s->state.begin() + e * s->state_width,
              state.begin());
    return absl::OkStatus();
  }

  absl::Status ImportRows(ShardId id, int64_t b, int64_t e, absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    absl::MutexLock lock(&mu_);
    Shard* s = Find(id);
    if (s == nullptr) return backend::ShardNotFound(id);
    if (absl::Status st = backend::ValidateImport(s->spec, b, e, weights, state); !st.ok()) {
      return st;
    }
    Store(s, b * s->spec.dim, weights.data(), (e - b) * s->spec.dim);
    std::copy(state.begin(), state.end(), s->state.begin() + b * s->state_width);
    s->bounds = backend::Widen(s->bounds, backend::ImportedBounds(s->spec, weights, state));
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> ExportStep(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = Find(id);
    if (s == nullptr) return backend::ShardNotFound(id);
    return s->step;
  }

  absl::Status ImportStep(ShardId id, int64_t step) override {
    absl::MutexLock lock(&mu_);
    Shard* s = Find(id);
    if (s == nullptr) return backend::ShardNotFound(id);
    if (step < 0) return absl::InvalidArgumentError("step must be >= 0");
    s->step = step;
    return absl::OkStatus();
  }

  // Keyed lookups find their ids as the CUDA backend does (KeyFindOne).
  bool FindsKeys() const override { return true; }
  absl::Status SyncKeyIndex(ShardId id, const backend::math::KeyLine* lines, int64_t count,
                            absl::Span<const int64_t> changed) override {
    absl::MutexLock lock(&mu_);
    Shard* shard = Find(id);
    if (shard == nullptr) return backend::ShardNotFound(id);
    if (absl::Status s = backend::CheckKeySync(lines, count, changed); !s.ok()) return s;
    if (static_cast<int64_t>(shard->key_lines.size()) != count) {
      shard->key_lines.assign(lines, lines + count);
    } else {
      for (int64_t k : changed) shard->key_lines[k] = lines[k];
    }
    return absl::OkStatus();
  }

  int64_t AvailableBytes() const override {
    return limited_ ? budget_.Available() : int64_t{1} << 40;
  }
  // Every shard is in host memory here: a mapped one (fused_uvm) is held
  // and run as any other.
  bool MapsHostMemory() const override { return true; }
  int64_t AvailableMappedBytes() const override {
    return mapped_limited_ ? mapped_budget_.Available() : int64_t{1} << 40;
  }
  std::string Name() const override { return "cuda-emulated/host"; }

 private:
  // One piece of a Lookup call (all of it when it fits the scratch): the
  // arrays concatenated as they are staged on the device, and the launch's
  // steps on the CPU (host_kernels.h).
  absl::Status LookupPiece(absl::Span<const LookupRequest> requests)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const LookupPlan plan = PlanLookup(requests, Resolver());
    std::vector<int64_t> lengths, ids;
    std::vector<float> weights(plan.any_weighted ? plan.total_ids : 0);
    for (const LookupRequest& r : requests) {
      const FeatureRequest& f = r.feature;
      lengths.insert(lengths.end(), f.lengths.begin(), f.lengths.end());
      if (!f.weights.empty()) std::copy(f.weights.begin(), f.weights.end(), weights.begin() + ids.size());
      ids.insert(ids.end(), f.ids.begin(), f.ids.end());
      if (f.keyed) {  // keys to slots, as the CUDA backend does on the device
        const Shard* shard = Find(f.shard);
        const uint64_t mask = shard->key_lines.size() * backend::math::kKeyLineEntries - 1;
        int64_t* keys = ids.data() + (ids.size() - f.ids.size());
        for (size_t e = 0; e < f.ids.size(); ++e) {
          cuda::kernels::KeyFindOne(static_cast<int64_t>(e), keys, shard->key_lines.data(), mask,
                                    shard->spec.rows - 1);
        }
      }
    }
    std::vector<int64_t> offsets(lengths.size() + 1);
    std::vector<float> out(plan.total_out);
    cuda::LookupLaunch a;
    a.item_begin = plan.item_begin.data();
    a.descs = plan.descs.data();
    a.num_requests = static_cast<int64_t>(requests.size());
    a.total_items = plan.total_items;
    a.lengths = lengths.data();
    a.num_bags = static_cast<int64_t>(lengths.size());
    a.ids = ids.data();
    a.weights = weights.data();
    a.offsets = offsets.data();
    a.out = out.data();
    cuda::RunLookupOnHost(a);
    size_t at = 0;
    for (const LookupRequest& r : requests) {
      std::copy(out.begin() + at, out.begin() + at + r.output.size(), r.output.begin());
      at += r.output.size();
    }
    return absl::OkStatus();
  }

  // A piece's guarded rows computed and not stored: a misfit refuses the
  // call (named by a second, reporting launch); the fit rows' largest
  // values go to *seen.
  absl::Status CheckPiece(absl::Span<const GradientRequest> piece, backend::OverflowReport* seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    cuda::OverflowRecord rec = FreshRecord();
    if (absl::Status s = GradientPiece(piece, cuda::kCheckRows, false, &rec); !s.ok()) return s;
    NoteMaxima(rec, seen);
    if (rec.first_key == FreshRecord().first_key) return absl::OkStatus();
    if (absl::Status s = GradientPiece(piece, cuda::kReportRow, false, &rec); !s.ok()) return s;
    ShardId id;
    const backend::OverflowReport r = ReportOf(PlanGradients(piece, Resolver()), rec, &id);
    return backend::OverflowRefusal(Find(id)->spec, r);
  }

  // One piece of an ApplyGradients call, without the Adam step, its update
  // step as `mode` says (kernel_descs.h), noting in *record.
  absl::Status GradientPiece(absl::Span<const GradientRequest> requests, int32_t mode,
                             bool guarded_apply, cuda::OverflowRecord* record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const GradientPlan plan = PlanGradients(requests, Resolver());
    const int64_t total = plan.total_ids;
    std::vector<int64_t> lengths, ids;
    std::vector<float> weights(plan.any_weighted ? total : 0), grads;
    for (const GradientRequest& r : requests) {
      const FeatureRequest& f = r.feature;
      lengths.insert(lengths.end(), f.lengths.begin(), f.lengths.end());
      if (!f.weights.empty()) std::copy(f.weights.begin(), f.weights.end(), weights.begin() + ids.size());
      ids.insert(ids.end(), f.ids.begin(), f.ids.end());
      grads.insert(grads.end(), r.grad.begin(), r.grad.end());
    }
    std::vector<int64_t> offsets(lengths.size() + 1);
    std::vector<uint64_t> keys_a(total), keys_b(total);
    std::vector<int64_t> pos_a(total), pos_b(total), src_off(total), run_id(total),
        run_begin(total + 1), hot_units(total), hot_end(total);
    std::vector<float> scale(total);
    const int64_t max_units = MaxHotUnits(total);
    std::vector<float> partials(max_units * plan.max_dim);
    cuda::BackwardLaunch a;
    a.id_begin = plan.id_begin.data();
    a.descs = plan.descs.data();
    a.num_requests = static_cast<int64_t>(requests.size());
    a.updates = plan.updates.data();
    a.key_base = plan.key_base.data();
    a.num_shards = static_cast<int64_t>(plan.slots.size());
    a.lengths = lengths.data();
    a.num_bags = static_cast<int64_t>(lengths.size());
    a.ids = ids.data();
    a.total_ids = total;
    a.weights = weights.data();
    a.grads = grads.data();
    a.end_bit = plan.end_bit;
    a.max_dim = plan.max_dim;
    a.offsets = offsets.data();
    a.keys_a = keys_a.data();
    a.keys_b = keys_b.data();
    a.pos_a = pos_a.data();
    a.pos_b = pos_b.data();
    a.src_off = src_off.data();
    a.scale = scale.data();
    a.run_id = run_id.data();
    a.run_begin = run_begin.data();
    a.hot_units = hot_units.data();
    a.hot_end = hot_end.data();
    a.partials = partials.data();
    a.max_units = max_units;
    a.mode = mode;
    a.guarded_apply = guarded_apply ? 1 : 0;
    a.record = record;
    cuda::RunBackwardOnHost(a);
    return absl::OkStatus();
  }

  // fp32 values into the shard's weight type, rounded to nearest even.
  static void Store(Shard* s, int64_t at, const float* v, int64_t n) {
    switch (s->spec.weight_type) {
      case WeightType::kFp16:
        s->half.resize(s->spec.rows * s->spec.dim);
        for (int64_t i = 0; i < n; ++i) s->half[at + i] = backend::FloatToFp16(v[i]);
        break;
      case WeightType::kBf16:
        s->half.resize(s->spec.rows * s->spec.dim);
        for (int64_t i = 0; i < n; ++i) s->half[at + i] = backend::FloatToBf16(v[i]);
        break;
      default:
        s->full.resize(s->spec.rows * s->spec.dim);
        std::copy(v, v + n, s->full.begin() + at);
    }
  }
  static float Get(const Shard& s, int64_t i) {
    switch (s.spec.weight_type) {
      case WeightType::kFp16:
        return backend::Fp16ToFloat(s.half[i]);
      case WeightType::kBf16:
        return backend::Bf16ToFloat(s.half[i]);
      default:
        return s.full[i];
    }
  }

  Shard* Find(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second.get();
  }
  std::function<const ShardSpec*(ShardId)> FindSpec() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS -> const ShardSpec* {
      const Shard* s = Find(id);
      return s == nullptr ? nullptr : &s->spec;
    };
  }
  ShardResolver Resolver() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      Shard* s = Find(id);
      ShardView v;
      v.weights = s->weights();
      v.state = s->state.data();
      v.spec = &s->spec;
      v.state_width = s->state_width;
      v.step = s->step;
      v.guard = s->guard;
      return v;
    };
  }

  // The bounds of every value a shard holds.
  static backend::ValueBounds Measure(const Shard& s) {
    std::vector<float> w(s.spec.rows * s.spec.dim);
    for (size_t i = 0; i < w.size(); ++i) w[i] = Get(s, static_cast<int64_t>(i));
    return backend::MeasureValues(s.spec, w, s.state);
  }

  const bool skip_overflow_;
  const bool limited_, mapped_limited_;
  backend::MemoryBudget budget_, mapped_budget_;
  mutable absl::Mutex mu_;
  int64_t skipped_rows_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<ShardId, std::unique_ptr<Shard>> shards_ ABSL_GUARDED_BY(mu_);
  ShardId next_id_ ABSL_GUARDED_BY(mu_) = 0;
  Scratch scratch_;
};

}  // namespace

std::unique_ptr<backend::EmbeddingBackend> CreateEmulatedCudaBackend(
    const EmulatedCudaOptions& options) {
  return std::make_unique<EmulatedBackend>(options);
}

}  // namespace backend
}  // namespace ember
