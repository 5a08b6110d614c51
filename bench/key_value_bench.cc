// key_value_bench: a table on the key_value kernel (rows in a file under
// --ssd_dir, a cache of them in memory: server/backend/key_value/) against
// the same table held whole in memory (fused), in one run: the same rows,
// optimizer, ids and threads on the CPU backend. A benchmark, not a test.
//
//   bazel run -c opt //bench:key_value_bench -- --rows=4000000 --dim=64 --alpha=1.05
//       --cache_fractions=0.2,0.05 [--steps=200 --warmup=100 --threads=1]
//       [--memory_limit_mib=N] [--ssd_dir=/var/tmp] [--dynamic] [--format=table|json]
//
// A training step is a SUM lookup of 2,048 bags x 20 ids (zipf over the
// rows, hot rows scattered) and the row-wise Adagrad update of the same ids.
// Each run draws the same id stream: --warmup steps first, and for a
// key_value run as many more as its cache takes to fill (rows enter the
// cache and the file; at most 3,000), then --steps timed ones.
//
//   steps/s      training steps a second, and key_value / fused
//   hit rate     of the lookups' distinct rows, the cache's (CLOCK) and an
//                offline LRU's of the same capacity over the same stream
//                (the ideal the issue names)
//   learned      the hit rate at the cache's size on the curve the shard
//                learned from its own traffic (key_value/lru_curve.h: every
//                call's rows, lookups and updates, sampled), beside an
//                offline LRU over those same accesses ("LRU l+u")
//   reads/s      rows read from the file a second; writes/s: rows written
//                back
//
// --dynamic: both tables are dynamic (hash-keyed, dynamic/dynamic_backend.h)
// of capacity --rows, admission on the first update, LRU; the stream's ids
// are 64-bit hashes of its rows (the rows the table holds then are the ids
// admitted so far, at most --rows). The index stays in memory on both.
//
// --memory_limit_mib moves the process into a memory cgroup (v1, as root)
// of that size before the key_value runs (the fused one runs first,
// outside it): the file's pages then compete for it with the cache, as on
// a worker whose table is larger than its memory, and misses reach the
// disk; without it the kernel's page cache may hold the whole file.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <list>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gflags/gflags.h"
#include "math/embedding_math.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/key_value/key_value_backend.h"
#include "server/backend/key_value/row_file.h"

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
DEFINE_bool(dynamic, false,
            "Dynamic (hash-keyed) tables of capacity --rows, ids 64-bit hashes of the rows.");

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
  if (FLAGS_dynamic) {
    s.is_dynamic = true;
    s.dynamic.admit_after = 1;
    s.dynamic.eviction = eb::Eviction::kLru;
  }
  return s;
}

// The id stream: steps of batch * pooling_factor zipf ids, the same
// sequence from every new Stream.
class Stream {
 public:
  Stream() : rng_(42), ids_(int64_t{FLAGS_batch} * FLAGS_pooling_factor) {
    static const std::vector<double>* const cdf = [] {
      auto* c = new std::vector<double>(FLAGS_rows);
      double acc = 0;
      for (int64_t r = 0; r < FLAGS_rows; ++r)
        (*c)[r] = (acc += 1.0 / std::pow(r + 1.0, FLAGS_alpha));
      return c;
    }();
    cdf_ = cdf;
  }
  const std::vector<int64_t>& Next() {
    std::uniform_real_distribution<double> u(0, cdf_->back());
    for (int64_t& id : ids_) {
      const int64_t rank = std::lower_bound(cdf_->begin(), cdf_->end(), u(rng_)) - cdf_->begin();
      id = static_cast<int64_t>((static_cast<uint64_t>(rank) * 2654435761ULL) %
                                static_cast<uint64_t>(FLAGS_rows));
      if (FLAGS_dynamic) id = static_cast<int64_t>(eb::math::Mix64(static_cast<uint64_t>(id)));
    }
    return ids_;
  }

 private:
  const std::vector<double>* cdf_;
  std::mt19937_64 rng_;
  std::vector<int64_t> ids_;
};

// An offline LRU of `capacity` rows over the stream's distinct rows of each
// step; its hit rate over the `steps` after the first `warm`. With
// `with_updates`, each step's rows twice in the order they first occur
// (its lookup, then its update: the accesses the learned curve sees).
double LruHitRate(int64_t capacity, int warm, int steps, bool with_updates = false) {
  Stream stream;
  std::list<int64_t> order;  // most recent first
  std::unordered_map<int64_t, std::list<int64_t>::iterator> at;
  at.reserve(static_cast<size_t>(capacity) * 2);
  int64_t hits = 0, seen = 0;
  std::unordered_set<int64_t> in_step;
  for (int s = 0; s < warm + steps; ++s) {
    std::vector<int64_t> rows = stream.Next();
    if (with_updates) {
      in_step.clear();
      rows.erase(std::remove_if(rows.begin(), rows.end(),
                                [&](int64_t r) { return !in_step.insert(r).second; }),
                 rows.end());
      const size_t n = rows.size();
      rows.insert(rows.end(), rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(n));
    } else {
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    }
    const bool timed = s >= warm;
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

// The learned curve's hit rate at `fraction` over the accesses between
// `a` and `b` (0 with none sampled).
double LearnedHitRate(const eb::TierStats& a, const eb::TierStats& b, double fraction) {
  const double n = static_cast<double>(b.sampled - a.sampled);
  if (n <= 0) return 0;
  std::array<double, eb::math::kLruCurveFractions.size()> curve;
  for (size_t i = 0; i < curve.size(); ++i) {
    curve[i] = static_cast<double>(b.curve_hits[i] - a.curve_hits[i]) / n;
  }
  return eb::math::HitRateAt(curve.data(), fraction);
}

struct Result {
  std::string kernel;
  double export_s = 0;  // the whole table read out in 65,536-row ranges
  double fraction = 1;
  double steps_per_s = 0;
  double hit_rate = 1, lru_hit_rate = 1;
  // The learned curve's estimate at the cache's fraction, and the offline
  // LRU over the same accesses (lookups and updates).
  double learned_hit_rate = 1, lru_both_hit_rate = 1;
  double reads_per_s = 0, writes_per_s = 0;
  int warm = 0;  // steps before the timed ones
};

// Most warm-up steps a run takes waiting for its cache to fill.
constexpr int kMaxWarmup = 3000;

// Warm-up (at least --warmup steps, and a key_value run until its cache
// is full), then the timed steps; the lookups' cache counters over them.
// `timed` holds --steps id vectors of a step's size, drawn into in place
// (allocated before the memory cgroup, so the bench's ids are not counted
// as the table's memory).
Result Run(eb::EmbeddingBackend* be, eb::ShardId id, bool key_value,
           std::vector<std::vector<int64_t>>* timed) {
  const std::vector<int64_t> lengths(FLAGS_batch, FLAGS_pooling_factor);
  std::vector<float> out(static_cast<size_t>(FLAGS_batch) * FLAGS_dim);
  std::vector<float> grad(out.size(), 1e-3f);
  Result r;
  Stream stream;
  int64_t hits = 0, fills = 0;
  eb::TierStats at_start;
  absl::Time start;
  auto step = [&](const std::vector<int64_t>& ids, bool timed) {
    eb::TierStats before;
    if (key_value && timed) before = *be->GetTierStats(id);
    const eb::LookupRequest l{eb::FeatureRequest{id, eb::Pooling::kSum, lengths, ids, {}},
                              absl::MakeSpan(out)};
    Die(be->Lookup({l}), "lookup");
    if (key_value && timed) {
      const eb::TierStats after = *be->GetTierStats(id);
      hits += after.hits - before.hits;
      fills += after.fills - before.fills;
    }
    const eb::GradientRequest g{eb::FeatureRequest{id, eb::Pooling::kSum, lengths, ids, {}}, grad};
    Die(be->ApplyGradients({g}), "update");
  };
  auto full = [&] {
    if (!key_value) return true;
    const eb::TierStats t = *be->GetTierStats(id);
    return t.cached_rows == t.cache_rows;
  };
  while (r.warm < FLAGS_warmup || (!full() && r.warm < kMaxWarmup)) {
    step(stream.Next(), false);
    ++r.warm;
  }
  for (auto& ids : *timed) ids = stream.Next();  // drawn before the clock starts
  if (key_value) std::fprintf(stderr, "key_value_bench: %d warm-up steps, %d timed\n", r.warm, FLAGS_steps);
  start = absl::Now();
  if (key_value) at_start = *be->GetTierStats(id);
  for (const auto& ids : *timed) step(ids, true);
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  r.steps_per_s = FLAGS_steps / secs;
  // Read the table out as a checkpoint does, a range at a time.
  if (key_value) std::fprintf(stderr, "key_value_bench: reading the table out\n");
  const absl::Time export_start = absl::Now();
  constexpr int64_t kRange = 65536;
  const int64_t width = eb::OptimizerStateWidth(eb::OptimizerType::kRowwiseAdagrad, FLAGS_dim);
  std::vector<float> w(kRange * FLAGS_dim), st(kRange * width);
  for (int64_t b = 0; b < FLAGS_rows; b += kRange) {
    const int64_t e = std::min(FLAGS_rows, b + kRange);
    Die(be->ExportRows(id, b, e, absl::MakeSpan(w.data(), (e - b) * FLAGS_dim),
                       absl::MakeSpan(st.data(), (e - b) * width)),
        "export");
  }
  r.export_s = absl::ToDoubleSeconds(absl::Now() - export_start);
  if (key_value) {
    const eb::TierStats end = *be->GetTierStats(id);
    r.hit_rate =
        hits + fills > 0 ? static_cast<double>(hits) / static_cast<double>(hits + fills) : 0;
    r.reads_per_s = static_cast<double>(end.disk_reads - at_start.disk_reads) / secs;
    r.writes_per_s = static_cast<double>(end.write_backs - at_start.write_backs) / secs;
    r.learned_hit_rate = LearnedHitRate(at_start, end, static_cast<double>(end.cache_rows) /
                                                           static_cast<double>(FLAGS_rows));
  }
  return r;
}

// The drive's ceiling in the same run: rows of the table's record size
// written, then read, at random in batches of 4,096 through a RowFile of
// --rows rows, for a second each; rows a second.
std::pair<double, double> IoCeiling() {
  const int64_t record =
      4 * (FLAGS_dim + eb::OptimizerStateWidth(eb::OptimizerType::kRowwiseAdagrad, FLAGS_dim));
  auto file = eb::RowFile::Create(FLAGS_ssd_dir, FLAGS_rows, record, "ceiling file");
  Die(file.status(), "ceiling file");
  eb::RowBuffer buf;
  Die(buf.Resize(4096, (*file)->stride()), "buffer");
  std::memset(buf.bytes(), 0, static_cast<size_t>(4096 * (*file)->stride()));
  std::mt19937_64 rng(7);
  double rate[2];
  for (int write = 1; write >= 0; --write) {
    int64_t done = 0;
    const absl::Time start = absl::Now();
    while (absl::Now() - start < absl::Seconds(1)) {
      std::vector<int64_t> rows(4096);
      for (int64_t& r : rows) r = static_cast<int64_t>(rng() % static_cast<uint64_t>(FLAGS_rows));
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
      Die(write ? (*file)->WriteRows(rows, buf) : (*file)->ReadRows(rows, &buf), "ceiling I/O");
      done += static_cast<int64_t>(rows.size());
    }
    rate[write] = static_cast<double>(done) / absl::ToDoubleSeconds(absl::Now() - start);
  }
  return {rate[0], rate[1]};
}

std::unique_ptr<eb::EmbeddingBackend> Cpu() {
  eb::CpuBackendOptions o;
  o.num_threads = FLAGS_threads;
  auto b = eb::CreateCpuBackend(o);
  Die(b.status(), "cpu backend");
  return std::move(*b);
}

// Dynamic shards over `b` with --dynamic.
std::unique_ptr<eb::EmbeddingBackend> MaybeDynamic(std::unique_ptr<eb::EmbeddingBackend> b) {
  return FLAGS_dynamic ? eb::WithDynamicShards(std::move(b)) : std::move(b);
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
// The most memory the cgroup held (rows, bookkeeping, page cache), MiB.
double PeakMib(const std::string& dir) {
  int64_t bytes = 0;
  std::ifstream(dir + "/memory.max_usage_in_bytes") >> bytes;
  return static_cast<double>(bytes) / (1 << 20);
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
  std::vector<Result> results;
  std::vector<std::vector<int64_t>> timed(
      FLAGS_steps, std::vector<int64_t>(int64_t{FLAGS_batch} * FLAGS_pooling_factor));
  {
    auto be = MaybeDynamic(Cpu());
    auto id = be->CreateShard(Spec(0));
    Die(id.status(), "fused shard");
    std::fprintf(stderr, "key_value_bench: fused\n");
    results.push_back(Run(be.get(), *id, false, &timed));
    results.back().kernel = "fused";
  }
  std::fprintf(stderr, "key_value_bench: the drive's ceiling\n");
  const auto [read_ceiling, write_ceiling] = IoCeiling();
  const std::string cgroup =
      FLAGS_memory_limit_mib > 0 ? JoinMemoryCgroup(FLAGS_memory_limit_mib) : "";
  for (double f : fractions) {
    eb::KeyValueOptions o;
    o.dir = FLAGS_ssd_dir;
    auto be = MaybeDynamic(eb::WithKeyValueShards(Cpu(), o));
    const int64_t cache = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(f * FLAGS_rows)));
    auto id = be->CreateShard(Spec(cache));
    Die(id.status(), "key_value shard");
    std::fprintf(stderr, "key_value_bench: key_value, cache %.3f\n", f);
    Result r = Run(be.get(), *id, true, &timed);
    r.kernel = "key_value";
    r.fraction = f;
    r.lru_hit_rate = LruHitRate(cache, r.warm, FLAGS_steps);
    r.lru_both_hit_rate = LruHitRate(cache, r.warm, FLAGS_steps, /*with_updates=*/true);
    results.push_back(r);
  }
  double peak_mib = 0;
  if (!cgroup.empty()) {
    peak_mib = PeakMib(cgroup);
    LeaveMemoryCgroup(cgroup);
  }
  const double fused = results[0].steps_per_s;
  if (FLAGS_format == "json") {
    std::printf("[");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf(
          "%s{\"kernel\": \"%s\", \"dynamic\": %s, \"rows\": %lld, \"dim\": %d, \"alpha\": %.2f, \"threads\": %d, "
          "\"memory_limit_mib\": %lld, \"cache_fraction\": %.3f, \"warm_steps\": %d, "
          "\"steps_per_s\": %.2f, "
          "\"ratio\": %.3f, \"hit_rate\": %.4f, \"lru_hit_rate\": %.4f, "
          "\"learned_hit_rate\": %.4f, \"lru_both_hit_rate\": %.4f, \"reads_per_s\": %.0f, "
          "\"writes_per_s\": %.0f, \"export_s\": %.2f, \"cgroup_peak_mib\": %.0f, "
          "\"drive_reads_per_s\": %.0f, \"drive_writes_per_s\": %.0f}",
          i ? ", " : "", r.kernel.c_str(), FLAGS_dynamic ? "true" : "false",
          static_cast<long long>(FLAGS_rows), FLAGS_dim,
          FLAGS_alpha, FLAGS_threads, static_cast<long long>(FLAGS_memory_limit_mib), r.fraction,
          r.warm, r.steps_per_s, r.steps_per_s / fused, r.hit_rate, r.lru_hit_rate,
          r.learned_hit_rate, r.lru_both_hit_rate, r.reads_per_s, r.writes_per_s, r.export_s, r.kernel == "fused" ? 0.0 : peak_mib, read_ceiling,
          write_ceiling);
    }
    std::printf("]\n");
    return 0;
  }
  if (FLAGS_dynamic) {
    std::printf("dynamic tables of capacity %lld (ids: 64-bit hashes of the rows)\n",
                static_cast<long long>(FLAGS_rows));
  }
  std::printf("%-10s %6s %6s %9s %6s %8s %8s %8s %8s %10s %10s %9s\n", "kernel", "cache", "warm",
              "steps/s", "ratio", "hits", "LRU", "learned", "LRU l+u", "reads/s", "writes/s",
              "export s");
  for (const Result& r : results) {
    std::printf("%-10s %6.3f %6d %9.2f %6.2f %8.4f %8.4f %8.4f %8.4f %10.0f %10.0f %9.2f\n",
                r.kernel.c_str(), r.fraction, r.warm, r.steps_per_s, r.steps_per_s / fused,
                r.hit_rate, r.lru_hit_rate, r.learned_hit_rate, r.lru_both_hit_rate,
                r.reads_per_s, r.writes_per_s, r.export_s);
  }
  std::printf("learned: the hit rate the worker's learned curve gives at the cache's size; "
              "LRU l+u: an offline LRU over the same accesses (each step's rows, lookup and "
              "update)\n");
  std::printf("drive: %.0f random row reads/s, %.0f writes/s (batches of 4,096, %s)\n",
              read_ceiling, write_ceiling, FLAGS_ssd_dir.c_str());
  if (!cgroup.empty()) {
    std::printf("memory cgroup of %lld MiB: at most %.0f MiB held by the key_value runs\n",
                static_cast<long long>(FLAGS_memory_limit_mib), peak_mib);
  }
  return 0;
}
