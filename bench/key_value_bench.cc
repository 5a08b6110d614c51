// key_value_bench: a table on the key_value kernel (rows in a file under
// --ssd_dir, a cache of them in memory: server/backend/key_value/) against
// the same table held whole in memory (fused), in one run: the same rows,
// optimizer, ids and threads on the CPU backend. A benchmark, not a test.
//
//   bazel run -c opt //bench:key_value_bench -- --rows=4000000 --dim=64 --alpha=1.05
//       --cache_fractions=0.2,0.05 [--steps=200 --warmup=100 --threads=1]
//       [--memory_limit_mib=N] [--ssd_dir=/var/tmp] [--format=table|json]
//
// A training step is a SUM lookup of 2,048 bags x 20 ids (zipf over the
// rows, hot rows scattered) and the row-wise Adagrad update of the same ids.
// Each cache fraction runs the same id stream: --warmup steps first (rows
// enter the cache and the file), then --steps timed ones.
//
//   steps/s      training steps a second, and key_value / fused
//   hit rate     of the lookups' distinct rows, the cache's (CLOCK) and an
//                offline LRU's of the same capacity over the same stream
//                (the ideal the issue names)
//   reads/s      rows read from the file a second; writes/s: rows written
//                back
//
// --memory_limit_mib moves the process into a memory cgroup (v1, as root)
// of that size before the key_value runs (the fused one runs first,
// outside it): the file's pages then compete for it with the cache, as on
// a worker whose table is larger than its memory, and misses reach the
// disk; without it the kernel's page cache may hold the whole file.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <list>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gflags/gflags.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/key_value/key_value_backend.h"

DEFINE_int64(rows, 4000000, "Rows of the table.");
DEFINE_int32(dim, 64, "Embedding dimension.");
DEFINE_double(alpha, 1.05, "Zipf exponent of the ids.");
DEFINE_string(cache_fractions, "0.2,0.05", "Cache sizes to run, as fractions of the rows.");
DEFINE_int32(batch, 2048, "Bags per step.");
DEFINE_int32(pooling_factor, 20, "Ids per bag.");
DEFINE_int32(steps, 200, "Timed training steps per run.");
DEFINE_int32(warmup, 100, "Steps before the timed ones.");
DEFINE_int32(threads, 1, "Backend threads per call.");
DEFINE_string(ssd_dir, "/var/tmp", "Where the key_value file goes.");
DEFINE_int64(memory_limit_mib, 0, "A memory cgroup of this size for the key_value runs; 0: none.");
DEFINE_string(format, "table", "table or json.");

namespace eb = ember::backend;

namespace {

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "key_value_bench: %s: %s\n", what, std::string(s.message()).c_str());
  std::exit(1);
}

eb::ShardSpec Spec(int64_t cache_rows) {
  eb::ShardSpec s;
  s.table = "t";
  s.rows = FLAGS_rows;
  s.table_rows = FLAGS_rows;
  s.dim = FLAGS_dim;
  s.optimizer.type = eb::OptimizerType::kRowwiseAdagrad;
  s.optimizer.learning_rate = 0.01f;
  s.initializer.seed = 1;
  s.cache_rows = cache_rows;
  return s;
}

// The id stream: steps of batch * pooling_factor zipf ids.
std::vector<std::vector<int64_t>> Stream(int steps) {
  std::mt19937_64 rng(42);
  std::vector<double> cdf(FLAGS_rows);
  double acc = 0;
  for (int64_t r = 0; r < FLAGS_rows; ++r) cdf[r] = (acc += 1.0 / std::pow(r + 1.0, FLAGS_alpha));
  std::uniform_real_distribution<double> u(0, acc);
  const int64_t n = int64_t{FLAGS_batch} * FLAGS_pooling_factor;
  std::vector<std::vector<int64_t>> out(steps, std::vector<int64_t>(n));
  for (auto& ids : out) {
    for (int64_t& id : ids) {
      const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
      id = static_cast<int64_t>((static_cast<uint64_t>(rank) * 2654435761ULL) %
                                static_cast<uint64_t>(FLAGS_rows));
    }
  }
  return out;
}

// An offline LRU of `capacity` rows over the stream's distinct rows of each
// step; its hit rate over the timed steps.
double LruHitRate(const std::vector<std::vector<int64_t>>& stream, int64_t capacity) {
  std::list<int64_t> order;  // most recent first
  std::unordered_map<int64_t, std::list<int64_t>::iterator> at;
  at.reserve(static_cast<size_t>(capacity) * 2);
  int64_t hits = 0, seen = 0;
  for (size_t s = 0; s < stream.size(); ++s) {
    std::vector<int64_t> rows = stream[s];
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    const bool timed = s >= static_cast<size_t>(FLAGS_warmup);
    for (int64_t r : rows) {
      auto it = at.find(r);
      if (it != at.end()) {
        order.splice(order.begin(), order, it->second);
        hits += timed;
      } else {
        order.push_front(r);
        at[r] = order.begin();
        if (static_cast<int64_t>(order.size()) > capacity) {
          at.erase(order.back());
          order.pop_back();
        }
      }
      seen += timed;
    }
  }
  return seen > 0 ? static_cast<double>(hits) / static_cast<double>(seen) : 0;
}

struct Result {
  std::string kernel;
  double fraction = 1;
  double steps_per_s = 0;
  double hit_rate = 1, lru_hit_rate = 1;
  double reads_per_s = 0, writes_per_s = 0;
};

// Warm-up, then the timed steps; the lookups' cache counters over them.
Result Run(eb::EmbeddingBackend* be, eb::ShardId id,
           const std::vector<std::vector<int64_t>>& stream, bool key_value) {
  const std::vector<int64_t> lengths(FLAGS_batch, FLAGS_pooling_factor);
  std::vector<float> out(static_cast<size_t>(FLAGS_batch) * FLAGS_dim);
  std::vector<float> grad(out.size(), 1e-3f);
  Result r;
  int64_t hits = 0, fills = 0;
  eb::TierStats at_start;
  absl::Time start;
  for (int s = 0; s < FLAGS_warmup + FLAGS_steps; ++s) {
    if (s == FLAGS_warmup) {
      start = absl::Now();
      if (key_value) at_start = *be->GetTierStats(id);
    }
    eb::TierStats before;
    if (key_value) before = *be->GetTierStats(id);
    const eb::LookupRequest l{eb::FeatureRequest{id, eb::Pooling::kSum, lengths, stream[s], {}},
                              absl::MakeSpan(out)};
    Die(be->Lookup({l}), "lookup");
    if (key_value && s >= FLAGS_warmup) {
      const eb::TierStats after = *be->GetTierStats(id);
      hits += after.hits - before.hits;
      fills += after.fills - before.fills;
    }
    const eb::GradientRequest g{eb::FeatureRequest{id, eb::Pooling::kSum, lengths, stream[s], {}},
                                grad};
    Die(be->ApplyGradients({g}), "update");
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  r.steps_per_s = FLAGS_steps / secs;
  if (key_value) {
    const eb::TierStats end = *be->GetTierStats(id);
    r.hit_rate =
        hits + fills > 0 ? static_cast<double>(hits) / static_cast<double>(hits + fills) : 0;
    r.reads_per_s = static_cast<double>(end.disk_reads - at_start.disk_reads) / secs;
    r.writes_per_s = static_cast<double>(end.write_backs - at_start.write_backs) / secs;
  }
  return r;
}

std::unique_ptr<eb::EmbeddingBackend> Cpu() {
  eb::CpuBackendOptions o;
  o.num_threads = FLAGS_threads;
  auto b = eb::CreateCpuBackend(o);
  Die(b.status(), "cpu backend");
  return std::move(*b);
}

// This process into a new memory cgroup (v1) of `mib`; its path.
std::string JoinMemoryCgroup(int64_t mib) {
  const std::string dir = absl::StrCat("/sys/fs/cgroup/memory/ember-kv-bench-", getpid());
  if (mkdir(dir.c_str(), 0755) != 0)
    Die(absl::FailedPreconditionError(dir), "memory cgroup (root, cgroup v1)");
  std::ofstream(dir + "/memory.limit_in_bytes") << (mib << 20);
  std::ofstream(dir + "/cgroup.procs") << getpid();
  return dir;
}
void LeaveMemoryCgroup(const std::string& dir) {
  std::ofstream("/sys/fs/cgroup/memory/cgroup.procs") << getpid();
  rmdir(dir.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  std::vector<double> fractions;
  for (absl::string_view f : absl::StrSplit(FLAGS_cache_fractions, ',')) {
    double v = 0;
    if (!absl::SimpleAtod(f, &v) || !(v > 0 && v <= 1)) {
      std::fprintf(stderr, "key_value_bench: --cache_fractions: '%s' is not in (0, 1]\n",
                   std::string(f).c_str());
      return 2;
    }
    fractions.push_back(v);
  }
  if (FLAGS_rows < 1 || FLAGS_steps < 1 || FLAGS_warmup < 0 || FLAGS_dim < 1) {
    std::fprintf(stderr, "key_value_bench: --rows, --steps, --dim must be >= 1\n");
    return 2;
  }
  std::fprintf(stderr, "key_value_bench: drawing %d steps of zipf(%.2f) ids over %lld rows\n",
               FLAGS_warmup + FLAGS_steps, FLAGS_alpha, static_cast<long long>(FLAGS_rows));
  const auto stream = Stream(FLAGS_warmup + FLAGS_steps);
  std::vector<Result> results;
  {
    auto be = Cpu();
    auto id = be->CreateShard(Spec(0));
    Die(id.status(), "fused shard");
    std::fprintf(stderr, "key_value_bench: fused\n");
    results.push_back(Run(be.get(), *id, stream, false));
    results.back().kernel = "fused";
  }
  const std::string cgroup =
      FLAGS_memory_limit_mib > 0 ? JoinMemoryCgroup(FLAGS_memory_limit_mib) : "";
  for (double f : fractions) {
    eb::KeyValueOptions o;
    o.dir = FLAGS_ssd_dir;
    auto be = eb::WithKeyValueShards(Cpu(), o);
    const int64_t cache = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(f * FLAGS_rows)));
    auto id = be->CreateShard(Spec(cache));
    Die(id.status(), "key_value shard");
    std::fprintf(stderr, "key_value_bench: key_value, cache %.3f\n", f);
    Result r = Run(be.get(), *id, stream, true);
    r.kernel = "key_value";
    r.fraction = f;
    r.lru_hit_rate = LruHitRate(stream, cache);
    results.push_back(r);
  }
  if (!cgroup.empty()) LeaveMemoryCgroup(cgroup);
  const double fused = results[0].steps_per_s;
  if (FLAGS_format == "json") {
    std::printf("[");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf(
          "%s{\"kernel\": \"%s\", \"rows\": %lld, \"dim\": %d, \"alpha\": %.2f, \"threads\": %d, "
          "\"memory_limit_mib\": %lld, \"cache_fraction\": %.3f, \"steps_per_s\": %.2f, "
          "\"ratio\": %.3f, \"hit_rate\": %.4f, \"lru_hit_rate\": %.4f, \"reads_per_s\": %.0f, "
          "\"writes_per_s\": %.0f}",
          i ? ", " : "", r.kernel.c_str(), static_cast<long long>(FLAGS_rows), FLAGS_dim,
          FLAGS_alpha, FLAGS_threads, static_cast<long long>(FLAGS_memory_limit_mib), r.fraction,
          r.steps_per_s, r.steps_per_s / fused, r.hit_rate, r.lru_hit_rate, r.reads_per_s,
          r.writes_per_s);
    }
    std::printf("]\n");
    return 0;
  }
  std::printf("%-10s %6s %9s %6s %8s %8s %10s %10s\n", "kernel", "cache", "steps/s", "ratio",
              "hits", "LRU", "reads/s", "writes/s");
  for (const Result& r : results) {
    std::printf("%-10s %6.3f %9.2f %6.2f %8.4f %8.4f %10.0f %10.0f\n", r.kernel.c_str(), r.fraction,
                r.steps_per_s, r.steps_per_s / fused, r.hit_rate, r.lru_hit_rate, r.reads_per_s,
                r.writes_per_s);
  }
  return 0;
}
