// WithDynamicShards (dynamic_backend.h).
#include "server/backend/dynamic/dynamic_backend.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/dynamic/dynamic_index.h"
#include "server/backend/forwarding_backend.h"
#include "server/backend/overflow_guard.h"

namespace ember {
namespace backend {
namespace {

// Ids a thread of a lookup's id-to-slot pass takes at a time.
constexpr int64_t kFindGrain = 8192;

class DynamicShardsBackend : public ForwardingBackend {
 public:
  DynamicShardsBackend(std::unique_ptr<EmbeddingBackend> inner, const DynamicShardOptions& options)
      : ForwardingBackend(std::move(inner)), options_(options) {}

  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    if (!spec.is_dynamic) return inner()->CreateShard(spec);
    if (absl::Status s = ValidateDynamicSpec(spec); !s.ok()) return s;
    auto id = inner()->CreateShard(FixedSpec(spec));
    if (!id.ok()) return id.status();
    auto shard = std::make_shared<Shard>(spec, options_.max_pending_ids);
    // A backend that finds ids itself gets the index, then every change of
    // it; not under a cache (key_value, fused_uvm_caching), whose shard is
    // indexed by the cache's slots, not by this shard's.
    if (inner()->FindsKeys() && spec.cache_rows == 0) {
      shard->index.TrackChangedLines();
      const absl::Status synced =
          inner()->SyncKeyIndex(*id, shard->index.lines(), shard->index.line_count(), {});
      if (!synced.ok()) {
        (void)inner()->DropShard(*id);
        return synced;
      }
      shard->backend_finds = true;
    }
    // The zero slot: zero weights and zero state, which a zero gradient
    // leaves as they are under every optimizer (an Adagrad step of 0 / eps).
    const std::vector<float> zeros(static_cast<size_t>(spec.dim), 0.0f);
    const std::vector<float> zero_state(
        static_cast<size_t>(OptimizerStateWidth(spec.optimizer.type, spec.dim)), 0.0f);
    const absl::Status zeroed = inner()->ImportRows(*id, spec.rows, spec.rows + 1, zeros, zero_state);
    if (!zeroed.ok()) {
      (void)inner()->DropShard(*id);
      return zeroed;
    }
    absl::MutexLock lock(&mu_);
    shards_[*id] = std::move(shard);
    return *id;
  }

  absl::Status DropShard(ShardId id) override {
    std::shared_ptr<Shard> shard;
    {
      absl::MutexLock lock(&mu_);
      auto it = shards_.find(id);
      if (it != shards_.end()) {
        shard = std::move(it->second);
        shards_.erase(it);
      }
    }
    if (shard != nullptr) absl::MutexLock wait(&shard->mu);  // calls in flight end first
    return inner()->DropShard(id);
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    if (auto shard = Find(id)) return shard->spec;
    return inner()->GetShardSpec(id);
  }

  // This wrapper takes the ids of its dynamic shards as they come; its
  // callers never key them.
  bool FindsKeys() const override { return false; }
  absl::Status SyncKeyIndex(ShardId id, const math::KeyLine* lines, int64_t count,
                            absl::Span<const int64_t> changed) override {
    return EmbeddingBackend::SyncKeyIndex(id, lines, count, changed);
  }

  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    for (size_t i = 0; i < requests.size(); ++i) {  // keys are this wrapper's to hand on
      if (requests[i].feature.keyed) {
        return absl::InvalidArgumentError(absl::StrCat(
            "lookup request ", i, ": keyed ids, but dynamic shards take their ids as they come"));
      }
    }
    Held held = Collect(requests, /*exclusive=*/false);
    if (held.shards.empty()) return inner()->Lookup(requests);
    std::vector<LookupRequest> mapped(requests.begin(), requests.end());
    std::vector<std::vector<int64_t>>& slots = Scratch().slots;
    if (slots.size() < requests.size()) slots.resize(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      const Shard* s = held.Of(requests[i].feature.shard);
      if (s == nullptr) continue;
      if (s->keyed()) {  // the backend finds them (ids on the device too)
        mapped[i].feature.keyed = true;
        continue;
      }
      if (s->backend_finds && requests[i].feature.on_device) {  // its copy is behind
        return absl::UnavailableError(absl::StrCat(
            "lookup request ", i, " (table '", s->spec.table,
            "'): the device's copy of the index is behind (a sync failed); it is synced again "
            "with the next update: retry, or send the ids in host memory"));
      }
      if (absl::Status st = CheckHostInputs(requests[i].feature, "lookup", i, *s); !st.ok()) {
        return st;
      }
      const absl::Span<const int64_t> ids = requests[i].feature.ids;
      slots[i].resize(ids.size());
      int64_t* out = slots[i].data();
      // On the backend's threads (the CPU backend's pool) for a large
      // request: the pass is a sixth to a half of a lookup.
      inner()->ParallelFor(static_cast<int64_t>(ids.size()), kFindGrain,
                           [&](int64_t b, int64_t e) {
                             s->index.FindAll(ids.subspan(b, e - b), s->spec.rows, out + b);
                           });
      mapped[i].feature.ids = slots[i];
    }
    return inner()->Lookup(mapped);
  }

  // A dynamic shard's ids go on as its slots (under the shard's shared
  // lock, so that no update moves them meanwhile); ids without a row as the
  // zero slot, which their lookup reads (nothing is counted toward their
  // admission). Shards kept whole in memory have no cache: nothing to do
  // for them. Keys are any int64.
  absl::StatusOr<int64_t> Prefetch(absl::Span<const FeatureRequest> features) override {
    Held held = Collect(features, /*exclusive=*/false);
    if (held.shards.empty()) return inner()->Prefetch(features);
    std::vector<FeatureRequest> mapped;
    std::vector<std::vector<int64_t>> slots(features.size());
    for (size_t i = 0; i < features.size(); ++i) {
      const Shard* s = held.Of(features[i].shard);
      if (s == nullptr) {
        mapped.push_back(features[i]);
        continue;
      }
      if (absl::Status st = CheckHostInputs(features[i], "prefetch", i, *s); !st.ok()) return st;
      if (features[i].keyed) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prefetch request ", i, ": keyed ids, but dynamic shards take their ids as they come"));
      }
      if (s->spec.cache_rows == 0) continue;
      const absl::Span<const int64_t> ids = features[i].ids;
      slots[i].resize(ids.size());
      s->index.FindAll(ids, s->spec.rows, slots[i].data());
      FeatureRequest f = features[i];
      f.ids = slots[i];
      f.lengths = {};
      f.weights = {};
      mapped.push_back(f);
    }
    return inner()->Prefetch(mapped);
  }

  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    Held held = Collect(requests, /*exclusive=*/true);
    if (held.shards.empty()) return inner()->ApplyGradients(requests);
    for (size_t i = 0; i < requests.size(); ++i) {
      if (const Shard* s = held.Of(requests[i].feature.shard)) {
        if (absl::Status st = CheckHostInputs(requests[i].feature, "gradient", i, *s); !st.ok()) {
          return st;
        }
      }
    }
    // Each shard's step over its ids in request order; BeginUpdate gives
    // every occurrence's slot after the step's admissions (the zero slot
    // for ids still without a row). (Scratch is kept from call to call:
    // not faulted in anew.)
    CallScratch& scratch = Scratch();
    std::vector<Undo>& undo = scratch.undo;
    std::vector<std::vector<int64_t>>& shard_slots = scratch.slots;
    if (undo.size() < held.shards.size()) undo.resize(held.shards.size());
    if (shard_slots.size() < held.shards.size()) shard_slots.resize(held.shards.size());
    for (size_t k = 0; k < held.shards.size(); ++k) undo[k].Clear();
    std::vector<int64_t>& ids = scratch.ids;
    for (size_t k = 0; k < held.shards.size(); ++k) {
      auto& [id, shard] = held.shards[k];
      ids.clear();
      for (const GradientRequest& r : requests) {
        if (r.feature.shard == id) ids.insert(ids.end(), r.feature.ids.begin(), r.feature.ids.end());
      }
      shard_slots[k].resize(ids.size());
      undo[k].begun = true;
      const auto created = shard->index.BeginUpdate(ids, shard->spec.rows, shard_slots[k].data());
      if (absl::Status s = WriteCreated(id, *shard, created, &undo[k]); !s.ok()) {
        s = UndoAll(held, &undo, s);
        SyncKeys(held);
        return s;
      }
    }
    // Each request's slots, in its shard's; ids without a row contribute
    // nothing: weight 0 (pooled) or zero gradient rows (NONE).
    std::vector<GradientRequest> mapped(requests.begin(), requests.end());
    std::vector<std::vector<float>>& weights = scratch.weights;
    std::vector<std::vector<float>>& grads = scratch.grads;
    if (weights.size() < requests.size()) weights.resize(requests.size());
    if (grads.size() < requests.size()) grads.resize(requests.size());
    std::vector<size_t> taken(held.shards.size(), 0);  // each shard's slots handed out
    for (size_t i = 0; i < requests.size(); ++i) {
      const size_t k = held.IndexOf(requests[i].feature.shard);
      if (k == held.shards.size()) continue;
      const Shard& s = *held.shards[k].second;
      const FeatureRequest& f = requests[i].feature;
      const int64_t zero = s.spec.rows;
      const absl::Span<const int64_t> slots =
          absl::MakeConstSpan(shard_slots[k]).subspan(taken[k], f.ids.size());
      taken[k] += f.ids.size();
      mapped[i].feature.ids = slots;
      if (std::find(slots.begin(), slots.end(), zero) == slots.end()) continue;
      if (f.pooling != Pooling::kNone) {
        weights[i].assign(f.ids.size(), 1.0f);
        if (!f.weights.empty()) weights[i].assign(f.weights.begin(), f.weights.end());
        for (size_t j = 0; j < slots.size(); ++j) {
          if (slots[j] == zero) weights[i][j] = 0.0f;
        }
        mapped[i].feature.weights = weights[i];
      } else if (requests[i].grad.size() == f.ids.size() * static_cast<size_t>(s.spec.dim)) {
        grads[i].assign(requests[i].grad.begin(), requests[i].grad.end());
        for (size_t j = 0; j < slots.size(); ++j) {
          if (slots[j] == zero) std::fill_n(grads[i].begin() + j * s.spec.dim, s.spec.dim, 0.0f);
        }
        mapped[i].grad = grads[i];
      }  // (a gradient of the wrong size: the wrapped backend refuses it)
    }
    if (absl::Status s = inner()->ApplyGradients(mapped); !s.ok()) {
      s = NameOverflowId(held, s);  // the id, not the slot the wrapped backend saw
      s = UndoAll(held, &undo, s);
      SyncKeys(held);
      return s;
    }
    for (auto& [id, shard] : held.shards) shard->index.Commit();
    SyncKeys(held);
    return absl::OkStatus();
  }

  absl::Status ExportRows(ShardId id, int64_t begin, int64_t end, absl::Span<float> weights,
                          absl::Span<float> state) const override {
    if (auto shard = Find(id)) {
      absl::ReaderMutexLock lock(&shard->mu);
      if (absl::Status s = CheckSlots(*shard, begin, end); !s.ok()) return s;
    }
    return inner()->ExportRows(id, begin, end, weights, state);
  }

  absl::Status ImportRows(ShardId id, int64_t begin, int64_t end, absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    if (auto shard = Find(id)) {
      absl::MutexLock lock(&shard->mu);
      if (absl::Status s = CheckSlots(*shard, begin, end); !s.ok()) return s;
      return inner()->ImportRows(id, begin, end, weights, state);
    }
    return inner()->ImportRows(id, begin, end, weights, state);
  }

  // The wrapped shard's, less its zero slot (rows + 1 there).
  absl::StatusOr<std::vector<int64_t>> ChangedRowsIn(ShardId id, const ChangeMark& since,
                                                     int64_t begin, int64_t end) const override {
    auto rows = inner()->ChangedRowsIn(id, since, begin, end);
    if (!rows.ok()) return rows;
    if (auto shard = Find(id)) {
      const int64_t held = shard->spec.rows;
      rows->erase(std::lower_bound(rows->begin(), rows->end(), held), rows->end());
    }
    return rows;
  }

  absl::Status ImportStep(ShardId id, int64_t step) override {
    if (auto shard = Find(id)) {
      absl::MutexLock lock(&shard->mu);
      if (absl::Status s = inner()->ImportStep(id, step); !s.ok()) return s;
      shard->index.SetStep(step);
      return absl::OkStatus();
    }
    return inner()->ImportStep(id, step);
  }

  absl::Status ExportSlots(ShardId id, int64_t begin, int64_t end,
                           absl::Span<SlotMeta> out) const override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::ReaderMutexLock lock(&shard->mu);
    if (absl::Status s = CheckSlots(*shard, begin, end); !s.ok()) return s;
    if (out.size() != static_cast<size_t>(end - begin)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExportSlots: ", out.size(), " entries for ", end - begin, " slots"));
    }
    shard->index.ExportSlots(begin, end, out.data());
    return absl::OkStatus();
  }

  absl::Status ImportSlots(ShardId id, int64_t begin, int64_t end,
                           absl::Span<const SlotMeta> in) override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::MutexLock lock(&shard->mu);
    if (absl::Status s = CheckSlots(*shard, begin, end); !s.ok()) return s;
    if (in.size() != static_cast<size_t>(end - begin)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ImportSlots: ", in.size(), " entries for ", end - begin, " slots"));
    }
    const absl::Status restored = shard->index.RestoreSlots(begin, end, in.data());
    SyncKeys(id, shard.get());
    return restored;
  }

  absl::Status ImportIds(ShardId id, absl::Span<const int64_t> ids, absl::Span<const float> weights,
                         absl::Span<const float> state) override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::MutexLock lock(&shard->mu);
    const ShardSpec& spec = shard->spec;
    const size_t width = static_cast<size_t>(OptimizerStateWidth(spec.optimizer.type, spec.dim));
    if (weights.size() != ids.size() * spec.dim ||
        (!state.empty() && state.size() != ids.size() * width)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", spec.table, "': ", ids.size(), " ids take ", ids.size() * spec.dim,
          " weights and ", ids.size() * width, " state values (or none); got ", weights.size(),
          " and ", state.size()));
    }
    // Every row checked before anything changes.
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::vector<float> fresh = FreshState(spec);
      if (absl::Status s = ValidateImport(
              spec, 0, 1, weights.subspan(i * spec.dim, spec.dim),
              state.empty() ? absl::MakeConstSpan(fresh) : state.subspan(i * width, width));
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("id ", ids[i], ": ", s.message()));
      }
    }
    auto created = shard->index.BeginImport(ids);
    if (!created.ok()) return created.status();
    Undo undo;
    undo.begun = true;
    // Rows held before keep their state unless one is given (the created
    // ones have their fresh state by now).
    absl::Status s = WriteCreated(id, *shard, *created, &undo);
    std::vector<int64_t> slots(ids.size());
    shard->index.FindAll(ids, -1, slots.data());
    std::vector<float> unused, kept;
    if (s.ok() && state.empty()) {
      unused.resize(ids.size() * spec.dim);
      kept.resize(ids.size() * width);
      s = inner()->ExportRowsAt(id, slots, absl::MakeSpan(unused), absl::MakeSpan(kept));
    }
    if (s.ok()) {
      s = inner()->ImportRowsAt(id, slots, weights,
                                state.empty() ? absl::MakeConstSpan(kept) : state);
    }
    if (!s.ok()) {
      s = Restore(id, spec, undo, s);
      shard->index.Rollback();
      SyncKeys(id, shard.get());
      return s;
    }
    shard->index.Commit();
    SyncKeys(id, shard.get());
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int64_t>> ExportPendingCounts(ShardId id) const override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::ReaderMutexLock lock(&shard->mu);
    return shard->index.PendingCounts();
  }

  absl::Status ImportPendingCounts(ShardId id, absl::Span<const int64_t> packed) override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::MutexLock lock(&shard->mu);
    return shard->index.RestorePendingCounts(packed);
  }

  absl::StatusOr<std::vector<uint32_t>> ExportPendingSketch(ShardId id) const override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::ReaderMutexLock lock(&shard->mu);
    return shard->index.PendingSketch();
  }

  absl::Status MergePendingSketch(ShardId id, absl::Span<const uint32_t> counters) override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::MutexLock lock(&shard->mu);
    return shard->index.MergePendingSketch(counters);
  }

  absl::StatusOr<DynamicStats> GetDynamicStats(ShardId id) const override {
    auto shard = Find(id);
    if (shard == nullptr) return NotDynamic(id);
    absl::ReaderMutexLock lock(&shard->mu);
    return shard->index.Stats();
  }

 private:
  // The wrapped backend's fixed shard of dynamic shard `spec`: its slots
  // and the zero slot after them.
  static ShardSpec FixedSpec(const ShardSpec& spec) {
    ShardSpec fixed = spec;
    fixed.is_dynamic = false;
    fixed.rows = spec.rows + 1;  // the zero slot
    fixed.table_rows = spec.table_rows + 1;
    return fixed;
  }

  struct Shard {
    Shard(const ShardSpec& s, int64_t max_pending)
        : spec(s), index(s.rows, s.dynamic, max_pending) {}
    const ShardSpec spec;
    mutable absl::Mutex mu;
    DynamicIndex index;  // guarded by mu (shared for Find/FindAll)
    // The wrapped backend finds this shard's ids itself (FindsKeys), in a
    // copy of the index; `unsynced`: lines its copy lacks (a failed sync),
    // while which lookups map ids here instead. Guarded by mu.
    bool backend_finds = false;
    std::vector<int64_t> unsynced;
    bool keyed() const { return backend_finds && unsynced.empty(); }
  };
  // The dynamic shards of one call, locked in shard id order for the call.
  struct Held {
    std::vector<std::pair<ShardId, std::shared_ptr<Shard>>> shards;
    bool exclusive = false;
    Held() = default;
    Held(Held&& o) noexcept : shards(std::move(o.shards)), exclusive(o.exclusive) {}
    ~Held() {
      for (auto it = shards.rbegin(); it != shards.rend(); ++it) {
        if (exclusive) {
          it->second->mu.Unlock();
        } else {
          it->second->mu.ReaderUnlock();
        }
      }
    }
    // The position of shard `id` in `shards`, or shards.size().
    size_t IndexOf(ShardId id) const {
      for (size_t k = 0; k < shards.size(); ++k) {
        if (shards[k].first == id) return k;
      }
      return shards.size();
    }
    Shard* Of(ShardId id) const {
      const size_t k = IndexOf(id);
      return k < shards.size() ? shards[k].second.get() : nullptr;
    }
  };

  // An overflow refusal of the wrapped backend names a slot of one of
  // `held`'s shards: named by the id it holds (before the call's changes
  // are undone).
  absl::Status NameOverflowId(const Held& held, const absl::Status& s) const {
    for (const auto& [id, shard] : held.shards) {
      const ShardSpec fixed = FixedSpec(shard->spec);
      const int64_t slot = OverflowRowOf(s, fixed);
      if (slot < 0 || slot >= shard->spec.rows) continue;
      EmbeddingBackend::SlotMeta meta;
      shard->index.ExportSlots(slot, slot + 1, &meta);
      if (meta.held) return RenameOverflowRow(s, fixed, absl::StrCat("id ", meta.id));
    }
    return s;
  }
  // What an update overwrote: the rows of reused slots, put back on failure.
  struct Undo {
    bool begun = false;
    std::vector<int64_t> slots;
    std::vector<float> weights, state;
    void Clear() {
      begun = false;
      slots.clear();
      weights.clear();
      state.clear();
    }
  };

  // A calling thread's arrays, kept from call to call (not faulted in
  // anew each call).
  struct CallScratch {
    std::vector<std::vector<int64_t>> slots;
    std::vector<std::vector<float>> weights, grads;
    std::vector<int64_t> ids;
    std::vector<Undo> undo;
  };
  static CallScratch& Scratch() {
    thread_local CallScratch scratch;
    return scratch;
  }

  std::shared_ptr<Shard> Find(ShardId id) const {
    absl::MutexLock lock(&mu_);
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second;
  }

  template <typename Request>
  Held Collect(absl::Span<const Request> requests, bool exclusive) const {
    Held held;
    held.exclusive = exclusive;
    {
      absl::MutexLock lock(&mu_);
      if (shards_.empty()) return held;
      for (const Request& r : requests) {
        auto it = shards_.find(ShardOf(r));
        if (it != shards_.end() && held.Of(it->first) == nullptr) held.shards.push_back(*it);
      }
    }
    std::sort(held.shards.begin(), held.shards.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [id, s] : held.shards) {
      if (exclusive) {
        s->mu.Lock();
      } else {
        s->mu.ReaderLock();
      }
    }
    return held;
  }

  static absl::Status CheckHostInputs(const FeatureRequest& f, const char* kind, size_t i,
                                      const Shard& s) {
    if (!f.on_device) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        kind, " request ", i, " (table '", s.spec.table,
        "'): a dynamic table takes its ids in host memory, not on the device"));
  }

  static absl::Status CheckSlots(const Shard& s, int64_t begin, int64_t end) {
    if (begin < 0 || begin > end || end > s.spec.rows) {
      return absl::InvalidArgumentError(absl::StrCat("slot range [", begin, ", ", end,
                                                     ") is outside [0, ", s.spec.rows,
                                                     ") of dynamic table '", s.spec.table, "'"));
    }
    return absl::OkStatus();
  }

  static absl::Status NotDynamic(ShardId id) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", id, " is not a dynamic shard"));
  }

  // Hands the lines an update, import or restore changed to a backend that
  // finds ids itself (shard locked exclusive). A failed sync keeps them for
  // the next one, and the shard's lookups map ids here until one succeeds:
  // never a lookup against a stale copy.
  void SyncKeys(ShardId id, Shard* shard) {
    if (!shard->backend_finds) return;
    std::vector<int64_t> changed = shard->index.TakeChangedLines();
    if (changed.empty() && shard->unsynced.empty()) return;
    if (!shard->unsynced.empty()) {
      std::vector<int64_t> both;
      std::set_union(changed.begin(), changed.end(), shard->unsynced.begin(),
                     shard->unsynced.end(), std::back_inserter(both));
      changed.swap(both);
    }
    const absl::Status synced = inner()->SyncKeyIndex(id, shard->index.lines(),
                                                      shard->index.line_count(), changed);
    if (synced.ok()) {
      shard->unsynced.clear();
    } else {
      shard->unsynced.swap(changed);
    }
  }
  void SyncKeys(Held& held) {
    for (auto& [id, shard] : held.shards) SyncKeys(id, shard.get());
  }

  // The rows `created` gets: their initial values and fresh state, in one
  // write; the rows of reused slots (evicted now) kept in `undo` first.
  absl::Status WriteCreated(ShardId id, const Shard& shard,
                            const std::vector<DynamicIndex::Created>& created, Undo* undo) {
    if (created.empty()) return absl::OkStatus();
    const ShardSpec& spec = shard.spec;
    const std::vector<float> fresh = FreshState(spec);
    const size_t dim = static_cast<size_t>(spec.dim), width = fresh.size();
    for (const DynamicIndex::Created& c : created) {
      if (c.reused) undo->slots.push_back(c.slot);
    }
    if (!undo->slots.empty()) {
      undo->weights.resize(undo->slots.size() * dim);
      undo->state.resize(undo->slots.size() * width);
      if (absl::Status s = inner()->ExportRowsAt(id, undo->slots, absl::MakeSpan(undo->weights),
                                                 absl::MakeSpan(undo->state));
          !s.ok()) {
        undo->Clear();
        undo->begun = true;
        return s;
      }
    }
    std::vector<int64_t> slots(created.size()), ids(created.size());
    std::vector<float> rows(created.size() * dim), state(created.size() * width);
    for (size_t k = 0; k < created.size(); ++k) {
      slots[k] = created[k].slot;
      ids[k] = created[k].id;
      std::copy(fresh.begin(), fresh.end(), state.begin() + k * width);
    }
    InitialValuesOf(spec.initializer, spec.table_rows, ids, spec.col_offset, spec.dim, rows.data());
    return inner()->ImportRowsAt(id, slots, rows, state);
  }

  // Writes back the rows a refused call's admissions replaced (the slots
  // are distinct: an update evicts no row it writes). The call's answer:
  // `refused`, or DATA_LOSS where they could not be put back (below
  // memory: a key_value cache's write-back on a full disk), their ids then
  // held again without their rows.
  absl::Status Restore(ShardId id, const ShardSpec& spec, const Undo& undo,
                       const absl::Status& refused) {
    if (undo.slots.empty()) return refused;
    const absl::Status put_back = inner()->ImportRowsAt(id, undo.slots, undo.weights, undo.state);
    if (put_back.ok()) return refused;
    return absl::DataLossError(absl::StrCat(
        "table '", spec.table, "': ", refused.message(),
        "; and the rows it replaced could not be put back (", put_back.message(),
        "): restore the collection from a checkpoint"));
  }

  // Rolls the call back; its answer as Restore gives it (the first
  // DATA_LOSS, if any).
  absl::Status UndoAll(Held& held, std::vector<Undo>* undo, const absl::Status& refused) {
    absl::Status answer = refused;
    for (size_t k = held.shards.size(); k-- > 0;) {
      if (!(*undo)[k].begun) continue;
      const absl::Status s =
          Restore(held.shards[k].first, held.shards[k].second->spec, (*undo)[k], refused);
      if (answer.code() != absl::StatusCode::kDataLoss) answer = s;
      held.shards[k].second->index.Rollback();
    }
    return answer;
  }

  const DynamicShardOptions options_;
  mutable absl::Mutex mu_;
  std::map<ShardId, std::shared_ptr<Shard>> shards_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status ValidateDynamicSpec(const ShardSpec& spec) {
  const std::string what = absl::StrCat("dynamic table '", spec.table, "'");
  if (spec.rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": capacity must be > 0, got ", spec.rows));
  }
  if (IsQuantized(spec.weight_type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", WeightTypeName(spec.weight_type),
        " rows take no updates, and a dynamic table's rows are made by them"));
  }
  if (spec.dynamic.admit_after < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": admit_after must be >= 0, got ", spec.dynamic.admit_after));
  }
  if (spec.dynamic.ttl_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ttl_steps must be >= 0, got ", spec.dynamic.ttl_steps));
  }
  return absl::OkStatus();
}

std::unique_ptr<EmbeddingBackend> WithDynamicShards(std::unique_ptr<EmbeddingBackend> inner,
                                                    const DynamicShardOptions& options) {
  return std::make_unique<DynamicShardsBackend>(std::move(inner), options);
}

}  // namespace backend
}  // namespace ember
