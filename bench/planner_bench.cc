// planner_bench: wall time and plan quality of the sharding planner on random
// collections. A benchmark, not a test: it prints figures and asserts nothing.
//
//   bazel run -c opt //bench:planner_bench -- [--tables=10,100,1000,10000]
//       [--workers=8,64,512] [--compute_device=cuda|cpu] [--seed=N]
//       [--cache_mib=M] [--format=table|json]
//
// For each (tables, workers) it reports the planning wall time, the slowest
// worker's estimated cost against the lower bound max(total cost / W,
// largest indivisible shard), and the balance max/mean.
//
// Random tables: rows log-uniform in [1e3, 1e7], dim in {16, 32, 64, 128,
// 256}, pooling factor uniform in [1, 50], fp32 or fp16, one of the four
// optimizers, 1-3 features; no constraints, so every sharding type and
// kernel is open to the planner. Rows are scaled down together when the
// weights and optimizer state would exceed --hbm_fill of the cluster's HBM
// (default 0.5: every table fits in HBM; raise it to see the planner trade
// HBM for host memory).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gflags/gflags.h"
#include "planner/planner.h"

DEFINE_string(tables, "10,100,1000,10000", "Comma-separated table counts.");
DEFINE_string(workers, "8,64,512", "Comma-separated worker counts.");
DEFINE_string(compute_device, "cuda", "cuda or cpu.");
DEFINE_int32(local_world_size, 8, "Workers per host.");
DEFINE_uint64(seed, 1, "Random seed.");
DEFINE_string(format, "table", "table or json (one JSON line per case).");
DEFINE_int32(cache_mib, 0,
             "Workers' caches in the model, MiB (CostModel::cache_bytes, read at 20x the "
             "memory rate); 0: none, as the defaults.");
DEFINE_double(hbm_fill, 0.5, "Weights + optimizer state as a fraction of cluster HBM, at most.");

namespace {

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v = 0;
    if (absl::SimpleAtoi(part, &v) && v > 0) out.push_back(v);
  }
  return out;
}

ember::v1::CollectionSpec RandomSpec(int n, int workers, double hbm_per_worker,
                                     uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int dims[] = {16, 32, 64, 128, 256};
  ember::v1::CollectionSpec spec;
  spec.set_name(absl::StrCat("random_", n));
  double bytes = 0;
  for (int i = 0; i < n; ++i) {
    auto* t = spec.add_tables();
    t->set_name(absl::StrCat("t", i));
    t->set_num_embeddings(static_cast<int64_t>(std::pow(10.0, 3.0 + 4.0 * unit(rng))));
    t->set_embedding_dim(dims[rng() % 5]);
    t->set_data_type(rng() % 2 ? ember::v1::FP32 : ember::v1::FP16);
    t->mutable_optimizer()->set_type(
        static_cast<ember::v1::OptimizerSpec::Type>(rng() % 4));
    const int features = 1 + rng() % 3;
    auto& c = (*spec.mutable_constraints())[t->name()];
    for (int f = 0; f < features; ++f) {
      t->add_feature_names(absl::StrCat("t", i, "_f", f));
      c.add_pooling_factors(1.0 + 49.0 * unit(rng));
    }
    bytes += static_cast<double>(t->num_embeddings()) *
             (t->embedding_dim() * (t->data_type() == ember::v1::FP32 ? 4 : 2) +
              ember::planner::OptimizerStateBytesPerRow(t->optimizer().type(),
                                                        t->embedding_dim()));
  }
  const double budget = FLAGS_hbm_fill * workers * hbm_per_worker;
  if (bytes > budget) {
    const double scale = budget / bytes;
    for (auto& t : *spec.mutable_tables()) {
      t.set_num_embeddings(std::max<int64_t>(1, t.num_embeddings() * scale));
    }
  }
  return spec;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  const bool json = FLAGS_format == "json";
  const bool cpu = FLAGS_compute_device == "cpu";
  auto model = ember::planner::DefaultCostModel(cpu ? ember::v1::CPU : ember::v1::CUDA);
  if (FLAGS_cache_mib > 0) {
    model.cache_bytes = int64_t{FLAGS_cache_mib} << 20;
    model.cache_bw_gbps =
        20 * (cpu ? model.ddr_bw_gbps : model.hbm_bw_gbps) * model.lookup_efficiency;
  }
  ember::planner::PlannerOptions options;
  options.cost_model = model;
  const double cap = cpu ? model.ddr_cap_bytes : model.hbm_cap_bytes;
  if (!json) {
    std::printf("%7s %7s %10s %12s %12s %8s %12s %8s %9s\n", "tables", "workers",
                "wall_ms", "max_cost_ms", "LB_ms", "max/LB", "LB_opt_ms",
                "max/LBo", "max/mean");
  }
  for (int n : ParseList(FLAGS_tables)) {
    for (int w : ParseList(FLAGS_workers)) {
      const auto spec = RandomSpec(n, w, cap, FLAGS_seed * 1000003 + n);
      ember::v1::Topology topo;
      topo.set_world_size(w);
      topo.set_local_world_size(w % FLAGS_local_world_size == 0 ? FLAGS_local_world_size : w);
      topo.set_compute_device(cpu ? ember::v1::CPU : ember::v1::CUDA);
      const absl::Time start = absl::Now();
      auto plan = ember::planner::Plan(spec, topo, options);
      const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
      if (!plan.ok()) {
        std::printf("%7d %7d  planning failed: %s\n", n, w,
                    plan.status().ToString().c_str());
        continue;
      }
      const auto& st = plan->stats();
      const double ratio = st.lower_bound_ms() > 0 ? st.max_cost_ms() / st.lower_bound_ms() : 1.0;
      const double ratio_opt = st.option_lower_bound_ms() > 0
                                   ? st.max_cost_ms() / st.option_lower_bound_ms()
                                   : 1.0;
      if (json) {
        std::printf(
            "{\"tables\": %d, \"workers\": %d, \"wall_ms\": %.3f, \"max_cost_ms\": %.6g, "
            "\"lower_bound_ms\": %.6g, \"max_over_lower_bound\": %.4f, "
            "\"option_lower_bound_ms\": %.6g, \"max_over_option_lower_bound\": %.4f, "
            "\"balance\": %.4f}\n",
            n, w, ms, st.max_cost_ms(), st.lower_bound_ms(), ratio,
            st.option_lower_bound_ms(), ratio_opt, st.balance());
      } else {
        std::printf("%7d %7d %10.1f %12.4f %12.4f %8.4f %12.4f %8.4f %9.4f\n", n, w,
                    ms, st.max_cost_ms(), st.lower_bound_ms(), ratio,
                    st.option_lower_bound_ms(), ratio_opt, st.balance());
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
