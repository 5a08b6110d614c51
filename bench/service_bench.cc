// service_bench: fused lookups through the whole service (client SDK ->
// gRPC over loopback -> workers -> back, merged into a KeyedTensor) against
// the same lookups on the same data in this process (client/inprocess.h: the
// collection in one CPU backend, no RPC). A benchmark, not a test.
//
//   bazel run -c opt //bench:service_bench -- [--workers=2 --batch=4096
//       --features=8 --pooling_factor=20 --dim=64 --rows=500000
//       --sharding_type=TYPE --iters=50 --clients=1 --device=cpu|cuda
//       --data_type=FP32|FP16|BF16|INT8|INT4 --format=text|json]
//
// Starts its own cluster (`emberctl up`, the binary next to it in the
// runfiles, or --emberctl) unless --coordinator names a running one.
//
// lookups_per_s: KeyedJaggedTensor lookups (batches) per second, each of
// batch x features bags of pooling_factor ids; ids_per_s = lookups_per_s x
// batch x features x pooling_factor. MB/s: request ids + returned embeddings
// (the bytes each lookup moves) per second. Latency percentiles are of one
// lookup call as the client sees it. ratio = lookups_per_s /
// inprocess_lookups_per_s, the in-process collection running with
// workers x worker_threads backend threads (the same compute threads).
// kernel_lookups_per_s: the same lookups as one fused call of a CPU backend
// holding the same tables, into buffers allocated once: what the kernels
// alone do; collection / kernel is what the in-process collection's own
// work (checking the KJT, allocating and assembling the KeyedTensor)
// costs. kernel_kt_layout_lookups_per_s: the same fused calls writing every
// table's columns of one KeyedTensor-shaped matrix (strided outputs), the
// layout the collection produces; collection / that is its overhead apart
// from the layout's own cost. The kernels and the in-process collection are
// timed in alternating halves. The kernel's tables are whole: under a
// column-wise plan (the in-process collection keeps the plan's column
// blocks) the two do different work and the ratio is not the collection's
// overhead alone.
// --kept_output: the service's clients and the in-process collection look
// up into one KeyedTensor each, kept across calls (the reusing Lookup
// forms), as a trainer that keeps its output buffer does; off, every call
// returns a fresh one.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gflags/gflags.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/table_spec.h"
#include "tests/local_cluster.h"

DEFINE_string(coordinator, "", "A running cluster's coordinator; empty: start one.");
DEFINE_string(emberctl, "", "emberctl binary for the local cluster (default: from runfiles).");
DEFINE_int32(workers, 2, "Workers of the local cluster.");
DEFINE_int32(worker_threads, 1, "Backend threads per worker (emberctl up --threads).");
DEFINE_string(device, "cpu", "Worker device of the local cluster (emberctl up --device): cpu or cuda.");
DEFINE_int32(inprocess_threads, 0, "In-process backend threads (0: workers x worker_threads).");
DEFINE_int32(batch, 4096, "Samples per lookup.");
DEFINE_int32(features, 8, "Features per lookup, one table each.");
DEFINE_int32(pooling_factor, 20, "Ids per bag.");
DEFINE_int32(dim, 64, "Embedding dimension.");
DEFINE_int64(rows, 500000, "Rows per table.");
DEFINE_string(data_type, "FP32",
              "Every table's data type: FP32, FP16, BF16, or INT8 / INT4 (serving tables: "
              "row-wise quantized, lookups only; docs/serving.md).");
DEFINE_string(sharding_type, "", "Sharding type of every table (empty: the planner's choice).");
DEFINE_int32(warmup, 5, "Untimed lookups first.");
DEFINE_int32(iters, 50, "Timed lookups per client.");
DEFINE_int32(clients, 1, "Concurrent client threads (each its own Client).");
DEFINE_bool(kept_output, false,
            "Look up into one KeyedTensor per caller kept across calls (service and in-process) "
            "instead of a fresh one per call.");
DEFINE_int32(batches, 4, "Distinct random batches, cycled.");
DEFINE_int32(keep_freed_heap_mib, 256,
             "The clients' ClientOptions::keep_freed_heap_mib (0: glibc's allocator defaults).");
DEFINE_uint64(seed, 1, "Seed for ids.");
DEFINE_string(format, "text", "text or json (one line).");
DEFINE_string(transport, "shm",
              "How bulk arrays travel to the workers: shm (shared-memory channels, the client's "
              "default on one host), grpc (inline in the messages), nccl (link channels over "
              "NCCL, GPU to GPU: needs --device=cuda and two GPUs per pair) or socket (link "
              "channels over a Unix-domain socket: the NCCL channel's protocol on the CPU).");

namespace ember {
namespace {

using client::KeyedJaggedTensor;
using client::KeyedTensor;

std::string DefaultEmberctl(const char* argv0) {
  for (const std::string& p : {std::string("cli/emberctl"),
                               absl::StrCat(argv0, ".runfiles/ember/cli/emberctl")}) {
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

ember::v1::CollectionSpec BenchSpec() {
  ember::v1::CollectionSpec spec;
  spec.set_name(absl::StrCat("service_bench_", getpid()));
  for (int f = 0; f < FLAGS_features; ++f) {
    auto* t = spec.add_tables();
    t->set_name(absl::StrCat("t", f));
    t->set_num_embeddings(FLAGS_rows);
    t->set_embedding_dim(FLAGS_dim);
    t->add_feature_names(absl::StrCat("f", f));
    t->set_pooling(ember::v1::TableConfig::SUM);
    t->mutable_initializer()->set_seed(f + 1);
    ember::v1::DataType type = ember::v1::FP32;
    ember::v1::DataType_Parse(FLAGS_data_type, &type);  // checked in main
    t->set_data_type(type);
  }
  return spec;
}

std::vector<KeyedJaggedTensor> RandomBatches(const ember::v1::CollectionSpec& spec) {
  std::mt19937_64 rng(FLAGS_seed);
  std::vector<KeyedJaggedTensor> out(FLAGS_batches);
  for (KeyedJaggedTensor& kjt : out) {
    for (const auto& t : spec.tables()) {
      kjt.keys.push_back(t.feature_names(0));
      for (int b = 0; b < FLAGS_batch; ++b) {
        kjt.lengths.push_back(FLAGS_pooling_factor);
        for (int i = 0; i < FLAGS_pooling_factor; ++i) {
          kjt.values.push_back(static_cast<int64_t>(rng() % FLAGS_rows));
        }
      }
    }
  }
  return out;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

int Fail(const std::string& what, const absl::Status& s) {
  std::cerr << "service_bench: " << what << ": " << s << std::endl;
  return 1;
}

int Run(const char* argv0) {
  if (FLAGS_batch < 1 || FLAGS_features < 1 || FLAGS_pooling_factor < 1 || FLAGS_dim < 4 ||
      FLAGS_rows < 1 || FLAGS_iters < 1 || FLAGS_clients < 1 || FLAGS_batches < 1 ||
      FLAGS_workers < 1 || FLAGS_worker_threads < 1) {
    return Fail("flags", absl::InvalidArgumentError("sizes, counts and threads must be >= 1"));
  }
  const bool linked = FLAGS_transport == "nccl" || FLAGS_transport == "socket";
  if (FLAGS_transport != "shm" && FLAGS_transport != "grpc" && !linked) {
    return Fail("flags", absl::InvalidArgumentError("--transport must be shm, grpc, nccl or socket"));
  }
  if (FLAGS_transport == "nccl" && FLAGS_device != "cuda") {
    return Fail("flags", absl::InvalidArgumentError(
                             "--transport=nccl runs between GPUs: it needs --device=cuda"));
  }
  const bool text = FLAGS_format != "json";
  std::unique_ptr<testing_util::LocalCluster> cluster;
  std::string coordinator = FLAGS_coordinator;
  if (coordinator.empty()) {
    const std::string emberctl = FLAGS_emberctl.empty() ? DefaultEmberctl(argv0) : FLAGS_emberctl;
    if (emberctl.empty()) {
      return Fail("cluster", absl::NotFoundError("emberctl not found; pass --emberctl=PATH"));
    }
    if (text) std::cerr << "starting " << FLAGS_workers << " workers (" << emberctl << " up)\n";
    cluster = std::make_unique<testing_util::LocalCluster>(
        emberctl, FLAGS_workers,
        std::vector<std::string>{absl::StrCat("--threads=", FLAGS_worker_threads),
                                 absl::StrCat("--device=", FLAGS_device),
                                 "--links=" + std::string(linked ? FLAGS_transport : "auto")});
    if (!cluster->ok()) return Fail("cluster", absl::UnavailableError("emberctl up failed"));
    coordinator = cluster->coordinator();
  }
  client::ClientOptions options;
  options.timeout = absl::Seconds(120);
  options.shared_memory = FLAGS_transport == "shm";
  if (linked) options.link = FLAGS_transport;
  options.keep_freed_heap_mib = FLAGS_keep_freed_heap_mib;
  auto c = client::Client::Connect(coordinator, options);
  if (!c.ok()) return Fail("connect", c.status());

  const ember::v1::CollectionSpec spec = BenchSpec();
  if (text) std::cerr << "creating " << FLAGS_features << " tables of " << FLAGS_rows << " x "
                      << FLAGS_dim << " on the cluster and in process\n";
  auto info = (*c)->CreateCollection(spec, FLAGS_sharding_type);
  if (!info.ok()) return Fail("create", info.status());
  const int world = info->worker_addresses_size();
  std::map<std::string, int> types;  // what the plan chose, for the report
  for (const auto& t : info->plan().tables()) ++types[t.sharding_type()];
  std::string plan_types;
  for (const auto& [type, n] : types) {
    absl::StrAppend(&plan_types, plan_types.empty() ? "" : "+", type, " x", n);
  }
  const int inprocess_threads =
      FLAGS_inprocess_threads > 0 ? FLAGS_inprocess_threads : world * FLAGS_worker_threads;
  auto local = client::InProcessCollection::Create(spec, &info->plan(), inprocess_threads);
  if (!local.ok()) return Fail("in-process collection", local.status());
  const std::vector<KeyedJaggedTensor> batches = RandomBatches(spec);

  // The two must agree before either is timed.
  {
    auto a = (*c)->Lookup(spec.name(), batches[0]);
    if (!a.ok()) return Fail("lookup", a.status());
    auto b = (*local)->Lookup(batches[0]);
    if (!b.ok()) return Fail("in-process lookup", b.status());
    for (size_t i = 0; i < b->values.size(); ++i) {
      if (std::abs(a->values[i] - b->values[i]) > 1e-4f * (1 + std::abs(b->values[i]))) {
        return Fail("check", absl::InternalError("the service and the in-process lookup differ"));
      }
    }
  }

  // The kernels alone: the same tables in a CPU backend, each batch's
  // requests and outputs made once.
  backend::CpuBackendOptions kernel_options;
  kernel_options.num_threads = inprocess_threads;
  auto kernel = backend::CreateCpuBackend(kernel_options);
  if (!kernel.ok()) return Fail("kernel backend", kernel.status());
  std::vector<backend::ShardId> shards;
  for (const auto& t : spec.tables()) {
    auto id = (*kernel)->CreateShard(ShardSpecFromTable(t, 0, 0, t.num_embeddings(), t.embedding_dim()));
    if (!id.ok()) return Fail("kernel shard", id.status());
    shards.push_back(*id);
  }
  // Each table's output packed, and (kt_calls) all of them written into one
  // KeyedTensor-shaped matrix, each table's columns at its offset: the
  // layout the collection must produce.
  std::vector<std::vector<backend::LookupRequest>> kernel_calls(batches.size());
  std::vector<std::vector<backend::LookupRequest>> kt_calls(batches.size());
  std::vector<std::vector<float>> kernel_out(spec.tables_size());
  for (size_t k = 0; k < kernel_out.size(); ++k) kernel_out[k].resize(FLAGS_batch * FLAGS_dim);
  const int64_t kt_width = static_cast<int64_t>(spec.tables_size()) * FLAGS_dim;
  std::vector<float> kt_out(FLAGS_batch * kt_width);
  for (size_t b = 0; b < batches.size(); ++b) {
    const KeyedJaggedTensor& kjt = batches[b];
    const std::vector<int64_t> off = kjt.key_offsets();
    for (size_t k = 0; k < kjt.keys.size(); ++k) {
      backend::FeatureRequest r;
      r.shard = shards[k];
      r.lengths = absl::MakeConstSpan(kjt.lengths).subspan(k * FLAGS_batch, FLAGS_batch);
      r.ids = absl::MakeConstSpan(kjt.values).subspan(off[k], off[k + 1] - off[k]);
      kernel_calls[b].push_back({r, absl::MakeSpan(kernel_out[k])});
      backend::LookupRequest strided{
          r, absl::MakeSpan(kt_out.data() + k * FLAGS_dim,
                            (FLAGS_batch - 1) * kt_width + FLAGS_dim)};
      strided.output_stride = kt_width;
      kt_calls[b].push_back(strided);
    }
  }
  // In process and the kernels alone, in alternating halves.
  KeyedTensor kept_local;
  auto local_lookup = [&](const KeyedJaggedTensor& kjt) -> absl::Status {
    if (FLAGS_kept_output) return (*local)->Lookup(kjt, &kept_local);
    return (*local)->Lookup(kjt).status();
  };
  // Each timed over the same half of the lookups in turn, the halves
  // alternating, so that a drift in the machine's speed falls on all three.
  struct Phase {
    const char* what;
    std::function<absl::Status(size_t batch)> call;
    double seconds = 0;
  };
  Phase phases[] = {
      {"in-process lookup", [&](size_t b) { return local_lookup(batches[b]); }},
      {"kernel lookup", [&](size_t b) { return (*kernel)->Lookup(kernel_calls[b]); }},
      {"kernel lookup into one matrix", [&](size_t b) { return (*kernel)->Lookup(kt_calls[b]); }}};
  for (int i = 0; i < FLAGS_warmup; ++i) {
    for (Phase& p : phases) (void)p.call(i % batches.size());
  }
  for (int half = 0; half < 2; ++half) {
    const int first = half * (FLAGS_iters / 2), last = half ? FLAGS_iters : FLAGS_iters / 2;
    for (Phase& p : phases) {
      const absl::Time t0 = absl::Now();
      for (int i = first; i < last; ++i) {
        if (absl::Status s = p.call(i % batches.size()); !s.ok()) return Fail(p.what, s);
      }
      p.seconds += absl::ToDoubleSeconds(absl::Now() - t0);
    }
  }
  const double inprocess_per_s = FLAGS_iters / phases[0].seconds;
  const double kernel_per_s = FLAGS_iters / phases[1].seconds;
  const double kt_per_s = FLAGS_iters / phases[2].seconds;
  kernel->reset();  // its tables' memory back before the service is timed

  // Through the service: `clients` threads, each with its own Client.
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int t = 0; t < FLAGS_clients; ++t) {
    auto own = client::Client::Connect(coordinator, options);
    if (!own.ok()) return Fail("connect", own.status());
    clients.push_back(*std::move(own));
    for (int i = 0; i < FLAGS_warmup; ++i) {
      (void)clients.back()->Lookup(spec.name(), batches[i % batches.size()]);
    }
  }
  // The workers' time in the backend against their time in the Lookup
  // handler, and their lookups that wrote straight into the client's
  // KeyedTensor, over the timed calls (Worker.ShardStatus, before and
  // after).
  struct WorkerCounts {
    double backend_ns = 0, handler_ns = 0, lookups = 0, placed = 0, ids_in_place = 0, linked = 0;
  };
  auto worker_times = [&](WorkerCounts* w) -> absl::Status {
    *w = WorkerCounts();
    for (const std::string& address : info->worker_addresses()) {
      auto st = (*c)->WorkerStatus(address);
      if (!st.ok()) return st.status();
      w->backend_ns += static_cast<double>(st->backend_lookup_ns());
      w->handler_ns += static_cast<double>(st->lookup_handler_ns());
      w->lookups += static_cast<double>(st->lookups());
      w->placed += static_cast<double>(st->placed_lookups());
      w->ids_in_place += static_cast<double>(st->id_buffer_lookups());
      w->linked += static_cast<double>(st->link_lookups());
    }
    return absl::OkStatus();
  };
  WorkerCounts before;
  if (absl::Status s = worker_times(&before); !s.ok()) return Fail("worker status", s);
  std::vector<std::vector<double>> latencies(FLAGS_clients);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  absl::Time start = absl::Now();
  for (int t = 0; t < FLAGS_clients; ++t) {
    threads.emplace_back([&, t] {
      KeyedTensor kept;
      for (int i = 0; i < FLAGS_iters; ++i) {
        const absl::Time s = absl::Now();
        const KeyedJaggedTensor& kjt = batches[(i + t) % batches.size()];
        const absl::Status st = FLAGS_kept_output ? clients[t]->Lookup(spec.name(), kjt, &kept)
                                                  : clients[t]->Lookup(spec.name(), kjt).status();
        latencies[t].push_back(absl::ToDoubleMilliseconds(absl::Now() - s));
        if (!st.ok()) ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  const double service_s = absl::ToDoubleSeconds(absl::Now() - start);
  WorkerCounts after;
  if (absl::Status s = worker_times(&after); !s.ok()) return Fail("worker status", s);
  const double worker_share = after.handler_ns > before.handler_ns
                                  ? (after.backend_ns - before.backend_ns) /
                                        (after.handler_ns - before.handler_ns)
                                  : 0.0;
  const double placed_share = after.lookups > before.lookups
                                  ? (after.placed - before.placed) / (after.lookups - before.lookups)
                                  : 0.0;
  const double ids_share =
      after.lookups > before.lookups
          ? (after.ids_in_place - before.ids_in_place) / (after.lookups - before.lookups)
          : 0.0;
  const double link_share =
      after.lookups > before.lookups
          ? (after.linked - before.linked) / (after.lookups - before.lookups)
          : 0.0;
  // A worker's mean time in the backend per call, against the client's
  // mean time per lookup: what the service adds around the kernels.
  const double backend_ms_per_call =
      after.lookups > before.lookups
          ? (after.backend_ns - before.backend_ns) / (after.lookups - before.lookups) / 1e6
          : 0.0;
  (void)(*c)->DropCollection(spec.name());
  if (errors > 0) {
    return Fail("lookups", absl::InternalError(absl::StrCat(errors.load(), " lookups failed")));
  }
  if (linked && link_share == 0) {  // the figures would be the gRPC path's
    return Fail("transport", absl::UnavailableError(absl::StrCat(
                                 "no lookup went through a ", FLAGS_transport,
                                 " link channel (the client said why on stderr)")));
  }

  std::vector<double> all;
  for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  const double per_s = FLAGS_clients * FLAGS_iters / service_s;
  const double bags = static_cast<double>(FLAGS_batch) * FLAGS_features;
  const double ids = bags * FLAGS_pooling_factor;
  const double bytes = ids * 8 + bags * 8 +  // ids + lengths
                       bags * FLAGS_dim * 4;                 // embeddings
  const double p50 = Percentile(all, 0.5), p99 = Percentile(all, 0.99);
  const double ratio = per_s / inprocess_per_s;
  if (text) {
    std::cout << absl::StrFormat(
        "service_bench: %d %s workers x %d threads, %s, transport %s, batch %d, %d features, "
        "pooling %d, dim %d, %d rows/table, %d client(s), %s output\n",
        world, FLAGS_device, FLAGS_worker_threads, plan_types, FLAGS_transport,
        FLAGS_batch, FLAGS_features, FLAGS_pooling_factor, FLAGS_dim, FLAGS_rows, FLAGS_clients,
        FLAGS_kept_output ? "kept" : "fresh");
    std::cout << absl::StrFormat(
        "  service:    %8.1f lookups/s  %.3g ids/s  %7.1f MB/s  p50 %.2f ms  p99 %.2f ms\n",
        per_s, per_s * ids, per_s * bytes / 1e6, p50, p99);
    std::cout << absl::StrFormat("  in-process: %8.1f lookups/s  %.3g ids/s  (%d threads)\n",
                                 inprocess_per_s, inprocess_per_s * ids, inprocess_threads);
    std::cout << absl::StrFormat("  kernel:     %8.1f lookups/s  %.3g ids/s  (%d threads)\n",
                                 kernel_per_s, kernel_per_s * ids, inprocess_threads);
    std::cout << absl::StrFormat("  kernel, KeyedTensor layout: %8.1f lookups/s  %.3g ids/s\n",
                                 kt_per_s, kt_per_s * ids);
    std::cout << absl::StrFormat("  ratio in-process / kernel: %.2f (target >= 0.95)\n",
                                 inprocess_per_s / kernel_per_s);
    std::cout << absl::StrFormat(
        "  ratio in-process / kernel into the KeyedTensor's layout: %.2f (target >= 0.95)\n",
        inprocess_per_s / kt_per_s);
    std::cout << absl::StrFormat("  ratio service / in-process: %.2f (target >= 0.9)\n", ratio);
    std::cout << absl::StrFormat(
        "  workers: time in the backend / time in the Lookup handler: %.3f (target >= 0.95)\n",
        worker_share);
    std::cout << absl::StrFormat(
        "  workers: lookups written straight into the client's KeyedTensor: %.0f%%\n",
        100 * placed_share);
    std::cout << absl::StrFormat(
        "  workers: lookups that read their ids straight from the client's KJT: %.0f%%\n",
        100 * ids_share);
    std::cout << absl::StrFormat(
        "  workers: %.2f ms in the backend per call; the client's mean lookup: %.2f ms\n",
        backend_ms_per_call, Mean(all));
    if (linked) {
      std::cout << absl::StrFormat("  workers: lookups through link channels: %.0f%%\n",
                                   100 * link_share);
    }
  } else {
    std::cout << absl::StrFormat(
        "{\"lookups_per_s\": %.2f, \"ids_per_s\": %.4g, \"mb_per_s\": %.1f, \"p50_ms\": %.3f, "
        "\"p99_ms\": %.3f, \"inprocess_lookups_per_s\": %.2f, \"kernel_lookups_per_s\": %.2f, "
        "\"kernel_kt_layout_lookups_per_s\": %.2f, "
        "\"worker_backend_share\": %.4f, \"placed_share\": %.3f, \"ids_in_place_share\": %.3f, "
        "\"link_share\": %.3f, "
        "\"worker_backend_ms_per_call\": %.3f, \"mean_ms\": %.3f, \"ratio\": %.3f, \"workers\": %d, "
        "\"worker_threads\": %d, \"inprocess_threads\": %d, \"clients\": %d, \"batch\": %d, "
        "\"features\": %d, \"pooling_factor\": %d, \"dim\": %d, \"rows\": %d, "
        "\"sharding_type\": \"%s\", \"device\": \"%s\", \"transport\": \"%s\", "
        "\"data_type\": \"%s\", \"kept_output\": %s}\n",
        per_s, per_s * ids, per_s * bytes / 1e6, p50, p99, inprocess_per_s, kernel_per_s,
        kt_per_s, worker_share, placed_share, ids_share, link_share, backend_ms_per_call, Mean(all),
        ratio,
        world,
        FLAGS_worker_threads, inprocess_threads, FLAGS_clients, FLAGS_batch, FLAGS_features,
        FLAGS_pooling_factor, FLAGS_dim, FLAGS_rows, plan_types, FLAGS_device, FLAGS_transport,
        FLAGS_data_type, FLAGS_kept_output ? "true" : "false");
  }
  return 0;
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  gflags::SetUsageMessage("service_bench [--workers=2 --batch=4096 ... --format=text|json]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  ember::v1::DataType type;
  if (!ember::v1::DataType_Parse(FLAGS_data_type, &type)) {
    std::fprintf(stderr, "service_bench: --data_type=%s is not FP32, FP16, BF16, INT8 or INT4\n",
                 FLAGS_data_type.c_str());
    return 1;
  }
  return ember::Run(argv[0]);
}
