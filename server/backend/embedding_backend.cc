#include "server/backend/embedding_backend.h"

#include <algorithm>

#include <cmath>
#include <cstring>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#ifdef __x86_64__
#include <immintrin.h>
#endif
#include <limits>
#include <map>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "math/rowwise_quant.h"
#include "server/common/id_range.h"

namespace ember {
namespace backend {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in (0, 1), from 24 bits of a counter-based hash of (seed, row,
// column, stream), in two parts: the column's (ColumnHash, in its stream),
// which InitialValues computes once a block, then the rest (UnitOf).
uint64_t ColumnHash(int64_t col, uint64_t stream) {
  return SplitMix64(static_cast<uint64_t>(col) + stream);
}
double UnitOf(uint64_t seed, int64_t row, uint64_t column_hash) {
  const uint64_t h =
      SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(row) * 0x100000001b3ULL ^ column_hash));
  return (static_cast<double>(h >> 40) + 0.5) / 16777216.0;
}

// The default initializer's bound, uniform in [-bound, bound): TorchRec's
// 1 / sqrt(table rows).
double DefaultBound(int64_t table_rows) {
  return std::sqrt(1.0 / static_cast<double>(std::max<int64_t>(table_rows, 1)));
}

// A column's hashes for the streams its initializer draws: 1 and 2 for
// normal (Box-Muller's two uniforms), 0 for the others.
struct ColumnHashes {
  uint64_t first = 0, second = 0;
};
ColumnHashes HashesOf(const InitializerConfig& init, int64_t col) {
  if (init.type == InitializerType::kNormal) return {ColumnHash(col, 1), ColumnHash(col, 2)};
  return {ColumnHash(col, 0), 0};
}

// Calls with(value), value(row, h) being the initial value of element
// (row, the column whose hashes are h) under `init`, one function a type:
// InitialValues chooses it once a block, not once an element, so the
// per-element loop has no switch. `bound` is DefaultBound's for the table.
template <typename F>
void WithValueFunction(const InitializerConfig& init, double bound, F&& with) {
  switch (init.type) {
    case InitializerType::kConstant:
      with([&](int64_t, const ColumnHashes&) { return init.value; });
      return;
    case InitializerType::kUniform:
      with([&](int64_t row, const ColumnHashes& h) {
        return static_cast<float>(init.low +
                                  (init.high - init.low) * UnitOf(init.seed, row, h.first));
      });
      return;
    case InitializerType::kNormal:
      with([&](int64_t row, const ColumnHashes& h) {
        const double u1 = UnitOf(init.seed, row, h.first), u2 = UnitOf(init.seed, row, h.second);
        return static_cast<float>(init.mean + init.std * std::sqrt(-2.0 * std::log(u1)) *
                                                  std::cos(2.0 * M_PI * u2));
      });
      return;
    case InitializerType::kDefault:
    default:
      with([&](int64_t row, const ColumnHashes& h) {
        return static_cast<float>(-bound + 2.0 * bound * UnitOf(init.seed, row, h.first));
      });
  }
}

}  // namespace

namespace {

math::StepOptimizer StepOptimizerOf(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdagrad:
      return math::kStepAdagrad;
    case OptimizerType::kRowwiseAdagrad:
      return math::kStepRowwiseAdagrad;
    case OptimizerType::kAdam:
      return math::kStepAdam;
    case OptimizerType::kSgd:
      break;
  }
  return math::kStepSgd;
}

}  // namespace

int64_t OptimizerStateWidth(OptimizerType type, int64_t dim) {
  return math::StateFloatsPerRow(StepOptimizerOf(type), dim);
}

int64_t OutputSize(const FeatureRequest& f, int64_t dim) {
  return (f.pooling == Pooling::kNone ? static_cast<int64_t>(f.ids.size())
                                      : static_cast<int64_t>(f.lengths.size())) *
         dim;
}

absl::Status MemoryBudget::Reserve(int64_t bytes, const std::string& table) {
  absl::MutexLock lock(&mu_);
  if (limit_ > 0 && used_ + bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat("shard of table '", table, "' needs ", bytes,
                                                     " bytes; ", used_, " of ", limit_,
                                                     " are in use"));
  }
  used_ += bytes;
  return absl::OkStatus();
}

void MemoryBudget::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
}

int64_t MemoryBudget::Available() const {
  if (limit_ <= 0) return std::numeric_limits<int64_t>::max();
  absl::MutexLock lock(&mu_);
  return std::max<int64_t>(0, limit_ - used_);
}

absl::Status ShardNotFound(ShardId shard) {
  return absl::NotFoundError(absl::StrCat("no shard with id ", shard));
}

absl::Status ValidateRequest(const FeatureRequest& f, const ShardSpec& spec, size_t dense_floats,
                             const std::string& what, const char* buffer, Checks checks,
                             int64_t stride) {
  if (absl::Status s = ValidateFeature(f, spec.rows, what, checks); !s.ok()) return s;
  const int64_t want = OutputSize(f, spec.dim);
  const int64_t got = static_cast<int64_t>(dense_floats);
  if (stride != 0) {
    if (stride < spec.dim) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", buffer, " row stride ", stride,
                                                     " is below the dim ", spec.dim));
    }
    const int64_t rows = spec.dim == 0 ? 0 : want / spec.dim;
    const int64_t need = rows == 0 ? 0 : (rows - 1) * stride + spec.dim;
    if (got < need) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", buffer, " has ", got,
                                                     " floats, expected at least ", need, " (",
                                                     rows, " rows at stride ", stride, ")"));
    }
    return absl::OkStatus();
  }
  if (got != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", buffer, " has ", got, " floats, expected ", want));
  }
  return absl::OkStatus();
}

absl::Status ValidateRowRange(const ShardSpec& spec, int64_t b, int64_t e, size_t weights,
                              size_t state) {
  if (b < 0 || e > spec.rows || b > e) {
    return absl::InvalidArgumentError(
        absl::StrCat("row range [", b, ", ", e, ") is outside [0, ", spec.rows, ")"));
  }
  const int64_t n = e - b;
  const int64_t width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
  if (static_cast<int64_t>(weights) != n * spec.dim ||
      static_cast<int64_t>(state) != n * width) {
    return absl::InvalidArgumentError(absl::StrCat("buffers hold ", weights, " weights and ",
                                                   state, " state floats; expected ",
                                                   n * spec.dim, " and ", n * width));
  }
  return absl::OkStatus();
}

namespace {
// rows * per_row + extra, or INT64_MAX past an int64 (0 for no rows).
int64_t SaturatedBytes(int64_t rows, int64_t per_row, int64_t extra = 0) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (rows <= 0 || per_row <= 0) return 0;
  if (rows > (kMax - extra) / per_row) return kMax;
  return rows * per_row + extra;
}
}  // namespace

int64_t WeightRowBytes(WeightType t, int64_t dim) {
  switch (t) {
    case WeightType::kFp16:
    case WeightType::kBf16:
      return 2 * dim;
    case WeightType::kInt8:
    case WeightType::kInt4:
      return math::QuantizedRowBytes(QuantBits(t), dim);
    default:
      return 4 * dim;
  }
}

const char* WeightTypeName(WeightType t) {
  switch (t) {
    case WeightType::kFp16:
      return "fp16";
    case WeightType::kBf16:
      return "bf16";
    case WeightType::kInt8:
      return "INT8";
    case WeightType::kInt4:
      return "INT4";
    default:
      return "fp32";
  }
}

int64_t ShardBytes(const ShardSpec& spec) {
  if (spec.cache_rows > 0) return KeyValueMemoryBytes(spec);
  return SaturatedBytes(spec.rows, WeightRowBytes(spec.weight_type, spec.dim) +
                                       4 * OptimizerStateWidth(spec.optimizer.type, spec.dim));
}

ShardSpec CacheShardSpec(const ShardSpec& spec) {
  ShardSpec cache = spec;
  cache.rows = spec.cache_rows;
  cache.cache_rows = 0;
  cache.host_mapped = false;  // fused_uvm_caching: the cache is in device memory
  return cache;
}

ShardSpec BackingShardSpec(const ShardSpec& spec) {
  ShardSpec backing = spec;
  backing.cache_rows = 0;
  backing.host_mapped = true;
  return backing;
}

int64_t DeviceShardBytes(const ShardSpec& spec) {
  if (!spec.host_mapped) return ShardBytes(spec);
  // fused_uvm: none; fused_uvm_caching: the cache's rows with their state
  // (its bookkeeping is host memory).
  return spec.cache_rows == 0 ? 0 : ShardBytes(CacheShardSpec(spec));
}

int64_t MappedShardBytes(const ShardSpec& spec) {
  return spec.host_mapped ? ShardBytes(BackingShardSpec(spec)) : 0;
}

std::vector<float> FreshState(const ShardSpec& spec) {
  const bool adagrad = spec.optimizer.type == OptimizerType::kAdagrad ||
                       spec.optimizer.type == OptimizerType::kRowwiseAdagrad;
  return std::vector<float>(static_cast<size_t>(OptimizerStateWidth(spec.optimizer.type, spec.dim)),
                            adagrad ? spec.optimizer.initial_accumulator_value : 0.0f);
}

int64_t KeyValueSlackRows(const ShardSpec& spec) {
  return math::KeyValueSlackRows(spec.rows, spec.cache_rows);
}

int64_t KeyValueMemoryBytes(const ShardSpec& spec) {
  const int64_t rows = ShardBytes(CacheShardSpec(spec));
  const int64_t extra = rows + SaturatedBytes(spec.cache_rows, 24);
  if (rows == std::numeric_limits<int64_t>::max() || extra < rows) return rows;
  // A row's slot and record (4 + 4 bytes), a record's owner (4).
  const int64_t books = SaturatedBytes(spec.rows + KeyValueSlackRows(spec), 4);
  const int64_t total = SaturatedBytes(spec.rows, 8, extra);
  return total > std::numeric_limits<int64_t>::max() - books ? std::numeric_limits<int64_t>::max()
                                                             : total + books;
}

int64_t KeyValueFileBytes(const ShardSpec& spec) {
  const int64_t record = 4 * (spec.dim + OptimizerStateWidth(spec.optimizer.type, spec.dim));
  if (record <= 0 || record > std::numeric_limits<int64_t>::max() / 2) return record <= 0 ? 0 : std::numeric_limits<int64_t>::max();
  return SaturatedBytes(spec.rows + KeyValueSlackRows(spec), math::KeyValueRecordStride(record));
}

absl::Status ValidateImport(const ShardSpec& spec, int64_t b, int64_t e,
                            absl::Span<const float> weights, absl::Span<const float> state) {
  if (absl::Status s = ValidateRowRange(spec, b, e, weights.size(), state.size()); !s.ok()) {
    return s;
  }
  const std::string what = absl::StrCat("import into table '", spec.table, "'");
  if (absl::Status s = CheckFinite(weights, what, "weights"); !s.ok()) return s;
  if (absl::Status s = CheckFinite(state, what, "state"); !s.ok()) return s;
  // A weight the table's type cannot hold would be stored as Inf (and the
  // checkpoints holding it would not restore).
  // (A quantized row's scale and bias are fp16: its values must be too.)
  if (spec.weight_type != WeightType::kFp32) {
    const bool bf16 = spec.weight_type == WeightType::kBf16;
    for (size_t i = 0; i < weights.size(); ++i) {  // finite, checked above
      const float stored = bf16 ? Bf16ToFloat(FloatToBf16(weights[i]))
                                : Fp16ToFloat(FloatToFp16(weights[i]));
      if (std::isinf(stored)) {
        const int64_t cols = spec.dim;
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": row ", spec.row_offset + b + static_cast<int64_t>(i) / cols, " column ",
            spec.col_offset + static_cast<int64_t>(i) % cols, ": weight ", weights[i],
            " overflows ",
            bf16                                     ? "bf16 (largest 3.39e38)"
            : spec.weight_type == WeightType::kFp16 ? "fp16 (largest 65504)"
                                                     : "the fp16 scale and bias of a quantized "
                                                       "row (largest 65504)"));
      }
    }
  }
  // Accumulators must be >= 0 (a square root is taken): all of Adagrad's
  // and row-wise Adagrad's state, the second half (v) of each Adam row.
  const int64_t width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
  const int64_t first = spec.optimizer.type == OptimizerType::kAdam ? spec.dim : 0;
  if (spec.optimizer.type == OptimizerType::kSgd || width == 0) return absl::OkStatus();
  for (int64_t r = 0; r < e - b; ++r) {
    for (int64_t k = first; k < width; ++k) {
      const float v = state[r * width + k];
      if (v < 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": accumulator state[", r * width + k,
                                                       "] is negative (", v, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateShardSpec(const ShardSpec& s, int column_multiple, bool maps_host_memory) {
  auto bad = [&](auto... parts) {
    return absl::InvalidArgumentError(absl::StrCat("shard of table '", s.table, "': ", parts...));
  };
  if (s.rows <= 0) return bad("rows must be > 0, got ", s.rows);
  if (s.dim <= 0) return bad("dim must be > 0, got ", s.dim);
  if (s.dim % column_multiple != 0) {
    return bad("dim ", s.dim, " is not a multiple of ", column_multiple,
               ", which this backend's kernels need (the CPU backend takes any dim)");
  }
  if (s.row_offset < 0 || s.col_offset < 0) return bad("offsets must be >= 0");
  if (s.table_rows < s.row_offset + s.rows) {
    return bad("row_offset + rows (", s.row_offset + s.rows, ") exceeds table_rows (",
               s.table_rows, ")");
  }
  if (s.cache_rows != 0 && s.host_mapped) {
    return bad("the fused_uvm_caching kernel (a cache of ", s.cache_rows,
               " rows in GPU memory over rows in host memory the GPU maps) needs a CUDA worker");
  }
  if (s.cache_rows != 0) {
    return bad("the key_value kernel (cache_rows ", s.cache_rows,
               ") needs a worker with an SSD tier (--ssd_dir)");
  }
  if (s.host_mapped && !maps_host_memory) {
    return bad("the fused_uvm kernel (rows in host memory the GPU maps) needs a CUDA worker");
  }
  if (static_cast<int>(s.weight_type) < 0 || static_cast<int>(s.weight_type) >= kWeightTypes) {
    return bad("unknown weight type ", static_cast<int>(s.weight_type));
  }
  if (IsQuantized(s.weight_type) && s.optimizer.type != OptimizerType::kSgd) {
    return bad(WeightTypeName(s.weight_type),
               " rows are for serving and take no updates: no optimizer state (SGD, the "
               "default), got optimizer type ",
               static_cast<int>(s.optimizer.type));
  }
  const OptimizerConfig& o = s.optimizer;
  if (!(o.learning_rate >= 0) || !std::isfinite(o.learning_rate)) {
    return bad("learning_rate must be finite and >= 0");
  }
  if (!(o.eps >= 0) || !(o.weight_decay >= 0) || !(o.initial_accumulator_value >= 0)) {
    return bad("eps, weight_decay and initial_accumulator_value must be >= 0");
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
    return bad("beta1 and beta2 must be in [0, 1)");
  }
  if (o.type == OptimizerType::kSgd && o.weight_decay > 0) {
    return bad("weight_decay is not supported with SGD (FBGEMM's exact SGD has none)");
  }
  if (o.type == OptimizerType::kAdagrad && o.weight_decay > 0 &&
      o.weight_decay_mode == WeightDecayMode::kDefault) {
    return bad("ADAGRAD has no weight decay in FBGEMM (EXACT_ADAGRAD); set weight_decay_mode "
               "to L2 or DECOUPLE to apply weight_decay");
  }
  const InitializerConfig& i = s.initializer;
  if (i.type == InitializerType::kUniform && !(i.low <= i.high)) {
    return bad("uniform initializer needs low <= high");
  }
  if (i.type == InitializerType::kNormal && !(i.std >= 0)) {
    return bad("normal initializer needs std >= 0");
  }
  // Initial values the weight type cannot hold would be stored as Inf.
  const double init_bound = InitialWeightBound(i, s.table_rows);
  const double limit = math::WeightLimit(static_cast<int32_t>(s.weight_type));
  if (!(init_bound <= limit)) {
    return bad("the initializer can produce weights of magnitude up to ", init_bound,
               ", beyond the largest finite ", WeightTypeName(s.weight_type), " value ", limit);
  }
  return absl::OkStatus();
}

absl::Status CheckLengths(absl::Span<const int64_t> lengths, int64_t num_ids,
                          const std::string& what) {
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": lengths[", b, "] is negative (", lengths[b], ")"));
    }
  }
  int64_t total = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (__builtin_add_overflow(total, lengths[b], &total)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": lengths overflow int64 at [", b, "]; there are ", num_ids, " ids"));
    }
  }
  if (total != num_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": lengths sum to ", total, " but there are ", num_ids, " ids"));
  }
  return absl::OkStatus();
}

uint32_t MaxAbsBits(absl::Span<const float> values) {
  // Without the sign bit, the bits of floats order as their magnitudes (as
  // int32 too), and NaN and Inf above every finite one. Four running maxima
  // of four lanes each, reduced once at the end: one pass, as cheap as the
  // finiteness check it replaced (SSE2 has no unsigned max, hence the
  // compare and select; a horizontal reduction per block had cost 3x).
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(values.data());
  const size_t n = values.size();
  size_t i = 0;
  int32_t top = 0;
#ifdef __SSE2__
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  __m128i acc[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                    _mm_setzero_si128()};
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 4; ++k) {
      const __m128i v = _mm_and_si128(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i + 4 * k)), mask);
      const __m128i gt = _mm_cmpgt_epi32(v, acc[k]);
      acc[k] = _mm_or_si128(_mm_and_si128(gt, v), _mm_andnot_si128(gt, acc[k]));
    }
  }
  alignas(16) int32_t lanes[16];
  for (int k = 0; k < 4; ++k) _mm_store_si128(reinterpret_cast<__m128i*>(lanes + 4 * k), acc[k]);
  for (const int32_t l : lanes) top = std::max(top, l);
#endif
  for (; i < n; ++i) top = std::max(top, static_cast<int32_t>(bits[i] & 0x7fffffffu));
  return static_cast<uint32_t>(top);
}

int64_t FirstNonFinite(absl::Span<const float> values) {
  // The position is searched for only on failure.
  if (MaxAbsBits(values) < 0x7f800000u) return -1;
  for (size_t j = 0; j < values.size(); ++j) {
    if (!std::isfinite(values[j])) return static_cast<int64_t>(j);
  }
  return -1;
}

absl::Status CheckFinite(absl::Span<const float> values, const std::string& what,
                         const char* name, int64_t first_position, float* max_abs) {
  const uint32_t top = MaxAbsBits(values);
  if (top < 0x7f800000u) {
    if (max_abs != nullptr) std::memcpy(max_abs, &top, sizeof(top));
    return absl::OkStatus();
  }
  const int64_t i = FirstNonFinite(values);
  absl::Status s = absl::InvalidArgumentError(absl::StrCat(
      what, ": ", name, "[", first_position + i, "] is ", values[i], " (NaN/Inf is refused)"));
  s.SetPayload(kNonFinitePayload, absl::Cord(name));
  return s;
}

bool IsNonFiniteRefusal(const absl::Status& s) {
  return absl::IsInvalidArgument(s) && s.GetPayload(kNonFinitePayload).has_value();
}

absl::Status CheckIds(absl::Span<const int64_t> ids, int64_t rows, const std::string& what,
                      int64_t first_position) {
  const int64_t j = FirstIdOutside(ids, rows);
  if (j < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": id ", ids[j], " at position ",
                                                 first_position + j, " is outside [0, ", rows,
                                                 ")"));
}

math::StepDecay ResolvedDecay(const OptimizerConfig& o) {
  if (!(o.weight_decay > 0) || o.type == OptimizerType::kSgd) return math::kDecayNone;
  switch (o.weight_decay_mode) {
    case WeightDecayMode::kL2:
      return math::kDecayL2;
    case WeightDecayMode::kDecouple:
      return math::kDecayDecouple;
    default:
      return o.type == OptimizerType::kAdam ? math::kDecayDecouple : math::kDecayL2;
  }
}

math::StepParams MakeStepParams(const OptimizerConfig& o, int64_t step) {
  math::StepParams p{};
  p.optimizer = StepOptimizerOf(o.type);
  p.decay = ResolvedDecay(o);
  p.lr = o.learning_rate;
  p.eps = o.eps;
  p.beta1 = o.beta1;
  p.beta2 = o.beta2;
  p.one_minus_beta1 = 1.0f - o.beta1;
  p.one_minus_beta2 = 1.0f - o.beta2;
  const double t = static_cast<double>(step);
  p.bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta1), t));
  p.bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), t));
  p.weight_decay = p.decay == math::kDecayNone ? 0.0f : o.weight_decay;
  p.decay_keep = 1.0f - o.learning_rate * p.weight_decay;
  return p;
}

std::string RequestWhat(const char* kind, size_t index, const ShardSpec& spec) {
  return absl::StrCat(kind, " request ", index, " (table '", spec.table, "')");
}

absl::Status ValidateFeature(const FeatureRequest& f, int64_t rows, const std::string& what,
                             Checks checks) {
  if (f.on_device) checks = Checks::kShapesOnly;  // values in device memory: the backend's
  if (absl::Status s = CheckLengths(f.lengths, static_cast<int64_t>(f.ids.size()), what);
      !s.ok()) {
    return s;
  }
  if (!f.weights.empty()) {
    if (f.pooling == Pooling::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": per-id weights need a pooled (SUM/MEAN) feature"));
    }
    if (f.weights.size() != f.ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", f.weights.size(), " weights for ", f.ids.size(), " ids"));
    }
    if (checks != Checks::kShapesOnly) {
      if (absl::Status s = CheckFinite(f.weights, what, "weights"); !s.ok()) return s;
    }
  }
  if (checks != Checks::kAll) return absl::OkStatus();
  return CheckIds(f.ids, rows, what);
}

double InitialWeightBound(const InitializerConfig& init, int64_t table_rows) {
  switch (init.type) {
    case InitializerType::kConstant:
      return std::fabs(static_cast<double>(init.value));
    case InitializerType::kUniform:
      return std::max(std::fabs(static_cast<double>(init.low)),
                      std::fabs(static_cast<double>(init.high)));
    case InitializerType::kNormal:
      // UnitOf's uniforms are at least 2^-25: sqrt(-2 ln 2^-25) < 5.9.
      return std::fabs(static_cast<double>(init.mean)) + 5.9 * static_cast<double>(init.std);
    case InitializerType::kDefault:
    default:
      return DefaultBound(table_rows);
  }
}

float InitialValue(const InitializerConfig& init, int64_t table_rows, int64_t row, int64_t col) {
  float v = 0;
  WithValueFunction(init, DefaultBound(table_rows),
                    [&](auto value) { v = value(row, HashesOf(init, col)); });
  return v;
}

namespace {

#ifdef __x86_64__
// One row of a + b * UnitOf(seed, row, column_hashes[c]) as float, eight
// columns at a time: UnitOf's two SplitMix64 rounds in 64-bit lanes
// (AVX-512DQ's vpmullq), the 24-bit value converted exactly, and the same
// double operations in the same order as the scalar code, with no fused
// multiply-add (the library is built with -ffp-contract=off), so every
// element has the scalar code's bits (validation_test checks).
__attribute__((target("avx512f,avx512dq,avx512vl"))) inline __m512i SplitMix64x8(__m512i x) {
  x = _mm512_add_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(0x9e3779b97f4a7c15ULL)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)),
                         _mm512_set1_epi64(static_cast<int64_t>(0xbf58476d1ce4e5b9ULL)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)),
                         _mm512_set1_epi64(static_cast<int64_t>(0x94d049bb133111ebULL)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

__attribute__((target("avx512f,avx512dq,avx512vl"))) void AffineUnitsAvx512(
    uint64_t seed, int64_t row, const uint64_t* column_hashes, int64_t cols, double a, double b,
    float* out) {
  const __m512i r =
      _mm512_set1_epi64(static_cast<int64_t>(static_cast<uint64_t>(row) * 0x100000001b3ULL));
  const __m512i sd = _mm512_set1_epi64(static_cast<int64_t>(seed));
  const __m512d va = _mm512_set1_pd(a), vb = _mm512_set1_pd(b);
  const __m512d half = _mm512_set1_pd(0.5), scale = _mm512_set1_pd(16777216.0);
  for (int64_t c = 0; c < cols; c += 8) {
    const __mmask8 m = cols - c >= 8 ? 0xff : static_cast<__mmask8>((1u << (cols - c)) - 1);
    const __m512i h = _mm512_maskz_loadu_epi64(m, column_hashes + c);
    const __m512i x = SplitMix64x8(_mm512_xor_si512(sd, SplitMix64x8(_mm512_xor_si512(r, h))));
    const __m512d u =
        _mm512_div_pd(_mm512_add_pd(_mm512_cvtepu64_pd(_mm512_srli_epi64(x, 40)), half), scale);
    _mm256_mask_storeu_ps(out + c, m, _mm512_cvtpd_ps(_mm512_add_pd(va, _mm512_mul_pd(vb, u))));
  }
}

bool HasAvx512DqVl() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}
#endif

// Rows row_of(0 .. rows-1) of columns [global_col, global_col + cols).
template <typename RowOf>
void InitialValuesBy(const InitializerConfig& init, int64_t table_rows, int64_t rows,
                     RowOf row_of, int64_t global_col, int64_t cols, float* out) {
#ifdef __x86_64__
  // The uniform initializers are a + b * unit: eight columns at a time
  // where the CPU has AVX-512 F, DQ and VL (a dynamic table creates rows
  // inside its updates, so this is on the training path). a and b are
  // formed as the scalar value functions form them.
  if ((init.type == InitializerType::kDefault || init.type == InitializerType::kUniform) &&
      HasAvx512DqVl()) {
    std::vector<uint64_t> firsts(static_cast<size_t>(cols));
    for (int64_t c = 0; c < cols; ++c) firsts[c] = HashesOf(init, global_col + c).first;
    const double bound = DefaultBound(table_rows);
    const bool uniform = init.type == InitializerType::kUniform;
    const double a = uniform ? static_cast<double>(init.low) : -bound;
    const double b = uniform ? static_cast<double>(init.high - init.low) : 2.0 * bound;
    for (int64_t r = 0; r < rows; ++r) {
      AffineUnitsAvx512(init.seed, row_of(r), firsts.data(), cols, a, b, out + r * cols);
    }
    return;
  }
#endif
  std::vector<ColumnHashes> hashes(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) hashes[c] = HashesOf(init, global_col + c);
  WithValueFunction(init, DefaultBound(table_rows), [&](auto value) {
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + r * cols;
      const int64_t row = row_of(r);
      for (int64_t c = 0; c < cols; ++c) o[c] = value(row, hashes[c]);
    }
  });
}

}  // namespace

void InitialValues(const InitializerConfig& init, int64_t table_rows, int64_t global_row,
                   int64_t rows, int64_t global_col, int64_t cols, float* out) {
  InitialValuesBy(
      init, table_rows, rows, [global_row](int64_t r) { return global_row + r; }, global_col, cols,
      out);
}

void InitialValuesOf(const InitializerConfig& init, int64_t table_rows,
                     absl::Span<const int64_t> ids, int64_t global_col, int64_t cols, float* out) {
  InitialValuesBy(
      init, table_rows, static_cast<int64_t>(ids.size()), [ids](int64_t r) { return ids[r]; },
      global_col, cols, out);
}

absl::Status ValidateRowsAt(const ShardSpec& spec, absl::Span<const int64_t> rows, size_t weights,
                            size_t state) {
  for (const int64_t r : rows) {
    if (r < 0 || r >= spec.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, " is outside [0, ", spec.rows, ")"));
    }
  }
  return ValidateRowRange(spec, 0, static_cast<int64_t>(rows.size()), weights, state);
}

absl::Status EmbeddingBackend::ExportRowsAt(ShardId shard, absl::Span<const int64_t> rows,
                                            absl::Span<float> weights,
                                            absl::Span<float> state) const {
  auto spec = GetShardSpec(shard);
  if (!spec.ok()) return spec.status();
  if (absl::Status s = ValidateRowsAt(*spec, rows, weights.size(), state.size()); !s.ok()) return s;
  const size_t dim = static_cast<size_t>(spec->dim);
  const size_t width = rows.empty() ? 0 : state.size() / rows.size();
  for (size_t k = 0; k < rows.size(); ++k) {
    if (absl::Status s = ExportRows(shard, rows[k], rows[k] + 1, weights.subspan(k * dim, dim),
                                    state.subspan(k * width, width));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackend::ImportRowsAt(ShardId shard, absl::Span<const int64_t> rows,
                                            absl::Span<const float> weights,
                                            absl::Span<const float> state) {
  auto spec = GetShardSpec(shard);
  if (!spec.ok()) return spec.status();
  // Everything checked (values too) before the first row is written.
  if (absl::Status s = ValidateRowsAt(*spec, rows, weights.size(), state.size()); !s.ok()) return s;
  if (absl::Status s =
          ValidateImport(*spec, 0, static_cast<int64_t>(rows.size()), weights, state);
      !s.ok()) {
    return s;
  }
  const size_t dim = static_cast<size_t>(spec->dim);
  const size_t width = rows.empty() ? 0 : state.size() / rows.size();
  for (size_t k = 0; k < rows.size(); ++k) {
    if (absl::Status s = ImportRows(shard, rows[k], rows[k] + 1, weights.subspan(k * dim, dim),
                                    state.subspan(k * width, width));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackend::ExportSlots(ShardId, int64_t, int64_t, absl::Span<SlotMeta>) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::Status EmbeddingBackend::ImportSlots(ShardId, int64_t, int64_t, absl::Span<const SlotMeta>) {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::StatusOr<std::vector<int64_t>> EmbeddingBackend::ExportPendingCounts(ShardId) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::Status EmbeddingBackend::ImportPendingCounts(ShardId, absl::Span<const int64_t>) {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::StatusOr<EmbeddingBackend::ChangeMark> EmbeddingBackend::MarkChanges(ShardId) {
  return absl::UnimplementedError(absl::StrCat(Name(), " does not track changed rows"));
}
absl::StatusOr<std::vector<int64_t>> EmbeddingBackend::ChangedRowsIn(ShardId, const ChangeMark&,
                                                                     int64_t, int64_t) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " does not track changed rows"));
}

absl::StatusOr<std::vector<uint32_t>> EmbeddingBackend::ExportPendingSketch(ShardId) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::Status EmbeddingBackend::MergePendingSketch(ShardId, absl::Span<const uint32_t>) {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
absl::Status EmbeddingBackend::SyncKeyIndex(ShardId, const math::KeyLine*, int64_t,
                                           absl::Span<const int64_t>) {
  return absl::UnimplementedError(absl::StrCat(Name(), " does not find keys itself"));
}
absl::Status CheckKeySync(const math::KeyLine* lines, int64_t count,
                          absl::Span<const int64_t> changed) {
  if (lines == nullptr || count <= 0 || (count & (count - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a key index is a power of two of lines (got ", count, ")"));
  }
  for (size_t k = 0; k < changed.size(); ++k) {
    if (changed[k] < 0 || changed[k] >= count || (k > 0 && changed[k] <= changed[k - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "changed key line ", changed[k], " (entry ", k, ") is out of order or outside [0, ",
          count, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status NoKeyIndex(const std::string& what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": keyed ids, but the shard's key index was never synced"));
}

absl::Status EmbeddingBackend::CheckPendingSketch(absl::Span<const uint32_t> counters) {
  if (counters.empty() || counters.size() == kPendingSketchCounters) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(counters.size(), " counters, not ", kPendingSketchCounters));
}

absl::Status EmbeddingBackend::AddPendingSketch(absl::Span<const uint32_t> counters,
                                                std::vector<uint32_t>* sketch) {
  if (absl::Status s = CheckPendingSketch(counters); !s.ok()) return s;
  if (counters.empty()) return absl::OkStatus();
  if (sketch->empty()) sketch->assign(kPendingSketchCounters, 0);
  for (size_t k = 0; k < kPendingSketchCounters; ++k) {
    const uint64_t sum = uint64_t{(*sketch)[k]} + counters[k];
    (*sketch)[k] = static_cast<uint32_t>(std::min<uint64_t>(sum, std::numeric_limits<uint32_t>::max()));
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackend::CheckPendingCounts(absl::Span<const int64_t> packed) {
  if (packed.size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pending counts hold ", packed.size(), " int64s, not (id, count) pairs"));
  }
  for (size_t k = 0; k < packed.size(); k += 2) {
    if (packed[k + 1] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("id ", packed[k], " has a pending count of ", packed[k + 1], " (>= 1)"));
    }
  }
  return absl::OkStatus();
}
absl::Status EmbeddingBackend::ImportIds(ShardId, absl::Span<const int64_t>, absl::Span<const float>,
                                         absl::Span<const float>) {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}
std::vector<int64_t> EmbeddingBackend::PackSlots(absl::Span<const SlotMeta> slots) {
  std::vector<int64_t> out;
  out.reserve(slots.size() * kSlotMetaFields);
  for (const SlotMeta& m : slots) {
    out.push_back(m.held ? m.id : 0);
    out.push_back(m.held ? m.last_step : 0);
    out.push_back(m.held ? m.updates : 0);
    out.push_back(m.held ? m.order : 0);
  }
  return out;
}

absl::StatusOr<std::vector<EmbeddingBackend::SlotMeta>> EmbeddingBackend::UnpackSlots(
    absl::Span<const int64_t> packed) {
  constexpr size_t k = kSlotMetaFields;
  if (packed.size() % k != 0) {
    return absl::InvalidArgumentError(absl::StrCat("slot_meta holds ", packed.size(),
                                                   " int64s, not ", k, " per slot"));
  }
  std::vector<SlotMeta> out(packed.size() / k);
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t id = packed[k * i], last = packed[k * i + 1], updates = packed[k * i + 2],
                  order = packed[k * i + 3];
    if (last < 0 || updates < 0 || order < 0) {
      return absl::InvalidArgumentError(absl::StrCat("slot_meta of slot ", i, ": last step ", last,
                                                     ", updates ", updates, " and order ", order,
                                                     " must be >= 0"));
    }
    out[i] = SlotMeta{id, last, updates, updates > 0, order};
  }
  return out;
}

absl::StatusOr<DynamicStats> EmbeddingBackend::GetDynamicStats(ShardId) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no dynamic shards"));
}

absl::Status ValidatePrefetch(absl::Span<const FeatureRequest> features,
                              const std::function<const ShardSpec*(ShardId)>& find_spec) {
  for (size_t i = 0; i < features.size(); ++i) {
    const FeatureRequest& f = features[i];
    const ShardSpec* spec = find_spec(f.shard);
    if (spec == nullptr) return ShardNotFound(f.shard);
    const std::string what = RequestWhat("prefetch", i, *spec);
    if (f.on_device || f.keyed) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a prefetch takes its ids in host memory, as rows"));
    }
    if (absl::Status s = CheckIds(f.ids, spec->rows, what, 0); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> EmbeddingBackend::Prefetch(absl::Span<const FeatureRequest> features) {
  std::map<ShardId, ShardSpec> specs;
  auto find = [&](ShardId id) -> const ShardSpec* {
    auto it = specs.find(id);
    if (it == specs.end()) {
      auto spec = GetShardSpec(id);
      if (!spec.ok()) return nullptr;
      it = specs.emplace(id, *std::move(spec)).first;
    }
    return &it->second;
  };
  if (absl::Status s = ValidatePrefetch(features, find); !s.ok()) return s;
  return 0;  // no cache: nothing to bring in
}

absl::StatusOr<TierStats> EmbeddingBackend::GetTierStats(ShardId) const {
  return absl::UnimplementedError(absl::StrCat(Name(), " holds no key_value shards"));
}

}  // namespace backend
}  // namespace ember
