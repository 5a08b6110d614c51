// emberctl calibrate: measures, on the live workers of a deployment, the
// constants the planner's cost model needs, and fits them
// (planner/cost_model_io.h).
//
// It creates a scratch collection with two tables per worker, of 16 and
// 128 columns (table-wise, placed by an explicit plan, so each table's
// calls reach exactly one worker), times lookups whose ids and output sizes
// vary independently (tiny calls for the fixed cost, many ids with few
// bags for the gather, many bags with one id each for the output and the
// wire) on both, one-id calls with one and with both of a worker's tables
// (what a shard adds to a call's fixed time), then gradient updates; on
// CPU workers, training steps (lookup and update) on every worker at once
// from the large tables and from two more per worker of 1 and 16 MiB (the
// caches: how much they hold and how fast rows read from them;
// calibrate.cc); where every worker serves key_value, lookups of rows read
// from its files against the same ids in memory (the SSD tier's read rate,
// CostModel::ssd_bw_gbps); and drops the collection. The fit:
// ms per call = overhead + ids x cost per id + gathered bytes x (1 /
// memory bandwidth) + wire bytes x (1 / network bandwidth), the two widths
// telling ids from gathered bytes; the backward multiplier from the
// updates against the same fit. What the client does per call (building requests, copying outputs)
// is in the wire term, as it is in a training step.
#ifndef EMBER_CLI_CALIBRATE_H_
#define EMBER_CLI_CALIBRATE_H_

#include <ostream>
#include <string>
#include <vector>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "planner/cost_model.h"
#include "planner/cost_model_io.h"

namespace ember {
namespace cli {

struct CalibrateOptions {
  int64_t rows = 1000000;  // rows of each worker's tables (dims 16 and 128, fp32, SGD)
  int reps = 9;            // timed calls per configuration (the median counts)
  // Write the caches the probe measures into the model (cache_bytes,
  // cache_bw_gbps). Off by default: with the client and the workers
  // sharing a host, the probe's caches are not what a training step gets,
  // and the model under-predicted steps with them (docs/lab-notes/
  // 2026-11-benchmarks.md, "A cache term per worker"). They are measured
  // and printed either way.
  bool write_caches = false;
};

// Sampled accesses a table's learned curve needs before calibrate uses it.
inline constexpr int64_t kMinCurveSamples = 1000;

struct Calibration {
  ember::v1::ComputeDevice device = ember::v1::CPU;
  int workers = 0;
  planner::CallFit fit;
  // What a second shard in the same call adds to its fixed time (the fit's
  // overhead_ms is one call with one shard). Measured and printed; the
  // model keeps the whole fixed time per shard (calibrate.cc says why).
  double per_shard_overhead_ms = 0;
  double bwd_compute_multiplier = 0;
  // The workers' caches as the probe measured them (0: not measured, or
  // too small a gain to model) and the rate of the row reads they serve
  // (CostModel's cache_bytes and cache_bw_gbps; in `model` only with
  // write_caches).
  int64_t cache_bytes = 0;
  double cache_bw_gbps = 0;
  // Rows read from the workers' key_value files, GB/s of row bytes (0: not
  // measured: a worker without an SSD tier). Written into `model`
  // (CostModel::ssd_bw_gbps) when measured.
  double ssd_bw_gbps = 0;
  // Hit-rate curves learned by the workers' key_value and
  // fused_uvm_caching shards from the traffic they served, by table name
  // (every collection's tables of that name, calibrate's own excepted),
  // and the sampled accesses behind each. Written into `model`
  // (CostModel::hit_rate_curves) where a table has at least
  // kMinCurveSamples.
  std::map<std::string, std::vector<double>> curves;
  std::map<std::string, int64_t> curve_samples;
  planner::CostModel model;
  // Per lookup shape: the median time over the workers and what the fit
  // predicts.
  struct Row {
    int64_t dim = 0, batch = 0, pooling_factor = 0;
    double measured_ms = 0, predicted_ms = 0;
  };
  std::vector<Row> lookups;
};

// Progress lines go to `log`. The scratch collection is dropped whatever
// happens. FAILED_PRECONDITION when there are no live workers or they mix
// devices.
// A shard's learned hit-rate curve (ShardInfo.lru_*) added to *sampled and
// *hits (sized to the curve's points on first use); false, nothing added,
// where the shard has none (not cached, or no traffic yet).
bool AddLearnedCurve(const ember::v1::ShardInfo& shard, int64_t* sampled,
                     std::vector<int64_t>* hits);

absl::StatusOr<Calibration> Calibrate(client::Client* client, const CalibrateOptions& options,
                                      std::ostream* log);

}  // namespace cli
}  // namespace ember

#endif  // EMBER_CLI_CALIBRATE_H_
