#include "server/backend/embedding_backend.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace ember {
namespace backend {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in (0, 1), from 24 bits of a counter-based hash.
double Unit(uint64_t seed, int64_t row, int64_t col, uint64_t stream) {
  const uint64_t h = SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(row) * 0x100000001b3ULL ^
                                                  SplitMix64(static_cast<uint64_t>(col) + stream)));
  return (static_cast<double>(h >> 40) + 0.5) / 16777216.0;
}

}  // namespace

int64_t OptimizerStateWidth(OptimizerType type, int64_t dim) {
  switch (type) {
    case OptimizerType::kSgd:
      return 0;
    case OptimizerType::kAdagrad:
      return dim;
    case OptimizerType::kRowwiseAdagrad:
      return 1;
    case OptimizerType::kAdam:
      return 2 * dim;
  }
  return 0;
}

int64_t OutputSize(const FeatureRequest& f, int64_t dim) {
  return (f.pooling == Pooling::kNone ? static_cast<int64_t>(f.ids.size())
                                      : static_cast<int64_t>(f.lengths.size())) *
         dim;
}

absl::Status ShardNotFound(ShardId shard) {
  return absl::NotFoundError(absl::StrCat("no shard with id ", shard));
}

absl::Status ValidateRequest(const FeatureRequest& f, const ShardSpec& spec, size_t dense_floats,
                             const std::string& what, const char* buffer) {
  if (absl::Status s = ValidateFeature(f, spec.rows, what); !s.ok()) return s;
  const int64_t want = OutputSize(f, spec.dim);
  const int64_t got = static_cast<int64_t>(dense_floats);
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

absl::Status ValidateShardSpec(const ShardSpec& s) {
  auto bad = [&](auto... parts) {
    return absl::InvalidArgumentError(absl::StrCat("shard of table '", s.table, "': ", parts...));
  };
  if (s.rows <= 0) return bad("rows must be > 0, got ", s.rows);
  if (s.dim <= 0 || s.dim % 4 != 0) return bad("dim must be > 0 and divisible by 4, got ", s.dim);
  if (s.row_offset < 0 || s.col_offset < 0) return bad("offsets must be >= 0");
  if (s.table_rows < s.row_offset + s.rows) {
    return bad("row_offset + rows (", s.row_offset + s.rows, ") exceeds table_rows (",
               s.table_rows, ")");
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
  const InitializerConfig& i = s.initializer;
  if (i.type == InitializerType::kUniform && !(i.low <= i.high)) {
    return bad("uniform initializer needs low <= high");
  }
  if (i.type == InitializerType::kNormal && !(i.std >= 0)) {
    return bad("normal initializer needs std >= 0");
  }
  return absl::OkStatus();
}

absl::Status ValidateFeature(const FeatureRequest& f, int64_t rows, const std::string& what) {
  int64_t total = 0;
  for (size_t b = 0; b < f.lengths.size(); ++b) {
    if (f.lengths[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": lengths[", b, "] is negative (", f.lengths[b], ")"));
    }
    total += f.lengths[b];
  }
  if (total != static_cast<int64_t>(f.ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": lengths sum to ", total, " but there are ", f.ids.size(), " ids"));
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
  }
  for (size_t i = 0; i < f.ids.size(); ++i) {
    if (f.ids[i] < 0 || f.ids[i] >= rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": id ", f.ids[i], " at position ", i, " is outside [0, ", rows, ")"));
    }
  }
  return absl::OkStatus();
}

float InitialValue(const InitializerConfig& init, int64_t table_rows, int64_t row, int64_t col) {
  switch (init.type) {
    case InitializerType::kConstant:
      return init.value;
    case InitializerType::kUniform:
      return static_cast<float>(init.low + (init.high - init.low) * Unit(init.seed, row, col, 0));
    case InitializerType::kNormal: {
      const double u1 = Unit(init.seed, row, col, 1), u2 = Unit(init.seed, row, col, 2);
      return static_cast<float>(init.mean + init.std * std::sqrt(-2.0 * std::log(u1)) *
                                                std::cos(2.0 * M_PI * u2));
    }
    case InitializerType::kDefault:
    default: {
      const double bound = std::sqrt(1.0 / static_cast<double>(std::max<int64_t>(table_rows, 1)));
      return static_cast<float>(-bound + 2.0 * bound * Unit(init.seed, row, col, 0));
    }
  }
}

}  // namespace backend
}  // namespace ember
