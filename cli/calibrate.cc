#include "cli/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "math/hit_rate_curve.h"

namespace ember {
namespace cli {
namespace {

// Calibrate's own collections' names begin so.
constexpr char kProbePrefix[] = "_calibrate_";

// Each worker holds a table of each width: rows of two widths tell the cost
// per id from the cost per gathered byte (with one width they are
// proportional). fp32, a multiple of every access granularity.
constexpr int64_t kDims[] = {16, 128};

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

// One lookup, timed (ms).
absl::StatusOr<double> TimedLookup(client::Client* client, const std::string& collection,
                                   const client::KeyedJaggedTensor& kjt) {
  const absl::Time start = absl::Now();
  auto kt = client->Lookup(collection, kjt);
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!kt.ok()) return kt.status();
  return ms;
}

// Ids and bytes of a lookup of `batch` bags of `pf` ids from rows of
// `dim` fp32 columns: gathered (rows read, output written) and on the wire.
planner::CallSample Bytes(int64_t batch, int64_t pf, int64_t dim) {
  const double ids = static_cast<double>(batch * pf), out = batch * dim * 4.0;
  planner::CallSample s;
  s.ids = ids;
  s.gathered_bytes = ids * dim * 4.0 + out;
  s.wire_bytes = ids * 8 + batch * 8.0 + out;
  return s;
}

std::string TableName(int rank, int64_t dim) { return absl::StrCat("cal_", rank, "_d", dim); }
std::string FeatureName(int rank, int64_t dim) { return absl::StrCat("f_", rank, "_d", dim); }

// The caches: training steps (lookup and update) on rows of kCacheDim
// columns from a table that stays in them, one larger than them and the
// large table, the same steps on each. The large table must be
// kCacheMissFactor times the larger probe to stand for memory.
constexpr int64_t kCacheDim = 128;
constexpr int64_t kCacheProbeBytes[] = {int64_t{1} << 20, int64_t{16} << 20};
constexpr int64_t kCacheMissFactor = 4;
constexpr int64_t kCacheConfigs[][2] = {{1024, 16}, {256, 64}};
std::string CacheTableName(int rank, int64_t bytes) {
  return absl::StrCat("cal_", rank, "_c", bytes >> 20, "m");
}
std::string CacheFeatureName(int rank, int64_t bytes) {
  return absl::StrCat("f_", rank, "_c", bytes >> 20, "m");
}

// A scratch table (fp32, SGD at a negligible rate) in `spec`, placed
// table-wise on `rank` by `plan`.
void AddTable(const std::string& name, const std::string& feature, int64_t rows, int64_t dim,
              int rank, ember::v1::CollectionSpec* spec, ember::v1::ShardingPlan* plan,
              const std::string& kernel = "fused") {
  auto* t = spec->add_tables();
  t->set_name(name);
  t->set_num_embeddings(rows);
  t->set_embedding_dim(dim);
  t->add_feature_names(feature);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  t->mutable_optimizer()->set_learning_rate(1e-6f);
  auto* ts = plan->add_tables();
  ts->set_table(name);
  ts->set_sharding_type("table_wise");
  ts->set_compute_kernel(kernel);
  if (kernel == "key_value") {  // a table opts in by its constraints
    ember::v1::ParameterConstraints& c = (*spec->mutable_constraints())[name];
    c.add_compute_kernels(kernel);
    c.set_cache_load_factor(0.01);
    ts->set_cache_load_factor(0.01);
  }
  ts->add_ranks(rank);
  auto* sh = ts->add_shards();
  sh->set_rows(rows);
  sh->set_cols(dim);
  sh->set_rank(rank);
}

// The hit-rate curves the live workers' cached shards learned from their
// traffic (ShardInfo.lru_*), summed by table name over every collection
// but calibrate's own, into cal->curves / curve_samples.
absl::Status LearnCurves(client::Client* client, const ember::v1::ListWorkersResponse& workers,
                         Calibration* cal, std::ostream* log) {
  std::map<std::string, std::vector<int64_t>> hits;
  for (const auto& w : workers.workers()) {
    if (!w.live()) continue;
    auto status = client->WorkerStatus(w.info().address());
    if (!status.ok()) {
      return absl::Status(status.status().code(),
                          absl::StrCat("worker ", w.info().address(), ": ",
                                       status.status().message()));
    }
    for (const auto& s : status->shards()) {
      if (absl::StartsWith(s.collection(), kProbePrefix)) continue;
      int64_t sampled = 0;
      std::vector<int64_t>& h = hits[s.shard().table()];
      if (AddLearnedCurve(s, &sampled, &h)) cal->curve_samples[s.shard().table()] += sampled;
    }
  }
  for (const auto& [table, h] : hits) {
    if (h.empty()) continue;  // the table's shards learned nothing
    const int64_t n = cal->curve_samples[table];
    std::vector<double>& curve = cal->curves[table];
    for (int64_t x : h) curve.push_back(static_cast<double>(x) / static_cast<double>(n));
    if (n < kMinCurveSamples) {
      *log << "calibrate: hit-rate curve of table '" << table << "' not used: " << n
           << " sampled accesses, fewer than " << kMinCurveSamples << std::endl;
      continue;
    }
    *log << absl::StrFormat(
                "calibrate: hit-rate curve of table '%s' (%d sampled accesses): %.3f at a 5%% "
                "cache, %.3f at 20%%, %.3f at 50%%",
                table, n, curve[2], curve[4], curve[6])
         << std::endl;
  }
  if (cal->curves.empty()) {
    *log << "calibrate: no hit-rate curves: no key_value or fused_uvm_caching table has had "
            "traffic"
         << std::endl;
  }
  return absl::OkStatus();
}

// The SSD tier (workers that serve key_value): a table of kSsdDim columns
// on it per worker, every row written to its file first; lookups of rows
// never read since (each row once, so every one misses the cache and is
// read from the file) against the same ids from the worker's table of the
// same width in memory. The difference is the reads' time.
constexpr int64_t kSsdDim = 128;
constexpr int64_t kSsdBags = 256, kSsdPooling = 16;
std::string SsdTableName(int rank) { return absl::StrCat("cal_", rank, "_kv"); }
std::string SsdFeatureName(int rank) { return absl::StrCat("f_", rank, "_kv"); }

// The SSD probe (above) on every worker: GB/s of rows read from the file
// (the median over workers; 0 when the reads took no measurable time).
absl::StatusOr<double> ProbeSsd(client::Client* client, const std::string& collection,
                                int workers, const CalibrateOptions& options, int64_t rows,
                                std::mt19937_64& rng, std::ostream* log) {
  const int64_t per_lookup = kSsdBags * kSsdPooling;
  std::vector<double> rates, gbps;
  for (int r = 0; r < workers; ++r) {
    // Every row to the file (a range import writes the rows it does not
    // find cached to the file: key_value_backend.h), then lookups in a
    // shuffled order, each row once: each a miss read from the file.
    const std::vector<float> values(static_cast<size_t>(rows * kSsdDim), 1e-3f);
    if (absl::Status s = client->ImportTable(collection, SsdTableName(r), values, rows, kSsdDim);
        !s.ok()) {
      return s;
    }
    std::vector<int64_t> order(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<double> on_ssd, in_memory;
    for (int i = -1; i < options.reps; ++i) {
      client::KeyedJaggedTensor kjt;
      kjt.lengths.assign(kSsdBags, kSsdPooling);
      kjt.values.assign(order.begin() + (i + 1) * per_lookup, order.begin() + (i + 2) * per_lookup);
      kjt.keys = {SsdFeatureName(r)};
      auto kv = TimedLookup(client, collection, kjt);
      if (!kv.ok()) return kv.status();
      kjt.keys = {FeatureName(r, kSsdDim)};
      auto mem = TimedLookup(client, collection, kjt);
      if (!mem.ok()) return mem.status();
      if (i >= 0) {
        on_ssd.push_back(*kv);
        in_memory.push_back(*mem);
      }
    }
    const double extra_ms = Median(on_ssd) - Median(in_memory);
    if (extra_ms > 0) {
      rates.push_back(per_lookup / (extra_ms * 1e-3));
      gbps.push_back(per_lookup * kSsdDim * 4.0 / (extra_ms * 1e6));
    }
  }
  if (gbps.empty()) {
    *log << "calibrate: SSD tier: the reads took no measurable time; ssd_bw_gbps left as it was"
         << std::endl;
    return 0.0;
  }
  *log << absl::StrFormat(
              "calibrate: SSD tier: %.0f random row reads/s of %d-byte rows from the key_value "
              "files (median over %d worker(s)): ssd_bw_gbps %.3f",
              Median(rates), kSsdDim * 4, static_cast<int>(rates.size()), Median(gbps))
       << std::endl;
  return Median(gbps);
}

}  // namespace

bool AddLearnedCurve(const ember::v1::ShardInfo& shard, int64_t* sampled,
                     std::vector<int64_t>* hits) {
  const size_t points = backend::math::kLruCurveFractions.size();
  if (shard.lru_sampled() <= 0 || static_cast<size_t>(shard.lru_curve_hits_size()) != points) {
    return false;
  }
  *sampled += shard.lru_sampled();
  hits->resize(points, 0);
  for (size_t i = 0; i < points; ++i) (*hits)[i] += shard.lru_curve_hits(static_cast<int>(i));
  return true;
}

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
  bool all_ssd = true;  // every live worker serves key_value (has an SSD tier)
  for (const auto& w : listed->workers()) {
    if (!w.live()) continue;
    const auto& k = w.info().compute_kernels();
    all_ssd = all_ssd && std::find(k.begin(), k.end(), "key_value") != k.end();
  }
  if (mixed) {
    return absl::FailedPreconditionError("the live workers mix CPU and CUDA; one model fits one kind");
  }

  // The curves first, before calibrate's own tables take traffic.
  if (absl::Status s = LearnCurves(client, *listed, &cal, log); !s.ok()) return s;

  // A table of each width per worker, table-wise on its rank.
  ember::v1::CollectionSpec spec;
  spec.set_name(absl::StrCat(kProbePrefix, getpid(), "_", absl::ToUnixMicros(absl::Now()) % 100000));
  ember::v1::ShardingPlan plan;
  int64_t cols_per_worker = 0;
  for (int64_t dim : kDims) cols_per_worker += dim;
  for (int r = 0; r < cal.workers; ++r) {
    for (int64_t dim : kDims) {
      AddTable(TableName(r, dim), FeatureName(r, dim), options.rows, dim, r, &spec, &plan);
    }
  }
  const int64_t row_bytes = kCacheDim * 4;
  static_assert(kCacheDim == kDims[std::size(kDims) - 1], "the probe's large table is kDims'");
  static_assert(kSsdDim == kDims[std::size(kDims) - 1], "the SSD probe's twin is kDims' last");
  // CPU workers only: on a GPU the model's memory tier is HBM, whose L2 a
  // probe of this shape does not isolate.
  const bool probe_caches = cal.device == ember::v1::CPU &&
                            options.rows * row_bytes >= kCacheMissFactor * kCacheProbeBytes[1];
  if (probe_caches) {
    for (int r = 0; r < cal.workers; ++r) {
      for (int64_t bytes : kCacheProbeBytes) {
        AddTable(CacheTableName(r, bytes), CacheFeatureName(r, bytes), bytes / row_bytes, kCacheDim,
                 r, &spec, &plan);
      }
    }
  }
  // Each timed lookup (and its warm-up) reads rows no other did.
  const int64_t ssd_rows = (options.reps + 1) * kSsdBags * kSsdPooling;
  const bool probe_ssd = all_ssd && ssd_rows <= options.rows;
  if (probe_ssd) {
    for (int r = 0; r < cal.workers; ++r) {
      AddTable(SsdTableName(r), SsdFeatureName(r), ssd_rows, kSsdDim, r, &spec, &plan,
               "key_value");
    }
  }
  *log << "calibrate: " << cal.workers << " " << ember::v1::ComputeDevice_Name(cal.device)
       << " worker(s), tables of " << options.rows << " rows x " << kDims[0] << " and "
       << kDims[1] << " columns on each (" << options.rows * cols_per_worker * 4 / (1 << 20)
       << " MiB per worker)" << std::endl;
  auto created = client->CreateCollectionWithPlan(spec, plan);
  if (!created.ok()) return created.status();
  struct Drop {
    client::Client* c;
    std::string name;
    ~Drop() { (void)c->DropCollection(name); }
  } drop{client, spec.name()};

  std::mt19937_64 rng(7);
  std::vector<planner::CallSample> samples;
  constexpr size_t kShapes = std::size(kDims) * std::size(kConfigs);
  std::vector<std::vector<double>> per_shape(kShapes);  // [dim][config], over workers
  for (int r = 0; r < cal.workers; ++r) {
    for (size_t d = 0; d < std::size(kDims); ++d) {
      const std::string key = FeatureName(r, kDims[d]);
      for (size_t k = 0; k < std::size(kConfigs); ++k) {
        const int64_t batch = kConfigs[k][0], pf = kConfigs[k][1];
        std::vector<double> times;
        for (int i = -1; i < options.reps; ++i) {  // one untimed warm-up
          auto ms = TimedLookup(client, spec.name(), Batch(key, batch, pf, options.rows, rng));
          if (!ms.ok()) return ms.status();
          if (i >= 0) times.push_back(*ms);
        }
        planner::CallSample s = Bytes(batch, pf, kDims[d]);
        s.ms = Median(times);
        samples.push_back(s);
        per_shape[d * std::size(kConfigs) + k].push_back(s.ms);
      }
    }
    *log << "calibrate: worker rank " << r << ": " << kShapes << " lookup shapes timed"
         << std::endl;
  }
  auto fit = planner::FitCalls(samples);
  if (!fit.ok()) return fit.status();
  cal.fit = *fit;

  // The fixed time split: one bag of one id from one table, against one
  // from each of a worker's two tables in the same call (one RPC, two
  // shards). The difference is what a shard adds; the rest is the call's.
  std::vector<double> per_shard;
  for (int r = 0; r < cal.workers; ++r) {
    std::vector<double> one, both;
    for (int i = -1; i < options.reps; ++i) {
      for (bool two : {false, true}) {
        client::KeyedJaggedTensor kjt = Batch(FeatureName(r, kDims[0]), 1, 1, options.rows, rng);
        if (two) {
          kjt.keys.push_back(FeatureName(r, kDims[1]));
          kjt.lengths.push_back(1);
          kjt.values.push_back(static_cast<int64_t>(rng() % options.rows));
        }
        auto ms = TimedLookup(client, spec.name(), kjt);
        if (!ms.ok()) return ms.status();
        if (i >= 0) (two ? both : one).push_back(*ms);
      }
    }
    per_shard.push_back(std::max(0.0, Median(both) - Median(one)));
  }
  cal.per_shard_overhead_ms = Median(per_shard);

  // Updates (SGD: no optimizer state): the backward multiplier is what
  // their compute takes beyond the fit's wire and overhead, relative to a
  // forward gather of the same bytes.
  std::vector<double> multipliers;
  constexpr int64_t kUpdateDim = kDims[std::size(kDims) - 1];
  for (int r = 0; r < cal.workers; ++r) {
    const std::string key = FeatureName(r, kUpdateDim);
    for (const auto& [batch, pf] : {std::pair<int64_t, int64_t>{64, 256}, {1024, 16}}) {
      std::vector<double> times;
      for (int i = -1; i < options.reps; ++i) {
        const client::KeyedJaggedTensor kjt = Batch(key, batch, pf, options.rows, rng);
        client::KeyedTensor grads;
        grads.keys = {key};
        grads.length_per_key = {kUpdateDim};
        grads.batch_size = batch;
        grads.values.assign(batch * kUpdateDim, 1e-3f);
        const absl::Time start = absl::Now();
        absl::Status s = client->ApplyGradients(spec.name(), kjt, grads);
        const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
        if (!s.ok()) return s;
        if (i >= 0) times.push_back(ms);
      }
      const planner::CallSample b = Bytes(batch, pf, kUpdateDim);
      const double compute = Median(times) - cal.fit.overhead_ms - cal.fit.ms_per_wire_byte * b.wire_bytes;
      const double forward =
          cal.fit.ms_per_gathered_byte * b.gathered_bytes + cal.fit.ms_per_id * b.ids;
      if (forward > 0) multipliers.push_back(compute / forward);
    }
  }
  cal.bwd_compute_multiplier =
      multipliers.empty() ? 0 : std::clamp(Median(multipliers), 0.5, 20.0);
  // The model file keeps the whole fixed time per shard: charged per call
  // (what the split measures), it leaves row-wise splits nearly free of
  // fixed costs, and the model under-prices row-wise on the service by
  // more than that (docs/lab-notes/2026-11-benchmarks.md, "a cost per call"), so the planner
  // chose row-wise splits that measured slower. The split is measured and
  // printed; per_call_overhead_ms takes it where a model is written by hand.
  cal.model = planner::Calibrated(planner::DefaultCostModel(cal.device), cal.device, cal.fit,
                                  cal.bwd_compute_multiplier);
  // The caches, measured the way the planner uses them: training steps
  // (a lookup and its update), on every worker at once (workers on one
  // host share its last-level cache, and in a step they are all busy),
  // from the large tables (x_m), from tables that fit the caches (x_c)
  // and from tables of S bytes larger than them (x_s). The model without
  // caches prices each step (e_m, e_c, e_s: it already knows a small
  // table's update touches fewer rows); what the measurements differ by
  // beyond that is the caches'. With R the step's row reads at memory's
  // rate (a shard's cache saving were its rows read for free):
  //   x_m - x_c = e_m - e_c + faster * R_c    (faster = 1 - memory's
  //   x_m - x_s = e_m - e_s + (C / S) * faster * R_s     rate / caches')
  // the large table's own cached share left out (under 1/4 of C / S).
  if (probe_caches) {
    auto steps = [&](auto feature, int64_t rows) -> absl::StatusOr<double> {
      double sum = 0;
      for (const auto& config : kCacheConfigs) {
        std::vector<double> times;
        for (int i = -1; i < options.reps; ++i) {
          client::KeyedJaggedTensor kjt;
          client::KeyedTensor grads;
          grads.batch_size = config[0];
          for (int r = 0; r < cal.workers; ++r) {
            const client::KeyedJaggedTensor one = Batch(feature(r), config[0], config[1], rows, rng);
            kjt.keys.push_back(one.keys[0]);
            kjt.lengths.insert(kjt.lengths.end(), one.lengths.begin(), one.lengths.end());
            kjt.values.insert(kjt.values.end(), one.values.begin(), one.values.end());
            grads.keys.push_back(one.keys[0]);
            grads.length_per_key.push_back(kCacheDim);
          }
          grads.values.assign(config[0] * kCacheDim * cal.workers, 1e-3f);
          const absl::Time start = absl::Now();
          auto kt = client->Lookup(spec.name(), kjt);
          if (!kt.ok()) return kt.status();
          if (absl::Status st = client->ApplyGradients(spec.name(), kjt, grads); !st.ok()) return st;
          if (i >= 0) times.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        }
        sum += Median(times);
      }
      return sum;
    };
    // The model's step (e) and row reads (R) for a table of `rows`.
    planner::CostModel free_reads = cal.model;
    free_reads.cache_bytes = 1;
    free_reads.cache_bw_gbps = 1e30;
    auto model_step = [&](int64_t rows, double* e, double* reads) {
      *e = *reads = 0;
      for (const auto& config : kCacheConfigs) {
        planner::TableWorkload w;
        w.ids = static_cast<double>(config[0] * config[1]);
        w.bags = static_cast<double>(config[0]);
        w.pooling_factor = static_cast<double>(config[1]);
        const planner::ShardBlock block{0, 0, rows, kCacheDim};
        const planner::ShardCost c =
            planner::EstimateShard(free_reads, w, planner::ShardingType::kTableWise,
                                   planner::ComputeKernel::kFused, cal.device, block, rows, 1);
        *e += c.total_ms();
        *reads += c.fwd_cache_saving_ms + c.bwd_cache_saving_ms;
      }
    };
    const int64_t rows_c = kCacheProbeBytes[0] / row_bytes, rows_s = kCacheProbeBytes[1] / row_bytes;
    auto x_m = steps([](int r) { return FeatureName(r, kCacheDim); }, options.rows);
    auto x_c = steps([](int r) { return CacheFeatureName(r, kCacheProbeBytes[0]); }, rows_c);
    auto x_s = steps([](int r) { return CacheFeatureName(r, kCacheProbeBytes[1]); }, rows_s);
    if (!x_m.ok()) return x_m.status();
    if (!x_c.ok()) return x_c.status();
    if (!x_s.ok()) return x_s.status();
    double e_m, e_c, e_s, r_m, r_c, r_s;
    model_step(options.rows, &e_m, &r_m);
    model_step(rows_c, &e_c, &r_c);
    model_step(rows_s, &e_s, &r_s);
    *log << absl::StrFormat(
                "calibrate: training steps on every worker at once, rows from %d MiB, %d MiB "
                "and %d MiB tables: measured %.3f, %.3f, %.3f ms; the model without caches "
                "%.3f, %.3f, %.3f ms",
                kCacheProbeBytes[0] >> 20, kCacheProbeBytes[1] >> 20,
                options.rows * row_bytes >> 20, *x_c, *x_s, *x_m, e_c, e_s, e_m)
         << std::endl;
    // The caches' part, at most 95% of the row reads' time (timing noise
    // could say more); under 5% of the small table's step: nothing to model.
    const double faster = std::min(0.95, ((*x_m - *x_c) - (e_m - e_c)) / r_c);
    if (faster * r_c >= 0.05 * *x_c && r_s > 0) {
      const double share = std::clamp(((*x_m - *x_s) - (e_m - e_s)) / (faster * r_s), 0.0, 1.0);
      cal.cache_bytes = static_cast<int64_t>(share * kCacheProbeBytes[1]);
      const double memory = free_reads.ddr_bw_gbps * free_reads.lookup_efficiency;
      cal.cache_bw_gbps = memory / (1.0 - faster);
    }
    if (cal.cache_bytes <= 0 || cal.cache_bw_gbps <= 0) {
      cal.cache_bytes = 0;
      cal.cache_bw_gbps = 0;
    }
  } else if (cal.device != ember::v1::CPU) {
    *log << "calibrate: caches not measured (CPU workers only)" << std::endl;
  } else {
    *log << "calibrate: caches not measured: the large tables (" << (options.rows * row_bytes >> 20)
         << " MiB) must be " << kCacheMissFactor << "x the " << (kCacheProbeBytes[1] >> 20)
         << " MiB probe to stand for memory (--calibrate_rows >= "
         << kCacheMissFactor * kCacheProbeBytes[1] / row_bytes << ")" << std::endl;
  }
  if (options.write_caches) {
    cal.model.cache_bytes = cal.cache_bytes;
    cal.model.cache_bw_gbps = cal.cache_bw_gbps;
  }
  if (probe_ssd) {
    auto ssd = ProbeSsd(client, spec.name(), cal.workers, options, ssd_rows, rng, log);
    if (!ssd.ok()) return ssd.status();
    cal.ssd_bw_gbps = *ssd;
    if (cal.ssd_bw_gbps > 0) cal.model.ssd_bw_gbps = cal.ssd_bw_gbps;
  } else if (!all_ssd) {
    *log << "calibrate: SSD tier not measured: not every worker serves key_value (--ssd_dir)"
         << std::endl;
  } else {
    *log << "calibrate: SSD tier not measured: its probe reads " << ssd_rows
         << " rows, more than --calibrate_rows" << std::endl;
  }

  for (const auto& [table, curve] : cal.curves) {
    if (cal.curve_samples[table] >= kMinCurveSamples) cal.model.hit_rate_curves[table] = curve;
  }

  for (size_t d = 0; d < std::size(kDims); ++d) {
    for (size_t k = 0; k < std::size(kConfigs); ++k) {
      Calibration::Row row;
      row.dim = kDims[d];
      row.batch = kConfigs[k][0];
      row.pooling_factor = kConfigs[k][1];
      row.measured_ms = Median(per_shape[d * std::size(kConfigs) + k]);
      row.predicted_ms = planner::PredictCall(cal.fit, Bytes(row.batch, row.pooling_factor, row.dim));
      cal.lookups.push_back(row);
    }
  }
  return cal;
}

}  // namespace cli
}  // namespace ember
