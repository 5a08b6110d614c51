// seed_tutorial: TorchRec's sharding tutorial, run against a live Ember
// cluster. Creates the spec's tables with one sharding type, prints the plan,
// runs KeyedJaggedTensor lookups and optimizer steps through the client SDK,
// runs the same on an in-process copy of the collection (client/inprocess.h),
// compares lookups and the exported tables, drops the collection, and ends
// with one line: "<type> PASS|FAIL ...". Exit status 0 on PASS.
//
//   seed_tutorial --coordinator=127.0.0.1:PORT --sharding_type=row_wise
//                 [--spec=examples/seed_tables.json --steps=3 --batch=16]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "cli/spec_io.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gflags/gflags.h"
#include "planner/plan_format.h"

DEFINE_string(coordinator, "", "Coordinator address host:port (emberctl up prints it).");
DEFINE_string(spec, "examples/seed_tables.json", "Collection spec (JSON).");
DEFINE_string(sharding_type, "", "table_wise, row_wise, column_wise, table_row_wise, "
                                 "data_parallel; empty: the planner's choice.");
DEFINE_int32(steps, 3, "Lookup + gradient steps.");
DEFINE_int32(batch, 16, "Samples per KeyedJaggedTensor.");
DEFINE_int32(pooling_factor, 4, "Most ids per bag (bags have 0..this many).");
DEFINE_int32(seed, 1, "Random seed for ids and gradients.");
DEFINE_double(tolerance, 1e-5, "Largest |service - in-process| / (1 + |in-process|) accepted.");

namespace ember {
namespace {

using client::KeyedJaggedTensor;
using client::KeyedTensor;

// Largest |a - b| / (1 + |b|); infinity when the sizes differ.
double MaxRelDiff(absl::Span<const float> a, absl::Span<const float> b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double{a[i]} - b[i]) / (1 + std::abs(double{b[i]})));
  }
  return worst;
}

// A batch over every pooled feature of the spec, TorchRec's KJT layout.
KeyedJaggedTensor RandomBatch(const ember::v1::CollectionSpec& spec, std::mt19937_64& rng) {
  KeyedJaggedTensor kjt;
  for (const auto& t : spec.tables()) {
    if (t.pooling() == ember::v1::TableConfig::NONE) continue;
    for (const auto& f : t.feature_names()) {
      kjt.keys.push_back(f);
      for (int b = 0; b < FLAGS_batch; ++b) {
        const int64_t n = static_cast<int64_t>(rng() % (FLAGS_pooling_factor + 1));
        kjt.lengths.push_back(n);
        for (int64_t i = 0; i < n; ++i) {
          kjt.values.push_back(static_cast<int64_t>(rng() % t.num_embeddings()));
        }
      }
    }
  }
  return kjt;
}

int Run() {
  const std::string type = FLAGS_sharding_type.empty() ? "planner" : FLAGS_sharding_type;
  auto fail = [&](const std::string& why) {
    std::cout << absl::StrFormat("%-15s FAIL  %s", type, why) << std::endl;
    return 1;
  };
  if (FLAGS_coordinator.empty()) return fail("needs --coordinator=HOST:PORT");
  if (FLAGS_steps < 1 || FLAGS_batch < 1 || FLAGS_pooling_factor < 0) {
    return fail("--steps and --batch must be >= 1, --pooling_factor >= 0");
  }
  auto spec = cli::ReadCollectionSpec(FLAGS_spec);
  if (!spec.ok()) return fail(spec.status().ToString());
  spec->set_name(absl::StrCat(spec->name(), "_", type));
  auto c = client::Client::Connect(FLAGS_coordinator);
  if (!c.ok()) return fail(c.status().ToString());
  client::Client& cl = **c;

  auto info = cl.CreateCollection(*spec, FLAGS_sharding_type);
  if (!info.ok()) return fail(info.status().ToString());
  std::cout << planner::FormatPlanTable(info->plan());
  std::cout << "collection '" << spec->name() << "' at epoch " << info->plan().epoch() << " on "
            << info->worker_addresses_size() << " worker(s)" << std::endl;
  std::string summary;
  auto result = [&]() -> std::string {  // "" on success
    auto ref = client::InProcessCollection::Create(*spec, &info->plan());
    if (!ref.ok()) return ref.status().ToString();
    std::mt19937_64 rng(FLAGS_seed);
    std::uniform_real_distribution<float> grad(-1, 1);
    double lookup_diff = 0, table_diff = 0;
    int64_t ids = 0;
    for (int step = 0; step <= FLAGS_steps; ++step) {  // the last lookup sees every update
      const KeyedJaggedTensor kjt = RandomBatch(*spec, rng);
      ids += static_cast<int64_t>(kjt.values.size());
      auto got = cl.Lookup(spec->name(), kjt);
      if (!got.ok()) return absl::StrCat("lookup: ", got.status().ToString());
      auto want = (*ref)->Lookup(kjt);
      if (!want.ok()) return absl::StrCat("in-process lookup: ", want.status().ToString());
      if (got->keys != want->keys || got->length_per_key != want->length_per_key) {
        return "lookup output keys/widths differ from the in-process lookup";
      }
      lookup_diff = std::max(lookup_diff, MaxRelDiff(got->values, want->values));
      if (step == FLAGS_steps) break;
      KeyedTensor grads = *got;
      for (float& g : grads.values) g = grad(rng);
      if (absl::Status s = cl.ApplyGradients(spec->name(), kjt, grads); !s.ok()) {
        return absl::StrCat("apply gradients: ", s.ToString());
      }
      if (absl::Status s = (*ref)->ApplyGradients(kjt, grads); !s.ok()) {
        return absl::StrCat("in-process apply gradients: ", s.ToString());
      }
    }
    for (const auto& t : spec->tables()) {
      int64_t rows = 0, dim = 0;
      auto got = cl.ExportTable(spec->name(), t.name(), &rows, &dim);
      if (!got.ok()) return absl::StrCat("export ", t.name(), ": ", got.status().ToString());
      auto want = (*ref)->ExportTable(t.name(), &rows, &dim);
      if (!want.ok()) return want.status().ToString();
      table_diff = std::max(table_diff, MaxRelDiff(*got, *want));
    }
    std::set<std::string> optimizers;
    for (const auto& t : spec->tables()) {
      const auto& o = t.optimizer();
      optimizers.insert(absl::StrFormat("%s lr %g", ember::v1::OptimizerSpec::Type_Name(o.type()),
                                        o.has_learning_rate() ? o.learning_rate() : 0.01));
    }
    summary = absl::StrFormat(
        "%d tables on %d workers; %d steps of batch %d (%d ids), %s; max rel diff vs "
        "in-process: lookups %.2g, exported tables %.2g",
        spec->tables_size(), info->worker_addresses_size(), FLAGS_steps, FLAGS_batch, ids,
        absl::StrJoin(optimizers, ", "), lookup_diff, table_diff);
    if (lookup_diff > FLAGS_tolerance || table_diff > FLAGS_tolerance) {
      return absl::StrCat("over tolerance ", FLAGS_tolerance, ": ", summary);
    }
    return "";
  }();
  const absl::Status dropped = cl.DropCollection(spec->name());
  if (!result.empty()) return fail(result);
  if (!dropped.ok()) return fail(absl::StrCat("drop: ", dropped.ToString()));
  std::cout << absl::StrFormat("%-15s PASS  %s", type, summary) << std::endl;
  return 0;
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  gflags::SetUsageMessage("seed_tutorial --coordinator=HOST:PORT [--spec=FILE] [--sharding_type=T]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return ember::Run();
}
