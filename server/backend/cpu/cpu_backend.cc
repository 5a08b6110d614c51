#include "server/backend/cpu/cpu_backend.h"

#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "math/embedding_math.h"
#include "math/half.h"
#include "server/backend/cpu/cpu_kernels.h"
#include "server/backend/cpu/thread_pool.h"
#include "server/backend/overflow_guard.h"
#include "server/backend/shard_registry.h"
#include "server/common/host_memory.h"

namespace ember {
namespace backend {
namespace {

// Output rows ahead that a lookup fetches for writing.
constexpr int64_t kOutputAhead = 4;

// PREFETCHW (0F 0D /1): a hint, a no-op on x86 CPUs without it.
inline void PrefetchForWrite(const void* p) {
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Host memory for a shard's weights or state (AllocateTableMemory: huge
// pages requested from 2 MiB up). nullptr when the memory cannot be had.
template <typename T>
std::unique_ptr<T[], FreeDeleter> AllocateHost(int64_t count) {
  return std::unique_ptr<T[], FreeDeleter>(
      static_cast<T*>(AllocateTableMemory(static_cast<size_t>(count) * sizeof(T))));
}

struct Shard {
  ShardSpec spec;
  int64_t row_bytes = 0;  // WeightRowBytes: a quantized row has its scale and bias
  int64_t state_width = 0;
  std::unique_ptr<uint8_t[], FreeDeleter> weights;  // [rows, dim] in spec.weight_type
  std::unique_ptr<float[], FreeDeleter> state;      // [rows, state_width]
  int64_t step = 0;                    // Adam's t
  ValueBounds bounds;                  // what its values stay within (overflow_guard.h)
  // How the lookups prefetch (options, row and shard size): in a call that
  // reads at most kIntoL1CallBytes of shards, and in larger ones.
  PrefetchAhead lookup_prefetch;
  PrefetchAhead lookup_prefetch_large_call;

  int64_t RowBytes() const { return row_bytes; }
  int64_t WeightBytes() const { return spec.rows * RowBytes(); }
  const uint8_t* Row(int64_t r) const { return weights.get() + r * RowBytes(); }
  uint8_t* Row(int64_t r) { return weights.get() + r * RowBytes(); }
  int64_t Bytes() const { return WeightBytes() + spec.rows * state_width * 4; }
};

// Runs fn over [0, rows) on the calling thread and, for `work` (elements)
// worth it, on up to hardware_concurrency - 1 threads more, made for the
// call: shard initialisation, which must not hold the lookup pool.
template <typename F>
void InitParallel(int64_t work, int64_t rows, F fn) {
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(std::thread::hardware_concurrency(), work / (int64_t{1} << 16)));
  if (threads <= 1) {
    fn(0, rows);
    return;
  }
  const int64_t per = (rows + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int64_t b = per; b < rows; b += per) pool.emplace_back(fn, b, std::min(rows, b + per));
  fn(0, std::min(rows, per));
  for (std::thread& t : pool) t.join();
}

class CpuBackend : public EmbeddingBackend {
 public:
  CpuBackend(const CpuBackendOptions& options, const RowKernels* kernels, PrefetchStyle style)
      : options_(options),
        kernels_(kernels),
        update_rows_(UpdateRowsFor(*kernels)),
        style_(style),
        pool_(options.num_threads),
        budget_(options.memory_limit_bytes),
        parts_(pool_.num_threads()) {}

  // The memory is reserved under the lock; allocation and initialisation
  // run outside it (on threads of their own, not the lookup pool), so a
  // large shard's creation does not stall the calls on the shards held.
  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    if (absl::Status s = ValidateShardSpec(spec); !s.ok()) return s;
    auto shard = std::make_unique<Shard>();
    shard->spec = spec;
    shard->row_bytes = WeightRowBytes(spec.weight_type, spec.dim);
    shard->state_width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
    shard->lookup_prefetch =
        ShardLookupPrefetch(options_.prefetch_distance, style_, shard->RowBytes(), spec.rows,
                            shard->WeightBytes());
    shard->lookup_prefetch_large_call =
        ShardLookupPrefetch(options_.prefetch_distance, style_, shard->RowBytes(), spec.rows,
                            std::numeric_limits<int64_t>::max());
    shard->bounds = InitialBounds(spec);
    const int64_t bytes = shard->Bytes();
    if (absl::Status s = budget_.Reserve(bytes, spec.table); !s.ok()) return s;
    shard->weights = AllocateHost<uint8_t>(shard->WeightBytes());
    if (shard->state_width > 0) shard->state = AllocateHost<float>(spec.rows * shard->state_width);
    if (!shard->weights || (shard->state_width > 0 && !shard->state)) {
      budget_.Release(bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("out of host memory for shard of table '", spec.table, "' (", bytes,
                       " bytes)"));
    }
    Shard* s = shard.get();
    const NarrowNearestFn narrow = kernels_->narrow_nearest[static_cast<int>(spec.weight_type)];
    InitParallel(spec.rows * spec.dim, spec.rows, [s, narrow](int64_t b, int64_t e) {
      const ShardSpec& sp = s->spec;
      const bool adagrad = sp.optimizer.type == OptimizerType::kAdagrad ||
                           sp.optimizer.type == OptimizerType::kRowwiseAdagrad;
      // Blocks of rows: fp32 ones straight into the shard, 16-bit ones
      // through a block of floats, rounded to nearest (half.h's FloatToFp16
      // and FloatToBf16, bit for bit).
      constexpr int64_t kBlockRows = 256;
      std::vector<float> block;
      for (int64_t r0 = b; r0 < e; r0 += kBlockRows) {
        const int64_t n = std::min(kBlockRows, e - r0);
        if (narrow == nullptr) {
          InitialValues(sp.initializer, sp.table_rows, sp.row_offset + r0, n, sp.col_offset,
                        sp.dim, reinterpret_cast<float*>(s->Row(r0)));
        } else {
          block.resize(static_cast<size_t>(n * sp.dim));
          InitialValues(sp.initializer, sp.table_rows, sp.row_offset + r0, n, sp.col_offset,
                        sp.dim, block.data());
          for (int64_t r = 0; r < n; ++r) narrow(s->Row(r0 + r), block.data() + r * sp.dim, sp.dim);
        }
      }
      if (s->state_width > 0) {
        std::fill(s->state.get() + b * s->state_width, s->state.get() + e * s->state_width,
                  adagrad ? sp.optimizer.initial_accumulator_value : 0.0f);
      }
    });
    absl::MutexLock lock(&mu_);
    return shards_.Add(std::move(shard));
  }

  absl::Status DropShard(ShardId id) override {
    absl::MutexLock lock(&mu_);
    auto shard = shards_.Remove(id);
    if (!shard.ok()) return shard.status();
    budget_.Release((*shard)->Bytes());
    return absl::OkStatus();
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    return shards_.Spec(id);
  }

  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    absl::MutexLock lock(&mu_);
    // Everything but the ids first; those are checked as the kernels gather them (one
    // pass over them, not two, and safe against ids that change meanwhile:
    // ChecksIdsWhileGathering).
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kAllButIds,
                                           /*strided_outputs=*/true);
        !st.ok()) {
      // An earlier request's bad id comes first in ValidateRequests' order,
      // which every backend's refusals follow (the error path only).
      if (absl::IsInvalidArgument(st)) {
        if (absl::Status first = ValidateRequests(requests, find_spec, Checks::kAll,
                                                  /*strided_outputs=*/true);
            !first.ok()) {
          return first;
        }
      }
      return st;
    }
    // Work items: one per bag (pooled) or per id (NONE), across requests.
    PrepareItems(requests);
    // The shards' bytes the call reads (a shard named twice counted twice):
    // its prefetch into L1 only when they all fit the caches together.
    int64_t call_bytes = 0;
    for (const Shard* s : shard_ptr_) call_bytes += s->WeightBytes();
    const bool small_call = call_bytes <= kIntoL1CallBytes;
    const int64_t total = item_begin_.back();
    const RowKernels* kernels = kernels_;
    // Chunks of up to 256 items, at least two per thread: a chunk restarts
    // the prefetch pipeline (its first ids wait for memory) and its last
    // ids prefetch rows another thread will gather. 256 against 64
    // measured +16-22% on narrow rows at 2 threads (docs/lab-notes/2026-11-benchmarks.md).
    const int64_t grain = std::clamp<int64_t>(total / (2 * options_.num_threads), 64, 256);
    std::atomic<bool> bad_id{false};
    pool_.ParallelFor(total, grain, [&](int64_t b, int64_t e) {
      size_t req = std::upper_bound(item_begin_.begin(), item_begin_.end(), b) - item_begin_.begin() - 1;
      bool ok = true;
      for (int64_t item = b; item < e; ++item) {
        while (item >= item_begin_[req + 1]) ++req;
        const LookupRequest& r = requests[req];
        const FeatureRequest& f = r.feature;
        const Shard& s = *shard_ptr_[req];
        const PrefetchAhead prefetch =
            small_call ? s.lookup_prefetch : s.lookup_prefetch_large_call;
        const int64_t dim = s.spec.dim;
        const int64_t row_bytes = s.RowBytes();
        const PoolFn pool = kernels->pool[static_cast<int>(s.spec.weight_type)];
        const int64_t local = item - item_begin_[req];
        const int64_t stride = r.output_stride == 0 ? dim : r.output_stride;
        float* out = r.output.data() + local * stride;
        // The output row a few items ahead, fetched for writing: rows apart
        // in a wider matrix (a KeyedTensor's columns) defeat the hardware's
        // stream prefetch, and each would wait for its line.
        if (local + kOutputAhead < item_begin_[req + 1] - item_begin_[req]) {
          const char* ahead = reinterpret_cast<const char*>(out + kOutputAhead * stride);
          for (int64_t l = 0; l < dim * 4; l += 64) PrefetchForWrite(ahead + l);
        }
        const uint64_t rows = static_cast<uint64_t>(s.spec.rows);
        if (f.pooling == Pooling::kNone) {
          ok &= pool(out, s.weights.get(), row_bytes, rows, &f.ids[local], nullptr, 1,
                     static_cast<int64_t>(f.ids.size()) - local, dim, 1.0f, prefetch);
          continue;
        }
        const int64_t begin = offsets_[req][local], end = offsets_[req][local + 1];
        const float scale = f.pooling == Pooling::kMean ? math::MeanScale(end - begin) : 1.0f;
        ok &= pool(out, s.weights.get(), row_bytes, rows, f.ids.data() + begin,
                   f.weights.empty() ? nullptr : f.weights.data() + begin, end - begin,
                   static_cast<int64_t>(f.ids.size()) - begin, dim, scale, prefetch);
      }
      if (!ok) bad_id.store(true, std::memory_order_relaxed);
    });
    if (!bad_id.load(std::memory_order_relaxed)) return absl::OkStatus();
    // Name the bad id as validation does; if none is bad now, the ids
    // changed while they were read (memory another process writes).
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kAll,
                                           /*strided_outputs=*/true);
        !st.ok()) {
      return st;
    }
    return absl::InvalidArgumentError(
        "lookup: an id was out of range when its row was gathered but is in range now: the "
        "ids changed during the call");
  }

  // Every shard's update is first planned: whether its bounds show that no
  // row can overflow (overflow_guard.h), else its rows are checked; only
  // when every shard's rows fit (or, with skip_overflow, their misfits are
  // known) is anything applied.
  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    absl::MutexLock lock(&mu_);
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    grad_max_.assign(requests.size(), 0.0f);
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kAll,
                                           /*device_memory=*/false, absl::MakeSpan(grad_max_));
        !st.ok()) {
      return st;
    }
    // Requests grouped by shard (stable: request order within a shard);
    // each shard's rows are merged, then updated once.
    req_order_.resize(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) req_order_[i] = i;
    std::stable_sort(req_order_.begin(), req_order_.end(), [&](size_t x, size_t y) {
      return requests[x].feature.shard < requests[y].feature.shard;
    });
    plans_.clear();
    for (size_t first = 0; first < req_order_.size();) {
      const ShardId id = requests[req_order_[first]].feature.shard;
      size_t last = first;
      while (last < req_order_.size() && requests[req_order_[last]].feature.shard == id) ++last;
      ShardPlan p;
      p.shard = FindShard(id);
      p.group = Group{requests, req_order_.data() + first, req_order_.data() + last, 0};
      double merged = 0;
      for (size_t j = first; j < last; ++j) {
        const size_t i = req_order_[j];
        const FeatureRequest& f = requests[i].feature;
        const IdScales scales = ScalesOf(f);
        p.group.occurrences += f.ids.size();
        merged += MergedBound(scales.sum, static_cast<double>(f.ids.size()), grad_max_[i]);
        p.max_grad = std::max(p.max_grad, static_cast<double>(grad_max_[i]));
        p.max_scale = std::max(p.max_scale, scales.max);
      }
      // Adam's t of this call: the step taken per call that names the
      // shard, ids or not (as FBGEMM's iteration count).
      p.params = MakeStepParams(p.shard->spec.optimizer, p.shard->step + 1);
      Shard* s = p.shard;
      p.check = !GuardStep(s->spec, p.params, &s->bounds, merged, &p.after,
                           [this, s] { return MeasureShard(*kernels_, *s); });
      plans_.push_back(std::move(p));
      first = last;
    }
    int64_t skipped = 0;
    for (ShardPlan& p : plans_) {
      if (!p.check || p.group.occurrences == 0) continue;
      OverflowReport report;
      CheckRows(p, &report);
      if (report.row >= 0 && !options_.skip_overflow) return OverflowRefusal(p.shard->spec, report);
      p.after = BoundsAfterCheck(p.shard->spec, p.shard->bounds, report);
      skipped += static_cast<int64_t>(p.skip.size());
    }
    for (ShardPlan& p : plans_) {
      Shard& s = *p.shard;
      ++s.step;
      if (p.group.occurrences == 0) continue;  // nothing applied: the bounds hold
      // Far from the limits the decision's bounds are kept. Nearer, they
      // grow by what the rows' own merged gradients could add (at most
      // max_run occurrences each), not the decision's sum over every id:
      // they reach a type's limit, and ask for a measurement, that much
      // later.
      const bool near = p.after.weight > WeightLimitOf(s.spec.weight_type) / 64 ||
                        p.after.acc > math::kStateLimit / 64;
      const size_t max_run = ApplyRows(p, near && !p.check);
      ValueBounds tight;
      const double row_grad = MergedBound(static_cast<double>(max_run) * p.max_scale,
                                          static_cast<double>(max_run), p.max_grad);
      s.bounds = near && !p.check &&
                         StepStaysFinite(s.spec, p.params, s.bounds, row_grad, &tight)
                     ? tight
                     : p.after;
    }
    skipped_rows_.fetch_add(skipped, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  int64_t OverflowSkippedRows() const override {
    return skipped_rows_.load(std::memory_order_relaxed);
  }

  absl::Status ExportRows(ShardId id, int64_t row_begin, int64_t row_end,
                          absl::Span<float> weights, absl::Span<float> state) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateRowRange(s->spec, row_begin, row_end, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    const int64_t dim = s->spec.dim;
    if (s->spec.weight_type == WeightType::kFp32) {  // rows are contiguous fp32: one copy
      std::memcpy(weights.data(), s->Row(row_begin), (row_end - row_begin) * dim * sizeof(float));
    } else {
      const WidenFn widen = kernels_->widen[static_cast<int>(s->spec.weight_type)];
      for (int64_t r = row_begin; r < row_end; ++r) {
        widen(weights.data() + (r - row_begin) * dim, s->Row(r), dim);
      }
    }
    if (s->state_width > 0) {
      std::memcpy(state.data(), s->state.get() + row_begin * s->state_width,
                  (row_end - row_begin) * s->state_width * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status ImportRows(ShardId id, int64_t row_begin, int64_t row_end,
                          absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    absl::MutexLock lock(&mu_);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateImport(s->spec, row_begin, row_end, weights, state);
        !st.ok()) {
      return st;
    }
    const int64_t dim = s->spec.dim;
    if (s->spec.weight_type == WeightType::kFp32) {
      std::memcpy(s->Row(row_begin), weights.data(), (row_end - row_begin) * dim * sizeof(float));
    } else {
      const NarrowNearestFn narrow =
          kernels_->narrow_nearest[static_cast<int>(s->spec.weight_type)];
      for (int64_t r = row_begin; r < row_end; ++r) {
        narrow(s->Row(r), weights.data() + (r - row_begin) * dim, dim);
      }
    }
    if (s->state_width > 0) {
      std::memcpy(s->state.get() + row_begin * s->state_width, state.data(),
                  (row_end - row_begin) * s->state_width * sizeof(float));
    }
    s->bounds = Widen(s->bounds, ImportedBounds(s->spec, weights, state));
    return absl::OkStatus();
  }

  absl::Status ExportRowsAt(ShardId id, absl::Span<const int64_t> rows, absl::Span<float> weights,
                            absl::Span<float> state) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st = ValidateRowsAt(s->spec, rows, weights.size(), state.size()); !st.ok()) {
      return st;
    }
    const int64_t dim = s->spec.dim;
    const WidenFn widen = kernels_->widen[static_cast<int>(s->spec.weight_type)];
    for (size_t k = 0; k < rows.size(); ++k) {
      float* out = weights.data() + k * dim;
      if (s->spec.weight_type == WeightType::kFp32) {
        std::memcpy(out, s->Row(rows[k]), dim * sizeof(float));
      } else {
        widen(out, s->Row(rows[k]), dim);
      }
      if (s->state_width > 0) {
        std::memcpy(state.data() + k * s->state_width, s->state.get() + rows[k] * s->state_width,
                    s->state_width * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    absl::MutexLock lock(&mu_);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (absl::Status st = ValidateRowsAt(s->spec, rows, weights.size(), state.size()); !st.ok()) {
      return st;
    }
    if (absl::Status st = ValidateImport(s->spec, 0, n, weights, state); !st.ok()) return st;
    const int64_t dim = s->spec.dim;
    const NarrowNearestFn narrow = kernels_->narrow_nearest[static_cast<int>(s->spec.weight_type)];
    for (int64_t k = 0; k < n; ++k) {
      const float* in = weights.data() + k * dim;
      if (s->spec.weight_type == WeightType::kFp32) {
        std::memcpy(s->Row(rows[k]), in, dim * sizeof(float));
      } else {
        narrow(s->Row(rows[k]), in, dim);
      }
      if (s->state_width > 0) {
        std::memcpy(s->state.get() + rows[k] * s->state_width, state.data() + k * s->state_width,
                    s->state_width * sizeof(float));
      }
    }
    s->bounds = Widen(s->bounds, ImportedBounds(s->spec, weights, state));
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> ExportStep(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    return shards_.Step(id);
  }

  absl::Status ImportStep(ShardId id, int64_t step) override {
    absl::MutexLock lock(&mu_);
    return shards_.SetStep(id, step);
  }

  void ParallelFor(int64_t n, int64_t grain,
                   const std::function<void(int64_t, int64_t)>& fn) override {
    pool_.ParallelFor(n, grain, fn);
  }

  int64_t AvailableBytes() const override { return budget_.Available(); }

  std::string Name() const override { return absl::StrCat("cpu/", kernels_->isa); }
  bool WritesStridedOutputs() const override { return true; }
  bool ChecksIdsWhileGathering() const override { return true; }

 private:
  // One id of a gradient request: its row, the gradient row it receives
  // and the scale on it.
  struct Occ {
    int64_t row;
    const float* grad;
    float scale;
  };

  // A thread's share of a shard's update (all of it below
  // kOccurrencesPerPart occurrences a thread): its occurrences, sorted by
  // row, and where each row's run of them begins.
  struct UpdatePart {
    std::vector<Occ> occ, tmp;
    std::vector<size_t> unique_begin;
    size_t max_run = 0;  // the most occurrences of one row (MaxRun)
  };

  // For the shared request validation (ValidateRequests).
  const ShardSpec* FindSpec(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Shard* s = FindShard(id);
    return s == nullptr ? nullptr : &s->spec;
  }

  Shard* FindShard(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shards_.Find(id);
  }

  // Bag offsets and shard per lookup request, in reused buffers;
  // item_begin_ is the prefix sum of work items (bags, or ids for NONE).
  void PrepareItems(absl::Span<const LookupRequest> requests) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t n = requests.size();
    if (offsets_.size() < n) offsets_.resize(n);
    shard_ptr_.resize(n);
    item_begin_.assign(1, 0);
    for (size_t i = 0; i < n; ++i) {
      const FeatureRequest& f = requests[i].feature;
      shard_ptr_[i] = FindShard(f.shard);
      auto& off = offsets_[i];
      off.resize(f.lengths.size() + 1);
      off[0] = 0;
      for (size_t b = 0; b < f.lengths.size(); ++b) off[b + 1] = off[b] + f.lengths[b];
      item_begin_.push_back(item_begin_.back() +
                            static_cast<int64_t>(f.pooling == Pooling::kNone ? f.ids.size()
                                                                             : f.lengths.size()));
    }
  }

  // The gradient requests of one shard in a call, in request order.
  struct Group {
    absl::Span<const GradientRequest> requests;
    const size_t* begin;  // indices into requests
    const size_t* end;
    size_t occurrences;  // their ids
  };

  // One shard's share of an ApplyGradients call: its requests, this call's
  // step parameters, and what the overflow guard decided (overflow_guard.h):
  // whether its rows must be checked first, the bounds after the update,
  // and (skip_overflow) the rows to leave alone, ascending.
  struct ShardPlan {
    Shard* shard;
    Group group;
    math::StepParams params;
    bool check = false;
    ValueBounds after;
    std::vector<int64_t> skip;
    // The shard's largest |gradient| and |scale| (an id's weight; MEAN's
    // 1/length is at most 1): with the most occurrences of one row (known
    // once sorted), a tighter bound on merged gradients than the decision's.
    double max_grad = 0, max_scale = 0;
  };

  // The bounds of every value the shard holds (16-bit rows widened a row
  // at a time by the row kernels).
  static ValueBounds MeasureShard(const RowKernels& k, const Shard& s) {
    const ShardSpec& spec = s.spec;
    const absl::Span<const float> state(s.state.get(), spec.rows * s.state_width);
    if (spec.weight_type == WeightType::kFp32) {
      return MeasureValues(
          spec, absl::MakeConstSpan(reinterpret_cast<const float*>(s.Row(0)), spec.rows * spec.dim),
          state);
    }
    const WidenFn widen = k.widen[static_cast<int>(spec.weight_type)];
    std::vector<float> row(static_cast<size_t>(spec.dim));
    ValueBounds b = MeasureValues(spec, {}, state);
    for (int64_t r = 0; r < spec.rows; ++r) {
      widen(row.data(), s.Row(r), spec.dim);
      b.weight = std::max(b.weight, MeasureValues(spec, row, {}).weight);
    }
    return b;
  }

  // Computes every touched row's update without storing it (one thread:
  // the rare path), into `report`: the first row that would not fit and the
  // largest values of those that do; with skip_overflow, the misfits go to
  // p.skip.
  void CheckRows(ShardPlan& p, OverflowReport* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Shard& s = *p.shard;
    UpdatePart& part = parts_[0];
    GatherAll(p.group, s.spec.dim, &part.occ);
    UpdateRun run = SortAndMerge(&s, &part);
    run.params = p.params;
    thread_local std::vector<float> merged;
    if (static_cast<int64_t>(merged.size()) < run.dim) merged.resize(run.dim);
    p.skip.clear();
    for (int64_t u = 0; u < run.num_unique; ++u) {
      const int64_t row = MergeRow(run, u, merged.data());
      if (!CheckRow(*kernels_, s, row, merged.data(), run.params, report)) {
        p.skip.push_back(row);
      }
    }
  }

  // The most occurrences of one row of a sorted part.
  static size_t MaxRun(const UpdatePart& part) {
    size_t m = 0;
    for (size_t u = 0; u + 1 < part.unique_begin.size(); ++u) {
      m = std::max(m, part.unique_begin[u + 1] - part.unique_begin[u]);
    }
    return m;
  }

  // Applies the shard's update (p.skip's rows left alone); returns the most
  // occurrences of one row when `want_max_run`, else 0.
  size_t ApplyRows(const ShardPlan& p, bool want_max_run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Shard& s = *p.shard;
    const Group& group = p.group;
    const int64_t* skip_begin = p.skip.data();
    const int64_t* skip_end = p.skip.data() + p.skip.size();
    // Many occurrences and threads: the shard's rows are split among the
    // threads by a hash of the row (UpdatePartOf), and each thread gathers,
    // sorts, merges and updates the rows it owns, all in one hand-off to
    // the pool. Each row's occurrences stay in (request, position) order,
    // so every split gives the bits of one thread's update. Otherwise one
    // thread gathers and sorts, and the pool shares the rows' updates.
    const int num_parts = static_cast<int>(std::min<int64_t>(
        pool_.num_threads(), static_cast<int64_t>(group.occurrences) / kOccurrencesPerPart));
    UpdatePart* parts = parts_.data();
    if (num_parts <= 1) {
      UpdatePart& part = parts[0];
      GatherAll(group, s.spec.dim, &part.occ);
      UpdateRun run = SortAndMerge(&s, &part);
      run.skip_begin = skip_begin;
      run.skip_end = skip_end;
      // Chunks of 128 rows: with 16 the threads took turns at every 16
      // neighbouring rows and the 2-thread backward ran below 1 thread's
      // (docs/lab-notes/2026-11-benchmarks.md).
      pool_.ParallelFor(run.num_unique, 128,
                        [&](int64_t b, int64_t e) { update_rows_(run, b, e); });
      return want_max_run ? MaxRun(part) : 0;
    }
    pool_.ParallelFor(num_parts, 1, [&](int64_t b, int64_t e) {
      for (int64_t q = b; q < e; ++q) {
        UpdatePart& part = parts[q];
        GatherPart(group, s.spec.dim, static_cast<uint32_t>(q), static_cast<uint32_t>(num_parts),
                   &part.occ);
        if (part.occ.empty()) continue;
        UpdateRun run = SortAndMerge(&s, &part);
        run.skip_begin = skip_begin;
        run.skip_end = skip_end;
        update_rows_(run, 0, run.num_unique);
        part.max_run = want_max_run ? MaxRun(part) : 0;
      }
    });
    size_t max_run = 0;
    for (int q = 0; q < num_parts; ++q) {
      if (!parts[q].occ.empty()) max_run = std::max(max_run, parts[q].max_run);
    }
    return max_run;
  }

  // At least this many occurrences a part: below, a part's hand-off and its
  // pass over every id cost more than the split saves.
  static constexpr int64_t kOccurrencesPerPart = 4096;

  // The part of `parts` that owns row `row`: a multiplicative hash of the
  // row, scaled to [0, parts) (no division), so that neighbouring rows and
  // a zipf distribution's hot rows spread over the parts.
  static uint32_t UpdatePartOf(int64_t row, uint32_t parts) {
    const uint32_t h = static_cast<uint32_t>(
        (static_cast<uint64_t>(row) * uint64_t{0x9E3779B97F4A7C15}) >> 32);
    return static_cast<uint32_t>((static_cast<uint64_t>(h) * parts) >> 32);
  }

  // Appends the occurrences of a group at `o`, in (request, position) order:
  // the row, its gradient row and the scale (per-id weight, 1/length for
  // MEAN). With kFilter, only those of rows in part `part` of `parts`, at
  // most `room` of them (a slot past them is written, never kept); returns
  // how many it kept. Written field by field into sized memory: built whole
  // and pushed back, each went through the stack and its 16-byte copy
  // waited on two 8-byte stores (a failed store forward), most of the time
  // of this loop.
  template <bool kFilter>
  static size_t GatherInto(const Group& g, int64_t dim, uint32_t part, uint32_t parts,
                           size_t room, Occ* o) {
    size_t kept = 0;
    auto put = [&](int64_t row, const float* grad, float scale) {
      Occ& slot = o[kept];
      slot.row = row;
      slot.grad = grad;
      slot.scale = scale;
      if (kFilter) {
        kept += UpdatePartOf(row, parts) == part && kept < room;
      } else {
        ++kept;
      }
    };
    for (const size_t* r = g.begin; r != g.end; ++r) {
      const GradientRequest& req = g.requests[*r];
      const FeatureRequest& f = req.feature;
      const int64_t* ids = f.ids.data();
      const float* grad = req.grad.data();
      if (f.pooling == Pooling::kNone) {
        for (size_t k = 0; k < f.ids.size(); ++k) put(ids[k], grad + k * dim, 1.0f);
        continue;
      }
      const bool weighted = !f.weights.empty();
      const float* weights = f.weights.data();
      int64_t k = 0;
      for (size_t bag = 0; bag < f.lengths.size(); ++bag) {
        const int64_t len = f.lengths[bag];
        const float mean = f.pooling == Pooling::kMean ? math::MeanScale(len) : 1.0f;
        const float* bag_grad = grad + bag * dim;
        for (int64_t end = k + len; k < end; ++k) {
          put(ids[k], bag_grad, math::IdScale(weighted, weighted ? weights[k] : 1.0f, mean));
        }
      }
    }
    return kept;
  }

  // Every occurrence of the group into `occ`.
  static void GatherAll(const Group& g, int64_t dim, std::vector<Occ>* occ) {
    occ->resize(g.occurrences);
    GatherInto<false>(g, dim, 0, 1, g.occurrences, occ->data());
  }

  // The occurrences of the rows of part `part` of `parts` into `occ`:
  // counted first, so that `occ` has their size.
  static void GatherPart(const Group& g, int64_t dim, uint32_t part, uint32_t parts,
                         std::vector<Occ>* occ) {
    size_t n = 0;
    for (const size_t* r = g.begin; r != g.end; ++r) {
      for (const int64_t row : g.requests[*r].feature.ids) n += UpdatePartOf(row, parts) == part;
    }
    occ->resize(n + 1);  // the slot past the kept ones
    occ->resize(GatherInto<true>(g, dim, part, parts, n, occ->data()));
  }

  // Stable LSD radix sort of `occ` by row (rows in [0, rows)), so
  // occurrences of a row stay in (request, position) order and the merged
  // sums are reproducible. `tmp` is scratch. The row bits are split evenly
  // over the fewest passes of at most kMaxBits.
  static void SortByRow(int64_t rows, std::vector<Occ>* occ, std::vector<Occ>* tmp) {
    constexpr int kMaxBits = 12;
    int row_bits = 0;
    while (row_bits < 63 && (rows - 1) >> row_bits > 0) ++row_bits;
    if (row_bits == 0) return;
    const int passes = (row_bits + kMaxBits - 1) / kMaxBits;
    const int bits = (row_bits + passes - 1) / passes;
    const size_t buckets = size_t{1} << bits;
    const int64_t mask = static_cast<int64_t>(buckets - 1);
    size_t count[(size_t{1} << kMaxBits) + 1];
    tmp->resize(occ->size());
    for (int pass = 0, shift = 0; pass < passes; ++pass, shift += bits) {
      std::fill(count, count + buckets + 1, size_t{0});
      for (const Occ& o : *occ) ++count[((o.row >> shift) & mask) + 1];
      for (size_t b = 1; b <= buckets; ++b) count[b] += count[b - 1];
      Occ* out = tmp->data();
      for (const Occ& o : *occ) out[count[(o.row >> shift) & mask]++] = o;
      occ->swap(*tmp);
    }
  }

  // The rows [b, e) of an update: each row's gradient merged from its
  // occurrences, then its optimizer step (UpdateRow). Compiled three times
  // (UpdateRowsFor): for the baseline, and with AVX2 or AVX-512 enabled,
  // where the same loops vectorise wider (the formulas are embedding_math.h's,
  // inlined; the file is built with -ffp-contract=off, so no multiply and
  // add fuse and every ISA gives the same bits).
  struct UpdateRun {
    Shard* shard;
    const Occ* occ;
    const size_t* unique_begin;
    int64_t num_unique;
    int64_t dim;
    const RowKernels* kernels;
    AccumulateFn accumulate_f32;
    math::StepParams params;
    bool noise;
    int prefetch;
    // Rows to leave alone (skip_overflow), ascending; empty mostly.
    const int64_t* skip_begin = nullptr;
    const int64_t* skip_end = nullptr;
  };
  using UpdateRowsFn = void (*)(const UpdateRun&, int64_t, int64_t);

  // kSkip: some rows are left alone (a.skip_begin..skip_end); the plain
  // copy has no test per row.
  template <bool kSkip>
  __attribute__((always_inline)) static inline void UpdateRowsBody(const UpdateRun& a, int64_t b,
                                                                   int64_t e) {
    Shard& s = *a.shard;
    const int64_t dim = a.dim, num_unique = a.num_unique;
    const int prefetch = a.prefetch;
    const math::StepParams& params = a.params;
    const bool noise = a.noise;
    // The row's merged gradient, in this thread's scratch (reused, in L1):
    // a buffer of every row's, written once and read once, had doubled the
    // update's memory traffic (docs/lab-notes/2026-11-benchmarks.md).
    thread_local std::vector<float> merged;
    if (static_cast<int64_t>(merged.size()) < dim) merged.resize(dim);
    float* __restrict g = merged.data();
    for (int64_t u = b; u < e; ++u) {
      // As the lookups' (cpu_kernels_impl.h): every line of the row
      // and its state 2 * prefetch rows ahead to the outer caches, the
      // first lines `prefetch` ahead into L1.
      // Prefetching reaches past this chunk's end: with several
      // threads the chunks are short, and a chunk's last rows would
      // otherwise never be prefetched.
      if (prefetch > 0 && u + prefetch < num_unique) {
        const int64_t ahead = a.occ[a.unique_begin[u + prefetch]].row;
        _mm_prefetch(reinterpret_cast<const char*>(s.Row(ahead)), _MM_HINT_T0);
        if (s.state_width > 0) {
          _mm_prefetch(reinterpret_cast<const char*>(s.state.get() + ahead * s.state_width),
                       _MM_HINT_T0);
        }
        if (u + 2 * prefetch < num_unique) {
          const int64_t far = a.occ[a.unique_begin[u + 2 * prefetch]].row;
          const char* w = reinterpret_cast<const char*>(s.Row(far));
          for (int64_t l = 0; l < s.RowBytes(); l += 64) _mm_prefetch(w + l, _MM_HINT_T2);
          const char* st = reinterpret_cast<const char*>(s.state.get() + far * s.state_width);
          for (int64_t l = 0; l < s.state_width * 4; l += 64) _mm_prefetch(st + l, _MM_HINT_T2);
        }
      }
      if (kSkip && std::binary_search(a.skip_begin, a.skip_end, a.occ[a.unique_begin[u]].row)) {
        continue;
      }
      const int64_t row = MergeRow(a, u, g);
      UpdateRow(*a.kernels, &s, row, g, params, noise ? NoiseKey(s, row) : 0);
    }
  }
  // Row u's merged gradient into g: its first occurrence scaled, then the
  // others added. "0 + x" keeps the bits of adding it to zeros (a -0
  // product becomes +0), as before. Returns the row.
  __attribute__((always_inline)) static inline int64_t MergeRow(const UpdateRun& a, int64_t u,
                                                                float* __restrict g) {
    const int64_t dim = a.dim;
    const AccumulateFn accumulate_f32 = a.accumulate_f32;
    const Occ& first = a.occ[a.unique_begin[u]];
    const float* __restrict src = first.grad;
    for (int64_t c = 0; c < dim; ++c) g[c] = 0.0f + first.scale * src[c];
    for (size_t k = a.unique_begin[u] + 1; k < a.unique_begin[u + 1]; ++k) {
      accumulate_f32(g, a.occ[k].grad, dim, a.occ[k].scale);
    }
    return first.row;
  }
  static void UpdateRowsBaseline(const UpdateRun& a, int64_t b, int64_t e) {
    if (a.skip_begin == a.skip_end) return UpdateRowsBody<false>(a, b, e);
    UpdateRowsBody<true>(a, b, e);
  }
  __attribute__((target("avx2"))) static void UpdateRowsAvx2(const UpdateRun& a, int64_t b,
                                                             int64_t e) {
    if (a.skip_begin == a.skip_end) return UpdateRowsBody<false>(a, b, e);
    UpdateRowsBody<true>(a, b, e);
  }
  __attribute__((target("avx512f,avx512vl,avx2"))) static void UpdateRowsAvx512(
      const UpdateRun& a, int64_t b, int64_t e) {
    if (a.skip_begin == a.skip_end) return UpdateRowsBody<false>(a, b, e);
    UpdateRowsBody<true>(a, b, e);
  }
  // The copy for the backend's row kernels' ISA (their table exists only
  // where the CPU has it); chosen once, at construction (update_rows_).
  static UpdateRowsFn UpdateRowsFor(const RowKernels& k) {
    const std::string isa = k.isa;
    if (isa == "avx512") return UpdateRowsAvx512;
    if (isa == "avx2") return UpdateRowsAvx2;
    return UpdateRowsBaseline;
  }

  // Sorts a part's occurrences by row and finds each row's run of them: the
  // update of its rows, ready to run.
  UpdateRun SortAndMerge(Shard* s, UpdatePart* part) const {
    SortByRow(s->spec.rows, &part->occ, &part->tmp);
    const std::vector<Occ>& occ = part->occ;
    part->unique_begin.clear();
    for (size_t k = 0; k < occ.size(); ++k) {
      if (k == 0 || occ[k].row != occ[k - 1].row) part->unique_begin.push_back(k);
    }
    part->unique_begin.push_back(occ.size());
    const int64_t num_unique = static_cast<int64_t>(part->unique_begin.size()) - 1;
    const int64_t dim = s->spec.dim;
    const bool noise =
        s->spec.weight_type != WeightType::kFp32 && s->spec.optimizer.stochastic_rounding;
    return UpdateRun{s,
                     occ.data(),
                     part->unique_begin.data(),
                     num_unique,
                     dim,
                     kernels_,
                     kernels_->accumulate[0],
                     MakeStepParams(s->spec.optimizer, s->step),
                     noise,
                     options_.update_prefetch_distance,
                     nullptr,
                     nullptr};
  }

  // One optimizer step on row r with merged gradient g (modified in place),
  // by embedding_math.h's formulas; `noise_key` is this row's stochastic
  // rounding key (fp16/bf16 with stochastic_rounding only).
  __attribute__((always_inline)) static inline void UpdateRow(const RowKernels& k, Shard* s,
                                                              int64_t r, float* g,
                                                              const math::StepParams& p,
                                                              uint64_t noise_key) {
    const int64_t dim = s->spec.dim;
    // fp32 rows are updated in place; fp16/bf16 rows through a per-thread
    // fp32 copy (grown once, then reused).
    const bool fp32 = s->spec.weight_type == WeightType::kFp32;
    thread_local std::vector<float> scratch;
    float* wp;
    if (fp32) {
      wp = reinterpret_cast<float*>(s->Row(r));
    } else {
      if (static_cast<int64_t>(scratch.size()) < dim) scratch.resize(dim);
      wp = scratch.data();
      k.widen[static_cast<int>(s->spec.weight_type)](wp, s->Row(r), dim);
    }
    StepRow(wp, s->state_width > 0 ? s->state.get() + r * s->state_width : nullptr, g, dim, p);
    if (fp32) return;
    if (!s->spec.optimizer.stochastic_rounding) {
      k.narrow_nearest[static_cast<int>(s->spec.weight_type)](s->Row(r), wp, dim);
      return;
    }
    k.narrow_stochastic[static_cast<int>(s->spec.weight_type)](s->Row(r), wp, dim, noise_key,
                                                               s->spec.col_offset);
  }

  // Whether row r's update with merged gradient g fits (overflow_guard.h):
  // computed as UpdateRow computes it, into copies of the row and its
  // state, and nothing stored. A misfit that is the first of the call goes
  // to `report` (rows come in ascending order); a fit row's largest values
  // raise report's maxima.
  static bool CheckRow(const RowKernels& k, const Shard& s, int64_t r, float* g,
                       const math::StepParams& p, OverflowReport* report) {
    const int64_t dim = s.spec.dim;
    const int64_t width = s.state_width;
    thread_local std::vector<float> w, st;
    w.resize(dim);
    st.resize(std::max<int64_t>(width, 1));
    if (s.spec.weight_type == WeightType::kFp32) {
      std::memcpy(w.data(), s.Row(r), dim * sizeof(float));
    } else {
      k.widen[static_cast<int>(s.spec.weight_type)](w.data(), s.Row(r), dim);
    }
    if (width > 0) std::memcpy(st.data(), s.state.get() + r * width, width * sizeof(float));
    StepRow(w.data(), width > 0 ? st.data() : nullptr, g, dim, p);
    const float limit = WeightLimitOf(s.spec.weight_type);
    int64_t bad = -1;
    bool in_state = false;
    for (int64_t c = 0; c < dim && bad < 0; ++c) {
      if (!math::Fits(w[c], limit)) bad = c;
    }
    for (int64_t c = 0; c < width && bad < 0; ++c) {
      if (!math::Fits(st[c], math::kStateLimit)) bad = c, in_state = true;
    }
    if (bad >= 0) {
      if (report->row < 0) {
        report->row = r;
        report->col = bad;
        report->state = in_state;
        report->value = in_state ? st[bad] : w[bad];
      }
      return false;
    }
    for (int64_t c = 0; c < dim; ++c) {
      report->max_weight = std::max(report->max_weight, std::fabs(static_cast<double>(w[c])));
    }
    for (int64_t c = FirstAccumulator(s.spec.optimizer.type, dim); c < width; ++c) {
      report->max_acc = std::max(report->max_acc, static_cast<double>(st[c]));
    }
    return true;
  }

  // The optimizer step on a row's fp32 weights w and state st (null for
  // SGD) with merged gradient g (modified in place).
  __attribute__((always_inline)) static inline void StepRow(float* wp, float* stp, float* g,
                                                            int64_t dim,
                                                            const math::StepParams& p) {
    // Restrict pointers and the parameters in a local, so the loops
    // vectorise (the compiler cannot otherwise rule out aliasing).
    float* __restrict w = wp;
    float* __restrict gr = g;
    const math::StepParams q = p;
    float* __restrict st = stp;
    // L2 decay enters the gradient first (SGD's decay is always none). The
    // decay mode is tested here and once per optimizer below, never per
    // element, so the loops vectorise.
    if (q.decay == math::kDecayL2) {
      for (int64_t c = 0; c < dim; ++c) gr[c] = math::L2Gradient(q, gr[c], w[c]);
    }
    const bool decouple = q.decay == math::kDecayDecouple;
    math::StepParams plain = q;  // the step without decoupled decay
    plain.decay = math::kDecayNone;
    switch (q.optimizer) {
      case math::kStepSgd:
        for (int64_t c = 0; c < dim; ++c) w[c] = math::SgdStep(q, w[c], gr[c]);
        break;
      case math::kStepAdagrad:
        if (decouple) {
          for (int64_t c = 0; c < dim; ++c) w[c] = math::AdagradStep(q, w[c], gr[c], &st[c]);
        } else {
          for (int64_t c = 0; c < dim; ++c) w[c] = math::AdagradStep(plain, w[c], gr[c], &st[c]);
        }
        break;
      case math::kStepRowwiseAdagrad: {
        // The squares go into 8 running sums in double: one sum was a chain
        // of dependent adds, 4 cycles an element, most of an update's time
        // (docs/lab-notes/2026-11-benchmarks.md). The order of the sum is not FBGEMM's either
        // (a warp's tree); the result differs in double's last bits at most.
        // Every part[] index a constant (the tail's too: a part[c % 8] kept
        // them all on the stack, a load and a store around every add).
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 8 <= dim; c += 8) {
#pragma GCC unroll 8
          for (int k = 0; k < 8; ++k) part[k] += static_cast<double>(gr[c + k]) * gr[c + k];
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          if (c + k < dim) part[k] += static_cast<double>(gr[c + k]) * gr[c + k];
        }
        const double sq = ((part[0] + part[1]) + (part[2] + part[3])) +
                          ((part[4] + part[5]) + (part[6] + part[7]));
        const float mult =
            math::RowwiseMultiplier(q, &st[0], static_cast<float>(sq / static_cast<double>(dim)));
        if (decouple) {
          for (int64_t e = 0; e < dim; ++e) w[e] = math::RowwiseStep(q, w[e], gr[e], mult);
        } else {
          for (int64_t e = 0; e < dim; ++e) w[e] = math::RowwiseStep(plain, w[e], gr[e], mult);
        }
        break;
      }
      case math::kStepAdam: {
        float* __restrict m = st;
        float* __restrict v = st + dim;
        if (decouple) {
          for (int64_t c = 0; c < dim; ++c) w[c] = math::AdamStep(q, w[c], gr[c], &m[c], &v[c]);
        } else {
          for (int64_t c = 0; c < dim; ++c) {
            w[c] = math::AdamStep(plain, w[c], gr[c], &m[c], &v[c]);
          }
        }
        break;
      }
    }
  }

  // The stochastic rounding key of shard row r at the shard's current step.
  static uint64_t NoiseKey(const Shard& s, int64_t r) {
    return math::RowNoiseKey(s.spec.initializer.seed, s.step, s.spec.row_offset + r);
  }

  const CpuBackendOptions options_;
  const RowKernels* const kernels_;
  const UpdateRowsFn update_rows_;  // UpdateRowsFor(*kernels_)
  const PrefetchStyle style_;  // the lookups' (options_.prefetch_style resolved)
  ThreadPool pool_;
  mutable absl::Mutex mu_;
  ShardRegistry<Shard> shards_ ABSL_GUARDED_BY(mu_);
  MemoryBudget budget_;
  // Scratch reused across calls (no allocation once warm).
  std::vector<std::vector<int64_t>> offsets_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> req_order_ ABSL_GUARDED_BY(mu_);
  std::vector<const Shard*> shard_ptr_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> item_begin_ ABSL_GUARDED_BY(mu_);
  std::vector<UpdatePart> parts_ ABSL_GUARDED_BY(mu_);  // one a thread
  std::vector<float> grad_max_ ABSL_GUARDED_BY(mu_);     // a request's largest |gradient|
  std::vector<ShardPlan> plans_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> skipped_rows_{0};
};

}  // namespace

PrefetchStyle DefaultPrefetchStyle() {
  return CpuIsIntel() ? PrefetchStyle::kOuterOnly : PrefetchStyle::kTwoStage;
}

absl::StatusOr<PrefetchStyle> ParsePrefetchStyle(const std::string& name) {
  if (name == "auto" || name.empty()) return DefaultPrefetchStyle();
  if (name == "outer") return PrefetchStyle::kOuterOnly;
  if (name == "two_stage") return PrefetchStyle::kTwoStage;
  if (name == "l1") return PrefetchStyle::kIntoL1;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown prefetch style '", name, "' (valid: auto, outer, two_stage, l1)"));
}

PrefetchAhead FixedPrefetch(PrefetchStyle style, int distance) {
  PrefetchAhead p;
  p.outer = distance;
  if (style == PrefetchStyle::kTwoStage) p.l1 = std::min(distance / 2, 16);
  p.outer_into_l1 = style == PrefetchStyle::kIntoL1;
  return p;
}

PrefetchAhead LookupPrefetchFor(PrefetchStyle style, int64_t row_bytes, int64_t rows,
                                int64_t call_bytes) {
  constexpr int64_t kCachedShardBytes = int64_t{4} << 20;
  if (style == PrefetchStyle::kIntoL1 ||
      (style == PrefetchStyle::kOuterOnly && row_bytes <= 512 &&
       std::max(call_bytes, row_bytes * rows) <= kIntoL1CallBytes)) {
    return FixedPrefetch(PrefetchStyle::kIntoL1, 16);
  }
  if (row_bytes * rows <= kCachedShardBytes) return FixedPrefetch(style, 24);
  if (style == PrefetchStyle::kOuterOnly || row_bytes <= 128) return FixedPrefetch(style, 64);
  if (row_bytes <= 256) return FixedPrefetch(style, 32);
  return FixedPrefetch(style, 24);
}

PrefetchAhead ShardLookupPrefetch(int prefetch_distance, PrefetchStyle style, int64_t row_bytes,
                                  int64_t rows, int64_t call_bytes) {
  return prefetch_distance == CpuBackendOptions::kPrefetchByRow
             ? LookupPrefetchFor(style, row_bytes, rows, call_bytes)
             : FixedPrefetch(style, prefetch_distance);
}

absl::StatusOr<std::unique_ptr<EmbeddingBackend>> CreateCpuBackend(
    const CpuBackendOptions& options) {
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads must be >= 1, got ", options.num_threads));
  }
  if ((options.prefetch_distance < 0 &&
       options.prefetch_distance != CpuBackendOptions::kPrefetchByRow) ||
      options.update_prefetch_distance < 0) {
    return absl::InvalidArgumentError(
        "prefetch distances must be >= 0 (or, for lookups, kPrefetchByRow)");
  }
  auto kernels = RowKernelsFor(options.isa);
  if (!kernels.ok()) return kernels.status();
  auto style = ParsePrefetchStyle(options.prefetch_style);
  if (!style.ok()) return style.status();
  return std::unique_ptr<EmbeddingBackend>(new CpuBackend(options, *kernels, *style));
}

}  // namespace backend
}  // namespace ember
