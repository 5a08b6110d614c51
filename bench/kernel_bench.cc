// kernel_bench: throughput of an EmbeddingBackend's fused lookup and fused
// backward + optimizer on one table. A benchmark, not a test.
//
//   bazel run -c opt //bench:kernel_bench -- [--backend=cpu|cuda] --rows=1000000 --dim=64 --batch=2048
//       --pooling_factor=20 --threads=1 --distribution=uniform|zipf
//       --dtype=fp32|fp16|bf16|int8|int4 --pooling=sum|mean --optimizer=sgd|adagrad|rowwise_adagrad|adam
//       [--iters=20] [--callers=1] [--id_sets=1] [--ceiling] [--format=table|json] [--serve]
//
// --tables=T holds T tables of --rows x --dim, one feature each, every call
// one fused call over all of them (the 8-table collection of service_bench
// is --tables=8 --rows=500000); the figures count the ids of all tables.
//
// --id_sets=N draws N batches of ids and cycles the calls through them. With
// one (the default) every call gathers the same rows, which stay in the
// caches when they fit (2048 x 20 ids of 256 bytes: 10 MB): a hot-batch
// figure. Enough sets that their rows pass the last-level cache time a
// table larger than the caches, as training's fresh batches see it;
// --id_sets=0 gives every call of a timing a batch of its own (none
// repeats within it; with --ceiling each round starts them again). A
// table only a few times the last-level cache still serves part of any
// batch from it: its --rows decide that, not the sets.
//
// --ceiling (CPU backend) also times bench/row_ceiling.h's bare gather on
// the same pattern (a table of the same rows, the same ids and threads, the
// backend's two-stage prefetch for these shards at its distances and at 2x
// and 4x them, the fastest counting), in turn with the forward
// (--ceiling_rounds), and prints the forward as a fraction of it: how close
// the kernel runs to what the memory gives.
//
// lookups_per_s: ids gathered per second; gbps: embedding bytes read per
// second (ids x dim x element size); bwd_lookups_per_s: ids per second through
// backward + optimizer (duplicates merged, one update per row). With
// --callers=N, N threads issue the timed calls at once (each its own output
// buffer): the CUDA backend overlaps one call's staging with the previous
// call's kernels, which one caller never shows.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/row_ceiling.h"
#include "gflags/gflags.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"

DEFINE_string(backend, "cpu", "cpu, or cuda (GPU 0; the call's host<->device copies are timed too).");
DEFINE_int64(rows, 1000000, "Table rows.");
DEFINE_int32(dim, 64, "Embedding dimension (multiple of 4).");
DEFINE_int32(batch, 2048, "Bags per batch.");
DEFINE_int32(pooling_factor, 20, "Ids per bag.");
DEFINE_int32(threads, 1, "Backend threads (cpu backend).");
DEFINE_bool(uvm, false,
            "--backend=cuda: the tables fused_uvm (rows and state in host memory mapped into "
            "the GPU, read over PCIe/C2C), for the bus's rate beside HBM's.");
DEFINE_string(distribution, "uniform", "uniform or zipf (alpha 1.05, hot rows scattered).");
DEFINE_string(dtype, "fp32",
              "fp32, fp16, bf16, or int8 / int4 (row-wise quantized: lookups only, no backward).");
DEFINE_string(pooling, "sum", "sum or mean.");
DEFINE_string(optimizer, "sgd", "sgd, adagrad, rowwise_adagrad or adam.");
DEFINE_bool(stochastic_rounding, true,
            "fp16/bf16 updates rounded stochastically (the default, FBGEMM's); false: to "
            "nearest even.");
DEFINE_string(isa, "auto", "auto, scalar, avx2 or avx512.");
DEFINE_int32(prefetch_distance, -1,
             "Ids ahead the CPU backend's lookups prefetch every line of a row to the outer "
             "caches (0: none; -1: the backend's choice by row and shard size, LookupPrefetchFor).");
DEFINE_string(prefetch_style, "auto",
              "How the CPU backend's lookups prefetch: auto (by CPU vendor), outer (every line "
              "to the outer caches; small shards into L1), two_stage (and the first line into "
              "L1) or l1 (every line into L1).");
DEFINE_int32(update_prefetch_distance, 4, "Rows ahead the CPU backend's updates prefetch (0: none).");
DEFINE_int32(iters, 20, "Timed iterations (after 3 warm-up ones), per caller.");
DEFINE_int32(callers, 1, "Threads issuing the timed calls at once.");
DEFINE_uint64(seed, 1, "Seed for ids.");
DEFINE_int32(tables, 1, "Tables (one feature each) in every fused call.");
DEFINE_int32(id_sets, 1,
             "Batches of ids, each drawn afresh; the calls cycle through them (1: every call "
             "gathers the same rows).");
DEFINE_bool(ceiling, false,
            "CPU backend: also time the bare gather of the same rows, ids, threads and prefetch "
            "(bench/row_ceiling.h) and print the forward as a fraction of it.");
DEFINE_int32(ceiling_rounds, 5,
             "With --ceiling: rounds of the forward and the ceiling timed in turn (medians).");
DEFINE_bool(ceiling_huge_pages, true,
            "The ceiling's table on transparent huge pages, as the CPU backend's shards (false: "
            "4 KiB pages).");
DEFINE_string(format, "table", "table or json (one line).");
DEFINE_bool(serve, false,
            "Measure on request (for bench/torch_compare.py, which alternates these timings with "
            "its peer's on the same ids): after setting up, read lines from stdin; each 'measure' "
            "times the forward and the backward again (--iters calls each, after 3 warm-ups) and "
            "prints one JSON line (backend, lookups_per_s, fwd_ms, bwd_lookups_per_s, bwd_ms); "
            "'quit' or the end of stdin ends.");
DEFINE_string(dump_ids, "",
              "If set, write the batches' ids (int64 little-endian, batch after batch, in each "
              "table after table, bag-major, pooling_factor per bag) to this file, so a peer "
              "(bench/torch_compare.py) runs on identical data.");

namespace eb = ember::backend;

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (FLAGS_callers < 1 || FLAGS_iters < 1 || FLAGS_id_sets < 0 || FLAGS_tables < 1) {
    std::fprintf(stderr,
                 "kernel_bench: --callers, --iters and --tables must be >= 1, --id_sets >= 0\n");
    return 1;
  }
  if (FLAGS_id_sets == 0 && FLAGS_serve) {
    std::fprintf(stderr, "kernel_bench: --serve repeats its calls: give --id_sets >= 1\n");
    return 1;
  }
  if (FLAGS_uvm && FLAGS_backend != "cuda") {
    std::fprintf(stderr, "kernel_bench: --uvm (fused_uvm tables) is for --backend=cuda\n");
    return 1;
  }
  if (FLAGS_ceiling && (FLAGS_backend != "cpu" || FLAGS_serve)) {
    std::fprintf(stderr, "kernel_bench: --ceiling is for the CPU backend, without --serve\n");
    return 1;
  }
  if (FLAGS_ceiling && FLAGS_ceiling_rounds < 1) {
    std::fprintf(stderr, "kernel_bench: --ceiling_rounds must be >= 1\n");
    return 1;
  }
  if (FLAGS_ceiling && FLAGS_tables != 1) {
    std::fprintf(stderr, "kernel_bench: --ceiling times one table: give --tables=1\n");
    return 1;
  }
  // 0: a batch for every call (3 warm-ups and the timed ones, per caller).
  if (FLAGS_id_sets == 0) FLAGS_id_sets = (3 + FLAGS_iters) * FLAGS_callers;
  // A misspelt choice would otherwise time the default silently.
  const struct {
    const char* flag;
    const std::string& value;
    std::vector<std::string> valid;
  } choices[] = {
      {"dtype", FLAGS_dtype, {"fp32", "fp16", "bf16", "int8", "int4"}},
      {"distribution", FLAGS_distribution, {"uniform", "zipf"}},
      {"pooling", FLAGS_pooling, {"sum", "mean"}},
      {"optimizer", FLAGS_optimizer, {"sgd", "adagrad", "rowwise_adagrad", "adam"}},
      {"format", FLAGS_format, {"table", "json"}},
  };
  for (const auto& c : choices) {
    if (std::find(c.valid.begin(), c.valid.end(), c.value) == c.valid.end()) {
      std::string valid;
      for (const std::string& v : c.valid) valid += (valid.empty() ? "" : ", ") + v;
      std::fprintf(stderr, "kernel_bench: --%s=%s is not one of %s\n", c.flag, c.value.c_str(),
                   valid.c_str());
      return 1;
    }
  }
  eb::ShardSpec spec;
  spec.table = "bench";
  spec.rows = FLAGS_rows;
  spec.dim = FLAGS_dim;
  spec.table_rows = FLAGS_rows;
  spec.weight_type = FLAGS_dtype == "fp16"   ? eb::WeightType::kFp16
                     : FLAGS_dtype == "bf16" ? eb::WeightType::kBf16
                     : FLAGS_dtype == "int8" ? eb::WeightType::kInt8
                     : FLAGS_dtype == "int4" ? eb::WeightType::kInt4
                                             : eb::WeightType::kFp32;
  // Quantized rows take no updates (nor optimizer state): no backward.
  const bool quantized = eb::IsQuantized(spec.weight_type);
  if (quantized && FLAGS_optimizer != "sgd") {
    std::fprintf(stderr, "kernel_bench: --dtype=%s tables have no optimizer (use --optimizer=sgd)\n",
                 FLAGS_dtype.c_str());
    return 1;
  }
  spec.optimizer.type = FLAGS_optimizer == "adagrad"           ? eb::OptimizerType::kAdagrad
                        : FLAGS_optimizer == "rowwise_adagrad" ? eb::OptimizerType::kRowwiseAdagrad
                        : FLAGS_optimizer == "adam"            ? eb::OptimizerType::kAdam
                                                               : eb::OptimizerType::kSgd;
  spec.optimizer.stochastic_rounding = FLAGS_stochastic_rounding;
  spec.host_mapped = FLAGS_uvm;
  eb::CpuBackendOptions options;
  options.num_threads = FLAGS_threads;
  options.isa = FLAGS_isa;
  options.prefetch_distance = FLAGS_prefetch_distance;
  options.prefetch_style = FLAGS_prefetch_style;
  options.update_prefetch_distance = FLAGS_update_prefetch_distance;
  absl::StatusOr<std::unique_ptr<eb::EmbeddingBackend>> backend =
      absl::InvalidArgumentError("--backend must be cpu or cuda, got '" + FLAGS_backend + "'");
  if (FLAGS_backend == "cpu") backend = eb::CreateCpuBackend(options);
  if (FLAGS_backend == "cuda") backend = ember::backend::CreateCudaBackend({});
  if (!backend.ok()) {
    std::fprintf(stderr, "kernel_bench: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  const std::string name = (*backend)->Name() + (FLAGS_uvm ? " fused_uvm" : "");
  const int tables = FLAGS_tables;
  std::vector<eb::ShardId> shards;
  for (int t = 0; t < tables; ++t) {
    auto shard = (*backend)->CreateShard(spec);
    if (!shard.ok()) {
      std::fprintf(stderr, "kernel_bench: %s\n", shard.status().ToString().c_str());
      return 1;
    }
    shards.push_back(*shard);
  }
  const int64_t n = static_cast<int64_t>(FLAGS_batch) * FLAGS_pooling_factor;  // per table
  std::vector<int64_t> lengths(FLAGS_batch, FLAGS_pooling_factor),
      ids(n * tables * FLAGS_id_sets);
  std::mt19937_64 rng(FLAGS_seed);
  if (FLAGS_distribution == "zipf") {
    std::vector<double> cdf(FLAGS_rows);
    double acc = 0;
    for (int64_t r = 0; r < FLAGS_rows; ++r) cdf[r] = (acc += 1.0 / std::pow(r + 1.0, 1.05));
    std::uniform_real_distribution<double> u(0, acc);
    for (auto& id : ids) {
      const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
      id = static_cast<int64_t>((static_cast<uint64_t>(rank) * 2654435761ULL) % FLAGS_rows);
    }
  } else {
    std::uniform_int_distribution<int64_t> u(0, FLAGS_rows - 1);
    for (auto& id : ids) id = u(rng);
  }
  if (!FLAGS_dump_ids.empty()) {
    FILE* fp = std::fopen(FLAGS_dump_ids.c_str(), "wb");
    if (fp == nullptr || std::fwrite(ids.data(), sizeof(int64_t), ids.size(), fp) != ids.size() ||
        std::fclose(fp) != 0) {
      std::fprintf(stderr, "kernel_bench: cannot write --dump_ids=%s\n", FLAGS_dump_ids.c_str());
      return 1;
    }
  }
  // Per id set, one feature request per table.
  std::vector<std::vector<eb::FeatureRequest>> sets(FLAGS_id_sets,
                                                    std::vector<eb::FeatureRequest>(tables));
  for (int k = 0; k < FLAGS_id_sets; ++k) {
    for (int t = 0; t < tables; ++t) {
      eb::FeatureRequest& f = sets[k][t];
      f.shard = shards[t];
      f.pooling = FLAGS_pooling == "mean" ? eb::Pooling::kMean : eb::Pooling::kSum;
      f.lengths = lengths;
      f.ids = absl::MakeConstSpan(ids.data() + (static_cast<int64_t>(k) * tables + t) * n, n);
    }
  }
  // One output buffer per caller and table.
  const size_t out_floats = static_cast<size_t>(FLAGS_batch) * FLAGS_dim;
  std::vector<std::vector<float>> outs(FLAGS_callers, std::vector<float>(out_floats * tables));
  // Each call's requests, made once: lookups per caller and id set (each
  // caller its own outputs), updates per id set.
  std::vector<std::vector<std::vector<eb::LookupRequest>>> lookup_calls(
      FLAGS_callers, std::vector<std::vector<eb::LookupRequest>>(FLAGS_id_sets));
  std::vector<float> grad(out_floats, 1e-3f);
  std::vector<std::vector<eb::GradientRequest>> gradient_calls(FLAGS_id_sets);
  for (int k = 0; k < FLAGS_id_sets; ++k) {
    for (int t = 0; t < tables; ++t) {
      for (int c = 0; c < FLAGS_callers; ++c) {
        lookup_calls[c][k].push_back(
            {sets[k][t], absl::MakeSpan(outs[c].data() + t * out_floats, out_floats)});
      }
      gradient_calls[k].push_back({sets[k][t], grad});
    }
  }
  const std::vector<eb::LookupRequest>& lreq = lookup_calls[0][0];
  const std::vector<eb::GradientRequest>& greq = gradient_calls[0];

  // A failing call would time nothing: check one of each first.
  for (const absl::Status& s :
       {(*backend)->Lookup(lreq),
        quantized ? absl::OkStatus() : (*backend)->ApplyGradients(greq)}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kernel_bench: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto time_it = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    const absl::Time start = absl::Now();
    for (int i = 0; i < FLAGS_iters; ++i) fn();
    return absl::ToDoubleSeconds(absl::Now() - start) / FLAGS_iters;
  };
  // As time_it, fn(i) for the i-th call (warm-ups included).
  auto time_indexed = [&](auto&& fn) {
    int i = 0;
    return time_it([&] { fn(i++); });
  };
  // Seconds per call with FLAGS_callers threads calling at once (one: on
  // this thread, as time_it).
  auto time_calls = [&](auto&& call) {
    if (FLAGS_callers == 1) return time_indexed([&](int i) { call(0, i); });
    for (int i = 0; i < 3; ++i) call(0, i);
    const absl::Time start = absl::Now();
    std::vector<std::thread> callers;
    for (int c = 0; c < FLAGS_callers; ++c) {
      callers.emplace_back([&, c] {
        for (int i = 0; i < FLAGS_iters; ++i) call(c, 3 + c + i * FLAGS_callers);
      });
    }
    for (std::thread& t : callers) t.join();
    return absl::ToDoubleSeconds(absl::Now() - start) / (FLAGS_iters * FLAGS_callers);
  };
  auto time_forward = [&] {
    return time_calls(
        [&](int c, int i) { (void)(*backend)->Lookup(lookup_calls[c][i % FLAGS_id_sets]); });
  };
  auto time_backward = [&] {
    return time_calls(
        [&](int, int i) { (void)(*backend)->ApplyGradients(gradient_calls[i % FLAGS_id_sets]); });
  };
  const double all_ids = static_cast<double>(n) * tables;
  if (FLAGS_serve) {
    char line[64];
    while (std::fgets(line, sizeof line, stdin) != nullptr) {
      const std::string request(line, std::strcspn(line, "\r\n"));
      if (request == "quit") break;
      if (request != "measure") {
        std::fprintf(stderr, "kernel_bench: unknown request '%s' (valid: measure, quit)\n",
                     request.c_str());
        return 1;
      }
      const double f = time_forward(), b = quantized ? 0.0 : time_backward();
      std::printf("{\"backend\": \"%s\", \"lookups_per_s\": %.4g, \"fwd_ms\": %.4f, "
                  "\"bwd_lookups_per_s\": %.4g, \"bwd_ms\": %.4f}\n",
                  name.c_str(), all_ids / f, f * 1e3, b > 0 ? all_ids / b : 0.0,
                  b * 1e3);
      std::fflush(stdout);
    }
    return 0;
  }
  // Bytes a row read moves (a quantized row: its values, scale and bias).
  const int64_t row_bytes = eb::WeightRowBytes(spec.weight_type, FLAGS_dim);
  // The lookups' prefetch, as the CPU backend chooses it for these shards,
  // all read in each call (CreateCpuBackend has accepted the style by now).
  eb::PrefetchAhead prefetch;
  if (FLAGS_backend == "cpu") {
    prefetch = eb::ShardLookupPrefetch(FLAGS_prefetch_distance,
                                       *eb::ParsePrefetchStyle(FLAGS_prefetch_style), row_bytes,
                                       FLAGS_rows, tables * row_bytes * FLAGS_rows);
  }
  // The forward, and with --ceiling the bare gather of the same pattern
  // (bench/row_ceiling.h), timed in turn --ceiling_rounds times: the
  // medians, and the median of the rounds' ratios (the machine drifts).
  double fwd_s = 0, ceiling_s = 0, of_ceiling = 0, of_ceiling_min = 0, of_ceiling_max = 0;
  int64_t huge_page_bytes = -1;
  uint64_t ceiling_checksum = 0;
  int ceiling_scale = 0;
  if (FLAGS_ceiling) {
    ember::bench::RowCeiling ceiling(FLAGS_rows, row_bytes,
                                     FLAGS_ceiling_huge_pages);
    std::vector<absl::Span<const int64_t>> id_sets;
    for (int k = 0; k < FLAGS_id_sets; ++k) id_sets.push_back(sets[k][0].ids);
    std::vector<double> fwd, ceil, ratio;
    // The bare gather runs ahead of its prefetches at the kernel's
    // distances (it spends less per id, so the same ids ahead are less time
    // ahead): each round takes its fastest of the kernel's distances times
    // 1, 2 and 4, and the distances that won most often are reported.
    std::vector<int> wins(3, 0);
    for (int round = 0; round < FLAGS_ceiling_rounds; ++round) {
      fwd.push_back(time_forward());
      double best = 0;
      int best_scale = 0;
      for (int scale = 0; scale < 3; ++scale) {
        const int times = 1 << scale;
        const double t = ceiling.SecondsPerCall(
            id_sets, FLAGS_pooling_factor, FLAGS_threads,
            {prefetch.outer * times, prefetch.outer_into_l1, prefetch.l1 * times}, FLAGS_iters);
        if (scale == 0 || t < best) best = t, best_scale = scale;
      }
      ++wins[best_scale];
      ceil.push_back(best);
      ratio.push_back(ceil.back() / fwd.back());
    }
    ceiling_scale = 1 << (std::max_element(wins.begin(), wins.end()) - wins.begin());
    ceiling_checksum = ceiling.checksum();
    huge_page_bytes = ember::bench::ProcessHugePageBytes();
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    fwd_s = median(fwd);
    ceiling_s = median(ceil);
    of_ceiling = median(ratio);
    of_ceiling_min = *std::min_element(ratio.begin(), ratio.end());
    of_ceiling_max = *std::max_element(ratio.begin(), ratio.end());
  } else {
    fwd_s = time_forward();
  }
  const double bwd_s = quantized ? 0.0 : time_backward();
  // Host-side costs inside those calls, timed alone: request validation,
  // and one plain memcpy of the bytes a call moves between the caller's
  // arrays and the device (ids and lengths in, output out; for the backward,
  // ids, lengths and gradients in), which bounds what staging through host
  // memory can cost.
  auto find_spec = [&](eb::ShardId) { return &spec; };
  const double validate_fwd_s =
      time_it([&] { (void)eb::ValidateRequests(absl::MakeConstSpan(lreq), find_spec); });
  const double validate_bwd_s =
      time_it([&] { (void)eb::ValidateRequests(absl::MakeConstSpan(greq), find_spec); });
  const size_t fwd_bytes = ((n + lengths.size()) * 8 + out_floats * 4) * tables;
  const size_t bwd_bytes = ((n + lengths.size()) * 8 + grad.size() * 4) * tables;
  std::vector<char> copy_src(std::max(fwd_bytes, bwd_bytes), 1), copy_dst(copy_src.size());
  const double memcpy_fwd_s =
      time_it([&] { std::memcpy(copy_dst.data(), copy_src.data(), fwd_bytes); });
  const double memcpy_bwd_s =
      time_it([&] { std::memcpy(copy_dst.data(), copy_src.data(), bwd_bytes); });
  const double lookups = all_ids / fwd_s;
  const double gbps = all_ids * row_bytes / fwd_s / 1e9;
  const double bwd = quantized ? 0.0 : all_ids / bwd_s;
  if (FLAGS_format == "json") {
    std::printf(
        "{\"backend\": \"%s\", \"rows\": %lld, \"dim\": %d, \"batch\": %d, \"pooling_factor\": %d, "
        "\"threads\": %d, \"callers\": %d, \"tables\": %d, \"id_sets\": %d, "
        "\"distribution\": \"%s\", \"dtype\": \"%s\", \"pooling\": \"%s\", "
        "\"optimizer\": \"%s\", \"lookups_per_s\": %.4g, \"gbps\": %.4g, \"fwd_ms\": %.4f, "
        "\"bwd_lookups_per_s\": %.4g, \"bwd_ms\": %.4f, \"validate_fwd_ms\": %.4f, "
        "\"validate_bwd_ms\": %.4f, \"memcpy_fwd_ms\": %.4f, \"memcpy_bwd_ms\": %.4f, "
        "\"prefetch_outer\": %d, \"prefetch_l1\": %d, \"prefetch_outer_into_l1\": %s, "
        "\"ceiling_lookups_per_s\": %.4g, \"of_ceiling\": %.4g, \"ceiling_prefetch_scale\": %d, "
        "\"ceiling_checksum\": %llu}\n",
        name.c_str(), static_cast<long long>(FLAGS_rows), FLAGS_dim, FLAGS_batch,
        FLAGS_pooling_factor, FLAGS_threads, FLAGS_callers, tables, FLAGS_id_sets,
        FLAGS_distribution.c_str(), FLAGS_dtype.c_str(), FLAGS_pooling.c_str(), FLAGS_optimizer.c_str(), lookups, gbps, fwd_s * 1e3, bwd,
        bwd_s * 1e3, validate_fwd_s * 1e3, validate_bwd_s * 1e3, memcpy_fwd_s * 1e3,
        memcpy_bwd_s * 1e3, prefetch.outer, prefetch.l1,
        prefetch.outer_into_l1 ? "true" : "false", ceiling_s > 0 ? all_ids / ceiling_s : 0.0,
        of_ceiling, ceiling_scale, static_cast<unsigned long long>(ceiling_checksum));
  } else {
    std::printf("%s rows=%lld dim=%d batch=%d L=%d threads=%d callers=%d tables=%d id_sets=%d %s %s %s %s\n",
                name.c_str(), static_cast<long long>(FLAGS_rows), FLAGS_dim,
                FLAGS_batch, FLAGS_pooling_factor, FLAGS_threads, FLAGS_callers, tables,
                FLAGS_id_sets,
                FLAGS_distribution.c_str(),
                FLAGS_dtype.c_str(), FLAGS_pooling.c_str(), FLAGS_optimizer.c_str());
    std::printf("  forward:  %.3f ms/batch, %.3g lookups/s, %.2f GB/s", fwd_s * 1e3, lookups, gbps);
    if (FLAGS_backend == "cpu") {
      std::printf(" (prefetch: every line %d ids ahead %s, first line %d into L1; 0: none)",
                  prefetch.outer, prefetch.outer_into_l1 ? "into L1" : "to L2", prefetch.l1);
    }
    std::printf("\n");
    if (ceiling_s > 0) {
      std::printf("  ceiling:  %.3f ms/batch, %.3g rows/s, %.2f GB/s (bare gather of the same rows, "
                  "ids and threads, prefetching %dx as far; %s pages): the forward runs at %.2f "
                  "of it [%.2f-%.2f over %d rounds in turn]\n",
                  ceiling_s * 1e3, all_ids / ceiling_s,
                  all_ids * row_bytes / ceiling_s / 1e9, ceiling_scale,
                  FLAGS_ceiling_huge_pages ? "huge" : "4 KiB", of_ceiling, of_ceiling_min,
                  of_ceiling_max, FLAGS_ceiling_rounds);
      std::printf("  huge pages: %.0f MiB of the two tables' %.0f MiB (the backend's and the "
                  "ceiling's)\n",
                  huge_page_bytes / 1048576.0, 2.0 * FLAGS_rows * row_bytes / 1048576.0);
    }
    if (quantized) {
      std::printf("  backward: none (%s rows take no updates)\n", FLAGS_dtype.c_str());
    } else {
      std::printf("  backward: %.3f ms/batch, %.3g lookups/s (with %s%s)\n", bwd_s * 1e3, bwd,
                  FLAGS_optimizer.c_str(),
                  FLAGS_dtype == "fp32"              ? ""
                  : FLAGS_stochastic_rounding ? ", stochastic rounding"
                                              : ", rounding to nearest");
    }
    std::printf("  host parts: validation %.3f / %.3f ms, memcpy of the bytes moved %.3f / %.3f "
                "ms (forward / backward)\n",
                validate_fwd_s * 1e3, validate_bwd_s * 1e3, memcpy_fwd_s * 1e3,
                memcpy_bwd_s * 1e3);
  }
  return 0;
}
