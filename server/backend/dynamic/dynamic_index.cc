// DynamicIndex (dynamic_index.h).
#include "server/backend/dynamic/dynamic_index.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/host_memory.h"

namespace ember {
namespace backend {
namespace {

constexpr size_t kSketchRows = 4;
constexpr size_t kSketchWidth = size_t{1} << 16;
static_assert(kSketchRows * kSketchWidth == DynamicIndex::kSketchCounters, "the sketch's size");
constexpr size_t kFindAhead = 64;  // ids ahead FindAll prefetches a home line
// FindAll's mark for an id not in its home line, whose line holds no
// empty entry either (slots are >= -1).
constexpr int64_t kUnresolved = std::numeric_limits<int64_t>::min();

size_t IndexSize(int64_t capacity) { return static_cast<size_t>(math::KeyIndexEntries(capacity)); }

size_t SketchCell(int64_t id, size_t row) {
  return row * kSketchWidth +
         (math::Mix64(static_cast<uint64_t>(id) + (row + 1) * 0xd6e8feb86659fd93ull) &
          (kSketchWidth - 1));
}

}  // namespace

namespace {

// n value-initialised T in table memory; aborts when there is none (as a
// std::vector of the size would).
template <typename T, typename B>
void Allocate(size_t n, const T& value, B* block) {
  T* p = static_cast<T*>(AllocateTableMemory(std::max<size_t>(n, 1) * sizeof(T)));
  if (p == nullptr) std::abort();
  for (size_t i = 0; i < n; ++i) new (p + i) T(value);
  block->data.reset(p);
  block->size = n;
}

}  // namespace

DynamicIndex::DynamicIndex(int64_t capacity, const DynamicConfig& config, int64_t max_pending_ids)
    : capacity_(capacity), config_(config), max_pending_(max_pending_ids) {
  Line empty;
  for (size_t k = 0; k < kLineEntries; ++k) {
    empty.id[k] = 0;
    empty.slot[k] = -1;
  }
  const size_t entries = IndexSize(capacity);
  Allocate(entries / kLineEntries, empty, &lines_);
  mask_ = entries - 1;
  Allocate(static_cast<size_t>(capacity), Meta{}, &meta_);
  free_.reserve(static_cast<size_t>(capacity));
  // Slot 0 is taken first.
  for (int64_t s = capacity - 1; s >= 0; --s) free_.push_back(s);
  stats_.capacity = capacity;
}

size_t DynamicIndex::Home(int64_t id) const {
  // The first entry of a line: an id lies in its home line unless the
  // line was full when it came.
  return static_cast<size_t>(math::KeyHome(id, mask_));
}

int64_t DynamicIndex::Find(int64_t id) const { return ProbeFrom(Home(id), id); }

int64_t DynamicIndex::ProbeFrom(size_t at, int64_t id) const {
  return math::KeyProbeFrom(lines_.data.get(), mask_, at, id, -1);
}

std::vector<int64_t> DynamicIndex::TakeChangedLines() {
  std::vector<int64_t> lines;
  lines.swap(changed_lines_);
  std::sort(lines.begin(), lines.end());
  lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
  return lines;
}

namespace {

// The slot of `id` in a line of the index, or `missing` when the line has
// an empty entry and not the id, or kUnresolved when the line is full
// without it. Masks, not conditions: no branch on what the line holds (a
// mispredicted branch on a load still in flight costs the load's latency).
inline int64_t ProbeLinePortable(const int64_t* line_ids, const int64_t* line_slots, int64_t id,
                                 int64_t missing) {
  int64_t s = kUnresolved;
  uint64_t empty = 0;
  for (size_t k = 0; k < DynamicIndex::kLineEntries; ++k) {
    const uint64_t used = (static_cast<uint64_t>(line_slots[k]) >> 63) ^ 1;  // slot >= 0
    const uint64_t hit = -(static_cast<uint64_t>(line_ids[k] == id) & used);
    s ^= (s ^ line_slots[k]) & static_cast<int64_t>(hit);
    empty |= used ^ 1;
  }
  const uint64_t open = -(static_cast<uint64_t>(s == kUnresolved) & empty);
  return s ^ ((s ^ missing) & static_cast<int64_t>(open));
}

__attribute__((target("avx2"))) inline int64_t ProbeLineAvx2(const int64_t* line_ids,
                                                             const int64_t* line_slots,
                                                             int64_t id, int64_t missing) {
  const __m256i ids = _mm256_load_si256(reinterpret_cast<const __m256i*>(line_ids));
  const __m256i slots = _mm256_load_si256(reinterpret_cast<const __m256i*>(line_slots));
  const __m256i used = _mm256_cmpgt_epi64(slots, _mm256_set1_epi64x(-1));
  const __m256i hit = _mm256_and_si256(_mm256_cmpeq_epi64(ids, _mm256_set1_epi64x(id)), used);
  // At most one lane hits: its slot + 1, or 0, by OR across the lanes.
  __m256i x = _mm256_and_si256(_mm256_add_epi64(slots, _mm256_set1_epi64x(1)), hit);
  __m128i y = _mm_or_si128(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  y = _mm_or_si128(y, _mm_unpackhi_epi64(y, y));
  const int64_t found = _mm_cvtsi128_si64(y) - 1;  // -1: not in the line
  const int64_t full = -static_cast<int64_t>(_mm256_movemask_pd(_mm256_castsi256_pd(used)) == 0xF);
  const int64_t absent = (full & kUnresolved) | (~full & missing);
  const int64_t in = -static_cast<int64_t>(found >= 0);
  return (found & in) | (absent & ~in);
}

}  // namespace

void DynamicIndex::FindAll(absl::Span<const int64_t> ids, int64_t missing, int64_t* slots,
                           Probe probe) const {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  // The positions pass 1 left unresolved (per thread: FindAll runs
  // concurrently).
  thread_local std::vector<size_t> rest;
  rest.resize(ids.size());
  const size_t unresolved = avx2 && probe == Probe::kByCpu
                                ? FindLinesAvx2(ids, missing, slots, rest.data())
                                : FindLinesBaseline(ids, missing, slots, rest.data());
  // Pass 2: the few ids whose home line was full without them (its next
  // line prefetched by pass 1).
  for (size_t k = 0; k < unresolved; ++k) {
    const size_t i = rest[k];
    const int64_t s = ProbeFrom((Home(ids[i]) + kLineEntries) & mask_, ids[i]);
    slots[i] = s >= 0 ? s : missing;
  }
}

template <bool kAvx2>
__attribute__((always_inline)) inline size_t DynamicIndex::FindLines(absl::Span<const int64_t> ids,
                                                                   int64_t missing, int64_t* slots,
                                                                   size_t* rest) const {
  // Each id's home line is compared whole (where nearly every id lies),
  // its home computed and the line prefetched kFindAhead ids before; the
  // next line of a full one is prefetched for pass 2. (Prefetching the
  // rows found here, for the gather that follows, made lookups slower:
  // docs/lab-notes/2026-11-28-dynamic-index-lines.md.)
  const size_t n = ids.size();
  size_t home[kFindAhead];
  for (size_t i = 0; i < std::min(n, kFindAhead); ++i) {
    home[i] = Home(ids[i]);
    __builtin_prefetch(&LineOf(home[i]), 0, 1);
  }
  size_t unresolved = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t at = home[i % kFindAhead];
    const Line& line = LineOf(at);
    if (i + kFindAhead < n) {
      const size_t h = Home(ids[i + kFindAhead]);
      home[i % kFindAhead] = h;
      __builtin_prefetch(&LineOf(h), 0, 1);
    }
    const int64_t s = kAvx2 ? ProbeLineAvx2(line.id, line.slot, ids[i], missing)
                            : ProbeLinePortable(line.id, line.slot, ids[i], missing);
    slots[i] = s;
    const bool full = s == kUnresolved;
    rest[unresolved] = i;  // kept when full (no branch)
    unresolved += full;
    __builtin_prefetch(&LineOf(full ? (at + kLineEntries) & mask_ : at), 0, 1);
  }
  return unresolved;
}

__attribute__((target("avx2"))) size_t DynamicIndex::FindLinesAvx2(absl::Span<const int64_t> ids,
                                                                   int64_t missing, int64_t* slots,
                                                                   size_t* rest) const {
  return FindLines<true>(ids, missing, slots, rest);
}

size_t DynamicIndex::FindLinesBaseline(absl::Span<const int64_t> ids, int64_t missing,
                                       int64_t* slots, size_t* rest) const {
  return FindLines<false>(ids, missing, slots, rest);
}

void DynamicIndex::IndexInsert(int64_t id, int64_t slot) {
  size_t i = Home(id);
  while (SlotAt(i) >= 0) i = (i + 1) & mask_;
  SetEntry(i, id, slot);
}

void DynamicIndex::IndexErase(int64_t id) {
  size_t i = Home(id);
  while (SlotAt(i) >= 0 && IdAt(i) != id) i = (i + 1) & mask_;
  if (SlotAt(i) < 0) return;
  // Backward shift: every later entry of the run whose home is not in
  // (i, j] moves into the hole.
  for (size_t j = (i + 1) & mask_; SlotAt(j) >= 0; j = (j + 1) & mask_) {
    const size_t k = Home(IdAt(j));
    const bool stays = i <= j ? (k > i && k <= j) : (k > i || k <= j);
    if (!stays) {
      SetEntry(i, IdAt(j), SlotAt(j));
      i = j;
    }
  }
  SetEntry(i, 0, -1);
}

void DynamicIndex::SetMeta(int64_t slot, const Meta& m) {
  Meta& cur = meta_[slot];
  Change c{Change::kMeta};
  c.a = slot;
  c.meta = cur;
  journal_.push_back(c);
  const bool moved = cur.used() != m.used() || (m.used() && cur.id != m.id);
  if (moved && cur.used()) IndexErase(cur.id);
  if (moved && m.used()) IndexInsert(m.id, slot);
  cur = m;
}

bool DynamicIndex::Valid(const QEntry& e) const {
  const Meta& m = meta_[e.slot];
  return m.used() && m.version == e.version;
}

void DynamicIndex::Evict(int64_t slot, int64_t* counter) {
  Meta m = meta_[slot];
  m.updates = 0;  // free
  m.version = next_version_++;
  SetMeta(slot, m);
  free_.push_back(slot);
  Change c{Change::kFreePush};
  c.a = slot;
  journal_.push_back(c);
  evicted_now_.insert(slot);
  ++*counter;
}

int64_t DynamicIndex::TakeSlot(bool import) {
  if (free_.empty()) {
    if (config_.eviction == Eviction::kLfu) {
      while (!lfu_.empty() && free_.empty()) {
        auto bucket = lfu_.begin();
        while (!bucket->second.empty()) {
          const QEntry e = bucket->second.front();
          bucket->second.pop_front();
          Change c{Change::kLfuPop};
          c.a = bucket->first;
          c.q = e;
          journal_.push_back(c);
          if (Valid(e)) {
            Evict(e.slot, import ? &stats_.evicted_import : &stats_.evicted_lfu);
            break;
          }
        }
        if (bucket->second.empty()) lfu_.erase(bucket);
      }
    } else {
      while (!lru_.empty() && free_.empty()) {
        const QEntry e = lru_.front();
        lru_.pop_front();
        Change c{Change::kLruPop};
        c.q = e;
        journal_.push_back(c);
        if (Valid(e)) Evict(e.slot, import ? &stats_.evicted_import : &stats_.evicted_lru);
      }
    }
    if (free_.empty()) return -1;  // every row is this step's
  }
  const int64_t slot = free_.back();
  free_.pop_back();
  Change c{Change::kFreePop};
  c.a = slot;
  journal_.push_back(c);
  return slot;
}

int64_t DynamicIndex::CountPending(int64_t id, int64_t n) {
  auto it = pending_.find(id);
  if (it != pending_.end() || static_cast<int64_t>(pending_.size()) < max_pending_) {
    Change c{Change::kPending};
    c.a = id;
    c.had = it != pending_.end();
    c.b = c.had ? it->second : 0;
    journal_.push_back(c);
    int64_t& count = pending_[id];
    // An id the sketch counted before (when the exact counts were full)
    // starts from its estimate.
    if (!c.had && !sketch_.empty()) count = SketchEstimate(id);
    count += n;
    return count;
  }
  const uint32_t add = static_cast<uint32_t>(std::min<int64_t>(n, 1 << 30));
  const uint32_t least = SketchAdd(id, add);
  Change c{Change::kSketch};
  c.a = id;
  c.b = add;
  journal_.push_back(c);
  stats_.sketch_counts += n;
  return least;
}

uint32_t DynamicIndex::SketchAdd(int64_t id, uint32_t add) {
  if (sketch_.empty()) sketch_.assign(kSketchRows * kSketchWidth, 0);
  uint32_t least = std::numeric_limits<uint32_t>::max();
  for (size_t r = 0; r < kSketchRows; ++r) {
    uint32_t& cell = sketch_[SketchCell(id, r)];
    cell = cell > std::numeric_limits<uint32_t>::max() - add ? std::numeric_limits<uint32_t>::max()
                                                             : cell + add;
    least = std::min(least, cell);
  }
  return least;
}

int64_t DynamicIndex::SketchEstimate(int64_t id) const {
  uint32_t least = std::numeric_limits<uint32_t>::max();
  for (size_t r = 0; r < kSketchRows; ++r) least = std::min(least, sketch_[SketchCell(id, r)]);
  return least;
}

void DynamicIndex::BeginJournal() {
  if (rebuild_) Rebuild();
  journal_.clear();
  touched_.clear();
  evicted_now_.clear();
  marked_.clear();
  saved_step_ = step_;
  saved_stats_ = stats_;
}

std::vector<DynamicIndex::Created> DynamicIndex::BeginUpdate(absl::Span<const int64_t> ids) {
  std::vector<int64_t> slots(ids.size());
  return BeginUpdate(ids, -1, slots.data());
}

std::vector<DynamicIndex::Created> DynamicIndex::BeginUpdate(absl::Span<const int64_t> ids,
                                                             int64_t missing, int64_t* slots) {
  BeginJournal();
  const int64_t t = ++step_;
  stats_.steps = step_;
  const int64_t ttl = config_.ttl_steps;
  if (ttl > 0) {
    while (!lru_.empty()) {
      const QEntry e = lru_.front();
      if (Valid(e) && t - meta_[e.slot].last_step <= ttl) break;
      lru_.pop_front();
      Change c{Change::kLruPop};
      c.q = e;
      journal_.push_back(c);
      if (Valid(e)) Evict(e.slot, &stats_.evicted_ttl);
    }
  }
  // Every occurrence's slot, in one prefetched pass; then each row held is
  // updated once, in the order of its first occurrence.
  FindAll(ids, -1, slots);
  std::vector<size_t>& absent = scratch_.absent;  // occurrences without a row
  absent.clear();
  // Each row's bookkeeping is prefetched kMetaAhead occurrences before
  // (slot 0's for an id without a row, so that no branch waits on the slot).
  constexpr size_t kMetaAhead = 24;
  const size_t n = ids.size();
  auto prefetch_meta = [this](int64_t slot) { __builtin_prefetch(&meta_[slot < 0 ? 0 : slot], 1); };
  for (size_t i = 0; i < std::min(n, kMetaAhead); ++i) prefetch_meta(slots[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kMetaAhead < n) prefetch_meta(slots[i + kMetaAhead]);
    const int64_t slot = slots[i];
    if (slot < 0) {
      absent.push_back(i);
      continue;
    }
    Meta& m = meta_[slot];
    if (m.last_step == t) continue;  // updated already in this step
    // Only these three change (the row stays where it is): journaled apart,
    // in a record a quarter of a Change's size.
    touched_.emplace_back(slot, m.last_step, m.updates, m.version);
    m.last_step = t;
    ++m.updates;
    m.version = next_version_++;
    marked_.emplace_back(slot, m.version, m.updates);
  }
  std::vector<Created> created;
  if (absent.empty()) return created;
  // Ids without a row, in the order of their first occurrence: counted
  // toward admission; those admitted get rows (evicting when full).
  auto& calls = scratch_.absent_ids;  // id -> occurrences here, then its new slot or -1
  std::vector<int64_t>& order = scratch_.order;
  calls.clear();
  order.clear();
  for (const size_t i : absent) {
    auto [it, inserted] = calls.try_emplace(ids[i], 0);
    if (inserted) order.push_back(ids[i]);
    ++it->second;
  }
  // Every id counted before any is admitted (an admission frees a count).
  const int64_t threshold = std::max<int64_t>(config_.admit_after, 1);
  std::vector<int64_t>& admit = scratch_.admit;
  admit.clear();
  for (const int64_t id : order) {
    int64_t& entry = calls[id];
    const int64_t occurrences = entry;
    entry = -1 - occurrences;  // not admitted (yet): -1 - its occurrences
    if ((threshold <= 1 ? occurrences : CountPending(id, occurrences)) < threshold) {
      stats_.dropped_pending += occurrences;
    } else {
      admit.push_back(id);
    }
  }
  // Each admission writes its id's home line and, on a full shard, erases
  // the LRU victim's: both prefetched ahead (the victims' bookkeeping
  // first, then their ids' lines), as they would otherwise be two and
  // three dependent misses an admission.
  constexpr size_t kAdmitAhead = 8;
  const bool evicting = config_.eviction == Eviction::kLru && free_.size() < admit.size();
  for (size_t k = 0; k < admit.size(); ++k) {
    const int64_t id = admit[k];
    if (k + kAdmitAhead < admit.size()) __builtin_prefetch(&LineOf(Home(admit[k + kAdmitAhead])));
    if (evicting) {
      if (k + 2 * kAdmitAhead < lru_.size()) __builtin_prefetch(&meta_[lru_[k + 2 * kAdmitAhead].slot]);
      if (k + kAdmitAhead < lru_.size()) {
        __builtin_prefetch(&LineOf(Home(meta_[lru_[k + kAdmitAhead].slot].id)));
      }
    }
    int64_t& entry = calls[id];
    const int64_t occurrences = -1 - entry;
    const int64_t slot = TakeSlot(/*import=*/false);
    if (slot < 0) {
      ++stats_.dropped_no_room;
      stats_.dropped_pending += occurrences;
      continue;
    }
    created.push_back(CreateRow(id, slot, t));
    ++stats_.admitted;
    entry = slot;
  }
  for (const size_t i : absent) {
    const int64_t slot = calls[ids[i]];
    slots[i] = slot >= 0 ? slot : missing;  // (< 0: not admitted)
  }
  return created;
}

DynamicIndex::Created DynamicIndex::CreateRow(int64_t id, int64_t slot, int64_t step) {
  // Reused: the slot's row was evicted in this update (just now or by TTL).
  const bool reused = evicted_now_.contains(slot);
  auto it = pending_.find(id);
  if (it != pending_.end()) {  // its count is done with
    Change c{Change::kPending};
    c.a = id;
    c.had = true;
    c.b = it->second;
    journal_.push_back(c);
    pending_.erase(it);
  }
  Meta m;
  m.id = id;
  m.last_step = step;
  m.updates = 1;  // held
  m.version = next_version_++;
  SetMeta(slot, m);
  marked_.emplace_back(slot, m.version, m.updates);
  return Created{id, slot, reused};
}

absl::StatusOr<std::vector<DynamicIndex::Created>> DynamicIndex::BeginImport(
    absl::Span<const int64_t> ids) {
  BeginJournal();
  std::vector<int64_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  // Rows held: written at the current step (so no row of the import makes
  // room for another), their update count kept.
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int64_t id = sorted[i];
    if (i > 0 && sorted[i - 1] == id) {
      Rollback();
      return absl::InvalidArgumentError(absl::StrCat("id ", id, " is given twice"));
    }
    const int64_t slot = Find(id);
    if (slot < 0) continue;
    Meta m = meta_[slot];
    m.last_step = step_;
    m.version = next_version_++;
    SetMeta(slot, m);
    marked_.emplace_back(slot, m.version, m.updates);
  }
  std::vector<Created> created;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int64_t id = sorted[i];
    if (Find(id) >= 0) continue;
    const int64_t slot = TakeSlot(/*import=*/true);
    if (slot < 0) {
      Rollback();
      return absl::ResourceExhaustedError(absl::StrCat(
          "the shard holds at most ", capacity_, " rows; the import brings more new ids"));
    }
    created.push_back(CreateRow(id, slot, step_));
    ++stats_.imported;
  }
  return created;
}

void DynamicIndex::Commit() {
  // The rows written join the queues in write order (their versions'
  // order, which Compact keeps).
  for (const Written& w : marked_) {
    lru_.push_back(w.q);
    if (config_.eviction == Eviction::kLfu) lfu_[w.updates].push_back(w.q);
  }
  marked_.clear();
  journal_.clear();
  touched_.clear();
  const size_t held = static_cast<size_t>(capacity_) - free_.size();
  if (lru_.size() > 3 * held + 4096) Compact();
}

void DynamicIndex::Rollback() {
  for (auto it = journal_.rbegin(); it != journal_.rend(); ++it) {
    const Change& c = *it;
    switch (c.kind) {
      case Change::kMeta: {
        Meta& cur = meta_[c.a];
        const bool moved = cur.used() != c.meta.used() || (cur.used() && cur.id != c.meta.id);
        if (moved && cur.used()) IndexErase(cur.id);
        if (moved && c.meta.used()) IndexInsert(c.meta.id, c.a);
        cur = c.meta;
        break;
      }
      case Change::kFreePop:
        free_.push_back(c.a);
        break;
      case Change::kFreePush:
        free_.pop_back();
        break;
      case Change::kPending:
        if (c.had) {
          pending_[c.a] = c.b;
        } else {
          pending_.erase(c.a);
        }
        break;
      case Change::kSketch:
        for (size_t r = 0; r < kSketchRows; ++r) {
          uint32_t& cell = sketch_[SketchCell(c.a, r)];
          cell -= std::min<uint32_t>(cell, static_cast<uint32_t>(c.b));
        }
        break;
      case Change::kLruPop:
        lru_.push_front(c.q);
        break;
      case Change::kLfuPop:
        lfu_[c.a].push_front(c.q);
        break;
    }
  }
  // Rows touched (never a row the journal changed: an update evicts no
  // row it writes, and TTL's evictions come first).
  for (auto it = touched_.rbegin(); it != touched_.rend(); ++it) {
    Meta& m = meta_[it->slot];
    m.last_step = it->last_step;
    m.updates = it->updates;
    m.version = it->version;
  }
  journal_.clear();
  touched_.clear();
  marked_.clear();
  step_ = saved_step_;
  stats_ = saved_stats_;
}

void DynamicIndex::Rebuild() {
  free_.clear();
  std::vector<int64_t> held;
  for (int64_t s = capacity_ - 1; s >= 0; --s) {
    if (!meta_[s].used()) {
      free_.push_back(s);
    } else {
      held.push_back(s);
    }
  }
  // Restored rows: in their write order where it came with them (a move),
  // else by last update step and id (rows gathered from several shards).
  std::vector<std::tuple<int64_t, uint64_t, int64_t, int64_t>> order;  // (last, order, id, slot)
  for (const int64_t s : held) {
    order.emplace_back(meta_[s].last_step, meta_[s].version, meta_[s].id, s);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [last, written, id, s] : order) meta_[s].version = next_version_++;
  Requeue();
  rebuild_ = false;
}

void DynamicIndex::ExportSlots(int64_t begin, int64_t end, EmbeddingBackend::SlotMeta* out) const {
  for (int64_t s = begin; s < end; ++s) {
    const Meta& m = meta_[s];
    out[s - begin] = EmbeddingBackend::SlotMeta{m.id, m.last_step, m.updates, m.used(),
                                                static_cast<int64_t>(m.version)};
  }
}

absl::Status DynamicIndex::RestoreSlots(int64_t begin, int64_t end,
                                        const EmbeddingBackend::SlotMeta* in) {
  absl::flat_hash_set<int64_t> ids;
  for (int64_t s = begin; s < end; ++s) {
    const EmbeddingBackend::SlotMeta& m = in[s - begin];
    if (!m.held) continue;
    const int64_t at = Find(m.id);
    if (!ids.insert(m.id).second || (at >= 0 && (at < begin || at >= end))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "id ", m.id, " for slot ", s, " is held in slot ", at >= 0 ? at : s, " too"));
    }
    if (m.updates < 1 || m.last_step < 0) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", s, ": updates ", m.updates,
                                                     " and last_step ", m.last_step,
                                                     " (a held row has updates >= 1)"));
    }
  }
  for (int64_t s = begin; s < end; ++s) {
    if (meta_[s].used()) IndexErase(meta_[s].id);
    meta_[s].updates = 0;  // free
  }
  for (int64_t s = begin; s < end; ++s) {
    const EmbeddingBackend::SlotMeta& m = in[s - begin];
    Meta& cur = meta_[s];
    cur.id = m.id;
    cur.last_step = m.last_step;
    cur.updates = m.held ? m.updates : 0;  // (checked >= 1 when held)
    cur.version = static_cast<uint64_t>(m.order);  // Rebuild orders by it
    if (m.held) {
      IndexInsert(m.id, s);
      pending_.erase(m.id);
    }
  }
  rebuild_ = true;
  return absl::OkStatus();
}

void DynamicIndex::Compact() {
  // The queues hold every row's current entry in write order, among stale
  // ones: keeping the valid ones keeps the order.
  // LRU: an entry is valid when it is the last of its slot (every write
  // queues one) and the slot holds a row: found from the back with a bit
  // per slot (set first for the free slots), not by reading each entry's
  // slot bookkeeping (a random access an entry).
  // In place: which to keep, from the back; then the kept ones moved
  // forward in order (the scratch kept from call to call, so a compaction
  // allocates nothing).
  std::vector<uint64_t>& done = scratch_.done;
  std::vector<uint64_t>& keep = scratch_.keep;
  done.assign((static_cast<size_t>(capacity_) + 63) / 64, 0);
  auto mark = [&done](int64_t slot) {
    uint64_t& word = done[static_cast<size_t>(slot) >> 6];
    const uint64_t bit = uint64_t{1} << (slot & 63);
    const bool was = word & bit;
    word |= bit;
    return was;
  };
  for (const int64_t slot : free_) mark(slot);
  const size_t n = lru_.size();
  keep.assign((n + 63) / 64, 0);
  size_t i = n;
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    --i;
    if (!mark(it->slot)) keep[i >> 6] |= uint64_t{1} << (i & 63);
  }
  auto out = lru_.begin();
  i = 0;
  for (auto it = lru_.begin(); it != lru_.end(); ++it, ++i) {
    if (keep[i >> 6] >> (i & 63) & 1) *out++ = *it;
  }
  lru_.erase(out, lru_.end());
  // LFU: a slot's entries lie in several buckets; each checked.
  for (auto it = lfu_.begin(); it != lfu_.end();) {
    std::deque<QEntry> valid;
    for (const QEntry& q : it->second) {
      if (Valid(q)) valid.push_back(q);
    }
    it->second.swap(valid);
    it = it->second.empty() ? lfu_.erase(it) : std::next(it);
  }
}

void DynamicIndex::Requeue() {
  // Every held row in write order (its version's).
  std::vector<std::pair<uint64_t, int64_t>> order;  // (version, slot)
  for (int64_t s = 0; s < capacity_; ++s) {
    if (meta_[s].used()) order.emplace_back(meta_[s].version, s);
  }
  std::sort(order.begin(), order.end());
  lru_.clear();
  lfu_.clear();
  for (const auto& [version, s] : order) {
    lru_.push_back(QEntry{s, version});
    if (config_.eviction == Eviction::kLfu) lfu_[meta_[s].updates].push_back(QEntry{s, version});
  }
}

std::vector<int64_t> DynamicIndex::PendingCounts() const {
  std::vector<std::pair<int64_t, int64_t>> sorted(pending_.begin(), pending_.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> packed;
  packed.reserve(2 * sorted.size());
  for (const auto& [id, count] : sorted) {
    packed.push_back(id);
    packed.push_back(count);
  }
  return packed;
}

absl::Status DynamicIndex::RestorePendingCounts(absl::Span<const int64_t> packed) {
  if (absl::Status s = EmbeddingBackend::CheckPendingCounts(packed); !s.ok()) return s;
  pending_.clear();
  sketch_.clear();
  for (size_t k = 0; k < packed.size(); k += 2) {
    const int64_t id = packed[k], count = packed[k + 1];
    if (Find(id) >= 0) continue;  // it has a row here: its count is done with
    if (pending_.contains(id) || static_cast<int64_t>(pending_.size()) < max_pending_) {
      pending_[id] = count;
      continue;
    }
    SketchAdd(id, static_cast<uint32_t>(std::min<int64_t>(count, 1 << 30)));
    stats_.sketch_counts += count;
  }
  return absl::OkStatus();
}

absl::Status DynamicIndex::MergePendingSketch(absl::Span<const uint32_t> counters) {
  return EmbeddingBackend::AddPendingSketch(counters, &sketch_);
}

void DynamicIndex::Held(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  std::vector<std::pair<int64_t, int64_t>> held;
  for (int64_t s = 0; s < capacity_; ++s) {
    if (meta_[s].used()) held.emplace_back(meta_[s].id, s);
  }
  std::sort(held.begin(), held.end());
  ids->clear();
  slots->clear();
  for (const auto& [id, s] : held) {
    ids->push_back(id);
    slots->push_back(s);
  }
}

DynamicStats DynamicIndex::Stats() const {
  DynamicStats s = stats_;
  s.rows_held = capacity_ - static_cast<int64_t>(free_.size());
  if (rebuild_) {
    s.rows_held = 0;
    for (int64_t k = 0; k < capacity_; ++k) s.rows_held += meta_[k].used();
  }
  s.pending_ids = static_cast<int64_t>(pending_.size());
  s.index_slots = static_cast<int64_t>(mask_ + 1);
  return s;
}

}  // namespace backend
}  // namespace ember
