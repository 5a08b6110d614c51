// EmbeddingBackend: the engine inside every worker. It holds the embedding
// shards assigned to a worker and runs fused batched lookups and fused
// backward + optimizer steps over all of them.
//
// Implementations: CpuBackend (cpu_backend.h, always built, the reference for
// parity tests) and, where nvcc exists, the CUDA backend in cuda/.
//
// Shapes and layouts. A lookup or gradient request is KeyedJaggedTensor
// shaped, one FeatureRequest per (feature, shard):
//   lengths  [batch]    int64, ids per bag, >= 0
//   ids      [sum(lengths)] int64, shard-local row ids in [0, rows)
//   weights  [sum(lengths)] float, optional per-id weights (pooled only)
//   output   [batch, dim] row-major fp32 for SUM/MEAN;
//            [sum(lengths), dim] for NONE (one row per id, in id order)
// MEAN divides by the bag's length; the MEAN of an empty bag is 0.
//
// Optimizers (one update per touched row per ApplyGradients call; g is the
// row's gradient summed over every occurrence of the row in the call, first
// multiplied by the per-id weight and, for MEAN, by 1/length; the formulas
// are FBGEMM's and live in embedding_math.h, shared by both backends):
//   SGD              w -= lr * g                        (no weight decay)
//   ADAGRAD          G += g*g;  w -= lr * g / (sqrt(G) + eps)   per element
//   ROWWISE_ADAGRAD  G += mean(g*g);  w -= (lr / (sqrt(G) + eps)) * g
//                    (FBGEMM EXACT_ROWWISE_ADAGRAD: one G per row)
//   ADAM             t += 1 per ApplyGradients call that names the shard in
//                    at least one request (even one with no ids), so a
//                    row-wise shard counts steps like the whole table;
//                    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
//                    w -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps))
// Weight decay wd (weight_decay_mode): L2 adds wd * w to g before the step
// (so it enters G, m and v); DECOUPLE leaves g alone and shrinks w:
// w = (1 - lr*wd) * w - update for the Adagrad variants, and
// w -= lr * (m^/(sqrt(v^)+eps) + wd * w) for Adam. The default is FBGEMM's
// form: DECOUPLE for ADAM, L2 for ROWWISE_ADAGRAD; ADAGRAD (none in FBGEMM)
// and SGD refuse a weight_decay unless ADAGRAD names a mode.
// Weights may be fp32, fp16 or bf16; all arithmetic is fp32; optimizer state
// is fp32. Updated fp16/bf16 weights are rounded stochastically (FBGEMM's
// default; random bits from seed, step, global row and column, identical in
// both backends and every sharding) unless stochastic_rounding is off, when
// they round to nearest even as initial and imported values always do.
//
// Errors: bad input (unknown shard, id out of range or negative, lengths
// that do not sum to the ids, weight count mismatch, gradient of the wrong
// shape, NaN/Inf in per-id weights, gradients or imported rows) returns
// INVALID_ARGUMENT / NOT_FOUND and changes nothing: every request of a call
// is validated before anything is written (inputs in device memory,
// FeatureRequest::on_device, on the device), except the ids of a lookup in
// a backend that checks them as it gathers (ChecksIdsWhileGathering), which
// may have written parts of the outputs when it refuses a bad id.
#ifndef EMBER_SERVER_BACKEND_EMBEDDING_BACKEND_H_
#define EMBER_SERVER_BACKEND_EMBEDDING_BACKEND_H_

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "math/embedding_math.h"
#include "math/hit_rate_curve.h"
#include "math/key_index.h"

namespace ember {
namespace backend {

enum class Pooling { kSum, kMean, kNone };
// kInt8 / kInt4: row-wise quantized rows (math/rowwise_quant.h), for
// serving: lookups, exports and imports, no updates.
enum class WeightType { kFp32, kFp16, kBf16, kInt8, kInt4 };
inline constexpr int kWeightTypes = 5;
inline bool IsQuantized(WeightType t) { return t == WeightType::kInt8 || t == WeightType::kInt4; }
// The bits of a quantized type's values (8 or 4).
inline int QuantBits(WeightType t) { return t == WeightType::kInt4 ? 4 : 8; }
// Bytes of one stored row of `dim` weights.
int64_t WeightRowBytes(WeightType t, int64_t dim);
// "fp32", "fp16", "bf16", "INT8", "INT4".
const char* WeightTypeName(WeightType t);
enum class OptimizerType { kSgd, kAdagrad, kRowwiseAdagrad, kAdam };
enum class WeightDecayMode { kDefault, kL2, kDecouple };
enum class InitializerType { kDefault, kUniform, kNormal, kConstant };

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kSgd;
  float learning_rate = 0.01f;
  float eps = 1e-8f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float weight_decay = 0.0f;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kDefault;
  float initial_accumulator_value = 0.0f;  // Adagrad variants
  // fp16 / bf16 weights: stochastic rounding of updates (else nearest even).
  bool stochastic_rounding = true;
};

// The decay `o` applies (kDecayNone when weight_decay is 0; kDefault
// resolved to FBGEMM's form for the optimizer).
math::StepDecay ResolvedDecay(const OptimizerConfig& o);

// `o` for one ApplyGradients call whose Adam step is `step` (t >= 1).
math::StepParams MakeStepParams(const OptimizerConfig& o, int64_t step);

// Element (r, c) of a table gets a value that depends only on the seed, the
// table's row count and the global (row, column), so a shard is reproducible
// from its spec and offsets whatever the sharding.
struct InitializerConfig {
  // kDefault is TorchRec's uniform(-sqrt(1/table_rows), sqrt(1/table_rows)).
  InitializerType type = InitializerType::kDefault;
  float low = 0, high = 0;   // kUniform
  float mean = 0, std = 0;   // kNormal
  float value = 0;           // kConstant
  uint64_t seed = 0;
};

// A hash-keyed (dynamic) shard: any int64 id, a row created once the id
// has appeared in admit_after updates, evicted by TTL or, when the shard is
// full, by LRU or LFU (dynamic/dynamic_index.h). capacity 0: a fixed shard.
enum class Eviction { kLru, kLfu };
struct DynamicConfig {
  int64_t admit_after = 0;  // 0 or 1: on an id's first update
  int64_t ttl_steps = 0;    // 0: never
  Eviction eviction = Eviction::kLru;
};

// One shard: rows [row_offset, row_offset + rows) and columns
// [col_offset, col_offset + dim) of a table with table_rows rows. A dynamic
// shard (`dynamic` set) holds up to `rows` rows of any ids (its share of
// the table's capacity, table_rows); row_offset places its share of the
// ids' hash range (dynamic/dynamic_index.h: RouteRow).
struct ShardSpec {
  std::string table;
  int64_t rows = 0;
  int64_t dim = 0;
  int64_t row_offset = 0;
  int64_t col_offset = 0;
  int64_t table_rows = 0;
  WeightType weight_type = WeightType::kFp32;
  OptimizerConfig optimizer;
  InitializerConfig initializer;
  bool is_dynamic = false;
  DynamicConfig dynamic;
  // The key_value kernel (key_value/key_value_backend.h): every row of the
  // shard in a file on local SSD, `cache_rows` of them (1 .. rows) in
  // memory. 0: the whole shard in memory (fused). Only a backend wrapped
  // by WithKeyValueShards takes it.
  int64_t cache_rows = 0;
  // The fused_uvm kernel: the shard's rows and optimizer state in pinned
  // host memory mapped into the GPU's address space, read and written in
  // place by the same kernels (over PCIe or C2C), and counted against the
  // backend's mapped memory (AvailableMappedBytes), not its device memory.
  // Only a backend that MapsHostMemory() takes it; the others refuse it
  // (INVALID_ARGUMENT). With cache_rows: fused_uvm_caching, every row in
  // such memory and cache_rows of them cached in device memory (the
  // key_value wrapper over a fused_uvm shard: CachesOverHostMemory()).
  bool host_mapped = false;
};

using ShardId = int32_t;

// A key_value shard's tiers (ShardSpec::cache_rows;
// key_value/key_value_backend.h), counted since it was created.
struct TierStats {
  int64_t cache_rows = 0;   // rows the memory tier holds at most
  int64_t cached_rows = 0;  // rows in it now
  int64_t hits = 0;         // rows a call found in memory (once a call)
  int64_t fills = 0;        // rows a call brought into memory
  int64_t disk_reads = 0;   // fills read from the file (the rest: never written, initial values)
  int64_t write_backs = 0;  // changed rows written to the file as they left memory
  int64_t evictions = 0;    // rows that left memory
  int64_t file_bytes = 0;   // the shard's file on SSD
  int64_t prefetched = 0;   // fills that a prefetch made (counted in fills too)
  // The hit-rate curve learned from the shard's traffic
  // (key_value/lru_curve.h): of `sampled` row accesses (a call's distinct
  // rows, sampled by hash), curve_hits[i] would have hit an LRU cache of
  // kLruCurveFractions[i] of the shard's rows. Ratios are the estimate.
  int64_t sampled = 0;
  std::array<int64_t, math::kLruCurveFractions.size()> curve_hits{};
};

// The cache sizes, as fractions of a shard's rows, at which TierStats
// gives the learned hit rate.
using math::kLruCurveFractions;

// A dynamic shard's counters (DynamicIndex: dynamic/dynamic_index.h).
struct DynamicStats {
  int64_t capacity = 0;
  int64_t rows_held = 0;
  int64_t steps = 0;
  int64_t admitted = 0;         // rows created by updates
  int64_t imported = 0;         // rows created by imports
  int64_t evicted_ttl = 0;
  int64_t evicted_lru = 0;
  int64_t evicted_lfu = 0;
  int64_t evicted_import = 0;   // rows an import made room for (by the policy)
  int64_t dropped_pending = 0;  // update occurrences of ids still below admit_after
  int64_t dropped_no_room = 0;  // ids admitted by count that found no row in their step
  int64_t pending_ids = 0;      // ids counted exactly, waiting for admission
  int64_t sketch_counts = 0;    // occurrences counted by the sketch instead
  int64_t index_slots = 0;      // the index's entries (load factor: rows_held / this)
};

// fp32 optimizer state elements per row (math::StateFloatsPerRow, the one
// formula): SGD 0, Adagrad dim, row-wise Adagrad 1, Adam 2 * dim (m then v).
int64_t OptimizerStateWidth(OptimizerType type, int64_t dim);

// A new row's optimizer state (OptimizerStateWidth floats): the Adagrad
// variants' initial_accumulator_value, else zeros. A row a dynamic shard
// admits or a key_value shard makes starts with it, as every row of a
// shard created in memory does.
std::vector<float> FreshState(const ShardSpec& spec);

// One feature's ids for one shard. Pointers are borrowed for the call.
struct FeatureRequest {
  ShardId shard = 0;
  Pooling pooling = Pooling::kSum;
  absl::Span<const int64_t> lengths;  // [batch]
  absl::Span<const int64_t> ids;      // [sum(lengths)]
  absl::Span<const float> weights;    // empty, or [sum(lengths)]
  // The ids and weights (and a gradient request's grad) are device memory
  // of the backend's device: a worker hands a link channel's device memory,
  // so that they never cross to the host. The lengths are host memory
  // still. Taken by a backend whose OutputMemory() is kCudaDevice, which
  // checks the values on the device before anything runs; every request of
  // a call alike; the others refuse it.
  bool on_device = false;
  // Lookups only, of a backend that FindsKeys: the ids are any int64 keys
  // of a dynamic shard, which the backend finds in its copy of the shard's
  // key index (SyncKeyIndex); a key without a row reads the shard's last
  // row (the dynamic shard's zero slot). Ids are then not range-checked.
  bool keyed = false;
};

struct LookupRequest {
  FeatureRequest feature;
  // Destination: [batch, dim] (pooled) or [num_ids, dim] (NONE), fp32.
  // Every element is written (an empty bag's row with zeros), so it need
  // not be cleared first.
  absl::Span<float> output;
  // Floats from one output row to the next; 0: dim (rows packed). A wider
  // stride writes the rows into a larger matrix (the in-process collection
  // pools straight into a KeyedTensor's columns); the floats between rows
  // are left alone. Only backends whose validation allows it take one
  // (the CPU backend, and the CUDA backend for outputs in host memory); the
  // others refuse a non-zero stride.
  int64_t output_stride = 0;
  // The output is device memory of the backend's device (OutputMemory() is
  // kCudaDevice: a worker hands a link channel's device memory, so that the
  // outputs never cross to the host). Every request of a call alike; the
  // others refuse it.
  bool output_on_device = false;
};

struct GradientRequest {
  FeatureRequest feature;
  // Gradient of the output: same shape as a lookup's output.
  absl::Span<const float> grad;
};

// The shard a feature or a request names.
inline ShardId ShardOf(const FeatureRequest& f) { return f.shard; }
inline ShardId ShardOf(const LookupRequest& r) { return r.feature.shard; }
inline ShardId ShardOf(const GradientRequest& r) { return r.feature.shard; }

// Counters of a dynamic shard's count-min sketch of pending ids (4 rows of
// 65536; EmbeddingBackend::ExportPendingSketch).
constexpr size_t kPendingSketchCounters = size_t{4} << 16;

class EmbeddingBackend {
 public:
  virtual ~EmbeddingBackend() = default;

  // Allocates and initialises a shard. INVALID_ARGUMENT for a malformed spec,
  // RESOURCE_EXHAUSTED when memory cannot be had.
  virtual absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) = 0;
  virtual absl::Status DropShard(ShardId shard) = 0;
  virtual absl::StatusOr<ShardSpec> GetShardSpec(ShardId shard) const = 0;

  // Fused lookup over every request (any mix of shards and poolings).
  virtual absl::Status Lookup(absl::Span<const LookupRequest> requests) = 0;
  // Brings the features' rows into the caches of the shards that keep one
  // (key_value, fused_uvm_caching: the key_value wrapper) so that the next
  // call naming them finds them there, as far as each cache holds them
  // beside the rows the prefetch finds cached (the rest are left out; one
  // call's rows never evict each other); the rows prefetched. Values,
  // optimizer state and steps never change; a dynamic shard's ids without
  // a row bring in the zero slot their lookup reads, and are never counted
  // toward admission. Ids in host memory, checked as a lookup's
  // (INVALID_ARGUMENT, nothing brought in); lengths, weights and pooling
  // are not read. Shards without a cache: nothing done (the default).
  virtual absl::StatusOr<int64_t> Prefetch(absl::Span<const FeatureRequest> features);
  // Whether Lookup takes a non-zero output_stride (rows written into a
  // wider matrix); false: outputs must be packed.
  virtual bool WritesStridedOutputs() const { return false; }
  // Whether Lookup checks each id as it gathers its row, reading it once,
  // and never reads outside a shard whatever the ids hold: the ids may then
  // lie in memory another process writes during the call (a worker reads
  // them in place in a channel's region). Lengths and weights counts are
  // still checked first, and must not change. False: the ids are checked
  // before anything runs and must hold still until the call returns.
  virtual bool ChecksIdsWhileGathering() const { return false; }
  // Where Lookup can write outputs: host memory always; kCudaDevice: also
  // device memory of its GPU (LookupRequest::output_on_device), and Lookup
  // and ApplyGradients read inputs there too (FeatureRequest::on_device).
  enum class Memory { kHost, kCudaDevice };
  virtual Memory OutputMemory() const { return Memory::kHost; }
  // Runs fn(begin, end) over chunks of about `grain` of [0, n) on the
  // backend's own threads where it has a pool for its calls (the CPU
  // backend), else on the caller's: for a wrapper's host work beside a call
  // (the dynamic shards' id-to-slot pass), which then shares the threads
  // the backend's kernels use instead of competing with them. fn must be
  // safe on disjoint ranges at once and must not call the backend.
  virtual void ParallelFor(int64_t n, int64_t grain,
                           const std::function<void(int64_t, int64_t)>& fn) {
    if (n > 0) fn(0, n);
  }

  // Fused backward + optimizer: duplicate rows (within and across requests
  // of one shard) are merged and each touched row is updated once. An
  // update that would take a weight beyond its type's largest finite value
  // or an optimizer state element to Inf/NaN is INVALID_ARGUMENT naming
  // the table, row, column and value, and nothing of the call is applied;
  // a backend made with skip_overflow leaves those rows alone instead,
  // applies the rest and counts them (OverflowSkippedRows). overflow_guard.h.
  virtual absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) = 0;
  // Rows left as they were because their update would have overflowed
  // (skip_overflow), since the backend was made.
  virtual int64_t OverflowSkippedRows() const { return 0; }

  // Rows [row_begin, row_end) of a shard (shard-local), as fp32 weights
  // [n, dim] and optimizer state [n, OptimizerStateWidth]. The Adam step
  // count is per shard (ExportStep / ImportStep).
  virtual absl::Status ExportRows(ShardId shard, int64_t row_begin, int64_t row_end,
                                  absl::Span<float> weights,
                                  absl::Span<float> state) const = 0;
  virtual absl::Status ImportRows(ShardId shard, int64_t row_begin, int64_t row_end,
                                  absl::Span<const float> weights,
                                  absl::Span<const float> state) = 0;
  // The same for rows anywhere in the shard: row k of `rows` (distinct,
  // each in [0, spec.rows)) to or from row k of the buffers. Import checks
  // everything first and writes nothing on a refusal. The default calls
  // ExportRows / ImportRows a row at a time; the CPU backend does it in one
  // pass (the dynamic shards' admissions write their new rows so).
  virtual absl::Status ExportRowsAt(ShardId shard, absl::Span<const int64_t> rows,
                                    absl::Span<float> weights, absl::Span<float> state) const;
  virtual absl::Status ImportRowsAt(ShardId shard, absl::Span<const int64_t> rows,
                                    absl::Span<const float> weights,
                                    absl::Span<const float> state);
  virtual absl::StatusOr<int64_t> ExportStep(ShardId shard) const = 0;
  virtual absl::Status ImportStep(ShardId shard, int64_t step) = 0;

  // Whether Lookup takes keyed requests (FeatureRequest::keyed): the backend
  // finds a dynamic shard's ids itself, in a copy of its key index that
  // SyncKeyIndex keeps (the CUDA backend: in device memory, so that ids on
  // the device never come to the host). False here.
  virtual bool FindsKeys() const { return false; }
  // Brings shard `shard`'s copy of its key index up to date from `lines`
  // (`count` lines of math/key_index.h's layout): whole when the copy has
  // another line count or there is none yet, else the lines `changed`
  // names (ascending, each < count). Lookups that follow find with it.
  // The copy counts against the backend's memory (RESOURCE_EXHAUSTED when
  // it does not fit; the shard then has no copy until a sync succeeds)
  // and goes with the shard. UNIMPLEMENTED unless FindsKeys().
  virtual absl::Status SyncKeyIndex(ShardId shard, const math::KeyLine* lines, int64_t count,
                                    absl::Span<const int64_t> changed);

  // Which rows changed, for incremental checkpoints (change_tracking.h's
  // WithChangeTracking keeps it; UNIMPLEMENTED elsewhere). A mark names a
  // shard's state at one moment: `lineage` is that shard's tracking (a new
  // one whenever a shard is created), `generation` counts its marks.
  struct ChangeMark {
    uint64_t lineage = 0;
    int64_t generation = 0;
  };
  // The mark of the shard as it is now; later changes belong to the next
  // generation. The caller keeps updates and imports of the shard out
  // while it marks (the worker's checkpoint fence).
  virtual absl::StatusOr<ChangeMark> MarkChanges(ShardId shard);
  // The rows (ascending, shard-local, in [0, spec.rows)) that updates or
  // imports changed since the shard was at `since`: a superset of them
  // (rows an update named are counted even if their values came out the
  // same; an update whose ids were in device memory counts every row).
  // FAILED_PRECONDITION when `since` is not a mark of this shard's lineage
  // or is later than its current generation: the caller writes it whole.
  absl::StatusOr<std::vector<int64_t>> ChangedRows(ShardId shard, const ChangeMark& since) const {
    return ChangedRowsIn(shard, since, 0, std::numeric_limits<int64_t>::max());
  }
  // ChangedRows among rows [begin, end) only (end clamped to the shard's
  // rows; INVALID_ARGUMENT when begin < 0 or begin > end): a live move
  // pages through a large shard without scanning all of it per page.
  virtual absl::StatusOr<std::vector<int64_t>> ChangedRowsIn(ShardId shard,
                                                             const ChangeMark& since,
                                                             int64_t begin, int64_t end) const;

  // Dynamic shards (ShardSpec::is_dynamic): their rows are slots
  // [0, rows), read and written by ExportRows / ImportRows as any shard's;
  // these carry what each slot holds. A backend without dynamic shards
  // answers UNIMPLEMENTED; a fixed shard, INVALID_ARGUMENT.
  struct SlotMeta {
    int64_t id = 0;
    int64_t last_step = 0;  // the shard step that last updated it
    int64_t updates = 0;    // steps that updated it since it was created
    bool held = false;      // false: a free slot (the rest is ignored)
    // Its place in the shard's write order (larger: written later; the
    // LRU order), kept by a move; comparable within one shard only.
    int64_t order = 0;
  };
  virtual absl::Status ExportSlots(ShardId shard, int64_t slot_begin, int64_t slot_end,
                                   absl::Span<SlotMeta> out) const;
  // Replaces the bookkeeping of slots [slot_begin, slot_end) (a moved or
  // restored shard; its rows come by ImportRows). INVALID_ARGUMENT, nothing
  // changed, when an id would be held twice.
  virtual absl::Status ImportSlots(ShardId shard, int64_t slot_begin, int64_t slot_end,
                                   absl::Span<const SlotMeta> in);
  // Writes the rows of `ids` (distinct), creating those absent (evicting by
  // the shard's policy when full): fp32 weights [n, dim] and optimizer state
  // [n, OptimizerStateWidth], or no state (rows held keep theirs, new ones
  // start fresh). RESOURCE_EXHAUSTED when more new ids than fit; nothing
  // changes on any refusal.
  virtual absl::Status ImportIds(ShardId shard, absl::Span<const int64_t> ids,
                                 absl::Span<const float> weights, absl::Span<const float> state);
  // The admission counts of ids still without a row: int64 pairs (id,
  // count >= 1) by ascending id, the exact ones (DynamicIndex::
  // PendingCounts). Import, between updates, replaces the shard's counts:
  // ids not held take these; INVALID_ARGUMENT, nothing changed, for an odd
  // length or a count < 1.
  virtual absl::StatusOr<std::vector<int64_t>> ExportPendingCounts(ShardId shard) const;
  virtual absl::Status ImportPendingCounts(ShardId shard, absl::Span<const int64_t> packed);
  // Such counts well formed: (id, count) pairs, every count >= 1; else
  // INVALID_ARGUMENT saying which.
  static absl::Status CheckPendingCounts(absl::Span<const int64_t> packed);
  // The counts past the exact ones: the shard's count-min sketch
  // (DynamicIndex::PendingSketch: kPendingSketchCounters uint32 counters,
  // or none while unused).
  // Merge adds such counters to the shard's sketch, after
  // ImportPendingCounts (which clears it): a moved shard's own, or every
  // source shard's on a restore onto other shards (an over-count: ids are
  // admitted early, never late). INVALID_ARGUMENT, nothing changed, for a
  // wrong length.
  virtual absl::StatusOr<std::vector<uint32_t>> ExportPendingSketch(ShardId shard) const;
  virtual absl::Status MergePendingSketch(ShardId shard, absl::Span<const uint32_t> counters);
  // Such counters well formed: none, or kPendingSketchCounters of them;
  // else INVALID_ARGUMENT ("<n> counters, not <kPendingSketchCounters>").
  static absl::Status CheckPendingSketch(absl::Span<const uint32_t> counters);
  // Adds well-formed `counters` to *sketch, saturating at the uint32 limit
  // (*sketch allocated, zeroed, on first use); nothing changes on a
  // refusal. The one merge of sketches: a shard's, and a restore's sum.
  static absl::Status AddPendingSketch(absl::Span<const uint32_t> counters,
                                       std::vector<uint32_t>* sketch);
  // Rows held, admissions, evictions, dropped gradients (dynamic_index.h).
  virtual absl::StatusOr<DynamicStats> GetDynamicStats(ShardId shard) const;
  // A key_value shard's cache and file counters (ShardSpec::cache_rows);
  // INVALID_ARGUMENT for a shard held whole in memory, UNIMPLEMENTED from
  // a backend without key_value shards.
  virtual absl::StatusOr<TierStats> GetTierStats(ShardId shard) const;
  // SlotMeta on the wire and on disk: int64 [n, kSlotMetaFields] (id,
  // last_step, updates, order), all 0 for a free slot (updates 0). Unpack:
  // INVALID_ARGUMENT for a length not a multiple of kSlotMetaFields or
  // negative fields.
  static constexpr int64_t kSlotMetaFields = 4;
  static std::vector<int64_t> PackSlots(absl::Span<const SlotMeta> slots);
  static absl::StatusOr<std::vector<SlotMeta>> UnpackSlots(absl::Span<const int64_t> packed);

  // Bytes still free for shards under the backend's memory limit
  // (INT64_MAX when it has none): a caller creating several shards checks
  // ShardBytes of all of them against this before creating any.
  virtual int64_t AvailableBytes() const = 0;
  // Whether CreateShard takes ShardSpec::host_mapped (the fused_uvm
  // kernel: the CUDA backend), and the bytes still free for such shards
  // under the backend's mapped-memory limit (INT64_MAX without one; 0 when
  // it maps none). ShardBytes of a mapped shard counts here, not in
  // AvailableBytes.
  virtual bool MapsHostMemory() const { return false; }
  virtual int64_t AvailableMappedBytes() const { return 0; }
  // Whether CreateShard takes a host_mapped spec with cache_rows (the
  // fused_uvm_caching kernel): the key_value wrapper over a backend that
  // maps host memory.
  virtual bool CachesOverHostMemory() const { return false; }

  // Human-readable name ("cpu/avx2", "cuda/H100").
  virtual std::string Name() const = 0;

  // OK while the backend can serve. A device lost for good (a sticky CUDA
  // error: illegal address, launch failure, uncorrectable ECC, ...) makes it
  // UNAVAILABLE, and every later data call answers that too; the worker then
  // stops heartbeating so the coordinator recovers its shards elsewhere.
  virtual absl::Status Health() const { return absl::OkStatus(); }
};

// Checks a shard spec: rows > 0, dim > 0 (and a multiple of
// column_multiple: the CUDA kernels move 4 columns at a time; the CPU
// backend takes any dim, as TorchRec's CPU modules do), offsets >= 0,
// row_offset + rows <= table_rows, optimizer hyper-parameters in range
// (SGD with weight_decay is rejected: FBGEMM's exact SGD has none).
// A host_mapped spec is refused unless `maps_host_memory` (the caller's
// MapsHostMemory()).
absl::Status ValidateShardSpec(const ShardSpec& spec, int column_multiple = 1,
                               bool maps_host_memory = false);

// The column multiple of the CUDA backend and its emulation.
inline constexpr int kCudaColumnMultiple = 4;

// What the validation functions below check. kShapesOnly leaves out the
// passes over every value (ids in range, weights and gradients finite) for a
// caller that checks those itself before anything is applied (the CUDA
// backend does while it copies them into staging: one pass over the bytes
// instead of two). kAllButIds leaves out the ids alone, for a backend whose
// lookup kernels check each id as they gather its row (the CPU backend).
enum class Checks { kAll, kShapesOnly, kAllButIds };

// Checks one feature request against a shard of `rows` rows: lengths >= 0
// summing to ids.size() (CheckLengths), ids in [0, rows) (CheckIds), weights
// empty or one finite weight per id and only for pooled features; the
// shapes alone for inputs on the device (their values are never read
// here). `what` prefixes the message.
absl::Status ValidateFeature(const FeatureRequest& f, int64_t rows,
                             const std::string& what, Checks checks = Checks::kAll);

// INVALID_ARGUMENT naming the first id outside [0, rows) and its position
// (`first_position` is added to the position: for a caller that checks an
// array in pieces).
absl::Status CheckIds(absl::Span<const int64_t> ids, int64_t rows, const std::string& what,
                      int64_t first_position = 0);

// Checks a KJT-style lengths array against num_ids ids: every length >= 0
// and the lengths summing to exactly num_ids, without overflow whatever the
// values. INVALID_ARGUMENT prefixed with `what`.
absl::Status CheckLengths(absl::Span<const int64_t> lengths, int64_t num_ids,
                          const std::string& what);

// The largest |x| of `values` as its float bits (0x7f800000 and above:
// there is a NaN or Inf), in one branch-free pass.
uint32_t MaxAbsBits(absl::Span<const float> values);
// Index of the first NaN or Inf in `values`, or -1.
int64_t FirstNonFinite(absl::Span<const float> values);
// INVALID_ARGUMENT naming `name`[i] when values[i] is NaN or Inf (i counted
// from `first_position`); otherwise *max_abs (when given) is the largest
// |value|, from the same pass.
absl::Status CheckFinite(absl::Span<const float> values, const std::string& what,
                         const char* name, int64_t first_position = 0,
                         float* max_abs = nullptr);
// CheckFinite's refusals carry this payload (the array's name), which
// IsNonFiniteRefusal tells them by (callers count them by it, not by the
// message's words).
inline constexpr char kNonFinitePayload[] = "type.ember.dev/nonfinite";
bool IsNonFiniteRefusal(const absl::Status& s);

// Bytes of memory a shard takes (weights + optimizer state; for a
// key_value or fused_uvm_caching shard, its cache's rows and the cache's
// bookkeeping: KeyValueMemoryBytes); INT64_MAX when that does not fit in an
// int64. Of a host_mapped shard, the part in device memory
// (DeviceShardBytes: 0 for fused_uvm; for fused_uvm_caching its cache's
// rows with their state, as the planner prices it: the cache's bookkeeping
// is host memory) and the part in mapped memory (MappedShardBytes: all its
// rows); DeviceShardBytes is ShardBytes for the others.
int64_t ShardBytes(const ShardSpec& spec);
int64_t DeviceShardBytes(const ShardSpec& spec);
int64_t MappedShardBytes(const ShardSpec& spec);
// The wrapped backend's shards behind a key_value or fused_uvm_caching
// shard (key_value/key_value_backend.h): the one that caches its rows
// (cache_rows of them, in the backend's own memory), and, for
// fused_uvm_caching, the fused_uvm one that holds them all below the cache.
ShardSpec CacheShardSpec(const ShardSpec& spec);
ShardSpec BackingShardSpec(const ShardSpec& spec);
// A key_value shard's memory: cache_rows rows of weights + state, 24 bytes
// a cached row, 8 a row of the shard (its cache slot and its record in the
// file) and 4 a record of the file.
int64_t KeyValueMemoryBytes(const ShardSpec& spec);
// A key_value shard's file: rows + KeyValueSlackRows records, each a row's
// fp32 weights then fp32 optimizer state, padded to a multiple of 512
// bytes (the drives' sector: the file is read and written with direct
// I/O); INT64_MAX when that does not fit in an int64.
int64_t KeyValueFileBytes(const ShardSpec& spec);
// The records a key_value file has beyond its rows (rows change records as
// they are written: key_value_backend.h): half the rows, and at least the
// cache's rows, at most the rows.
int64_t KeyValueSlackRows(const ShardSpec& spec);

// Output (and gradient) element count: batch * dim pooled, num_ids * dim NONE.
int64_t OutputSize(const FeatureRequest& f, int64_t dim);

// NOT_FOUND for a shard id a backend does not hold.
absl::Status ShardNotFound(ShardId shard);

// The bytes of shards (weights + optimizer state) a backend may hold: a
// shard's bytes are reserved before it is allocated (so creations running
// side by side cannot together pass the limit) and released when it goes,
// or when its allocation fails. A limit <= 0 means none. Thread-safe.
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}
  // RESOURCE_EXHAUSTED naming `table` when `bytes` more would pass the
  // limit; nothing is reserved then.
  absl::Status Reserve(int64_t bytes, const std::string& table);
  void Release(int64_t bytes);
  // What is left (int64 max without a limit): AvailableBytes.
  int64_t Available() const;

 private:
  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

// Checks one request against its shard: the feature (ValidateFeature) and
// its dense buffer (`buffer`: a lookup's output or a gradient), which must
// hold OutputSize floats, or with a row stride (> 0, at least dim) reach
// the last row's end. `what` prefixes the message.
absl::Status ValidateRequest(const FeatureRequest& f, const ShardSpec& spec, size_t dense_floats,
                             const std::string& what, const char* buffer,
                             Checks checks = Checks::kAll, int64_t stride = 0);

// Checks every request of a Lookup or ApplyGradients call before anything
// runs. find_spec(ShardId) returns the shard's spec, or nullptr if absent.
// A lookup's output_stride is refused (INVALID_ARGUMENT) unless
// `strided_outputs` says the backend writes strided rows, and its
// output_on_device, or inputs on the device (FeatureRequest::on_device),
// unless `device_memory` says it takes device memory. The values of inputs
// on the device are never read here (only their shapes are checked): the
// backend checks them.
// Keyed requests (FeatureRequest::keyed) are refused unless `finds_keys`
// says the backend finds keys itself.
template <typename FindSpec>
absl::Status ValidateRequests(absl::Span<const LookupRequest> requests, FindSpec&& find_spec,
                              Checks checks = Checks::kAll, bool strided_outputs = false,
                              bool device_memory = false, bool finds_keys = false);
// For gradients, `grad_max_abs` (empty, or one float a request) receives
// each request's largest |gradient| where its values are checked (0 where
// they are not: on the device, or kShapesOnly).
template <typename FindSpec>
absl::Status ValidateRequests(absl::Span<const GradientRequest> requests, FindSpec&& find_spec,
                              Checks checks = Checks::kAll, bool device_memory = false,
                              absl::Span<float> grad_max_abs = {});

// SyncKeyIndex's arguments: `count` lines (a power of two) at `lines`,
// `changed` ascending and each in [0, count); else INVALID_ARGUMENT.
absl::Status CheckKeySync(const math::KeyLine* lines, int64_t count,
                          absl::Span<const int64_t> changed);
// FAILED_PRECONDITION for a keyed lookup (`what`: its RequestWhat) on a
// shard whose key index was never synced.
absl::Status NoKeyIndex(const std::string& what);

// The prefix ValidateRequests gives request `index`'s messages: "lookup
// request 3 (table 't')" / "gradient request 3 (table 't')".
std::string RequestWhat(const char* kind, size_t index, const ShardSpec& spec);

// Checks a Prefetch call's features before anything is brought in: every
// shard known (find_spec as ValidateRequests'), ids in host memory as
// rows (not keyed), each inside [0, spec.rows) (INVALID_ARGUMENT naming
// the "prefetch request", the id and its position).
absl::Status ValidatePrefetch(absl::Span<const FeatureRequest> features,
                              const std::function<const ShardSpec*(ShardId)>& find_spec);

// Checks an ExportRows/ImportRows call: [row_begin, row_end) inside the
// shard, buffers of n * dim weights and n * OptimizerStateWidth state.
absl::Status ValidateRowRange(const ShardSpec& spec, int64_t row_begin, int64_t row_end,
                              size_t weights, size_t state);

// For ExportRowsAt / ImportRowsAt: every row in [0, spec.rows) and the
// buffers sized for rows.size() rows.
absl::Status ValidateRowsAt(const ShardSpec& spec, absl::Span<const int64_t> rows, size_t weights,
                            size_t state);

// ValidateRowRange for an ImportRows call, and the values themselves: every
// weight and state element finite, accumulators (Adagrad's, Adam's v) >= 0.
absl::Status ValidateImport(const ShardSpec& spec, int64_t row_begin, int64_t row_end,
                            absl::Span<const float> weights, absl::Span<const float> state);

// The largest magnitude `init` gives any element (normal: |mean| + 5.9 std,
// as its uniforms are at least 2^-25); +Inf or NaN for a non-finite
// parameter.
double InitialWeightBound(const InitializerConfig& init, int64_t table_rows);

// The initial value of element (global_row, global_col).
float InitialValue(const InitializerConfig& init, int64_t table_rows,
                   int64_t global_row, int64_t global_col);

// InitialValue of a block, bit for bit: rows [global_row, global_row + rows)
// by columns [global_col, global_col + cols), row-major into out (rows *
// cols floats). Each column's part of the hash is computed once for the
// block, where InitialValue computes it for every element.
void InitialValues(const InitializerConfig& init, int64_t table_rows, int64_t global_row,
                   int64_t rows, int64_t global_col, int64_t cols, float* out);
// The same for rows by id (a dynamic table's, id standing for the global
// row): out[k * cols + c] = InitialValue(init, table_rows, ids[k],
// global_col + c), the column hashes worked out once for all of them.
void InitialValuesOf(const InitializerConfig& init, int64_t table_rows,
                     absl::Span<const int64_t> ids, int64_t global_col, int64_t cols, float* out);

namespace internal {
inline size_t DenseFloats(const LookupRequest& r) { return r.output.size(); }
inline size_t DenseFloats(const GradientRequest& r) { return r.grad.size(); }
inline int64_t Stride(const LookupRequest& r) { return r.output_stride; }
inline int64_t Stride(const GradientRequest&) { return 0; }
inline bool OnDevice(const LookupRequest& r) { return r.output_on_device; }
inline bool OnDevice(const GradientRequest&) { return false; }
inline bool IsLookup(const LookupRequest&) { return true; }
inline bool IsLookup(const GradientRequest&) { return false; }
// A gradient's values must be finite (NaN/Inf would poison rows and
// optimizer state for good); a lookup's output is written, not read.
inline absl::Status CheckInputFloats(const LookupRequest&, const std::string&, float*) {
  return absl::OkStatus();
}
inline absl::Status CheckInputFloats(const GradientRequest& r, const std::string& what,
                                     float* max_abs) {
  return CheckFinite(r.grad, what, "gradient", 0, max_abs);
}

template <typename Request, typename FindSpec>
absl::Status ValidateAll(absl::Span<const Request> requests, FindSpec&& find_spec,
                         const char* kind, const char* buffer, Checks checks,
                         bool strided_outputs, bool device_memory, absl::Span<float> max_abs,
                         bool finds_keys = false) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const FeatureRequest& f = requests[i].feature;
    const ShardSpec* spec = find_spec(f.shard);
    if (spec == nullptr) return ShardNotFound(f.shard);
    const std::string what = RequestWhat(kind, i, *spec);
    const int64_t stride = Stride(requests[i]);
    if (stride != 0 && !strided_outputs) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": this backend writes packed outputs (output_stride 0), got ",
                       stride));
    }
    if (OnDevice(requests[i]) && !device_memory) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": this backend writes outputs to host memory only"));
    }
    if (OnDevice(requests[i]) != OnDevice(requests[0])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": outputs on the device and in host memory in one call"));
    }
    if (OnDevice(requests[i]) && stride != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": outputs on the device are packed (output_stride 0), got ", stride));
    }
    if (f.on_device && !device_memory) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": this backend reads inputs from host memory only"));
    }
    if (f.on_device != requests[0].feature.on_device) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": inputs on the device and in host memory in one call"));
    }
    if (!IsLookup(requests[i]) && IsQuantized(spec->weight_type)) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the table is ", WeightTypeName(spec->weight_type),
          " (row-wise quantized, for serving): it takes lookups and imports, no updates"));
    }
    if (f.keyed && !IsLookup(requests[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": keyed ids are for lookups, not updates"));
    }
    if (f.keyed && !finds_keys) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": keyed ids, but this backend does not find keys"));
    }
    // Values on the device are the backend's to check; keys are any int64.
    const Checks values = f.on_device                        ? Checks::kShapesOnly
                          : f.keyed && checks == Checks::kAll ? Checks::kAllButIds
                                                              : checks;
    if (absl::Status s =
            ValidateRequest(f, *spec, DenseFloats(requests[i]), what, buffer, values, stride);
        !s.ok()) {
      return s;
    }
    if (values != Checks::kShapesOnly) {
      float* m = max_abs.empty() ? nullptr : &max_abs[i];
      if (absl::Status s = CheckInputFloats(requests[i], what, m); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}
}  // namespace internal

template <typename FindSpec>
absl::Status ValidateRequests(absl::Span<const LookupRequest> requests, FindSpec&& find_spec,
                              Checks checks, bool strided_outputs, bool device_memory,
                              bool finds_keys) {
  return internal::ValidateAll(requests, find_spec, "lookup", "output", checks, strided_outputs,
                               device_memory, {}, finds_keys);
}
template <typename FindSpec>
absl::Status ValidateRequests(absl::Span<const GradientRequest> requests, FindSpec&& find_spec,
                              Checks checks, bool device_memory, absl::Span<float> grad_max_abs) {
  return internal::ValidateAll(requests, find_spec, "gradient", "gradient", checks, false,
                               device_memory, grad_max_abs);
}

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_EMBEDDING_BACKEND_H_
