// Cost models as files, and fitting one to measurements (emberctl
// calibrate writes such a file; the coordinator's and emberctl plan's
// --cost_model=FILE read it).
//
// The file is one JSON object: "device" ("cpu" or "cuda": the defaults the
// other fields start from, DefaultCostModel) and any CostModel field by its
// C++ name ("ddr_bw_gbps", "network_bw_gbps", "per_shard_overhead_ms",
// ...). Unknown fields are refused, so a typo cannot silently leave a
// default in place. "hit_rate_curves" (CostModel::hit_rate_curves) is an
// object: table name -> a list of 9 hit rates in [0, 1], never falling, at
// cache fractions 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75 and 1.
//
// Thread-safe: pure functions (plus file reading in LoadCostModel).
#ifndef EMBER_PLANNER_COST_MODEL_IO_H_
#define EMBER_PLANNER_COST_MODEL_IO_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cost_model.h"
#include "proto/plan.pb.h"

namespace ember {
namespace planner {

// Every field, with "device" first.
std::string CostModelToJson(const CostModel& model, ember::v1::ComputeDevice device);
// INVALID_ARGUMENT naming the field for unknown fields, wrong types,
// negative sizes or bandwidths, efficiencies outside (0, 1], or a
// bandwidth of 0 that the device's cost needs.
absl::StatusOr<CostModel> CostModelFromJson(const std::string& json,
                                            ember::v1::ComputeDevice* device = nullptr);
// CostModelFromJson of a file's contents; NOT_FOUND when it cannot be read.
absl::StatusOr<CostModel> LoadCostModel(const std::string& path,
                                        ember::v1::ComputeDevice* device = nullptr);

// One timed call to one worker with one table: the bytes the worker
// gathered and wrote (rows read + output written) and the bytes that
// crossed the wire (ids, lengths, outputs), how long it took, and the ids
// it looked up.
struct CallSample {
  double gathered_bytes = 0;
  double wire_bytes = 0;
  double ms = 0;
  double ids = 0;
};

// The least-squares fit (of relative errors: each sample weighs 1/ms^2)
// of ms = overhead + ids * per_id + gathered * per_gathered_byte +
// wire * per_wire_byte (each term >= 0), and how well it explains the
// samples (r2 of the times, 1 = exactly). The per-id term (hashing,
// bounds checks, the loop around each row) can be told from the gathered
// bytes only when the samples gather rows of more than one width.
struct CallFit {
  double overhead_ms = 0;
  double ms_per_id = 0;
  double ms_per_gathered_byte = 0;
  double ms_per_wire_byte = 0;
  double r2 = 0;
};
// The fit's prediction for a sample.
double PredictCall(const CallFit& fit, const CallSample& sample);
// INVALID_ARGUMENT for fewer than 3 samples or samples that cannot tell
// any byte term from the overhead. Terms the samples cannot tell apart
// (ids and gathered bytes in a fixed ratio, one row width) are fitted as
// one: the full fit where it comes out with every term >= 0, else the
// best of the fits without some terms.
absl::StatusOr<CallFit> FitCalls(const std::vector<CallSample>& samples);

// `base` with the fitted constants: the device's memory bandwidth at an
// efficiency of 1 (the fit measures what gathers reach), the cost per id,
// the network bandwidth, the fixed time of a call split into what each
// shard in it adds (`per_shard_ms`, at most the whole; negative: unknown,
// all of it per shard) and the rest per call, and the backward multiplier.
CostModel Calibrated(CostModel base, ember::v1::ComputeDevice device, const CallFit& fit,
                     double bwd_compute_multiplier, double per_shard_ms = -1);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_COST_MODEL_IO_H_
