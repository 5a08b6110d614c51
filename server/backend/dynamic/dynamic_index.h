// DynamicIndex: the bookkeeping of one hash-keyed (dynamic) shard, which
// holds up to `capacity` rows for any int64 ids. The rows themselves live
// in a fixed backend shard ("slots" 0 .. capacity-1, contiguous, so the
// backends' gather and update kernels run on them unchanged); this maps ids
// to slots and decides, per update, which ids get rows and which rows go.
//
//   Index       open addressing with linear probing over a power-of-two
//               array at most half full (16 bytes an entry: the id and its
//               slot), in 64-byte lines of 4 entries (ids, then slots); an
//               id's home is the first entry of a line, placed by a salted
//               mix of the id (math/key_index.h, the layout a backend's
//               copy shares), so that it does not share bits with the
//               routing (RouteRow, server/common/dynamic_route.h). A find
//               compares the home
//               line whole, without branching on it (AVX2 where the CPU
//               has it), and probes on only when the line is full without
//               the id (about 4% of ids at the load kept). Deletion shifts
//               the following entries back (no tombstones).
//   Steps       every update of the shard (every ApplyGradients call that
//               names it) is one step, counted from 1, as Adam's t is.
//   TTL         at the start of step t every row last updated at step L
//               with t - L > ttl_steps is evicted (ttl_steps 0: never).
//   Admission   each occurrence of an id without a row in an update counts
//               toward admit_after (0 and 1: on its first update); the
//               update in which the count reaches it creates the row. The
//               counts are exact for up to max_pending_ids ids; ids beyond
//               are counted in a count-min sketch (4 x 65536 counters),
//               which may over-count and so admit early, never late (an id
//               it counted that later gets an exact count starts from the
//               sketch's estimate).
//   Writes      an update writes the rows it updates, then the rows it
//               creates, each in the order of the ids' first occurrence in
//               the update; an import (BeginImport) the rows it names that
//               are held, then those it creates, each in ascending id
//               order. Rows are ordered by that write order.
//   Eviction    a full shard that must create a row evicts LRU: the row
//               written longest ago, or LFU: the row updated in the fewest
//               steps since it was created (ties: the one written longest
//               ago). A row the current update or import writes is never
//               evicted by it: an id that finds no row then is dropped for
//               this step (no_room) and keeps its count. An evicted id that
//               comes back starts over: count, row and optimizer state.
//               Rows restored by RestoreSlots count as written in (last
//               update step, id) order.
//   Order       the rows a step updates are marked first, then the ids it
//               admits get rows, in first-occurrence order.
//
// Every change of a Begin is journaled until Commit or Rollback, which
// restores the index exactly (the caller restores the rows' contents).
//
// Not thread-safe: the owner serialises Begin..Commit against everything
// and allows concurrent const calls (Find, FindAll) only between updates.
#ifndef EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_INDEX_H_
#define EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_INDEX_H_

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "math/embedding_math.h"
#include "math/key_index.h"
#include "server/backend/embedding_backend.h"
#include "server/common/dynamic_route.h"

namespace ember {
namespace backend {

class DynamicIndex {
 public:
  static constexpr int64_t kDefaultMaxPendingIds = int64_t{1} << 20;
  // Index entries to a 64-byte line (below).
  static constexpr size_t kLineEntries = math::kKeyLineEntries;

  DynamicIndex(int64_t capacity, const DynamicConfig& config,
               int64_t max_pending_ids = kDefaultMaxPendingIds);
  DynamicIndex(const DynamicIndex&) = delete;
  DynamicIndex& operator=(const DynamicIndex&) = delete;

  int64_t capacity() const { return capacity_; }
  int64_t step() const { return step_; }

  // The slot holding `id`, or -1.
  int64_t Find(int64_t id) const;
  // slots[i] = Find(ids[i]), or `missing` where there is none. Compares
  // with AVX2 where the CPU has it; kPortable: never (tests both).
  enum class Probe { kByCpu, kPortable };
  void FindAll(absl::Span<const int64_t> ids, int64_t missing, int64_t* slots,
               Probe probe = Probe::kByCpu) const;

  // A row the caller must initialise (fresh weights and optimizer state);
  // `reused`: the slot held an evicted row this step, whose contents the
  // caller keeps until Commit to put back on Rollback.
  struct Created {
    int64_t id;
    int64_t slot;
    bool reused;
  };
  // One update: steps the shard, evicts what TTL expires, marks the rows of
  // `ids` (every occurrence, any order) updated, counts the others toward
  // admission and creates rows for those admitted. Then Find tells which
  // ids have rows. Until Commit or Rollback nothing else may be called but
  // Find / FindAll.
  std::vector<Created> BeginUpdate(absl::Span<const int64_t> ids);
  // The same, writing each occurrence's slot after the update's admissions
  // to slots[i] (`missing` for an id still without a row).
  std::vector<Created> BeginUpdate(absl::Span<const int64_t> ids, int64_t missing,
                                   int64_t* slots);
  // Rows for `ids` (distinct) created where absent, as by an import: no
  // step, no admission counting; every row of the import counts as updated
  // at the current step (LRU, TTL), a held one keeping its update count
  // (LFU), a new one starting at 1. RESOURCE_EXHAUSTED (nothing changed)
  // when the ids are more than the shard holds.
  absl::StatusOr<std::vector<Created>> BeginImport(absl::Span<const int64_t> ids);
  void Commit();
  void Rollback();

  // The ids held and their slots, by ascending id.
  void Held(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const;
  DynamicStats Stats() const;

  // The index itself, for a backend that finds ids on its own (a copy of
  // it: EmbeddingBackend::SyncKeyIndex): line_count() lines of
  // math/key_index.h's layout, entries - 1 = mask(). Valid until the next
  // Begin.
  const math::KeyLine* lines() const { return lines_.data.get(); }
  int64_t line_count() const { return static_cast<int64_t>(lines_.size); }
  uint64_t mask() const { return mask_; }
  // From now on, notes which lines change (a Rollback's changes too).
  void TrackChangedLines() { track_lines_ = true; }
  // The lines changed since the last call (ascending, distinct); clears
  // the note. Between updates.
  std::vector<int64_t> TakeChangedLines();

  // Slots [begin, end)'s bookkeeping, for a move or a checkpoint
  // (in range: the caller checked).
  void ExportSlots(int64_t begin, int64_t end, EmbeddingBackend::SlotMeta* out) const;
  // Replaces it (a moved or restored shard). INVALID_ARGUMENT, nothing
  // changed, when an id would be held twice. Pending counts are kept.
  absl::Status RestoreSlots(int64_t begin, int64_t end, const EmbeddingBackend::SlotMeta* in);
  // The shard's step (the optimizer's, restored with it).
  void SetStep(int64_t step) { step_ = step; }

  // The exact admission counts of ids without a row, int64 pairs (id,
  // count >= 1) by ascending id; the sketch's counts (past max_pending_ids)
  // are not among them. For a move or a checkpoint.
  std::vector<int64_t> PendingCounts() const;
  // Replaces the counts by such pairs (a moved or restored shard), between
  // updates: each id not held gets its count (in the sketch once the exact
  // counts are full), and the counts before, the sketch's too, are gone.
  // INVALID_ARGUMENT, nothing changed, for an odd length or a count < 1.
  absl::Status RestorePendingCounts(absl::Span<const int64_t> packed);
  // The count-min sketch's counters (kSketchCounters, row-major), or none
  // while it was never used. For a move or a checkpoint.
  static constexpr size_t kSketchCounters = kPendingSketchCounters;
  const std::vector<uint32_t>& PendingSketch() const { return sketch_; }
  // Adds `counters` (kSketchCounters, or none) to the sketch, saturating:
  // a moved shard's own, or on a restore onto other shards every source
  // shard's of the table (the counts of ids that route elsewhere then add
  // to this shard's estimates: an over-count, which admits early, never
  // late). Between updates, after RestorePendingCounts (which clears the
  // sketch). INVALID_ARGUMENT, nothing changed, for another length.
  absl::Status MergePendingSketch(absl::Span<const uint32_t> counters);

 private:
  // 32 bytes, so that a slot's bookkeeping is one line of meta_ (an
  // update reads and writes it for every row it touches).
  struct alignas(32) Meta {  // math::kKeySlotMetaBytes
    int64_t id = 0;
    int64_t last_step = 0;
    // Steps that updated it since it was created (>= 1 while it holds a
    // row), 0 for a free slot.
    int64_t updates = 0;
    uint64_t version = 0;  // changes at every write; increasing in write order
    bool used() const { return updates > 0; }
  };
  struct QEntry {
    int64_t slot;
    uint64_t version;
  };
  // Written and Touch are built in place (emplace_back): GCC assembled
  // the aggregates on the stack and read them back wider than it wrote
  // them, a store-forwarding stall an id in the update loop.
  struct Written {
    Written(int64_t slot, uint64_t version, int64_t u) : q{slot, version}, updates(u) {}
    QEntry q;
    int64_t updates;  // its LFU bucket
  };
  // The index: linear probing over entries (id, slot; slot -1: empty),
  // kLineEntries to a 64-byte line, ids and slots apart so a line compares
  // at once. An id's home is a line's first entry (math/key_index.h).
  using Line = math::KeyLine;
  struct Change {
    enum Kind { kMeta, kFreePop, kFreePush, kPending, kSketch, kLruPop, kLfuPop } kind;
    int64_t a = 0;   // slot / id / frequency bucket
    int64_t b = 0;   // old count / sketch amount
    bool had = false;
    Meta meta;       // kMeta: the old meta
    QEntry q{0, 0};  // queue pops
  };

  size_t Home(int64_t id) const;
  // The slot of `id`, probing from entry `at` on (linear probing), or -1.
  int64_t ProbeFrom(size_t at, int64_t id) const;
  const Line& LineOf(size_t entry) const { return lines_[entry / kLineEntries]; }
  int64_t IdAt(size_t entry) const { return LineOf(entry).id[entry % kLineEntries]; }
  int64_t SlotAt(size_t entry) const { return LineOf(entry).slot[entry % kLineEntries]; }
  void SetEntry(size_t entry, int64_t id, int64_t slot) {
    if (track_lines_) changed_lines_.push_back(static_cast<int64_t>(entry / kLineEntries));
    Line& line = lines_[entry / kLineEntries];
    line.id[entry % kLineEntries] = id;
    line.slot[entry % kLineEntries] = slot;
  }
  // FindAll's first pass: the slots of the ids found in their home lines;
  // the positions of those left unresolved (a full line without the id)
  // in rest[0, returned). Compiled for AVX2 and for any x86-64, chosen by
  // the CPU.
  template <bool kAvx2>
  size_t FindLines(absl::Span<const int64_t> ids, int64_t missing, int64_t* slots,
                   size_t* rest) const;
  size_t FindLinesAvx2(absl::Span<const int64_t> ids, int64_t missing, int64_t* slots,
                       size_t* rest) const;
  size_t FindLinesBaseline(absl::Span<const int64_t> ids, int64_t missing, int64_t* slots,
                           size_t* rest) const;
  void IndexInsert(int64_t id, int64_t slot);
  void IndexErase(int64_t id);
  void SetMeta(int64_t slot, const Meta& m);  // journaled, index kept in step
  bool Valid(const QEntry& e) const;
  void Evict(int64_t slot, int64_t* counter);
  // A free slot, evicting by the policy if none: -1 when every row is this
  // step's. `import`: count an import's eviction.
  int64_t TakeSlot(bool import);
  // `id`'s new row in `slot` (taken), written at `step`; its pending count
  // dropped.
  Created CreateRow(int64_t id, int64_t slot, int64_t step);
  int64_t CountPending(int64_t id, int64_t n);  // the id's count after n more
  int64_t SketchEstimate(int64_t id) const;     // the sketch's count (allocated)
  uint32_t SketchAdd(int64_t id, uint32_t add);  // its count after `add` more
  void BeginJournal();
  // Drops the queues' stale entries (they keep their order).
  void Compact();
  // The queues anew from the slots' versions (after RestoreSlots).
  void Requeue();
  // The free slots and the queues again from the slots' bookkeeping (after
  // RestoreSlots, before the next update or import).
  void Rebuild();

  const int64_t capacity_;
  const DynamicConfig config_;
  const int64_t max_pending_;
  // Table memory (AllocateTableMemory: huge pages where the kernel gives
  // them, as the rows have): the index and the slots' bookkeeping.
  template <typename T>
  struct Block {
    struct Free {
      void operator()(T* p) const { std::free(p); }
    };
    std::unique_ptr<T[], Free> data;
    size_t size = 0;
    T& operator[](size_t i) const { return data[i]; }
  };
  Block<Line> lines_;
  size_t mask_ = 0;  // entries - 1
  Block<Meta> meta_;
  std::vector<int64_t> free_;  // a stack of free slots
  absl::flat_hash_map<int64_t, int64_t> pending_;
  std::vector<uint32_t> sketch_;  // 4 x kSketchWidth, allocated on first use
  std::deque<QEntry> lru_;                   // by (last_step, id)
  std::map<int64_t, std::deque<QEntry>> lfu_;  // by updates, then (last_step, id)
  std::vector<Written> marked_;  // the rows written, in write order, queued at Commit
  int64_t step_ = 0;
  uint64_t next_version_ = 1;
  bool rebuild_ = false;  // RestoreSlots ran: free_ and the queues are stale
  DynamicStats stats_;
  struct Scratch {
    std::vector<size_t> absent;
    std::vector<int64_t> order, admit;
    std::vector<uint64_t> done, keep;  // Compact's bits
    absl::flat_hash_map<int64_t, int64_t> absent_ids;
  } scratch_;
  // The journal of the update in progress: changes, and apart the rows an
  // update only touched (their old step, count and version).
  std::vector<Change> journal_;
  struct Touch {
    Touch(int64_t s, int64_t l, int64_t u, uint64_t v)
        : slot(s), last_step(l), updates(u), version(v) {}
    int64_t slot;
    int64_t last_step;
    int64_t updates;
    uint64_t version;
  };
  std::vector<Touch> touched_;
  absl::flat_hash_set<int64_t> evicted_now_;  // slots whose row it evicted
  bool track_lines_ = false;
  std::vector<int64_t> changed_lines_;  // since TakeChangedLines, with repeats
  int64_t saved_step_ = 0;
  DynamicStats saved_stats_;
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_DYNAMIC_DYNAMIC_INDEX_H_
