// No update makes a table's state non-finite: the rule every backend keeps,
// and the arithmetic that lets it keep the rule without a second pass over
// the rows on almost every call.
//
// An ApplyGradients call whose update would take a weight beyond its type's
// largest finite value (WeightLimit: fp16 65504) or an optimizer state
// element to Inf or NaN is refused with INVALID_ARGUMENT naming the table,
// row, column and value (OverflowRefusal), and nothing of it is applied; or,
// with the backend's skip_overflow, those rows alone are left as they are
// and counted. Each backend decides per shard and call:
//
//  1. Bounds. It keeps, per shard, ValueBounds: numbers no |weight| and no
//     accumulator exceed. From them, the call's largest merged gradient
//     (MergedGradientBound: the requests' largest |gradient| times their
//     summed |scale|) and the optimizer's formulas, StepStaysFinite tells
//     whether any row could leave the limits. Almost always it cannot: the
//     call applies in one pass, and the bounds grow by what the step could
//     add (bounded weight change: SGD lr |g|, Adagrad lr, row-wise Adagrad
//     lr sqrt(dim), Adam lr C sqrt(1-b2^t)/(1-b1^t); AdamRatioBound).
//  2. When the grown bounds say it could, the backend measures the shard
//     (MeasureValues: the bounds become the values' own), once until the
//     next update, and asks again.
//  3. When it still could, the call is checked first: every touched row's
//     update is computed without being stored (the kernels' check mode, the
//     same code as the update's), and the first row that would not fit
//     (lowest shard, then row, then column) refuses the call before any row
//     is written.
//
// Thread-compatible: pure functions and plain structs.
#ifndef EMBER_SERVER_BACKEND_OVERFLOW_GUARD_H_
#define EMBER_SERVER_BACKEND_OVERFLOW_GUARD_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "math/embedding_math.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

// WeightLimit for a WeightType.
float WeightLimitOf(WeightType type);

// Numbers a shard's values stay within: |weight| <= weight; every
// accumulator (Adagrad's G, row-wise Adagrad's G, Adam's v) <= acc; and,
// when adam_ok, Adam's |m| <= AdamRatioBound * sqrt(v) element by element
// (true of any state Adam's own steps reached from zeros: Cauchy-Schwarz
// over the steps' gradients). `measured`: the bounds are the values' own
// maxima (MeasureValues), taken since the last update.
struct ValueBounds {
  double weight = 0;
  double acc = 0;
  bool adam_ok = true;
  bool measured = false;
};

// The larger of two bounds (a shard whose rows were partly replaced).
ValueBounds Widen(const ValueBounds& a, const ValueBounds& b);

// Bounds of a newly created shard: its initializer's largest magnitude
// (uniform: max(|low|, |high|); normal: |mean| + 5.9 std, as the
// Box-Muller draw's uniforms are at least 2^-25; constant: |value|;
// default: 1 / sqrt(table rows)) and the initial accumulator.
ValueBounds InitialBounds(const ShardSpec& spec);

// C = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)), with 1% to spare for
// rounding: |m| <= C sqrt(v) holds after any Adam step from a state where
// it held. 0 when b1^2 >= b2 (no such bound: every Adam call is checked).
double AdamRatioBound(const OptimizerConfig& o);

// The measured bounds of rows given as fp32: weights [n, dim], state
// [n, OptimizerStateWidth] (measured = true).
ValueBounds MeasureValues(const ShardSpec& spec, absl::Span<const float> weights,
                          absl::Span<const float> state);

// Bounds to widen a shard's by after importing rows given as fp32 (the
// weights' rounding to fp16 / bf16 included; measured = false).
ValueBounds ImportedBounds(const ShardSpec& spec, absl::Span<const float> weights,
                           absl::Span<const float> state);

// A bound on |merged gradient| of a row whose occurrences' |scale|s sum to
// at most `scales`, over at most `terms` of them, each gradient element at
// most max_abs_grad: their product, with room for the float sum's rounding.
double MergedBound(double scales, double terms, double max_abs_grad);

// The scales a request's ids multiply their gradient rows by (an id's
// weight, times 1/length for MEAN): their sum of magnitudes, and the
// largest |weight| (1 unweighted), which bounds each scale.
struct IdScales {
  double sum = 0;
  double max = 0;
};
IdScales ScalesOf(const FeatureRequest& f);

// A bound on |merged gradient| of any row a request touches: MergedBound
// over all of its ids. A call's bound for a shard is the sum over its
// requests there.
double MergedGradientBound(const FeatureRequest& f, double max_abs_grad);

// Whether one step with `p` (this call's hyper-parameters) of a shard whose
// values are within `before`, and whose rows' merged gradients are at most
// `max_merged_grad`, keeps every weight within WeightLimitOf(spec's type)
// and every state element finite; *after then holds the bounds after it.
// False when the bounds cannot say (the call must be checked row by row).
bool StepStaysFinite(const ShardSpec& spec, const math::StepParams& p,
                     const ValueBounds& before, double max_merged_grad, ValueBounds* after);

// Whether no bounds can rule an overflow out for this optimizer and its
// parameters (eps of 2^-40 or less, so a vanished square divided by it
// could be anything; Adam with beta1^2 >= beta2): every call is checked,
// and measuring would not help.
bool BoundsCannotTell(const ShardSpec& spec, const math::StepParams& p);

// StepStaysFinite, and when the shard's grown bounds cannot tell, the
// same once more after `measure()` (the shard's MeasureValues) has set
// *bounds to the values' own, unless they are measured already.
// *after is set either way (the bounds themselves when it fails, for a
// caller that applies nothing).
template <typename Measure>
bool GuardStep(const ShardSpec& spec, const math::StepParams& p, ValueBounds* bounds,
               double max_merged_grad, ValueBounds* after, Measure&& measure) {
  *after = *bounds;
  if (StepStaysFinite(spec, p, *bounds, max_merged_grad, after)) return true;
  if (bounds->measured || BoundsCannotTell(spec, p)) return false;
  *bounds = measure();
  *after = *bounds;
  return StepStaysFinite(spec, p, *bounds, max_merged_grad, after);
}

// The first row of a checked call whose update would not fit, and the
// largest values among the rows that do (for the bounds after applying
// them).
struct OverflowReport {
  int64_t row = -1;    // shard row; -1: every row fits
  int64_t col = 0;     // shard column of a weight, or the state element
  bool state = false;  // an optimizer state element, not a weight
  float value = 0;     // what the update would make it
  double max_weight = 0;
  double max_acc = 0;
};

// INVALID_ARGUMENT for report.row of the shard: its table, global row and
// column (or state element), the value and the limit, and that nothing of
// the call was applied. It carries the payload kOverflowPayload, which
// IsOverflowRefusal tells by (callers count refusals by it, not by the
// message's words).
absl::Status OverflowRefusal(const ShardSpec& spec, const OverflowReport& report);
inline constexpr char kOverflowPayload[] = "type.ember.dev/update_overflow";
bool IsOverflowRefusal(const absl::Status& s);

// For a backend whose rows stand for others (a key_value shard's cache
// slots, a dynamic shard's slots): the shard-local row an overflow refusal
// of the wrapped backend's shard `spec` names, or -1 when `s` is not one or
// names another shard (the payload kOverflowRowPayload: the table, row
// offset and local row).
int64_t OverflowRowOf(const absl::Status& s, const ShardSpec& spec);
// `s` with that row named as `name` instead ("row 123456", "id -77").
absl::Status RenameOverflowRow(const absl::Status& s, const ShardSpec& spec,
                               const std::string& name);
inline constexpr char kOverflowRowPayload[] = "type.ember.dev/update_overflow_row";

// The bounds after applying a checked call's fitting rows (their fp32
// values in `report`, the stored ones a rounding gap above at most).
ValueBounds BoundsAfterCheck(const ShardSpec& spec, const ValueBounds& before,
                             const OverflowReport& report);


// The accumulator elements of a state row: Adagrad's all, row-wise
// Adagrad's one, Adam's second half (v); [first, width).
int64_t FirstAccumulator(OptimizerType type, int64_t dim);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_OVERFLOW_GUARD_H_
