#include "cli/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace ember {
namespace cli {
namespace {

constexpr int64_t kDim = 64;
constexpr double kRowBytes = kDim * 4;  // fp32, a multiple of every access granularity

// (batch, pooling factor): the fixed cost, gather-heavy, output-heavy and
// in between.
constexpr int64_t kConfigs[][2] = {{1, 1},    {16, 1},    {64, 256},  {256, 64},
                                   {1024, 16}, {4096, 4}, {16384, 1}, {2048, 1}};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

client::KeyedJaggedTensor Batch(const std::string& key, int64_t batch, int64_t pf, int64_t rows,
                                std::mt19937_64& rng) {
  client::KeyedJaggedTensor kjt;
  kjt.keys = {key};
  kjt.lengths.assign(batch, pf);
  kjt.values.resize(batch * pf);
  for (int64_t& id : kjt.values) id = static_cast<int64_t>(rng() % rows);
  return kjt;
}

// Bytes a lookup of `batch` bags of `pf` ids gathers and moves.
planner::CallSample Bytes(int64_t batch, int64_t pf) {
  const double ids = static_cast<double>(batch * pf), out = batch * kDim * 4.0;
  planner::CallSample s;
  s.gathered_bytes = ids * kRowBytes + out;
  s.wire_bytes = ids * 8 + batch * 8.0 + out;
  return s;
}

}  // namespace

absl::StatusOr<Calibration> Calibrate(client::Client* client, const CalibrateOptions& options,
                                      std::ostream* log) {
  if (options.rows < 1000 || options.reps < 1) {
    return absl::InvalidArgumentError("calibration needs rows >= 1000 and reps >= 1");
  }
  auto listed = client->ListWorkers();
  if (!listed.ok()) return listed.status();
  Calibration cal;
  bool mixed = false;
  for (const auto& w : listed->workers()) {
    if (!w.live()) continue;
    if (cal.workers > 0 && w.info().device() != cal.device) mixed = true;
    cal.device = w.info().device();
    ++cal.workers;
  }
  if (cal.workers == 0) return absl::FailedPreconditionError("no live workers to calibrate on");
  if (mixed) {
    return absl::FailedPreconditionError("the live workers mix CPU and CUDA; one model fits one kind");
  }

  // One table per worker, table-wise on its rank.
  ember::v1::CollectionSpec spec;
  spec.set_name(absl::StrCat("_calibrate_", getpid(), "_", absl::ToUnixMicros(absl::Now()) % 100000));
  ember::v1::ShardingPlan plan;
  for (int r = 0; r < cal.workers; ++r) {
    auto* t = spec.add_tables();
    t->set_name(absl::StrCat("cal_", r));
    t->set_num_embeddings(options.rows);
    t->set_embedding_dim(kDim);
    t->add_feature_names(absl::StrCat("f_", r));
    t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
    t->mutable_optimizer()->set_learning_rate(1e-6f);
    auto* ts = plan.add_tables();
    ts->set_table(t->name());
    ts->set_sharding_type("table_wise");
    ts->set_compute_kernel("fused");
    ts->add_ranks(r);
    auto* sh = ts->add_shards();
    sh->set_rows(options.rows);
    sh->set_cols(kDim);
    sh->set_rank(r);
  }
  *log << "calibrate: " << cal.workers << " " << ember::v1::ComputeDevice_Name(cal.device)
       << " worker(s), one " << options.rows << " x " << kDim << " table each ("
       << options.rows * kDim * 4 / (1 << 20) << " MiB)" << std::endl;
  auto created = client->CreateCollectionWithPlan(spec, plan);
  if (!created.ok()) return created.status();
  struct Drop {
    client::Client* c;
    std::string name;
    ~Drop() { (void)c->DropCollection(name); }
  } drop{client, spec.name()};

  std::mt19937_64 rng(7);
  std::vector<planner::CallSample> samples;
  std::vector<std::vector<double>> per_config(std::size(kConfigs));
  for (int r = 0; r < cal.workers; ++r) {
    const std::string key = absl::StrCat("f_", r);
    for (size_t k = 0; k < std::size(kConfigs); ++k) {
      const int64_t batch = kConfigs[k][0], pf = kConfigs[k][1];
      std::vector<double> times;
      for (int i = -1; i < options.reps; ++i) {  // one untimed warm-up
        const client::KeyedJaggedTensor kjt = Batch(key, batch, pf, options.rows, rng);
        const absl::Time start = absl::Now();
        auto kt = client->Lookup(spec.name(), kjt);
        const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
        if (!kt.ok()) return kt.status();
        if (i >= 0) times.push_back(ms);
      }
      planner::CallSample s = Bytes(batch, pf);
      s.ms = Median(times);
      samples.push_back(s);
      per_config[k].push_back(s.ms);
    }
    *log << "calibrate: worker rank " << r << ": " << std::size(kConfigs)
         << " lookup shapes timed" << std::endl;
  }
  auto fit = planner::FitCalls(samples);
  if (!fit.ok()) return fit.status();
  cal.fit = *fit;

  // Updates (SGD: no optimizer state): the backward multiplier is what
  // their compute takes beyond the fit's wire and overhead, relative to a
  // forward gather of the same bytes.
  std::vector<double> multipliers;
  for (int r = 0; r < cal.workers; ++r) {
    const std::string key = absl::StrCat("f_", r);
    for (const auto& [batch, pf] : {std::pair<int64_t, int64_t>{64, 256}, {1024, 16}}) {
      std::vector<double> times;
      for (int i = -1; i < options.reps; ++i) {
        const client::KeyedJaggedTensor kjt = Batch(key, batch, pf, options.rows, rng);
        client::KeyedTensor grads;
        grads.keys = {key};
        grads.length_per_key = {kDim};
        grads.batch_size = batch;
        grads.values.assign(batch * kDim, 1e-3f);
        const absl::Time start = absl::Now();
        absl::Status s = client->ApplyGradients(spec.name(), kjt, grads);
        const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
        if (!s.ok()) return s;
        if (i >= 0) times.push_back(ms);
      }
      const planner::CallSample b = Bytes(batch, pf);
      const double compute = Median(times) - cal.fit.overhead_ms - cal.fit.ms_per_wire_byte * b.wire_bytes;
      if (cal.fit.ms_per_gathered_byte > 0) {
        multipliers.push_back(compute / (cal.fit.ms_per_gathered_byte * b.gathered_bytes));
      }
    }
  }
  cal.bwd_compute_multiplier =
      multipliers.empty() ? 0 : std::clamp(Median(multipliers), 0.5, 20.0);
  cal.model = planner::Calibrated(planner::DefaultCostModel(cal.device), cal.device, cal.fit,
                                  cal.bwd_compute_multiplier);
  for (size_t k = 0; k < std::size(kConfigs); ++k) {
    const planner::CallSample b = Bytes(kConfigs[k][0], kConfigs[k][1]);
    Calibration::Row row;
    row.batch = kConfigs[k][0];
    row.pooling_factor = kConfigs[k][1];
    row.measured_ms = Median(per_config[k]);
    row.predicted_ms = cal.fit.overhead_ms + cal.fit.ms_per_gathered_byte * b.gathered_bytes +
                       cal.fit.ms_per_wire_byte * b.wire_bytes;
    cal.lookups.push_back(row);
  }
  return cal;
}

}  // namespace cli
}  // namespace ember
