// WithKeyValueShards (key_value_backend.h).
#include "server/backend/key_value/key_value_backend.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "math/embedding_math.h"
#include "math/half.h"
#include "server/backend/forwarding_backend.h"
#include "server/backend/key_value/lru_curve.h"
#include "server/backend/key_value/row_file.h"
#include "server/backend/overflow_guard.h"

namespace ember {
namespace backend {
namespace {

constexpr int32_t kAbsent = -1;
// Marks Fill's refusal of a call naming more distinct rows than a cache
// holds (a lookup then runs in pieces).
constexpr char kOverCachePayload[] = "type.ember.dev/key_value_over_cache";
// Records an export reads at a time: 2 MiB of 512-byte records (dim 64,
// row-wise Adagrad), 16 times the reads the ring keeps in flight.
constexpr size_t kExportChunk = 4096;

// A record: a row's `dim` fp32 weights, then its `width` fp32 state.
void PackRecord(int64_t dim, int64_t width, const float* w, const float* st, float* rec) {
  std::copy_n(w, dim, rec);
  std::copy_n(st, width, rec + dim);
}
void SplitRecord(int64_t dim, int64_t width, const float* rec, float* w, float* st) {
  std::copy_n(rec, dim, w);
  std::copy_n(rec + dim, width, st);
}

// Where a shard's rows live below its cache, as records of fp32 weights
// then fp32 state: a file on local SSD (key_value), or a shard of the
// wrapped backend in host memory mapped into the GPU (fused_uvm_caching).
class RecordStore {
 public:
  virtual ~RecordStore() = default;
  // RowFile's calls (row_file.h): records[k] into or from buffer row k.
  virtual absl::Status ReadRows(absl::Span<const int64_t> records, RowBuffer* buffer) const = 0;
  virtual absl::Status WriteRows(absl::Span<const int64_t> records, const RowBuffer& buffer) = 0;
  virtual absl::Status Exchange(absl::Span<const int64_t> write_records, const RowBuffer& out,
                                absl::Span<const int64_t> read_records, RowBuffer* in) = 0;
  virtual int64_t stride() const = 0;
};

class FileStore : public RecordStore {
 public:
  explicit FileStore(std::unique_ptr<RowFile> file) : file_(std::move(file)) {}
  absl::Status ReadRows(absl::Span<const int64_t> records, RowBuffer* buffer) const override {
    return file_->ReadRows(records, buffer);
  }
  absl::Status WriteRows(absl::Span<const int64_t> records, const RowBuffer& buffer) override {
    return file_->WriteRows(records, buffer);
  }
  absl::Status Exchange(absl::Span<const int64_t> write_records, const RowBuffer& out,
                        absl::Span<const int64_t> read_records, RowBuffer* in) override {
    return file_->Exchange(write_records, out, read_records, in);
  }
  int64_t stride() const override { return file_->stride(); }

 private:
  std::unique_ptr<RowFile> file_;
};

// Record r is row r of shard `backing` of `inner` (a fused_uvm shard: its
// weights in the table's type, its state fp32), read and written with the
// backend's ExportRowsAt / ImportRowsAt, whose conversions are exact both
// ways. The wrapper drops the backing shard with its own.
class MappedShardStore : public RecordStore {
 public:
  MappedShardStore(EmbeddingBackend* inner, ShardId backing, int64_t dim, int64_t width)
      : inner_(inner), backing_(backing), dim_(dim), width_(width) {}
  ShardId backing() const { return backing_; }
  absl::Status ReadRows(absl::Span<const int64_t> records, RowBuffer* buffer) const override {
    std::vector<float> w(records.size() * dim_), st(records.size() * width_);
    if (absl::Status s = inner_->ExportRowsAt(backing_, records, absl::MakeSpan(w),
                                              absl::MakeSpan(st));
        !s.ok()) {
      return s;
    }
    for (size_t k = 0; k < records.size(); ++k) {
      PackRecord(dim_, width_, w.data() + k * dim_, st.data() + k * width_,
                 buffer->row(static_cast<int64_t>(k)));
    }
    return absl::OkStatus();
  }
  absl::Status WriteRows(absl::Span<const int64_t> records, const RowBuffer& buffer) override {
    std::vector<float> w(records.size() * dim_), st(records.size() * width_);
    for (size_t k = 0; k < records.size(); ++k) {
      SplitRecord(dim_, width_, buffer.row(static_cast<int64_t>(k)), w.data() + k * dim_,
                  st.data() + k * width_);
    }
    return inner_->ImportRowsAt(backing_, records, w, st);
  }
  absl::Status Exchange(absl::Span<const int64_t> write_records, const RowBuffer& out,
                        absl::Span<const int64_t> read_records, RowBuffer* in) override {
    if (absl::Status s = WriteRows(write_records, out); !s.ok()) return s;
    return ReadRows(read_records, in);
  }
  int64_t stride() const override { return (dim_ + width_) * 4; }

 private:
  EmbeddingBackend* const inner_;
  const ShardId backing_;
  const int64_t dim_, width_;
};

struct Shard {
  ShardSpec spec;
  int64_t width = 0;   // optimizer state floats a row
  int64_t record = 0;  // floats a row in the file: dim + width
  int64_t file_bytes = 0;
  std::unique_ptr<RecordStore> file;
  // fused_uvm_caching (spec.host_mapped): the rows below the cache are
  // shard `backing` of the wrapped backend, a fused_uvm one
  // (MappedShardStore), each row always in its own record (written in
  // place: memory has no torn writes to guard against), every row there
  // from the start with its initial value.
  ShardId backing = -1;
  bool in_place() const { return spec.host_mapped; }
  // A row's cache slot, or kAbsent; mid-call, -2 - k for the call's k-th
  // miss (so that a row named twice misses once).
  std::vector<int32_t> slot_of_row;
  std::vector<int64_t> row_of_slot;  // -1: a free slot
  std::vector<uint8_t> changed;      // the slot's row changed since it was filled
  std::vector<uint8_t> used;         // CLOCK's bit
  std::vector<uint64_t> pinned;      // the call that last named the slot
  // The file as a log of row versions: a row's latest write lies in
  // record loc[row] (-1: never written: its initial value), and a record
  // is live when its owner's loc names it. New versions go to records that
  // are not live, ahead of a cursor that goes round the file (SlackRows
  // more records than rows), so no live record is ever overwritten: a
  // write that fails leaves every row's last version where it was.
  std::vector<int32_t> loc;    // [rows]
  std::vector<int32_t> owner;  // [records]: the row a record was last written for, or -1
  int64_t records = 0;
  int64_t cursor = 0;
  int64_t hand = 0;
  bool dropped = false;
  TierStats stats;
  // The hit rate an LRU cache of each size would have had on the calls'
  // rows (TierStats::curve_hits).
  std::unique_ptr<LruCurve> curve;

  int64_t cache_rows() const { return spec.cache_rows; }
  bool Written(int64_t r) const { return loc[r] >= 0; }
  bool Live(int64_t record) const { return owner[record] >= 0 && loc[owner[record]] == record; }
  // The records new versions of `rows` go to: records that are not live,
  // ahead of the cursor, ascending but for one wrap (no more of them than
  // the records that are not live: SlackRows); in place, their own.
  std::vector<int64_t> TakeFree(absl::Span<const int64_t> rows) {
    if (in_place()) return std::vector<int64_t>(rows.begin(), rows.end());
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(n));
    while (static_cast<int64_t>(out.size()) < n) {
      if (!Live(cursor)) out.push_back(cursor);
      cursor = cursor + 1 == records ? 0 : cursor + 1;
    }
    return out;
  }
  // Row rows[k]'s latest version is now in records[k].
  void Commit(absl::Span<const int64_t> rows, absl::Span<const int64_t> at) {
    for (size_t k = 0; k < rows.size(); ++k) {
      loc[rows[k]] = static_cast<int32_t>(at[k]);
      owner[at[k]] = static_cast<int32_t>(rows[k]);
    }
  }
};

// Rows as file records (weights then state, a row after another) and back.
void PackRow(const Shard& s, const float* w, const float* st, float* rec) {
  PackRecord(s.spec.dim, s.width, w, st, rec);
}
void Interleave(const Shard& s, int64_t n, const float* w, const float* st, RowBuffer* rec) {
  for (int64_t k = 0; k < n; ++k) PackRow(s, w + k * s.spec.dim, st + k * s.width, rec->row(k));
}
void Split(const Shard& s, const float* rec, float* w, float* st) {
  SplitRecord(s.spec.dim, s.width, rec, w, st);
}

// Sorts keys ascending, carrying values along.
void SortTogether(std::vector<int64_t>* keys, std::vector<int64_t>* values) {
  std::vector<std::pair<int64_t, int64_t>> kv(keys->size());
  for (size_t j = 0; j < kv.size(); ++j) kv[j] = {(*keys)[j], (*values)[j]};
  std::sort(kv.begin(), kv.end());
  for (size_t j = 0; j < kv.size(); ++j) std::tie((*keys)[j], (*values)[j]) = kv[j];
}

// One shard's part of a call's mapping to slots: the slots the call pinned
// already, the rows it misses.
struct ShardWork {
  Shard* shard;
  ShardId id;
  int64_t pinned = 0;
  std::vector<int64_t> misses;
};
// Shard s's work in `works`, added if new (valid until the next addition).
ShardWork& WorkOf(std::vector<ShardWork>* works, Shard* s, ShardId id) {
  auto w = std::find_if(works->begin(), works->end(),
                        [s](const ShardWork& x) { return x.shard == s; });
  if (w != works->end()) return *w;
  works->push_back(ShardWork{s, id});
  return works->back();
}

// A call's requests with the ids of key_value shards copied (read once,
// whatever memory they lie in) and then replaced by cache slots.
template <typename Request>
struct Mapped {
  std::vector<Request> requests;
  std::vector<std::vector<int64_t>> ids;
};

class KeyValueBackend : public ForwardingBackend {
 public:
  KeyValueBackend(std::unique_ptr<EmbeddingBackend> inner, const KeyValueOptions& options)
      : ForwardingBackend(std::move(inner)), options_(options), budget_(options.capacity_bytes) {}

  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    if (spec.cache_rows == 0) return inner()->CreateShard(spec);
    if (absl::Status s = ValidateKeyValueSpec(spec); !s.ok()) return s;
    if (spec.host_mapped) return CreateCachedOverHost(spec);
    if (options_.dir.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("table '", spec.table,
                       "': the key_value kernel needs a worker with an SSD "
                       "tier (--ssd_dir)"));
    }
    auto shard = NewShard(spec);
    shard->file_bytes = KeyValueFileBytes(spec);
    if (shard->file_bytes == std::numeric_limits<int64_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", spec.table, "': a key_value shard of ", spec.rows, " rows is too large"));
    }
    if (absl::Status s = budget_.Reserve(shard->file_bytes, spec.table); !s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(s.message(), " (the SSD tier's capacity)"));
    }
    const absl::Status made = Make(shard.get());
    absl::StatusOr<ShardId> id =
        made.ok() ? inner()->CreateShard(CacheShardSpec(spec)) : absl::StatusOr<ShardId>(made);
    if (!id.ok()) {
      budget_.Release(shard->file_bytes);
      return id.status();
    }
    shard->stats.file_bytes = shard->file_bytes;
    return Publish(*id, std::move(shard));
  }

  // fused_uvm_caching: a cache of cache_rows in the wrapped backend's
  // memory over a fused_uvm shard of it holding every row.
  absl::StatusOr<ShardId> CreateCachedOverHost(const ShardSpec& spec) {
    if (!inner()->MapsHostMemory()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", spec.table,
          "': the fused_uvm_caching kernel (a cache in GPU memory over rows in host memory "
          "the GPU maps) needs a CUDA worker"));
    }
    auto shard = NewShard(spec);
    if (absl::Status s = Make(shard.get()); !s.ok()) return s;
    auto id = inner()->CreateShard(CacheShardSpec(spec));
    if (!id.ok()) {
      (void)inner()->DropShard(shard->backing);
      return id.status();
    }
    return Publish(*id, std::move(shard));
  }

  // A shard of `spec` with its sizes, before its bookkeeping (Make).
  static std::shared_ptr<Shard> NewShard(const ShardSpec& spec) {
    auto shard = std::make_shared<Shard>();
    shard->spec = spec;
    shard->curve = std::make_unique<LruCurve>(spec.rows);
    shard->width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
    shard->record = spec.dim + shard->width;
    shard->stats.cache_rows = spec.cache_rows;
    return shard;
  }

  // Made: calls find it under the id of its cache shard.
  absl::StatusOr<ShardId> Publish(ShardId id, std::shared_ptr<Shard> shard) {
    absl::MutexLock lock(&map_mu_);
    shards_[id] = std::move(shard);
    return id;
  }

  bool CachesOverHostMemory() const override { return inner()->MapsHostMemory(); }

  absl::Status DropShard(ShardId id) override {
    std::shared_ptr<Shard> shard;
    {
      absl::MutexLock lock(&map_mu_);
      auto it = shards_.find(id);
      if (it != shards_.end()) {
        shard = std::move(it->second);
        shards_.erase(it);
      }
    }
    if (shard == nullptr) return inner()->DropShard(id);
    absl::MutexLock lock(&call_mu_);  // calls in flight end first
    shard->dropped = true;
    budget_.Release(shard->file_bytes);
    // A backing shard that cannot be dropped is said, not hidden.
    const absl::Status backing =
        shard->backing >= 0 ? inner()->DropShard(shard->backing) : absl::OkStatus();
    const absl::Status cache = inner()->DropShard(id);
    if (!backing.ok()) {
      return absl::Status(backing.code(),
                          absl::StrCat("table '", shard->spec.table,
                                       "': dropping its rows in host memory: ", backing.message()));
    }
    return cache;
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    if (auto s = Find(id)) return s->spec;
    return inner()->GetShardSpec(id);
  }

  absl::StatusOr<TierStats> GetTierStats(ShardId id) const override {
    auto shard = Find(id);
    if (shard == nullptr) {
      auto spec = inner()->GetShardSpec(id);
      if (!spec.ok()) return spec.status();
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", id, " of table '", spec->table, "' holds all its rows in memory"));
    }
    absl::MutexLock lock(&call_mu_);
    TierStats t = shard->stats;
    t.sampled = shard->curve->sampled();
    t.curve_hits = shard->curve->hits();
    return t;
  }

  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    std::vector<std::shared_ptr<Shard>> kv;
    if (!KeyValueShardsOf(requests, &kv)) return inner()->Lookup(requests);
    absl::MutexLock lock(&call_mu_);
    Mapped<LookupRequest> m;
    if (absl::Status s = CopyIds(requests, kv, &m); !s.ok()) return s;
    std::map<ShardId, ShardSpec> others;
    const absl::Span<const LookupRequest> copied(m.requests);
    if (absl::Status s = ValidateRequests(copied, SpecFinder(kv, copied, &others),
                                          Checks::kAll, inner()->WritesStridedOutputs());
        !s.ok()) {
      return s;
    }
    if (absl::Status s = MapToSlots(kv, &m); !s.ok()) {
      if (!s.GetPayload(kOverCachePayload).has_value()) return s;
      return LookupInPieces(kv, m);
    }
    return inner()->Lookup(m.requests);
  }

  // The key_value shards' rows not cached go into their caches (Fill, as
  // a miss does), each shard's as far as its cache holds them beside the
  // rows of the prefetch it finds cached (those are pinned for the call:
  // its own rows never evict each other); the rest are left out. The
  // rows' hits are neither counted nor learned (the call that uses them
  // counts them). Other shards' features go to the wrapped backend, first:
  // a refusal there brings nothing in. A fill that fails (a write-back)
  // answers its status and keeps the earlier shards' rows: their values
  // are the same wherever they are.
  absl::StatusOr<int64_t> Prefetch(absl::Span<const FeatureRequest> features) override {
    std::vector<std::shared_ptr<Shard>> kv;
    if (!KeyValueShardsOf(features, &kv)) return inner()->Prefetch(features);
    std::vector<FeatureRequest> others;
    std::map<ShardId, ShardSpec> other_specs;
    for (size_t i = 0; i < features.size(); ++i) {
      if (kv[i] == nullptr) {
        others.push_back(features[i]);
      } else if (absl::Status st = Usable(*kv[i]); !st.ok()) {
        return st;
      }
    }
    if (absl::Status st = ValidatePrefetch(features, SpecFinder(kv, features, &other_specs));
        !st.ok()) {
      return st;
    }
    int64_t brought = 0;
    if (!others.empty()) {
      auto inner_brought = inner()->Prefetch(others);
      if (!inner_brought.ok()) return inner_brought.status();
      brought = *inner_brought;
    }
    absl::MutexLock lock(&call_mu_);
    ++call_;
    std::vector<ShardWork> works;
    std::map<const Shard*, absl::flat_hash_set<int64_t>> missed;
    for (size_t i = 0; i < features.size(); ++i) {
      if (kv[i] == nullptr) continue;
      Shard& s = *kv[i];
      ShardWork& w = WorkOf(&works, &s, features[i].shard);
      absl::flat_hash_set<int64_t>& seen = missed[&s];
      for (int64_t row : features[i].ids) {
        const int32_t slot = s.slot_of_row[row];
        if (slot >= 0) {
          if (s.pinned[slot] != call_) {
            s.pinned[slot] = call_;
            s.used[slot] = 1;
            ++w.pinned;
          }
        } else if (seen.insert(row).second) {
          w.misses.push_back(row);
        }
      }
    }
    for (ShardWork& w : works) {
      const int64_t room = std::max<int64_t>(0, w.shard->cache_rows() - w.pinned);
      if (static_cast<int64_t>(w.misses.size()) > room) w.misses.resize(static_cast<size_t>(room));
      if (absl::Status st = Fill(w.shard, w.id, w.pinned, w.misses); !st.ok()) return st;
      w.shard->stats.prefetched += static_cast<int64_t>(w.misses.size());
      brought += static_cast<int64_t>(w.misses.size());
    }
    return brought;
  }

  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    std::vector<std::shared_ptr<Shard>> kv;
    if (!KeyValueShardsOf(requests, &kv)) return inner()->ApplyGradients(requests);
    absl::MutexLock lock(&call_mu_);
    Mapped<GradientRequest> m;
    if (absl::Status s = CopyIds(requests, kv, &m); !s.ok()) return s;
    std::map<ShardId, ShardSpec> others;
    const absl::Span<const GradientRequest> copied(m.requests);
    if (absl::Status s = ValidateRequests(copied, SpecFinder(kv, copied, &others));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = MapToSlots(kv, &m); !s.ok()) {
      if (!s.GetPayload(kOverCachePayload).has_value()) return s;
      return ApplyInPieces(kv, m);
    }
    if (absl::Status s = inner()->ApplyGradients(m.requests); !s.ok()) {
      return NameOverflowRow(kv, s);
    }
    MarkChanged(kv, m);
    return absl::OkStatus();
  }

  absl::Status ExportRows(ShardId id, int64_t begin, int64_t end, absl::Span<float> weights,
                          absl::Span<float> state) const override {
    auto shard = Find(id);
    if (shard == nullptr) return inner()->ExportRows(id, begin, end, weights, state);
    absl::MutexLock lock(&call_mu_);
    if (absl::Status st = Usable(*shard); !st.ok()) return st;
    if (absl::Status st = ValidateRowRange(shard->spec, begin, end, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    return ExportList(id, *shard, Range(begin, end), weights.data(), state.data());
  }

  absl::Status ImportRows(ShardId id, int64_t begin, int64_t end, absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    auto shard = Find(id);
    if (shard == nullptr) return inner()->ImportRows(id, begin, end, weights, state);
    absl::MutexLock lock(&call_mu_);
    if (absl::Status st = Usable(*shard); !st.ok()) return st;
    if (absl::Status st = ValidateImport(shard->spec, begin, end, weights, state); !st.ok()) {
      return st;
    }
    // (A range import is a restore's, a move's or a whole table's: its
    // uncached rows go to the file, leaving the cache to the hot rows.)
    return ImportList(id, *shard, Range(begin, end), weights.data(), state.data(),
                      /*into_cache=*/false);
  }

  // Rows anywhere (distinct): as the range calls above, in one batch each
  // (a dynamic shard's admissions write their new rows so, and its
  // rollbacks read the rows they replace).
  absl::Status ExportRowsAt(ShardId id, absl::Span<const int64_t> rows, absl::Span<float> weights,
                            absl::Span<float> state) const override {
    auto shard = Find(id);
    if (shard == nullptr) return inner()->ExportRowsAt(id, rows, weights, state);
    absl::MutexLock lock(&call_mu_);
    if (absl::Status st = Usable(*shard); !st.ok()) return st;
    if (absl::Status st = ValidateRowsAt(shard->spec, rows, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    return ExportList(id, *shard, rows, weights.data(), state.data());
  }
  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    auto shard = Find(id);
    if (shard == nullptr) return inner()->ImportRowsAt(id, rows, weights, state);
    absl::MutexLock lock(&call_mu_);
    if (absl::Status st = Usable(*shard); !st.ok()) return st;
    if (absl::Status st = ValidateRowsAt(shard->spec, rows, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    if (absl::Status st =
            ValidateImport(shard->spec, 0, static_cast<int64_t>(rows.size()), weights, state);
        !st.ok()) {
      return st;
    }
    std::vector<int64_t> sorted(rows.begin(), rows.end());  // one record a row
    std::sort(sorted.begin(), sorted.end());
    if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
      return absl::InvalidArgumentError(absl::StrCat("table '", shard->spec.table, "': row ",
                                                     *twice, " is named twice in one import"));
    }
    return ImportList(id, *shard, rows, weights.data(), state.data(), /*into_cache=*/true);
  }

 private:
  std::shared_ptr<Shard> Find(ShardId id) const {
    absl::MutexLock lock(&map_mu_);
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second;
  }

  // kv[i]: request i's key_value shard, or null; false when there is none.
  template <typename Request>
  bool KeyValueShardsOf(absl::Span<const Request> requests,
                        std::vector<std::shared_ptr<Shard>>* kv) const {
    absl::MutexLock lock(&map_mu_);
    if (shards_.empty()) return false;
    bool any = false;
    kv->assign(requests.size(), nullptr);
    for (size_t i = 0; i < requests.size(); ++i) {
      auto it = shards_.find(ShardOf(requests[i]));
      if (it == shards_.end()) continue;
      (*kv)[i] = it->second;
      any = true;
    }
    return any;
  }

  // The bookkeeping's memory, taken when the shard is made.
  absl::Status Make(Shard* s) {
    const ShardSpec& spec = s->spec;
    // Slots, rows and records are int32 in the bookkeeping.
    if (spec.rows + KeyValueSlackRows(spec) >= std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("table '", spec.table, "': a key_value shard holds at most ",
                       (std::numeric_limits<int32_t>::max() - 1) / 3 * 2, " rows, not ", spec.rows,
                       "; shard it row-wise"));
    }
    try {
      s->slot_of_row.assign(static_cast<size_t>(spec.rows), kAbsent);
      s->row_of_slot.assign(static_cast<size_t>(spec.cache_rows), -1);
      s->changed.assign(static_cast<size_t>(spec.cache_rows), 0);
      s->used.assign(static_cast<size_t>(spec.cache_rows), 0);
      s->pinned.assign(static_cast<size_t>(spec.cache_rows), 0);
      s->records = s->in_place() ? spec.rows : spec.rows + KeyValueSlackRows(spec);
      s->loc.assign(static_cast<size_t>(spec.rows), -1);
      s->owner.assign(static_cast<size_t>(s->records), -1);
      if (s->in_place()) {  // every row in its own record from the start
        for (int64_t r = 0; r < spec.rows; ++r) s->loc[r] = s->owner[r] = static_cast<int32_t>(r);
      }
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("table '", spec.table, "': no memory for a key_value shard's bookkeeping (",
                       KeyValueMemoryBytes(spec), " bytes)"));
    }
    if (s->in_place()) {
      auto backing = inner()->CreateShard(BackingShardSpec(spec));
      if (!backing.ok()) return backing.status();
      s->backing = *backing;
      s->file = std::make_unique<MappedShardStore>(inner(), *backing, spec.dim, s->width);
      return absl::OkStatus();
    }
    auto file = RowFile::Create(options_.dir, s->records, s->record * 4,
                                absl::StrCat("table '", spec.table, "' key_value shard file"));
    if (!file.ok()) return file.status();
    s->file = std::make_unique<FileStore>(std::move(*file));
    return absl::OkStatus();
  }

  static absl::Status Usable(const Shard& s) {
    if (s.dropped) return absl::NotFoundError(absl::StrCat("table '", s.spec.table, "': dropped"));
    return absl::OkStatus();
  }

  static std::vector<int64_t> Range(int64_t begin, int64_t end) {
    std::vector<int64_t> rows(static_cast<size_t>(std::max<int64_t>(0, end - begin)));
    for (size_t k = 0; k < rows.size(); ++k) rows[k] = begin + static_cast<int64_t>(k);
    return rows;
  }

  // Rows `rows` (distinct, checked) of a shard into row k of w / st: cached
  // ones from the cache, written ones from their records in file order in
  // one batch, the rest made (never written: their initial values).
  absl::Status ExportList(ShardId id, const Shard& s, absl::Span<const int64_t> rows, float* weights,
                          float* state) const {
    std::vector<int64_t> slots, at, fresh, fresh_at, records, read_at;
    for (size_t k = 0; k < rows.size(); ++k) {
      const int64_t r = rows[k];
      if (s.slot_of_row[r] >= 0) {
        slots.push_back(s.slot_of_row[r]);
        at.push_back(static_cast<int64_t>(k));
      } else if (s.Written(r)) {
        records.push_back(s.loc[r]);
        read_at.push_back(static_cast<int64_t>(k));
      } else {
        fresh.push_back(r);
        fresh_at.push_back(static_cast<int64_t>(k));
      }
    }
    // In file order, kExportChunk records a read: a checkpoint's range
    // costs a bounded buffer, not one as large as the range.
    SortTogether(&records, &read_at);
    RowBuffer rec;
    const size_t n = records.size();
    for (size_t c = 0; c < n; c += kExportChunk) {
      const size_t m = std::min(kExportChunk, n - c);
      if (absl::Status st = rec.Resize(static_cast<int64_t>(m), s.file->stride()); !st.ok()) {
        return st;
      }
      if (absl::Status st = s.file->ReadRows(absl::MakeConstSpan(records).subspan(c, m), &rec);
          !st.ok()) {
        return st;
      }
      for (size_t j = 0; j < m; ++j) {
        Split(s, rec.row(static_cast<int64_t>(j)), weights + read_at[c + j] * s.spec.dim,
              state + read_at[c + j] * s.width);
      }
    }
    if (!slots.empty()) {
      std::vector<float> w(slots.size() * s.spec.dim), st(slots.size() * s.width);
      if (absl::Status e =
              inner()->ExportRowsAt(id, slots, absl::MakeSpan(w), absl::MakeSpan(st));
          !e.ok()) {
        return e;
      }
      for (size_t k = 0; k < slots.size(); ++k) {
        std::copy_n(w.data() + (k * s.spec.dim), s.spec.dim, weights + at[k] * s.spec.dim);
        std::copy_n(st.data() + (k * s.width), s.width, state + at[k] * s.width);
      }
    }
    MakeFresh(s, fresh, fresh_at, weights, state);
    return absl::OkStatus();
  }

  // Row k of w / st into rows[k] (distinct, checked, values too): cached
  // rows take it in the cache (changed: it reaches the file when they leave
  // it); the others are written to the file, a chunk of whole rows at a
  // time: an import that fails part way has imported some rows and not
  // others, each whole, and the caller imports again.
  absl::Status ImportList(ShardId id, Shard& s, absl::Span<const int64_t> rows, const float* weights,
                          const float* state, bool into_cache) {
    ++call_;  // the cached rows are pinned: the others' victims are not among them
    std::vector<int64_t> slots, at, others, from;
    for (size_t k = 0; k < rows.size(); ++k) {
      const int32_t slot = s.slot_of_row[rows[k]];
      if (slot >= 0) {
        s.pinned[slot] = call_;
        slots.push_back(slot);
        at.push_back(static_cast<int64_t>(k));
      } else {
        others.push_back(rows[k]);
        from.push_back(static_cast<int64_t>(k));
      }
    }
    auto gather = [&](const std::vector<int64_t>& picked, std::vector<float>* w,
                      std::vector<float>* st) {
      w->resize(picked.size() * s.spec.dim);
      st->resize(picked.size() * s.width);
      for (size_t k = 0; k < picked.size(); ++k) {
        std::copy_n(weights + picked[k] * s.spec.dim, s.spec.dim, w->data() + k * s.spec.dim);
        std::copy_n(state + picked[k] * s.width, s.width, st->data() + k * s.width);
      }
    };
    if (!slots.empty()) {
      std::vector<float> w, st;
      gather(at, &w, &st);
      if (absl::Status e = inner()->ImportRowsAt(id, slots, w, st); !e.ok()) return e;
      for (int64_t slot : slots) s.changed[slot] = 1;
    }
    if (others.empty()) return absl::OkStatus();
    // into_cache (rows anywhere: a dynamic shard's admissions, which its
    // update reads next): rows not cached go into the cache where it holds
    // them all beside the rows above, victims written back as a fill's
    // are, nothing read. Otherwise, and for a larger import, to the file.
    if (into_cache && static_cast<int64_t>(slots.size() + others.size()) <= s.cache_rows()) {
      if (slots.empty()) return Fill(&s, id, 0, others, weights, state);  // all, in order
      std::vector<float> w, st;
      gather(from, &w, &st);
      return Fill(&s, id, static_cast<int64_t>(slots.size()), others, w.data(), st.data());
    }
    return WriteToFile(s, others, from, weights, state);
  }

  // Rows rows[k] (not cached) to the file, from row from[k] of w (weights)
  // and st (state), a chunk of whole rows at a time: a write that fails
  // part way has written some rows and not others, each whole.
  absl::Status WriteToFile(Shard& s, absl::Span<const int64_t> rows,
                           absl::Span<const int64_t> from, const float* w, const float* st) {
    const int64_t chunk = KeyValueSlackRows(s.spec);
    RowBuffer rec;
    for (size_t c = 0; c < rows.size(); c += static_cast<size_t>(chunk)) {
      const int64_t m = std::min<int64_t>(chunk, static_cast<int64_t>(rows.size() - c));
      if (absl::Status e = rec.Resize(m, s.file->stride()); !e.ok()) return e;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t i = from[c + k];
        PackRow(s, w + i * s.spec.dim, st + i * s.width, rec.row(k));
      }
      const absl::Span<const int64_t> these(rows.data() + c, static_cast<size_t>(m));
      const std::vector<int64_t> free = s.TakeFree(these);
      if (absl::Status e = s.file->WriteRows(free, rec); !e.ok()) return e;
      s.Commit(these, free);
    }
    return absl::OkStatus();
  }

  // An overflow refusal of the wrapped backend names a cache slot: named
  // by the table's row it caches instead.
  absl::Status NameOverflowRow(const std::vector<std::shared_ptr<Shard>>& kv,
                               const absl::Status& s) const {
    for (const auto& shard : kv) {
      if (shard == nullptr) continue;
      const ShardSpec cache = CacheShardSpec(shard->spec);
      const int64_t slot = OverflowRowOf(s, cache);
      if (slot >= 0 && shard->row_of_slot[slot] >= 0) {
        return RenameOverflowRow(
            s, cache, absl::StrCat("row ", shard->spec.row_offset + shard->row_of_slot[slot]));
      }
    }
    return s;
  }

  // An update applied: its slots' rows changed since they were filled.
  static void MarkChanged(const std::vector<std::shared_ptr<Shard>>& kv,
                          const Mapped<GradientRequest>& m) {
    for (size_t i = 0; i < kv.size(); ++i) {
      if (kv[i] == nullptr) continue;
      for (int64_t slot : m.ids[i]) kv[i]->changed[slot] = 1;
    }
  }

  // Rows of a key_value shard as they were before a piece of an update.
  struct Kept {
    Shard* shard;
    ShardId id;
    std::vector<int64_t> rows;  // ascending
    std::vector<float> w, st;
  };

  // An update naming more distinct rows of a key_value shard than its
  // cache holds, in pieces that each fit. Each such shard's distinct rows,
  // in the order they first occur, go cache_rows to a piece; piece p runs
  // every request of a key_value shard with the ids of its rows of piece p
  // only, so that all of a row's occurrences run together in their order
  // (its merged gradient is the call's, bit for bit), and the requests on
  // other shards run with the last piece. A pooled request's ids keep
  // their own scale (per-id weight times their whole bag's MEAN scale),
  // carried as SUM weights; a NONE request keeps its ids' gradient rows.
  // The pieces are one step: each starts from the shard's step before the
  // call (Adam's t). And one call: the rows a piece will change are kept
  // before it runs, and a piece refused (an overflow, a failed fill) puts
  // back every earlier piece's rows and the steps, so nothing of the call
  // is applied. `m` is validated, its ids still rows.
  absl::Status ApplyInPieces(const std::vector<std::shared_ptr<Shard>>& kv,
                             const Mapped<GradientRequest>& m) {
    // Each key_value shard's rows: the piece of each, its step before.
    struct Of {
      ShardId id = 0;
      absl::flat_hash_map<int64_t, int64_t> piece;  // row -> piece
      int64_t step = 0;
    };
    std::map<Shard*, Of> of;
    int64_t pieces = 1;
    for (size_t i = 0; i < kv.size(); ++i) {
      if (kv[i] == nullptr) continue;
      Of& o = of[kv[i].get()];
      o.id = m.requests[i].feature.shard;
      const int64_t cache = kv[i]->cache_rows();
      for (int64_t row : m.ids[i]) {
        const int64_t next = static_cast<int64_t>(o.piece.size());
        if (o.piece.try_emplace(row, next / cache).second) {
          pieces = std::max(pieces, next / cache + 1);
        }
      }
    }
    for (auto& [shard, o] : of) {
      auto step = inner()->ExportStep(o.id);
      if (!step.ok()) return step.status();
      o.step = *step;
    }
    std::vector<Kept> kept;  // each applied piece's rows as they were before it
    auto undo = [&](absl::Status refusal) {
      absl::Status restored = PutBack(kept);
      for (auto& [shard, o] : of) {
        if (absl::Status e = inner()->ImportStep(o.id, o.step); !e.ok() && restored.ok()) {
          restored = e;
        }
      }
      if (restored.ok()) return refusal;
      return absl::DataLossError(absl::StrCat(
          refusal.message(), "; and putting back the rows of the update's earlier pieces failed (",
          restored.message(), "): the key_value shard holds part of the update; restore it from "
          "a checkpoint"));
    };
    for (int64_t p = 0; p < pieces; ++p) {
      const bool last = p + 1 == pieces;
      Mapped<GradientRequest> piece;
      std::vector<std::shared_ptr<Shard>> piece_kv;
      // A request's share of the piece, in storage kept for the call.
      std::vector<std::vector<int64_t>> lengths(m.requests.size());
      std::vector<std::vector<float>> weights(m.requests.size()), grads(m.requests.size());
      for (size_t i = 0; i < m.requests.size(); ++i) {
        const GradientRequest& r = m.requests[i];
        if (kv[i] == nullptr) {
          if (last) {
            piece.requests.push_back(r);
            piece.ids.emplace_back();
            piece_kv.push_back(nullptr);
          }
          continue;
        }
        const FeatureRequest& f = r.feature;
        const Of& o = of.at(kv[i].get());
        const int64_t dim = kv[i]->spec.dim;
        const bool none = f.pooling == Pooling::kNone;
        const bool weighted = !f.weights.empty();
        std::vector<int64_t> ids;
        int64_t k = 0;
        for (const int64_t len : f.lengths) {
          const float mean = f.pooling == Pooling::kMean ? math::MeanScale(len) : 1.0f;
          int64_t taken = 0;
          for (const int64_t end = k + len; k < end; ++k) {
            if (o.piece.at(m.ids[i][k]) != p) continue;
            ids.push_back(m.ids[i][k]);
            ++taken;
            if (none) {  // (a sequence takes no per-id weights)
              grads[i].insert(grads[i].end(), r.grad.begin() + k * dim,
                              r.grad.begin() + (k + 1) * dim);
            } else {
              weights[i].push_back(math::IdScale(weighted, weighted ? f.weights[k] : 1.0f, mean));
            }
          }
          lengths[i].push_back(taken);
        }
        GradientRequest q = r;
        q.feature.lengths = lengths[i];
        q.feature.weights = weights[i];
        if (!none) q.feature.pooling = Pooling::kSum;
        if (none) q.grad = grads[i];
        piece.ids.push_back(std::move(ids));
        piece.requests.push_back(q);
        piece_kv.push_back(kv[i]);
      }
      for (size_t k = 0; k < piece.requests.size(); ++k) {
        if (piece_kv[k] != nullptr) piece.requests[k].feature.ids = piece.ids[k];
      }
      // The piece's rows into the cache, then kept as they are.
      std::vector<std::vector<int64_t>> rows(piece.ids.begin(), piece.ids.end());
      if (absl::Status e = MapToSlots(piece_kv, &piece); !e.ok()) return undo(e);
      std::map<Shard*, std::pair<ShardId, absl::flat_hash_set<int64_t>>> distinct;
      for (size_t k = 0; k < piece_kv.size(); ++k) {
        if (piece_kv[k] == nullptr) continue;
        auto& d = distinct[piece_kv[k].get()];
        d.first = piece.requests[k].feature.shard;
        d.second.insert(rows[k].begin(), rows[k].end());
      }
      std::vector<Kept> now;
      for (auto& [shard, d] : distinct) {
        Kept c{shard, d.first, std::vector<int64_t>(d.second.begin(), d.second.end()), {}, {}};
        std::sort(c.rows.begin(), c.rows.end());
        std::vector<int64_t> slots;
        for (int64_t row : c.rows) slots.push_back(shard->slot_of_row[row]);
        c.w.resize(slots.size() * shard->spec.dim);
        c.st.resize(slots.size() * shard->width);
        if (absl::Status e = inner()->ExportRowsAt(c.id, slots, absl::MakeSpan(c.w),
                                                   absl::MakeSpan(c.st));
            !e.ok()) {
          return undo(e);
        }
        now.push_back(std::move(c));
      }
      for (auto& [shard, o] : of) {
        if (absl::Status e = inner()->ImportStep(o.id, o.step); !e.ok()) return undo(e);
      }
      if (absl::Status e = inner()->ApplyGradients(piece.requests); !e.ok()) {
        return undo(NameOverflowRow(piece_kv, e));
      }
      MarkChanged(piece_kv, piece);
      for (Kept& c : now) kept.push_back(std::move(c));
    }
    return absl::OkStatus();
  }

  // The rows `kept` as they were: cached ones into their slots (changed),
  // the others written to the file.
  absl::Status PutBack(const std::vector<Kept>& kept) {
    for (const Kept& c : kept) {
      Shard& s = *c.shard;
      std::vector<int64_t> slots, file_rows, from;
      std::vector<float> w, st;
      for (size_t k = 0; k < c.rows.size(); ++k) {
        const int32_t slot = s.slot_of_row[c.rows[k]];
        if (slot >= 0) {
          slots.push_back(slot);
          w.insert(w.end(), c.w.begin() + k * s.spec.dim, c.w.begin() + (k + 1) * s.spec.dim);
          st.insert(st.end(), c.st.begin() + k * s.width, c.st.begin() + (k + 1) * s.width);
        } else {
          file_rows.push_back(c.rows[k]);
          from.push_back(static_cast<int64_t>(k));
        }
      }
      if (!slots.empty()) {
        if (absl::Status e = inner()->ImportRowsAt(c.id, slots, w, st); !e.ok()) return e;
        for (int64_t slot : slots) s.changed[slot] = 1;
      }
      if (absl::Status e = WriteToFile(s, file_rows, from, c.w.data(), c.st.data()); !e.ok()) {
        return e;
      }
    }
    return absl::OkStatus();
  }

  // Rows never written, made as a table in memory starts them: row rows[j]
  // into row at[j] of w (its initial values, rounded to the table's type as
  // an import rounds them) and of st (fresh optimizer state).
  void MakeFresh(const Shard& s, absl::Span<const int64_t> rows, absl::Span<const int64_t> at,
                 float* w, float* st) const {
    if (rows.empty()) return;
    std::vector<int64_t> global(rows.begin(), rows.end());
    for (int64_t& r : global) r += s.spec.row_offset;
    std::vector<float> made(rows.size() * s.spec.dim);
    InitialValuesOf(s.spec.initializer, s.spec.table_rows, global, s.spec.col_offset, s.spec.dim,
                    made.data());
    if (s.spec.weight_type == WeightType::kFp16) {
      for (float& x : made) x = Fp16ToFloat(FloatToFp16(x));
    } else if (s.spec.weight_type == WeightType::kBf16) {
      for (float& x : made) x = Bf16ToFloat(FloatToBf16(x));
    }
    const std::vector<float> state = FreshState(s.spec);
    for (size_t j = 0; j < rows.size(); ++j) {
      std::copy_n(made.data() + j * s.spec.dim, s.spec.dim, w + at[j] * s.spec.dim);
      std::copy(state.begin(), state.end(), st + at[j] * s.width);
    }
  }

  template <typename Request>
  absl::Status CopyIds(absl::Span<const Request> requests,
                       const std::vector<std::shared_ptr<Shard>>& kv, Mapped<Request>* m) const {
    m->requests.assign(requests.begin(), requests.end());
    m->ids.assign(requests.size(), {});
    for (size_t i = 0; i < requests.size(); ++i) {
      if (kv[i] == nullptr) continue;
      if (absl::Status s = Usable(*kv[i]); !s.ok()) return s;
      const FeatureRequest& f = requests[i].feature;
      if (f.on_device || f.keyed) {
        return absl::InvalidArgumentError(absl::StrCat(
            RequestWhat(internal::IsLookup(requests[i]) ? "lookup" : "gradient", i, kv[i]->spec),
            ": a key_value shard takes its ids in host memory, as rows"));
      }
      m->ids[i].assign(f.ids.begin(), f.ids.end());
      m->requests[i].feature.ids = m->ids[i];
    }
    return absl::OkStatus();
  }

  // The spec each request is checked against: a key_value shard's own (all
  // its rows), the wrapped backend's for the others.
  template <typename Request>
  std::function<const ShardSpec*(ShardId)> SpecFinder(const std::vector<std::shared_ptr<Shard>>& kv,
                                                      absl::Span<const Request> requests,
                                                      std::map<ShardId, ShardSpec>* others) const {
    return [this, &kv, requests, others](ShardId id) -> const ShardSpec* {
      for (size_t i = 0; i < requests.size(); ++i) {
        if (kv[i] != nullptr && ShardOf(requests[i]) == id) return &kv[i]->spec;
      }
      auto it = others->find(id);
      if (it == others->end()) {
        auto spec = inner()->GetShardSpec(id);
        if (!spec.ok()) return nullptr;
        it = others->emplace(id, *spec).first;
      }
      return &it->second;
    };
  }

  // Every id of a key_value shard to its cache slot, bringing rows in
  // (key_value_backend.h's steps 1-3).
  template <typename Request>
  absl::Status MapToSlots(const std::vector<std::shared_ptr<Shard>>& kv, Mapped<Request>* m) {
    ++call_;
    std::vector<ShardWork> works;
    for (size_t i = 0; i < kv.size(); ++i) {
      if (kv[i] == nullptr) continue;
      Shard& s = *kv[i];
      ShardWork* w = &WorkOf(&works, &s, m->requests[i].feature.shard);
      for (int64_t row : m->ids[i]) {
        int32_t& slot = s.slot_of_row[row];
        if (slot >= 0) {
          if (s.pinned[slot] != call_) {
            s.pinned[slot] = call_;
            s.used[slot] = 1;
            ++w->pinned;
            ++s.stats.hits;
            s.curve->Access(row);
          }
        } else if (slot == kAbsent) {
          slot = static_cast<int32_t>(-2 - static_cast<int64_t>(w->misses.size()));
          w->misses.push_back(row);
          s.curve->Access(row);
        }
      }
    }
    absl::Status failed;
    size_t done = 0;
    for (; done < works.size() && failed.ok(); ++done) {
      failed = Fill(works[done].shard, works[done].id, works[done].pinned, works[done].misses);
      if (!failed.ok()) break;
    }
    if (!failed.ok()) {  // the rows of shards not filled are absent again
      for (size_t k = done; k < works.size(); ++k) {
        for (int64_t row : works[k].misses) works[k].shard->slot_of_row[row] = kAbsent;
      }
      return failed;
    }
    for (size_t i = 0; i < kv.size(); ++i) {
      if (kv[i] == nullptr) continue;
      for (int64_t& id : m->ids[i]) id = kv[i]->slot_of_row[id];
    }
    return absl::OkStatus();
  }

  // A lookup naming more distinct rows of a key_value shard than its cache
  // holds, in pieces that each fit: its bags (a NONE feature's too: their
  // ids' output rows stay together) in order, a piece closed before the bag
  // that would take a shard past its cache. A bag alone past it is refused
  // as before. `m` is validated, its ids still rows. Each piece maps its
  // rows to slots and runs; the outputs are the whole call's, piece by piece.
  // The requests on other shards run once, apart.
  absl::Status LookupInPieces(const std::vector<std::shared_ptr<Shard>>& kv,
                              const Mapped<LookupRequest>& m) {
    struct Part {
      size_t request;
      int64_t bag_begin, bag_end, id_begin, id_end;
    };
    std::vector<Part> parts;
    std::map<const Shard*, absl::flat_hash_set<int64_t>> rows;  // of the piece
    auto run = [&]() -> absl::Status {
      Mapped<LookupRequest> piece;
      std::vector<std::shared_ptr<Shard>> piece_kv;
      piece.ids.resize(parts.size());
      for (size_t k = 0; k < parts.size(); ++k) {
        const Part& p = parts[k];
        const LookupRequest& r = m.requests[p.request];
        const FeatureRequest& f = r.feature;
        const int64_t dim = kv[p.request]->spec.dim;
        const int64_t id_begin = p.id_begin, id_end = p.id_end;
        LookupRequest q = r;
        q.feature.lengths = f.lengths.subspan(p.bag_begin, p.bag_end - p.bag_begin);
        piece.ids[k].assign(f.ids.begin() + id_begin, f.ids.begin() + id_end);
        q.feature.ids = piece.ids[k];
        if (!f.weights.empty()) q.feature.weights = f.weights.subspan(id_begin, id_end - id_begin);
        const bool none = f.pooling == Pooling::kNone;
        const int64_t first = none ? id_begin : p.bag_begin;
        const int64_t count = none ? id_end - id_begin : p.bag_end - p.bag_begin;
        const int64_t stride = r.output_stride == 0 ? dim : r.output_stride;
        const int64_t floats =
            count == 0 ? 0 : (r.output_stride == 0 ? count * dim : (count - 1) * stride + dim);
        q.output = r.output.subspan(first * stride, floats);
        piece.requests.push_back(q);
        piece_kv.push_back(kv[p.request]);
      }
      parts.clear();
      rows.clear();
      if (absl::Status s = MapToSlots(piece_kv, &piece); !s.ok()) return s;
      return inner()->Lookup(piece.requests);
    };
    std::vector<LookupRequest> others;
    for (size_t i = 0; i < m.requests.size(); ++i) {
      if (kv[i] == nullptr) others.push_back(m.requests[i]);
    }
    if (!others.empty()) {
      if (absl::Status st = inner()->Lookup(others); !st.ok()) return st;
    }
    for (size_t i = 0; i < m.requests.size(); ++i) {
      const FeatureRequest& f = m.requests[i].feature;
      Shard* s = kv[i].get();
      if (s == nullptr) continue;
      int64_t id = 0;
      for (int64_t b = 0; b < static_cast<int64_t>(f.lengths.size()); ++b) {
        const int64_t len = f.lengths[b];
        absl::flat_hash_set<int64_t>& seen = rows[s];
        size_t added = 0;
        for (int64_t k = id; k < id + len; ++k) added += seen.insert(f.ids[k]).second;
        // Past the cache with rows of earlier bags in the piece: those run
        // first (run() starts the next piece empty), this bag begins the next.
        if (static_cast<int64_t>(seen.size()) > s->cache_rows() && seen.size() > added) {
          if (absl::Status st = run(); !st.ok()) return st;
          absl::flat_hash_set<int64_t>& fresh = rows[s];
          for (int64_t k = id; k < id + len; ++k) fresh.insert(f.ids[k]);
        }
        if (!parts.empty() && parts.back().request == i && parts.back().bag_end == b) {
          ++parts.back().bag_end;
          parts.back().id_end += len;
        } else {
          parts.push_back(Part{i, b, b + 1, id, id + len});
        }
        id += len;
      }
    }
    return parts.empty() ? absl::OkStatus() : run();
  }

  // Brings `misses` (rows not cached, marked as the call's misses) into
  // victims' slots; `pinned` slots are the call's already. On a refusal the
  // shard is as it was (the caller clears the marks).
  // The rows `misses` into the cache (victims by CLOCK, changed ones written
  // back), read from the file or made; or, with `given_w` / `given_st`
  // (an import: row k of them for misses[k]), those values instead,
  // nothing read, the slots changed.
  absl::Status Fill(Shard* sp, ShardId id, int64_t pinned, const std::vector<int64_t>& misses,
                    const float* given_w = nullptr, const float* given_st = nullptr) {
    Shard& s = *sp;
    const int64_t n = static_cast<int64_t>(misses.size());
    if (n == 0) return absl::OkStatus();
    const int64_t cache = s.cache_rows();
    if (pinned + n > cache) {
      absl::Status over = absl::ResourceExhaustedError(
          absl::StrCat("table '", s.spec.table, "': one call names ", pinned + n,
                       " distinct rows of a key_value shard whose cache holds ", cache,
                       " rows; raise its cache_load_factor or send smaller batches"));
      over.SetPayload(kOverCachePayload, absl::Cord(s.spec.table));
      return over;
    }
    // Victims by CLOCK: a slot used since the hand last passed gets another
    // turn; the call's own slots are never taken.
    std::vector<int64_t> victims(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) {
      for (;;) {
        const int64_t v = s.hand;
        s.hand = s.hand + 1 == cache ? 0 : s.hand + 1;
        if (s.pinned[v] == call_) continue;
        if (s.used[v]) {
          s.used[v] = 0;
          continue;
        }
        s.pinned[v] = call_;
        victims[k] = v;
        break;
      }
    }
    // Changed victims go back to the file as the misses' rows come from it
    // (the rows never written are made instead), in one batch: the drive
    // serves the writes and reads together. The victims' new versions go to
    // records that are not live, ahead of the cursor: ascending, mostly
    // side by side, so the writes are few and long.
    std::vector<int64_t> back_slots, back_rows;
    for (int64_t v : victims) {
      if (s.row_of_slot[v] >= 0 && s.changed[v]) {
        back_slots.push_back(v);
        back_rows.push_back(s.row_of_slot[v]);
      }
    }
    const bool given = given_w != nullptr;
    std::vector<int64_t> fresh, fresh_at, read, read_at;
    for (int64_t k = 0; k < n && !given; ++k) {
      if (!s.Written(misses[k])) {
        fresh.push_back(misses[k]);
        fresh_at.push_back(k);
      } else {
        read.push_back(s.loc[misses[k]]);
        read_at.push_back(k);
      }
    }
    const int64_t nb = static_cast<int64_t>(back_slots.size());
    const int64_t reads = static_cast<int64_t>(read.size());
    SortTogether(&read, &read_at);  // in file order: runs of records are one read
    if (nb > 0) {
      std::vector<float> w(nb * s.spec.dim), st(nb * s.width);
      if (absl::Status e =
              inner()->ExportRowsAt(id, back_slots, absl::MakeSpan(w), absl::MakeSpan(st));
          !e.ok()) {
        return e;
      }
      if (absl::Status e = out_.Resize(nb, s.file->stride()); !e.ok()) return e;
      Interleave(s, nb, w.data(), st.data(), &out_);
    }
    const std::vector<int64_t> free = s.TakeFree(back_rows);
    if (nb + reads > 0) {
      if (absl::Status e = in_.Resize(reads, s.file->stride()); !e.ok()) return e;
      if (absl::Status e = s.file->Exchange(free, out_, read, &in_); !e.ok()) return e;
    }
    s.Commit(back_rows, free);
    for (int64_t slot : back_slots) s.changed[slot] = 0;
    s.stats.write_backs += nb;
    std::vector<float> w, st;  // the rows read or made (none when given)
    if (!given) {
      w.resize(n * s.spec.dim);
      st.resize(n * s.width);
      for (int64_t j = 0; j < reads; ++j) {
        const int64_t k = read_at[j];
        Split(s, in_.row(j), w.data() + k * s.spec.dim, st.data() + k * s.width);
      }
      MakeFresh(s, fresh, fresh_at, w.data(), st.data());
    }
    const absl::Span<const float> rows_w(given ? given_w : w.data(),
                                         static_cast<size_t>(n * s.spec.dim));
    const absl::Span<const float> rows_st(given ? given_st : st.data(),
                                          static_cast<size_t>(n * s.width));
    if (absl::Status e = inner()->ImportRowsAt(id, victims, rows_w, rows_st); !e.ok()) return e;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t v = victims[k];
      if (s.row_of_slot[v] >= 0) {
        s.slot_of_row[s.row_of_slot[v]] = kAbsent;
        ++s.stats.evictions;
      } else {
        ++s.stats.cached_rows;
      }
      s.slot_of_row[misses[k]] = static_cast<int32_t>(v);
      s.row_of_slot[v] = misses[k];
      s.changed[v] = given ? 1 : 0;  // an import's values are not the file's
      s.used[v] = 1;
    }
    if (!given) s.stats.fills += n;
    s.stats.disk_reads += reads;
    return absl::OkStatus();
  }

  const KeyValueOptions options_;
  MemoryBudget budget_;  // the SSD tier's bytes
  mutable absl::Mutex map_mu_;
  std::map<ShardId, std::shared_ptr<Shard>> shards_ ABSL_GUARDED_BY(map_mu_);
  // Serialises calls on key_value shards and guards their bookkeeping.
  mutable absl::Mutex call_mu_;
  uint64_t call_ = 0;
  // Rows on their way to and from a file (under call_mu_).
  RowBuffer out_, in_;
};

}  // namespace

std::unique_ptr<EmbeddingBackend> WithKeyValueShards(std::unique_ptr<EmbeddingBackend> inner,
                                                     const KeyValueOptions& options) {
  return std::make_unique<KeyValueBackend>(std::move(inner), options);
}

absl::Status ValidateKeyValueSpec(const ShardSpec& spec) {
  const std::string what = absl::StrCat(spec.host_mapped ? "fused_uvm_caching" : "key_value",
                                        " table '", spec.table, "'");
  if (spec.is_dynamic) {
    // (The dynamic wrapper above this one keeps a dynamic shard's ids and
    // hands this one a fixed shard of its slots.)
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a dynamic shard needs the dynamic wrapper over this one"));
  }
  if (IsQuantized(spec.weight_type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", WeightTypeName(spec.weight_type),
        " tables are held in memory (key_value's file holds fp32 rows and their state)"));
  }
  if (spec.cache_rows < 1 || spec.cache_rows > spec.rows) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cache_rows must be in [1, ", spec.rows,
                                                   "] (the shard's rows), got ", spec.cache_rows));
  }
  if (spec.weight_type != WeightType::kFp32 && spec.optimizer.stochastic_rounding) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": fp16/bf16 weights round updates stochastically "
                     "by the global row, which a "
                     "cached row does not carry; turn "
                     "stochastic_rounding off or keep the table fused"));
  }
  ShardSpec whole = spec;
  whole.cache_rows = 0;
  whole.host_mapped = false;  // (whether the backend maps host memory is the caller's to check)
  return ValidateShardSpec(whole);
}

}  // namespace backend
}  // namespace ember
