#include "server/backend/overflow_guard.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ember {
namespace backend {
namespace {

// Room for float rounding: each formula rounds a handful of times (2^-24
// each), and a bound that grows by this much a step is re-measured long
// before it matters.
constexpr double kRounding = 1e-6;

// The largest |g| whose square can vanish in fp32 (row-wise Adagrad's mean
// square included, for any dim up to 2^24): an accumulator or Adam's v can
// then stay 0 while the update divides g (or m) by eps alone.
constexpr double kUnderflowGrad = 0x1p-50;

// A bound on a stored weight given a bound on the fp32 value it was rounded
// from: stochastic rounding moves it up by less than a gap (2^-10 of it for
// fp16, 2^-7 for bf16; fp16's subnormal gap is 2^-24), to nearest by half.
double StoredWeightBound(WeightType t, double fp32_bound) {
  switch (t) {
    case WeightType::kFp16:
      return fp32_bound * (1 + 0x1p-10) + 0x1p-24;
    case WeightType::kBf16:
      return fp32_bound * (1 + 0x1p-7) + 0x1p-126;
    case WeightType::kInt8:
    case WeightType::kInt4:  // half a step of a range at most twice the bound
      return fp32_bound * (1 + 0x1p-2) + 0x1p-24;
    default:
      return fp32_bound;
  }
}

}  // namespace

float WeightLimitOf(WeightType type) { return math::WeightLimit(static_cast<int32_t>(type)); }

int64_t FirstAccumulator(OptimizerType type, int64_t dim) {
  return type == OptimizerType::kAdam ? dim : 0;
}

ValueBounds Widen(const ValueBounds& a, const ValueBounds& b) {
  ValueBounds w;
  w.weight = std::max(a.weight, b.weight);
  w.acc = std::max(a.acc, b.acc);
  w.adam_ok = a.adam_ok && b.adam_ok;
  w.measured = false;
  return w;
}

ValueBounds InitialBounds(const ShardSpec& spec) {
  ValueBounds b;
  b.weight = StoredWeightBound(spec.weight_type,
                               InitialWeightBound(spec.initializer, spec.table_rows));
  const bool adagrad = spec.optimizer.type == OptimizerType::kAdagrad ||
                       spec.optimizer.type == OptimizerType::kRowwiseAdagrad;
  b.acc = adagrad ? spec.optimizer.initial_accumulator_value : 0.0;
  return b;
}

double AdamRatioBound(const OptimizerConfig& o) {
  const double b1 = o.beta1, b2 = o.beta2;
  if (!(b1 * b1 < b2) || !(b2 < 1)) return 0;
  return 1.01 * (1 - b1) / std::sqrt((1 - b2) * (1 - b1 * b1 / b2));
}

ValueBounds MeasureValues(const ShardSpec& spec, absl::Span<const float> weights,
                          absl::Span<const float> state) {
  ValueBounds b;
  b.measured = true;
  // The largest |w| (NaN when there is one), in one vectorised pass.
  const uint32_t top = MaxAbsBits(weights);
  if (top > 0x7f800000u) {
    b.weight = std::numeric_limits<double>::quiet_NaN();
  } else {
    float a;
    std::memcpy(&a, &top, sizeof(a));
    b.weight = std::max(b.weight, static_cast<double>(a));
  }
  const int64_t dim = spec.dim;
  const int64_t width = OptimizerStateWidth(spec.optimizer.type, dim);
  if (width == 0) return b;
  const int64_t first = FirstAccumulator(spec.optimizer.type, dim);
  const int64_t rows = static_cast<int64_t>(state.size()) / width;
  const bool adam = spec.optimizer.type == OptimizerType::kAdam;
  const double c = adam ? AdamRatioBound(spec.optimizer) : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* st = state.data() + r * width;
    for (int64_t k = first; k < width; ++k) {
      const double a = st[k];
      b.acc = a > b.acc || std::isnan(a) ? a : b.acc;
    }
    if (!adam) continue;
    for (int64_t k = 0; k < dim; ++k) {
      const double m = std::fabs(static_cast<double>(st[k]));
      const double v = st[dim + k];
      if (!(m <= c * std::sqrt(std::max(v, 0.0)))) b.adam_ok = false;
    }
  }
  return b;
}

ValueBounds ImportedBounds(const ShardSpec& spec, absl::Span<const float> weights,
                           absl::Span<const float> state) {
  ValueBounds b = MeasureValues(spec, weights, state);
  b.weight = StoredWeightBound(spec.weight_type, b.weight);
  b.measured = false;
  return b;
}

double MergedBound(double scales, double terms, double max_abs_grad) {
  // A float sum of n terms is within n * 2^-24 of the exact one, relatively
  // to the sum of their magnitudes; each scale rounds once more.
  return scales * max_abs_grad * (1 + (terms + 2) * 1.2e-7);
}

IdScales ScalesOf(const FeatureRequest& f) {
  IdScales s;
  const size_t n = f.ids.size();
  if (n == 0) return s;
  s.max = 1;
  if (f.weights.empty()) {
    if (f.pooling != Pooling::kMean) {
      s.sum = static_cast<double>(n);
      return s;
    }
    for (const int64_t len : f.lengths) s.sum += len > 0 ? 1.0 : 0.0;  // len x 1/len
    return s;
  }
  s.max = 0;
  size_t k = 0;
  for (const int64_t len : f.lengths) {
    double bag = 0;
    for (int64_t j = 0; j < len; ++j) {
      const double w = std::fabs(static_cast<double>(f.weights[k + j]));
      bag += w;
      s.max = std::max(s.max, w);
    }
    if (f.pooling == Pooling::kMean && len > 0) bag /= static_cast<double>(len);
    s.sum += bag;
    k += static_cast<size_t>(len);
  }
  return s;
}

double MergedGradientBound(const FeatureRequest& f, double max_abs_grad) {
  if (f.ids.empty() || max_abs_grad == 0) return 0;
  return MergedBound(ScalesOf(f).sum, static_cast<double>(f.ids.size()), max_abs_grad);
}

bool StepStaysFinite(const ShardSpec& spec, const math::StepParams& p,
                     const ValueBounds& before, double max_merged_grad, ValueBounds* after) {
  const double limit = WeightLimitOf(spec.weight_type);
  const double state_limit = math::kStateLimit;
  const double g = max_merged_grad, w = before.weight, acc = before.acc;
  if (!(g >= 0 && g <= state_limit) || !(w >= 0 && w <= limit) ||
      !(acc >= 0 && acc <= state_limit)) {
    return false;
  }
  const double lr = p.lr, wd = p.weight_decay;
  // The gradient the optimizer sees: L2 decay adds wd * w to it.
  const double ge = p.decay == math::kDecayL2 ? g + wd * w : g;
  // Decoupled decay scales w by (1 - lr wd) before the Adagrad variants
  // subtract their update (Adam adds wd w to its update instead).
  const double keep = p.decay == math::kDecayDecouple && p.optimizer != math::kStepAdam
                          ? std::fabs(static_cast<double>(p.decay_keep))
                          : 1.0;
  double w_after = 0, acc_after = acc;
  switch (p.optimizer) {
    case math::kStepSgd:
      w_after = w + lr * ge;
      break;
    case math::kStepAdagrad:
      // |g| / (sqrt(G + g^2) + eps) <= 1, unless g^2 vanished in fp32
      // (then |g| / eps, g below kUnderflowGrad); lr * g is formed first.
      if (!(p.eps > 0) || lr * ge > state_limit) return false;
      acc_after = acc + ge * ge;
      w_after = keep * w + lr * (1.01 + std::min(ge, kUnderflowGrad) / p.eps);
      break;
    case math::kStepRowwiseAdagrad:
      // G' >= mean(g^2) >= g_c^2 / dim: each element moves at most
      // lr sqrt(dim) (or by g / eps, its squares vanished).
      if (!(p.eps > 0)) return false;
      acc_after = acc + ge * ge;
      w_after = keep * w + lr * (1.01 * std::sqrt(static_cast<double>(spec.dim)) +
                                 std::min(ge, kUnderflowGrad) / p.eps);
      break;
    case math::kStepAdam: {
      // m^ / (sqrt(v^) + eps) <= C sqrt(1 - b2^t) / (1 - b1^t) while
      // |m| <= C sqrt(v), which each step keeps.
      const double c = AdamRatioBound(spec.optimizer);
      if (!before.adam_ok || c == 0 || !(p.eps > 0) || !(p.bias1 > 0) || !(p.bias2 > 0)) {
        return false;
      }
      acc_after = std::max(acc, ge * ge);
      const double m = std::max(c * std::sqrt(acc_after), ge);
      if (m / p.bias1 > state_limit) return false;
      // m stays within C sqrt(v) unless v's g^2 vanished in fp32 (m below
      // kUnderflowGrad then: divided by eps alone).
      const double u = c * std::sqrt(static_cast<double>(p.bias2)) / p.bias1 +
                       std::min(m, kUnderflowGrad) / (p.bias1 * p.eps) +
                       (p.decay == math::kDecayDecouple ? wd * w : 0.0);
      w_after = w + lr * u;
      break;
    }
    default:
      return false;
  }
  if (ge * ge > state_limit) return false;  // g * g is formed in fp32
  w_after *= 1 + kRounding;
  acc_after *= 1 + kRounding;
  // The fp32 result must fit (a value at most the limit rounds to at most
  // the limit); what is stored may be a gap above the result.
  if (!(w_after <= limit) || !(acc_after <= state_limit)) return false;
  after->weight = StoredWeightBound(spec.weight_type, w_after);
  after->acc = acc_after;
  after->adam_ok = before.adam_ok;
  after->measured = false;
  return true;
}

bool BoundsCannotTell(const ShardSpec& spec, const math::StepParams& p) {
  if (p.optimizer == math::kStepSgd) return false;
  return !(p.eps > 0x1p-40) ||
         (p.optimizer == math::kStepAdam && AdamRatioBound(spec.optimizer) == 0);
}

ValueBounds BoundsAfterCheck(const ShardSpec& spec, const ValueBounds& before,
                             const OverflowReport& report) {
  ValueBounds b;
  b.weight = StoredWeightBound(spec.weight_type,
                               std::max(before.weight, report.max_weight) * (1 + kRounding));
  b.acc = std::max(before.acc, report.max_acc) * (1 + kRounding);
  b.adam_ok = before.adam_ok;
  b.measured = false;
  return b;
}

namespace {
// kOverflowRowPayload's text: the shard (table, row and column offsets)
// and its local row.
std::string RowPayload(const ShardSpec& spec, int64_t row) {
  return absl::StrCat(spec.table, ":", spec.row_offset, ":", spec.col_offset, ":", row);
}
}  // namespace

absl::Status OverflowRefusal(const ShardSpec& spec, const OverflowReport& r) {
  const std::string where =
      absl::StrCat("gradient update of table '", spec.table, "': row ", spec.row_offset + r.row);
  absl::Status s =
      r.state ? absl::InvalidArgumentError(absl::StrCat(
                    where, ": optimizer state[", r.col, "] would become ", r.value,
                    " (fp32 state must stay finite); nothing of the call was applied"))
              : absl::InvalidArgumentError(absl::StrCat(
                    where, " column ", spec.col_offset + r.col, ": the weight would become ",
                    r.value, ", beyond the largest finite ", WeightTypeName(spec.weight_type),
                    " value ", WeightLimitOf(spec.weight_type),
                    "; nothing of the call was applied"));
  s.SetPayload(kOverflowPayload, absl::Cord(spec.table));
  s.SetPayload(kOverflowRowPayload, absl::Cord(RowPayload(spec, r.row)));
  return s;
}

bool IsOverflowRefusal(const absl::Status& s) {
  return absl::IsInvalidArgument(s) && s.GetPayload(kOverflowPayload).has_value();
}

int64_t OverflowRowOf(const absl::Status& s, const ShardSpec& spec) {
  if (!IsOverflowRefusal(s)) return -1;
  const auto payload = s.GetPayload(kOverflowRowPayload);
  if (!payload.has_value()) return -1;
  // The payload ends with the local row; the rest must be this shard's.
  const std::string text(*payload);
  const size_t colon = text.rfind(':');
  int64_t row = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(text.substr(colon + 1), &row) ||
      RowPayload(spec, row) != text || row < 0 || row >= spec.rows) {
    return -1;
  }
  return row;
}

absl::Status RenameOverflowRow(const absl::Status& s, const ShardSpec& spec,
                               const std::string& name) {
  const int64_t row = OverflowRowOf(s, spec);
  if (row < 0) return s;
  const std::string named = absl::StrCat("': row ", spec.row_offset + row);
  std::string message(s.message());
  const size_t at = message.find(named);
  if (at == std::string::npos) return s;
  message.replace(at, named.size(), absl::StrCat("': ", name));
  absl::Status renamed(s.code(), message);
  renamed.SetPayload(kOverflowPayload, *s.GetPayload(kOverflowPayload));
  return renamed;
}

}  // namespace backend
}  // namespace ember
