#include "cli/cluster_commands.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cli/calibrate.h"
#include "cli/exit_status.h"
#include "cli/json_io.h"
#include "cli/spec_io.h"
#include "client/client.h"
#include "cuda/device_query.h"
#include "gflags/gflags.h"
#include "link/peer_link.h"
#include "planner/cost_model_io.h"
#include "planner/plan_format.h"
#include "server/common/auth.h"
#include "server/common/grpc_util.h"
#include "server/common/host_memory.h"
#include "server/common/metrics.h"
#include "server/common/scheduling.h"
#include "server/common/tls.h"
#include "server/coordinator/coordinator_service.h"
#include "server/worker/worker_server.h"

DECLARE_string(spec);
DECLARE_string(sharding_type);
DECLARE_string(format);
DEFINE_string(coordinator, "", "Coordinator address host:port.");
DEFINE_string(listen, "127.0.0.1:0", "Address a server listens on (port 0: a free port).");
DEFINE_int32(workers, 2, "up: number of local worker processes; scale: the worker count to serve the collection from (no default).");
DEFINE_bool(restart_workers, true, "up: start a worker process again when it dies.");
DEFINE_bool(drain_on_sigterm, true,
            "Worker: on SIGTERM, have the coordinator move this worker's shards to others "
            "(live copy, no update lost) before exiting. `up` starts its workers without it: "
            "it stops them all at once.");
DEFINE_string(worker, "", "drain: the worker id (see emberctl status).");
DEFINE_int32(trainers, 0, "set-trainers: the trainer count (>= 1).");
DEFINE_int64(from_step, -1, "set-trainers: the first step with the new count (>= 0).");
DEFINE_string(worker_names, "",
              "tokens: the workers' names, comma-separated (default: worker-0 ... worker-N-1 "
              "for --workers=N); Kubernetes: the pod names, e.g. ember-workers-0,...");
DEFINE_int32(port, 0, "up: the coordinator's port on 127.0.0.1 (0: a free port).");
DEFINE_string(auth_token_file, "",
              "Token authentication (server/common/auth.h, docs/security.md). Servers "
              "(coordinator, worker, up): a file of \"admin TOKEN\", \"trainer TOKEN\" and "
              "\"worker NAME TOKEN\" lines (one per worker); every call must then carry a "
              "token. Client commands: a file holding your token (or the servers' file: its "
              "admin token).");
DEFINE_string(worker_name, "",
              "worker: the NAME of this worker's \"worker NAME TOKEN\" line in "
              "--auth_token_file (default: the file's only worker line). up gives worker i the "
              "file's i-th worker line.");
DEFINE_string(tls_cert, "", "TLS: this process's PEM certificate (servers: required for TLS).");
DEFINE_string(tls_key, "", "TLS: the private key of --tls_cert.");
DEFINE_string(tls_ca, "",
              "TLS: PEM root certificates. Clients verify servers with it (TLS is on when "
              "given); servers given it require client certificates signed by it (mutual TLS).");
DEFINE_int32(metrics_port, 0,
             "Prometheus metrics over plain HTTP at /metrics on this port (0: none), on the "
             "--listen host. up: the coordinator's; worker i gets metrics_port + 1 + i.");
DEFINE_int32(health_port, 0,
             "A plaintext port serving only grpc.health.v1 (for kubelet probes, which cannot "
             "do mutual TLS), on the --listen host; 0: none.");
DEFINE_string(advertise_address, "",
              "worker: the HOST:PORT registered with the coordinator, which clients dial (e.g. "
              "a pod's stable DNS name); default: the --listen address.");
DEFINE_string(rate_window, "1s",
              "status: how long to watch the workers' counters for their request rates "
              "(0: no rates).");
DEFINE_string(device, "cpu",
              "Worker device: cpu or cuda; cuda_emulated: the CUDA kernels on the CPU, serving as "
              "a CUDA worker (its compute kernels: fused_uvm, fused_uvm_caching), for tests where "
              "there is no GPU (slow; --memory_gib 0: 16 GiB).");
DEFINE_int32(cuda_device, 0,
             "worker --device=cuda: the GPU ordinal (up gives worker i GPU i mod the GPU count).");
DEFINE_int32(cuda_scratch_mib, 256,
             "worker --device=cuda: device scratch (and twice as much pinned host staging) "
             "reserved at start for calls; not available for shards. Larger calls run in "
             "pieces.");
DEFINE_int32(threads, 1, "Worker backend threads per call.");
DEFINE_bool(batch_scheduling, true,
            "Workers: run under Linux's SCHED_BATCH policy: a worker woken by a call never "
            "preempts a trainer on its host that is still sending calls to other workers; its "
            "fair share of the CPU is unchanged. false: the default policy.");
DEFINE_double(memory_gib, 0,
              "Worker memory for shards in GiB (0: cpu, 90% of the host's available memory "
              "(the cgroup limit where there is one), shared among `up`'s workers; cuda, the "
              "card's). A cpu worker left at 0 beside live workers of its host that already "
              "claim memory is refused by the coordinator if together they would overcommit "
              "the host: give it its share.");
DEFINE_double(uvm_memory_gib, 0,
              "Workers --device=cuda: host memory in GiB for fused_uvm shards (a table's rows "
              "pinned in host memory and mapped into the GPU, read and written there by the "
              "kernels: for tables larger than HBM). 0: 90% of the host's available memory over "
              "its visible GPUs (shared among `up`'s workers).");
DEFINE_string(ssd_dir, "",
              "Workers: a directory on local SSD for the key_value kernel's files (a table's "
              "rows there, a cache of them in memory: constraints compute_kernels "
              "[\"key_value\"]). Empty: the kernel is not served.");
DEFINE_double(ssd_gib, 0,
              "Workers: GiB of --ssd_dir the key_value files may take (0: 90% of its free "
              "space, shared among `up`'s workers).");
DEFINE_int64(key_value_min_cache_rows, 65536,
             "Workers: the fewest rows a key_value shard caches (or all of a smaller shard), "
             "whatever its cache_load_factor: one call's distinct rows of a shard must fit in its "
             "cache, and a batch of 2,048 bags x 20 ids names up to 40,960.");
DEFINE_string(dedup_ttl, "10m",
              "Workers: how long an update's request id is remembered for exactly-once "
              "(must exceed every client's retry deadline).");
DEFINE_int32(dedup_window, 1 << 20,
             "Workers: most update ids remembered per collection (the memory bound).");
DEFINE_int32(max_queued_calls, 256,
             "Workers: lookups and gradient updates in progress at once (running or waiting for "
             "the backend); past it a call gets RESOURCE_EXHAUSTED \"worker busy\" and clients "
             "retry with back-off. 0: no bound.");
DEFINE_int64(max_pending_step_bytes, int64_t{1} << 30,
             "Workers: most bytes of gradient updates one SYNC or BOUNDED collection holds "
             "until their training step completes; past it a contribution is refused "
             "(RESOURCE_EXHAUSTED).");
DEFINE_int64(dynamic_exact_pending_ids, int64_t{1} << 20,
             "Workers: ids without a row whose admission counts a dynamic table's shard "
             "keeps exactly; past it a count-min sketch counts them (it may admit early, "
             "never late).");
DEFINE_bool(shared_memory, true,
            "Workers: offer shared-memory channels to trainers on the same host (bulk arrays "
            "bypass gRPC); clients use them where offered.");
DEFINE_string(shm_dir, "",
              "A directory on tmpfs shared by workers and trainers of one host (e.g. a volume "
              "both pods of a node mount, at the same path or not): workers accept channels "
              "whose regions are files in it; clients create them there and try every worker "
              "(one on another host refuses; its calls go inline). Empty: POSIX shared memory, "
              "workers at loopback addresses only.");
DEFINE_string(links, "auto",
              "Workers: the peer links offered for link channels (bulk arrays over a link "
              "instead of gRPC), a comma-separated list of \"nccl\" (GPU to GPU; needs "
              "--device=cuda) and \"socket\" (a Unix-domain socket in host memory, same host: "
              "the NCCL protocol without a GPU, for tests); \"auto\": nccl for a CUDA worker "
              "where libnccl.so.2 loads, else none; empty: none.");
DEFINE_int32(link_memory_mib, 4096,
             "Workers: most memory the regions of open link channels hold together, in MiB "
             "(each holds as much again in link memory: device memory for NCCL, outside "
             "--memory_gib); past it a trainer's link channel is refused and its calls go "
             "inline.");
DEFINE_bool(skip_nonfinite, false,
            "Workers: leave NaN/Inf gradient values (and the ids they touch) out of updates "
            "instead of refusing the update.");
DEFINE_int32(max_message_mb, 1024,
             "Servers: largest gRPC message received or sent, in MiB (1-1024); a worker keeps "
             "its responses under it.");
DEFINE_int32(lease_ms, 5000, "Coordinator: worker lease; workers heartbeat 4x per lease.");
DEFINE_string(forget_workers_after, "10m",
              "Coordinator: remove a worker silent this long once no collection uses it.");
DEFINE_string(plan, "",
              "create: a plan to use instead of planning: JSON in emberctl plan's form or "
              "TorchRec's (a ParameterSharding per table); checked against the live workers.");
DEFINE_string(cost_model, "",
              "Coordinator, up, plan: the planner's cost model, a JSON file (emberctl calibrate "
              "writes one); empty: the device's defaults.");
DEFINE_int64(calibrate_rows, 1000000, "calibrate: rows of each scratch table (16 and 128 columns) on each worker.");
DEFINE_int32(calibrate_reps, 9, "calibrate: timed calls per shape (the median counts).");
DEFINE_bool(calibrate_caches, false,
            "calibrate: write the workers' caches the probe measures into the model "
            "(cache_bytes, cache_bw_gbps); off by default, docs/lab-notes/2026-11-benchmarks.md says why.");
DEFINE_string(collection, "", "Collection name.");
DEFINE_string(table, "", "Table name (export).");
DEFINE_string(input, "", "KJT JSON file: {keys, lengths, values, weights?}.");
DEFINE_string(output, "", "Output file.");
DEFINE_string(grads, "", "Gradients JSON file, in lookup's output format.");
DEFINE_string(request_id, "", "apply-gradients: request id (empty: random).");
DEFINE_double(timeout_s, 30, "Client call deadline in seconds.");
DEFINE_string(checkpoint_dir, "",
              "Coordinator, worker, up: the ROOT every checkpoint lies under (a request's "
              "directory is taken relative to it, and refused outside it; docs/security.md); "
              "also where --checkpoint_every writes. Empty: no checkpoints.");
DEFINE_string(checkpoint_every, "",
              "Coordinator/up: checkpoint every collection this often, e.g. 10m, 1h (needs "
              "--checkpoint_dir; empty: never).");
DEFINE_string(state_dir, "",
              "Coordinator/up: keep the coordinator's state (workers, collections, plans, "
              "epochs, checkpoint catalogue) in a LevelDB store here; a restarted coordinator "
              "reloads it.");
DEFINE_int32(keep_checkpoints, 3,
             "Coordinator/up: committed checkpoints kept per collection and ROOT (and the "
             "bases an incremental one among them builds on).");
DEFINE_bool(checkpoint_incremental, false,
            "Coordinator/up: --checkpoint_every writes incremental checkpoints (only the rows "
            "changed since the previous one).");
DEFINE_int32(checkpoint_full_every, 8,
             "Coordinator/up: an incremental checkpoint whose chain would hold more than this "
             "many checkpoints is written whole instead (1: always whole).");
DEFINE_int32(checkpoint_compact_after, 4,
             "Coordinator/up: an incremental checkpoint whose chain holds this many "
             "checkpoints is rewritten whole in the background once committed (0: never).");
DEFINE_bool(incremental, false,
            "checkpoint: write only the rows changed since the collection's latest checkpoint "
            "under the same ROOT.");
DEFINE_string(dir, "",
              "checkpoint: the directory of the new checkpoint, under the servers' "
              "--checkpoint_dir (relative to it; default: the root itself). tokens: where the "
              "token files go.");
DEFINE_string(from, "", "restore: a checkpoint directory, or a ROOT (its latest checkpoint).");
DEFINE_double(checkpoint_timeout_s, 1800, "checkpoint/restore: deadline in seconds.");

namespace ember {
namespace cli {
namespace {

int Usage(const std::string& message) {
  std::cerr << "emberctl: " << message << "\n(run 'emberctl help')" << std::endl;
  return kExitUsage;
}

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// Waits for SIGINT/SIGTERM; every `poll`, calls tick() and stops waiting if
// it returns false. Returns the signal, or 0.
template <typename Tick>
int WaitForSignal(Tick tick) {
  const sigset_t set = TerminationSignals();
  const timespec poll = {1, 0};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &poll);
    if (sig > 0) return sig;
    if (!tick()) return 0;
  }
}

int MaxMessageBytes() { return FLAGS_max_message_mb << 20; }

// Checks the flags every server shares; "" when fine.
// The peer links a worker offers (--links, --device).
absl::StatusOr<std::vector<cuda::PeerLinks*>> OfferedLinks() {
  std::vector<cuda::PeerLinks*> kinds;
  if (FLAGS_links == "auto") {
    if (FLAGS_device != "cuda") return kinds;
    auto nccl = cuda::NcclLinks();
    if (nccl.ok()) kinds.push_back(*nccl);
    return kinds;
  }
  for (absl::string_view name : absl::StrSplit(FLAGS_links, ',', absl::SkipEmpty())) {
    auto kind = cuda::PeerLinksNamed(std::string(name));
    if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("--links: ", kind.status().message()));
    if ((*kind)->name() == "nccl" && FLAGS_device != "cuda") {
      return absl::InvalidArgumentError("--links=nccl needs --device=cuda");
    }
    kinds.push_back(*kind);
  }
  return kinds;
}

std::string BadServerFlags() {
  if (FLAGS_max_message_mb < 1 || FLAGS_max_message_mb > 1024) {
    return "--max_message_mb must be in [1, 1024]";
  }
  if (FLAGS_lease_ms < 100) return "--lease_ms must be >= 100";
  absl::Duration forget;
  if (!absl::ParseDuration(FLAGS_forget_workers_after, &forget) ||
      forget < absl::Milliseconds(FLAGS_lease_ms)) {
    return "--forget_workers_after must be a duration of at least the lease (e.g. 10m)";
  }
  if (FLAGS_keep_checkpoints < 1) return "--keep_checkpoints must be >= 1";
  if (FLAGS_checkpoint_full_every < 1) return "--checkpoint_full_every must be >= 1";
  if (FLAGS_checkpoint_compact_after < 0) return "--checkpoint_compact_after must be >= 0";
  absl::Duration ttl;
  if (!absl::ParseDuration(FLAGS_dedup_ttl, &ttl) || ttl < absl::Seconds(1)) {
    return "--dedup_ttl must be a duration of at least 1s (e.g. 10m)";
  }
  if (FLAGS_dedup_window < 1) return "--dedup_window must be >= 1";
  if (FLAGS_max_queued_calls < 0) return "--max_queued_calls must be >= 0";
  if (FLAGS_max_pending_step_bytes <= 0) return "--max_pending_step_bytes must be > 0";
  if (FLAGS_key_value_min_cache_rows < 1) return "--key_value_min_cache_rows must be >= 1";
  if (FLAGS_dynamic_exact_pending_ids <= 0) return "--dynamic_exact_pending_ids must be > 0";
  if (!FLAGS_shm_dir.empty() && !std::filesystem::is_directory(FLAGS_shm_dir)) {
    return "--shm_dir " + FLAGS_shm_dir + " is not a directory";
  }
  if (auto links = OfferedLinks(); !links.ok()) return std::string(links.status().message());
  if (FLAGS_link_memory_mib < 1) return "--link_memory_mib must be >= 1";
  absl::Duration every;
  if (!FLAGS_checkpoint_every.empty()) {
    if (!absl::ParseDuration(FLAGS_checkpoint_every, &every) || every < absl::Seconds(1)) {
      return "--checkpoint_every must be a duration of at least 1s (e.g. 90s, 10m, 1h)";
    }
    if (FLAGS_checkpoint_dir.empty()) return "--checkpoint_every needs --checkpoint_dir";
  }
  return "";
}

TlsFiles Tls() { return {FLAGS_tls_cert, FLAGS_tls_key, FLAGS_tls_ca}; }

// HOST:PORT on the --listen host (all interfaces for 0.0.0.0) for an extra
// port (/metrics, health); empty for none.
std::string SidePortBind(const std::string& listen, int port) {
  if (port <= 0) return "";
  return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
}

// The servers' token table (disabled without --auth_token_file).
absl::StatusOr<TokenTable> ServerTokens() {
  if (FLAGS_auth_token_file.empty()) return TokenTable();
  return TokenTable::Load(FLAGS_auth_token_file);
}

struct Coordinator {
  std::unique_ptr<coordinator::CoordinatorService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  TokenTable service_tokens;  // what it checks; `up` calls it as admin
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // for calling it (up)
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<grpc::Server> health;  // --health_port
};

// The coordinator's own series: workers by lease, collections by state.
void AddCoordinatorMetrics(const coordinator::CoordinatorService* service, ServerMetrics* m) {
  m->AddGauge("ember_coordinator_workers", "Registered workers, by whether they hold a lease",
              [service] {
                const auto s = service->GetStats();
                return std::vector<ServerMetrics::Sample>{
                    {{{"state", "live"}}, static_cast<double>(s.workers_live)},
                    {{{"state", "lost"}}, static_cast<double>(s.workers_lost)}};
              });
  m->AddGauge("ember_coordinator_collections", "Collections, by state", [service] {
    std::vector<ServerMetrics::Sample> out;
    for (const auto& [state, n] : service->GetStats().collections_by_state) {
      out.push_back({{{"state", state}}, static_cast<double>(n)});
    }
    return out;
  });
  auto one = [service](auto field) {
    return [service, field] {
      return std::vector<ServerMetrics::Sample>{{{}, static_cast<double>(service->GetStats().*field)}};
    };
  };
  using Stats = coordinator::CoordinatorService::Stats;
  m->AddGauge("ember_coordinator_checkpoints", "Checkpoints in the catalogue",
              one(&Stats::checkpoints));
  m->AddCounter("ember_coordinator_checkpoint_runs_total",
                "Checkpoints written since start (periodic and asked for), by result", [service] {
                  const auto s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"result", "ok"}}, static_cast<double>(s.checkpoints_ok)},
                      {{{"result", "failed"}}, static_cast<double>(s.checkpoints_failed)}};
                });
  m->AddCounter("ember_coordinator_checkpoint_seconds_total", "Time spent writing checkpoints",
                one(&Stats::checkpoint_seconds));
  m->AddGauge("ember_coordinator_last_checkpoint_duration_seconds",
              "How long the last checkpoint took (succeeded or not)",
              one(&Stats::last_checkpoint_seconds));
  m->AddGauge("ember_coordinator_last_checkpoint_success_timestamp_seconds",
              "Unix time the last successful checkpoint finished (0: none since start)",
              one(&Stats::last_checkpoint_unix_seconds));
  m->AddCounter("ember_coordinator_checkpoint_bytes_total",
                "Shard-file bytes the successful checkpoints wrote, by kind (full, incremental)",
                [service] {
                  const auto s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"kind", "full"}}, static_cast<double>(s.checkpoint_bytes_full)},
                      {{{"kind", "incremental"}},
                       static_cast<double>(s.checkpoint_bytes_incremental)}};
                });
  m->AddCounter("ember_coordinator_moves_total",
                "Live moves (drains, rescales, replicated shards' copies made anew) by kind and result", [service] {
                  const auto s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"kind", "drain"}, {"result", "ok"}}, static_cast<double>(s.drains_ok)},
                      {{{"kind", "drain"}, {"result", "failed"}},
                       static_cast<double>(s.drains_failed)},
                      {{{"kind", "scale"}, {"result", "ok"}}, static_cast<double>(s.scales_ok)},
                      {{{"kind", "scale"}, {"result", "failed"}},
                       static_cast<double>(s.scales_failed)},
                      {{{"kind", "copies"}, {"result", "ok"}}, static_cast<double>(s.copies_ok)},
                      {{{"kind", "copies"}, {"result", "failed"}},
                       static_cast<double>(s.copies_failed)}};
                });
  m->AddCounter("ember_coordinator_replica_takeovers_total",
                "Lost ranks of replicated collections whose shards their backups took over "
                "(nothing rolled back)",
                one(&Stats::replica_takeovers));
  m->AddCounter("ember_coordinator_move_bytes_total",
                "Row bytes the successful live moves copied: between workers, or within one "
                "(a re-cut shard's rows that stay)",
                [service] {
                  const auto s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"between", "workers"}}, static_cast<double>(s.move_bytes_between_workers)},
                      {{{"between", "local"}}, static_cast<double>(s.move_bytes_local)}};
                });
  m->AddGauge("ember_coordinator_last_move_fence_seconds",
              "How long the last successful live move refused updates",
              one(&Stats::last_move_fence_seconds));
  m->AddCounter("ember_coordinator_checkpoint_compactions_total",
                "Incremental chains rewritten whole in the background, by result", [service] {
                  const auto s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"result", "ok"}}, static_cast<double>(s.compactions_ok)},
                      {{{"result", "failed"}}, static_cast<double>(s.compactions_failed)}};
                });
}

absl::StatusOr<Coordinator> StartCoordinator(const std::string& listen) {
  coordinator::CoordinatorOptions o;
  o.lease = absl::Milliseconds(FLAGS_lease_ms);
  (void)absl::ParseDuration(FLAGS_forget_workers_after, &o.forget_workers_after);  // checked
  o.checkpoint_dir = FLAGS_checkpoint_dir;
  o.keep_checkpoints = FLAGS_keep_checkpoints;
  o.checkpoint_incremental = FLAGS_checkpoint_incremental;
  o.checkpoint_full_every = FLAGS_checkpoint_full_every;
  o.checkpoint_compact_after = FLAGS_checkpoint_compact_after;
  if (!FLAGS_checkpoint_every.empty()) {
    (void)absl::ParseDuration(FLAGS_checkpoint_every, &o.checkpoint_every);  // checked before
  }
  o.state_dir = FLAGS_state_dir;
  if (!FLAGS_cost_model.empty()) {
    auto model = planner::LoadCostModel(FLAGS_cost_model, &o.cost_model_device);
    if (!model.ok()) return model.status();
    o.cost_model = *model;
  }
  auto tokens = ServerTokens();
  if (!tokens.ok()) return tokens.status();
  o.auth = *std::move(tokens);
  auto server_credentials = ServerCredentialsFrom(Tls());
  if (!server_credentials.ok()) return server_credentials.status();
  auto worker_credentials = ChannelCredentialsFrom(Tls());
  if (!worker_credentials.ok()) return worker_credentials.status();
  o.worker_credentials = *worker_credentials;
  Coordinator c;
  c.service_tokens = o.auth;
  c.credentials = *worker_credentials;
  auto service = coordinator::CoordinatorService::Create(o);
  if (!service.ok()) return service.status();
  c.service = std::move(*service);
  auto metrics = ServerMetrics::Start(SidePortBind(listen, FLAGS_metrics_port), "coordinator");
  if (!metrics.ok()) return metrics.status();
  c.metrics = std::move(*metrics);
  AddCoordinatorMetrics(c.service.get(), c.metrics.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  b.experimental().SetInterceptorCreators(c.metrics->Interceptors());
  int port = 0;
  WarnIfPlaintextOffLoopback(listen, !FLAGS_tls_cert.empty());
  b.AddListeningPort(listen, *server_credentials, &port);
  b.SetMaxReceiveMessageSize(MaxMessageBytes());
  b.SetMaxSendMessageSize(MaxMessageBytes());
  b.RegisterService(c.service.get());
  c.server = b.BuildAndStart();
  if (!c.server || port == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  c.address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  auto health = StartHealthServer(SidePortBind(listen, FLAGS_health_port));
  if (!health.ok()) return health.status();
  c.health = std::move(*health);
  return c;
}

absl::StatusOr<std::unique_ptr<client::Client>> Connect() {
  if (FLAGS_coordinator.empty()) return absl::InvalidArgumentError("needs --coordinator=HOST:PORT");
  client::ClientOptions o;
  if (!FLAGS_auth_token_file.empty()) {
    auto token = LoadClientToken(FLAGS_auth_token_file);
    if (!token.ok()) return token.status();
    o.auth_token = *token;
  }
  auto credentials = ChannelCredentialsFrom(Tls());
  if (!credentials.ok()) return credentials.status();
  o.credentials = *credentials;
  o.timeout = absl::Seconds(FLAGS_timeout_s);
  o.shared_memory = FLAGS_shared_memory;
  o.shm_dir = FLAGS_shm_dir;
  return client::Client::Connect(FLAGS_coordinator, o);
}

// A collection's tables as it runs them: shape, data type, pooling and the
// optimizer's values (defaults filled in by the coordinator), the first
// kMaxTablesShown of them.
void PrintTables(const ember::v1::CollectionSpec& spec) {
  constexpr int kMaxTablesShown = 32;
  for (int i = 0; i < spec.tables_size() && i < kMaxTablesShown; ++i) {
    const ember::v1::TableConfig& t = spec.tables(i);
    const ember::v1::OptimizerSpec& o = t.optimizer();
    std::cout << "    table " << t.name() << " [" << t.num_embeddings() << " x "
              << t.embedding_dim() << "] " << ember::v1::DataType_Name(t.data_type()) << " "
              << ember::v1::TableConfig::Pooling_Name(t.pooling()) << ", "
              << ember::v1::OptimizerSpec::Type_Name(o.type()) << " lr " << o.learning_rate();
    if (o.type() != ember::v1::OptimizerSpec::SGD) std::cout << " eps " << o.eps();
    if (o.type() == ember::v1::OptimizerSpec::ADAM) {
      std::cout << " beta1 " << o.beta1() << " beta2 " << o.beta2();
    }
    if (o.weight_decay() > 0) {
      std::cout << " weight_decay " << o.weight_decay() << " ("
                << ember::v1::OptimizerSpec::WeightDecayMode_Name(o.weight_decay_mode()) << ")";
    }
    if (t.has_dynamic()) {
      const ember::v1::DynamicTableSpec& d = t.dynamic();
      std::cout << "; dynamic: capacity " << d.capacity() << ", admit after "
                << std::max<int64_t>(d.admit_after(), 1) << " update(s), "
                << ember::v1::DynamicTableSpec::Eviction_Name(d.eviction())
                << (d.ttl_steps() > 0 ? absl::StrCat(", ttl ", d.ttl_steps(), " steps") : "");
    }
    std::cout << std::endl;
  }
  if (spec.tables_size() > kMaxTablesShown) {
    std::cout << "    ... and " << spec.tables_size() - kMaxTablesShown
              << " more table(s) (GetCollection has them all)" << std::endl;
  }
}

void PrintPlan(const ember::v1::CollectionInfo& info) {
  if (FLAGS_format == "json") {
    std::cout << planner::FormatPlanJson(info.plan()) << std::endl;
    return;
  }
  std::cout << planner::FormatPlanTable(info.plan());
  std::cout << "collection '" << info.plan().collection() << "' at epoch " << info.plan().epoch()
            << " on " << info.worker_addresses_size() << " worker(s):";
  for (int r = 0; r < info.worker_addresses_size(); ++r) {
    std::cout << " rank" << r << "=" << info.worker_addresses(r);
  }
  std::cout << std::endl;
}

}  // namespace

void BlockTerminationSignals() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int RunCoordinator() {
  if (const std::string bad = BadServerFlags(); !bad.empty()) return Usage(bad);
  auto c = StartCoordinator(FLAGS_listen);
  if (!c.ok()) return Fail("coordinator", c.status());
  std::cout << "coordinator listening on " << c->address << std::endl;
  const int sig = WaitForSignal([] { return true; });
  std::cout << "coordinator: signal " << sig << ", shutting down" << std::endl;
  c->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

int RunWorker() {
  // First, so that every thread of the worker inherits it.
  if (FLAGS_batch_scheduling) {
    if (absl::Status s = UseBatchScheduling(); !s.ok()) {
      std::cerr << "worker: --batch_scheduling: " << s << "; keeping the default policy"
                << std::endl;
    }
  }
  worker::WorkerServerOptions o;
  o.listen = FLAGS_listen;
  o.coordinator = FLAGS_coordinator;
  o.device = FLAGS_device;
  o.cuda_device = FLAGS_cuda_device;
  o.cuda_scratch_bytes = int64_t{FLAGS_cuda_scratch_mib} << 20;
  o.threads = FLAGS_threads;
  o.memory_limit_bytes = static_cast<int64_t>(FLAGS_memory_gib * (1 << 30));
  o.uvm_memory_bytes = static_cast<int64_t>(FLAGS_uvm_memory_gib * (1 << 30));
  o.ssd_dir = FLAGS_ssd_dir;
  o.ssd_capacity_bytes = static_cast<int64_t>(FLAGS_ssd_gib * (1 << 30));
  o.max_message_bytes = MaxMessageBytes();
  o.service.skip_nonfinite = FLAGS_skip_nonfinite;
  o.service.checkpoint_root = FLAGS_checkpoint_dir;
  o.service.dedup_window = FLAGS_dedup_window;
  o.service.max_queued_calls = FLAGS_max_queued_calls;
  o.service.max_pending_step_bytes = FLAGS_max_pending_step_bytes;
  o.service.key_value_min_cache_rows = FLAGS_key_value_min_cache_rows;
  o.dynamic_exact_pending_ids = FLAGS_dynamic_exact_pending_ids;
  o.service.shared_memory = FLAGS_shared_memory;
  o.service.shm_dir = FLAGS_shm_dir;
  if (auto links = OfferedLinks(); links.ok()) {  // (checked with the other flags below)
    o.service.links.kinds = *links;
    o.service.links.device = FLAGS_cuda_device;
    o.service.links.max_bytes = int64_t{FLAGS_link_memory_mib} << 20;
  }
  (void)absl::ParseDuration(FLAGS_dedup_ttl, &o.service.dedup_ttl);  // checked before
  if (const std::string bad = BadServerFlags(); !bad.empty()) return Usage(bad);
  auto tokens = ServerTokens();
  if (!tokens.ok()) return Fail("worker", tokens.status());
  if (absl::Status s = tokens->SetSelf(FLAGS_worker_name); !s.ok()) {
    return Fail("worker", absl::InvalidArgumentError(
                              absl::StrCat(FLAGS_auth_token_file, ": ", s.message())));
  }
  o.service.auth = *std::move(tokens);
  auto server_credentials = ServerCredentialsFrom(Tls());
  if (!server_credentials.ok()) return Fail("worker", server_credentials.status());
  auto coordinator_credentials = ChannelCredentialsFrom(Tls());
  if (!coordinator_credentials.ok()) return Fail("worker", coordinator_credentials.status());
  o.server_credentials = *server_credentials;
  o.coordinator_credentials = *coordinator_credentials;
  WarnIfPlaintextOffLoopback(o.listen, !FLAGS_tls_cert.empty());
  o.metrics_bind = SidePortBind(o.listen, FLAGS_metrics_port);
  o.health_bind = SidePortBind(o.listen, FLAGS_health_port);
  o.advertise_address = FLAGS_advertise_address;
  auto w = worker::WorkerServer::Start(o);
  if (!w.ok()) return Fail("worker", w.status());
  std::cout << "worker " << (*w)->worker_id() << " listening on " << (*w)->address() << std::endl;
  const int sig = WaitForSignal([] { return true; });
  if (sig == SIGTERM && FLAGS_drain_on_sigterm) {
    std::cout << "worker: SIGTERM, draining (shards move to other workers)" << std::endl;
    if (absl::Status s = (*w)->Drain(); !s.ok()) {
      std::cerr << "worker: drain failed, exiting anyway: " << s << std::endl;
    }
  }
  (*w)->Shutdown();
  return 0;
}

int RunUp(const std::string& self_path) {
  if (FLAGS_workers < 1) return Usage("--workers must be >= 1");
  if (FLAGS_device != "cpu" && FLAGS_device != "cuda" && FLAGS_device != "cuda_emulated") {
    return Usage("--device must be cpu, cuda or cuda_emulated");
  }
  if (const std::string bad = BadServerFlags(); !bad.empty()) return Usage(bad);
  auto c = StartCoordinator(absl::StrCat("127.0.0.1:", FLAGS_port));
  if (!c.ok()) return Fail("up", c.status());
  const std::vector<std::string>& worker_names = c->service_tokens.worker_names();
  if (c->service_tokens.enabled() && static_cast<int>(worker_names.size()) < FLAGS_workers) {
    return Fail("up", absl::InvalidArgumentError(absl::StrCat(
                          FLAGS_auth_token_file, " has ", worker_names.size(),
                          " \"worker NAME TOKEN\" line(s); --workers=", FLAGS_workers,
                          " needs one per worker")));
  }
  // CPU workers share this host's memory: each gets its part unless told.
  double memory_gib = FLAGS_memory_gib;
  if (memory_gib == 0 && FLAGS_device == "cpu") {
    memory_gib = static_cast<double>(HostMemoryBytes() / 10 * 9) / FLAGS_workers / (1 << 30);
  }
  // CUDA workers' fused_uvm shards likewise, in the host memory they pin.
  double uvm_memory_gib = FLAGS_uvm_memory_gib;
  if (uvm_memory_gib == 0 && FLAGS_device != "cpu") {
    uvm_memory_gib = static_cast<double>(HostMemoryBytes() / 10 * 9) / FLAGS_workers / (1 << 30);
  }
  // The SSD tier likewise: each worker its part of the directory's space.
  double ssd_gib = FLAGS_ssd_gib;
  if (!FLAGS_ssd_dir.empty() && ssd_gib == 0) {
    struct statvfs fs;
    if (statvfs(FLAGS_ssd_dir.c_str(), &fs) != 0) {
      return Fail("up", absl::FailedPreconditionError(absl::StrCat(
                            "--ssd_dir '", FLAGS_ssd_dir, "': ", std::strerror(errno))));
    }
    ssd_gib = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) * 0.9 /
              FLAGS_workers / (1 << 30);
  }
  // Worker processes: this binary again, `emberctl worker`.
  std::vector<std::string> args = {
      self_path, "worker", "--coordinator=" + c->address, "--listen=127.0.0.1:0",
      "--device=" + FLAGS_device, absl::StrCat("--threads=", FLAGS_threads),
      absl::StrCat("--memory_gib=", memory_gib),
      absl::StrCat("--uvm_memory_gib=", uvm_memory_gib), "--ssd_dir=" + FLAGS_ssd_dir,
      absl::StrCat("--ssd_gib=", ssd_gib),
      absl::StrCat("--max_message_mb=", FLAGS_max_message_mb),
      absl::StrCat("--skip_nonfinite=", FLAGS_skip_nonfinite ? "true" : "false"),
      "--dedup_ttl=" + FLAGS_dedup_ttl, absl::StrCat("--dedup_window=", FLAGS_dedup_window),
      absl::StrCat("--max_queued_calls=", FLAGS_max_queued_calls),
      absl::StrCat("--max_pending_step_bytes=", FLAGS_max_pending_step_bytes),
      absl::StrCat("--key_value_min_cache_rows=", FLAGS_key_value_min_cache_rows),
      absl::StrCat("--dynamic_exact_pending_ids=", FLAGS_dynamic_exact_pending_ids),
      absl::StrCat("--cuda_scratch_mib=", FLAGS_cuda_scratch_mib),
      absl::StrCat("--shared_memory=", FLAGS_shared_memory ? "true" : "false"),
      absl::StrCat("--batch_scheduling=", FLAGS_batch_scheduling ? "true" : "false"),
      "--shm_dir=" + FLAGS_shm_dir, "--links=" + FLAGS_links,
      absl::StrCat("--link_memory_mib=", FLAGS_link_memory_mib), "--drain_on_sigterm=false",
      "--auth_token_file=" + FLAGS_auth_token_file, "--checkpoint_dir=" + FLAGS_checkpoint_dir,
      "--tls_cert=" + FLAGS_tls_cert, "--tls_key=" + FLAGS_tls_key, "--tls_ca=" + FLAGS_tls_ca};
  // CUDA workers: one GPU each, round-robin over the visible ones.
  int gpus = 1;
  if (FLAGS_device == "cuda") {
    auto devices = cuda::QueryDevices();
    if (!devices.ok() || devices->empty()) {
      return Fail("up", devices.ok() ? absl::UnavailableError("no CUDA device visible")
                                     : devices.status());
    }
    gpus = static_cast<int>(devices->size());
    if (FLAGS_workers > gpus) {
      std::cerr << "up: " << FLAGS_workers << " CUDA workers on " << gpus
                << " GPU(s): some share a GPU (and each advertises the whole card)" << std::endl;
    }
  }
  std::vector<pid_t> children;
  const pid_t parent = getpid();
  // Worker i's process (restarted with the same arguments).
  auto spawn = [&](int i) -> pid_t {
    std::vector<std::string> mine = args;
    if (FLAGS_device == "cuda") mine.push_back(absl::StrCat("--cuda_device=", i % gpus));
    if (c->service_tokens.enabled()) mine.push_back("--worker_name=" + worker_names[i]);
    if (FLAGS_metrics_port > 0) {
      mine.push_back(absl::StrCat("--metrics_port=", FLAGS_metrics_port + 1 + i));
    }
    std::vector<char*> argv;
    for (const auto& a : mine) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return pid;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive `up`
      if (getppid() != parent) _exit(1);
      const sigset_t set = TerminationSignals();
      pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
      execv(self_path.c_str(), argv.data());
      _exit(127);
    }
    return pid;
  };
  for (int i = 0; i < FLAGS_workers; ++i) {
    const pid_t pid = spawn(i);
    if (pid < 0) break;
    children.push_back(pid);
  }
  auto stop_children = [&children] {
    for (pid_t p : children) {
      if (p > 0) kill(p, SIGTERM);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    for (pid_t p : children) {
      if (p <= 0) continue;
      while (waitpid(p, nullptr, WNOHANG) == 0) {
        if (absl::Now() > deadline) {
          kill(p, SIGKILL);
          waitpid(p, nullptr, 0);
          break;
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
  };
  // Ready when every worker holds a lease.
  client::ClientOptions up_client;
  up_client.auth_token = c->service_tokens.TokenOf(Role::kAdmin);
  up_client.credentials = c->credentials;
  auto cl = client::Client::Connect(c->address, up_client);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  int live = 0;
  while (cl.ok() && absl::Now() < deadline) {
    auto w = (*cl)->ListWorkers();
    live = 0;
    if (w.ok()) {
      for (const auto& s : w->workers()) live += s.live();
    }
    if (live == FLAGS_workers) break;
    int status;
    if (waitpid(-1, &status, WNOHANG) > 0) break;  // a worker died at start-up
    absl::SleepFor(absl::Milliseconds(50));
  }
  if (live != FLAGS_workers) {
    stop_children();
    return Fail("up", absl::UnavailableError(absl::StrCat(
                          live, " of ", FLAGS_workers, " workers registered; see their logs")));
  }
  std::cout << "coordinator: " << c->address << std::endl;
  // Where Prometheus scrapes each process (--metrics_port: the coordinator's,
  // then worker i's at metrics_port + 1 + i, matched by pid).
  auto metrics_url = [](int port) {
    return absl::StrCat("http://127.0.0.1:", port, "/metrics");
  };
  if (FLAGS_metrics_port > 0) {
    std::cout << "metrics: coordinator " << metrics_url(FLAGS_metrics_port) << std::endl;
  }
  auto workers = (*cl)->ListWorkers();
  for (const auto& s : workers->workers()) {
    std::cout << "worker " << s.worker_id() << " " << s.info().address() << " pid "
              << s.info().pid();
    for (size_t i = 0; FLAGS_metrics_port > 0 && i < children.size(); ++i) {
      if (children[i] == static_cast<pid_t>(s.info().pid())) {
        std::cout << " metrics " << metrics_url(FLAGS_metrics_port + 1 + static_cast<int>(i));
      }
    }
    std::cout << std::endl;
  }
  std::cout << "ready: " << FLAGS_workers << " " << FLAGS_device
            << " worker(s); Ctrl-C (SIGINT) or SIGTERM stops everything" << std::endl;
  // Supervision, as Kubernetes restarts a pod: a worker that dies is started
  // again; it registers as a new worker and the coordinator recovers the
  // dead one's shards onto it.
  const int sig = WaitForSignal([&] {
    for (size_t i = 0; i < children.size(); ++i) {
      pid_t& p = children[i];
      int status;
      if (p <= 0 || waitpid(p, &status, WNOHANG) != p) continue;
      std::cerr << "up: worker pid " << p << " exited (status " << status << ")"
                << (FLAGS_restart_workers ? "; restarting it" : "") << std::endl;
      p = -1;
      if (!FLAGS_restart_workers) continue;
      const pid_t again = spawn(static_cast<int>(i));
      if (again > 0) {
        std::cout << "worker restarted pid " << again << std::endl;
        p = again;
      }
    }
    return true;
  });
  std::cout << "up: signal " << sig << ", stopping " << children.size() << " worker(s)" << std::endl;
  stop_children();
  c->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::cout << "up: stopped" << std::endl;
  return 0;
}

int RunCalibrate() {
  if (FLAGS_output.empty()) return Usage("calibrate needs --output=FILE (the cost model it writes)");
  auto cl = Connect();
  if (!cl.ok()) return Fail("calibrate", cl.status());
  CalibrateOptions o;
  o.rows = FLAGS_calibrate_rows;
  o.reps = FLAGS_calibrate_reps;
  o.write_caches = FLAGS_calibrate_caches;
  auto cal = Calibrate(cl->get(), o, &std::cout);
  if (!cal.ok()) return Fail("calibrate", cal.status());
  std::cout << "dim | batch x pooling | measured ms (median over workers) | fit ms\n";
  for (const auto& row : cal->lookups) {
    std::cout << absl::StrFormat("%3d | %6d x %-4d    | %10.3f | %10.3f\n", row.dim, row.batch,
                                 row.pooling_factor, row.measured_ms, row.predicted_ms);
  }
  std::cout << absl::StrFormat(
                   "fit: %.4f ms per call (a second shard in the call adds %.4f) + %.2f ns per "
                   "id + %.3f GB/s gathered + %.3f GB/s on the wire (r2 %.3f); backward "
                   "multiplier %.2f\n",
                   cal->fit.overhead_ms, cal->per_shard_overhead_ms,
                   cal->fit.ms_per_id * 1e6,
                   cal->fit.ms_per_gathered_byte > 0 ? 1e-6 / cal->fit.ms_per_gathered_byte : 0.0,
                   cal->fit.ms_per_wire_byte > 0 ? 1e-6 / cal->fit.ms_per_wire_byte : 0.0,
                   cal->fit.r2, cal->bwd_compute_multiplier);
  if (cal->cache_bytes > 0) {
    std::cout << absl::StrFormat("caches: %.1f MiB per worker, rows read from them at %.1f GB/s%s\n",
                                 cal->cache_bytes / 1048576.0, cal->cache_bw_gbps,
                                 FLAGS_calibrate_caches
                                     ? ""
                                     : " (not written: --calibrate_caches writes them)");
  } else {
    std::cout << "caches: none modelled (not measured, or saving under 5% of a small "
                 "table's step)\n";
  }
  if (cal->ssd_bw_gbps > 0) {
    std::cout << absl::StrFormat("ssd: rows read from the key_value files at %.3f GB/s\n",
                                 cal->ssd_bw_gbps);
  } else {
    std::cout << "ssd: not measured (ssd_bw_gbps left at the default's)\n";
  }
  for (const auto& [table, curve] : cal->curves) {
    const int64_t n = cal->curve_samples.at(table);
    std::cout << absl::StrFormat(
        "hit-rate curve of table '%s': %.3f at a 5%% cache, %.3f at 20%%, %.3f at 50%% (%d "
        "sampled accesses)%s\n",
        table, curve[2], curve[4], curve[6], n,
        n >= cli::kMinCurveSamples ? "" : "; not written: too few");
  }
  if (absl::Status s = WriteFile(FLAGS_output, planner::CostModelToJson(cal->model, cal->device));
      !s.ok()) {
    return Fail("calibrate", s);
  }
  std::cout << "wrote " << FLAGS_output << " (use: --cost_model=" << FLAGS_output
            << " on the coordinator and emberctl plan)" << std::endl;
  return 0;
}

int RunCreate() {
  if (FLAGS_spec.empty()) return Usage("create needs --spec=FILE");
  if (!FLAGS_plan.empty() && !FLAGS_sharding_type.empty()) {
    return Usage("create takes --plan or --sharding_type, not both");
  }
  auto spec = ReadCollectionSpec(FLAGS_spec);
  if (!spec.ok()) return Fail("create", spec.status());
  ember::v1::ShardingPlan plan;
  if (!FLAGS_plan.empty()) {
    auto text = ReadFile(FLAGS_plan);
    if (!text.ok()) return Fail("create", text.status());
    auto parsed = planner::ParsePlanJson(*text);
    if (!parsed.ok()) return Fail("create", parsed.status());
    plan = *std::move(parsed);
  }
  auto cl = Connect();
  if (!cl.ok()) return Fail("create", cl.status());
  auto info = FLAGS_plan.empty() ? (*cl)->CreateCollection(*spec, FLAGS_sharding_type)
                                 : (*cl)->CreateCollectionWithPlan(*spec, plan);
  if (!info.ok()) return Fail("create", info.status());
  PrintPlan(*info);
  return 0;
}

int RunLivePlan() {
  if (FLAGS_collection.empty()) return Usage("plan --coordinator needs --collection=NAME");
  auto cl = Connect();
  if (!cl.ok()) return Fail("plan", cl.status());
  auto info = (*cl)->GetCollection(FLAGS_collection);
  if (!info.ok()) return Fail("plan", info.status());
  PrintPlan(*info);
  return 0;
}

int RunStatus() {
  absl::Duration window;
  if (!absl::ParseDuration(FLAGS_rate_window, &window) || window < absl::ZeroDuration()) {
    return Usage("--rate_window must be a duration >= 0 (e.g. 1s)");
  }
  auto cl = Connect();
  if (!cl.ok()) return Fail("status", cl.status());
  auto workers = (*cl)->ListWorkers();
  if (!workers.ok()) return Fail("status", workers.status());
  std::cout << "coordinator " << FLAGS_coordinator << ": " << workers->workers_size()
            << " worker(s)" << std::endl;
  // Two samples of every live worker's counters, --rate_window apart.
  std::map<std::string, ember::v1::ShardStatusResponse> first, second;
  for (const auto& s : workers->workers()) {
    if (!s.live()) continue;
    auto st = (*cl)->WorkerStatus(s.info().address());
    if (st.ok()) first[s.worker_id()] = *st;
  }
  if (window > absl::ZeroDuration() && !first.empty()) absl::SleepFor(window);
  for (const auto& s : workers->workers()) {
    if (!first.count(s.worker_id())) continue;
    auto st = (*cl)->WorkerStatus(s.info().address());
    if (st.ok()) second[s.worker_id()] = *st;
  }
  const double seconds = std::max(absl::ToDoubleSeconds(window), 1e-9);
  for (const auto& s : workers->workers()) {
    std::cout << "  " << s.worker_id() << " " << s.info().address() << " host " << s.info().host()
              << " pid " << s.info().pid() << " "
              << (s.info().device() == ember::v1::CUDA ? "cuda" : "cpu") << " transports "
              << absl::StrJoin(s.info().transports(), ",") << " "
              << (s.live() ? "live" : "LEASE LAPSED") << " (heartbeat " << s.ms_since_heartbeat()
              << " ms ago)" << std::endl;
    auto a = first.find(s.worker_id());
    if (a == first.end()) continue;
    const int64_t capacity = s.info().device() == ember::v1::CUDA ? s.info().hbm_bytes()
                                                                  : s.info().ddr_bytes();
    const int64_t used = std::max<int64_t>(0, capacity - a->second.available_bytes());
    std::cout << absl::StrFormat("    %s, memory %.2f of %.2f GiB used, %d shard(s)",
                                 a->second.backend(), used / double(1 << 30),
                                 capacity / double(1 << 30), a->second.shards_size());
    if (a->second.shm_channels() > 0 || a->second.placed_lookups() > 0 ||
        a->second.id_buffer_lookups() > 0) {
      std::cout << absl::StrFormat(", %d shared-memory channel(s), %d lookup(s) written into "
                                   "trainers' KeyedTensors, %d read ids from their "
                                   "KeyedJaggedTensors",
                                   a->second.shm_channels(), a->second.placed_lookups(),
                                   a->second.id_buffer_lookups());
    }
    if (a->second.link_channels() > 0 || a->second.link_lookups() > 0) {
      std::cout << absl::StrFormat(", %d link channel(s), %d lookup(s) through links",
                                   a->second.link_channels(), a->second.link_lookups());
    }
    auto b = second.find(s.worker_id());
    if (b != second.end()) {
      std::cout << absl::StrFormat(
          ", %.1f lookups/s (%.3g ids/s), %.1f updates/s",
          (b->second.lookups() - a->second.lookups()) / seconds,
          (b->second.lookup_ids() - a->second.lookup_ids()) / seconds,
          (b->second.updates() - a->second.updates()) / seconds);
    }
    std::cout << std::endl;
  }
  // The hit-rate curves the cached tables' shards learned (ShardInfo.lru_*),
  // by collection and table.
  struct Curve {
    int64_t sampled = 0;
    std::vector<int64_t> hits;
  };
  std::map<std::pair<std::string, std::string>, Curve> curves;
  for (const auto& [id, st] : first) {
    for (const auto& sh : st.shards()) {
      Curve& c = curves[{sh.collection(), sh.shard().table()}];
      AddLearnedCurve(sh, &c.sampled, &c.hits);
    }
  }
  auto collections = (*cl)->ListCollections();
  if (!collections.ok()) return Fail("status", collections.status());
  std::cout << collections->size() << " collection(s)" << std::endl;
  for (const auto& c : *collections) {
    std::cout << "  " << c.spec().name() << " epoch " << c.plan().epoch() << " "
              << ember::v1::CollectionInfo::State_Name(c.state()) << ", "
              << c.spec().tables_size() << " table(s) on " << c.worker_addresses_size()
              << " rank(s)" << std::endl;
    if (c.recovered_unix_ms() > 0) {
      std::cout << "    last recovery: "
                << absl::FormatTime(absl::FromUnixMillis(c.recovered_unix_ms())) << " from "
                << (c.recovered_from().empty() ? "(no checkpoint)" : c.recovered_from())
                << std::endl;
    }
    if (!c.note().empty()) std::cout << "    " << c.note() << std::endl;
    PrintTables(c.spec());
    for (const auto& t : c.spec().tables()) {
      auto it = curves.find({c.spec().name(), t.name()});
      if (it == curves.end() || it->second.sampled == 0) continue;
      const double n = static_cast<double>(it->second.sampled);
      const std::vector<int64_t>& h = it->second.hits;
      std::cout << absl::StrFormat(
                       "    %s: an LRU cache would hit %.3f of its rows' accesses at 5%% of its "
                       "rows, %.3f at 20%%, %.3f at 50%% (learned from %d sampled accesses)",
                       t.name(), h[2] / n, h[4] / n, h[6] / n, it->second.sampled)
                << std::endl;
    }
  }
  return 0;
}

int RunLookup() {
  if (FLAGS_collection.empty() || FLAGS_input.empty() || FLAGS_output.empty()) {
    return Usage("lookup needs --collection, --input=kjt.json and --output=out.json");
  }
  auto text = ReadFile(FLAGS_input);
  if (!text.ok()) return Fail("lookup", text.status());
  auto kjt = ParseKjtJson(*text);
  if (!kjt.ok()) return Fail("lookup", kjt.status());
  auto cl = Connect();
  if (!cl.ok()) return Fail("lookup", cl.status());
  auto kt = (*cl)->Lookup(FLAGS_collection, *kjt);
  if (!kt.ok()) return Fail("lookup", kt.status());
  if (absl::Status s = WriteFile(FLAGS_output, KeyedTensorToJson(*kt)); !s.ok()) {
    return Fail("lookup", s);
  }
  return 0;
}

int RunApplyGradients() {
  if (FLAGS_collection.empty() || FLAGS_input.empty() || FLAGS_grads.empty()) {
    return Usage("apply-gradients needs --collection, --input=kjt.json and --grads=grads.json");
  }
  auto text = ReadFile(FLAGS_input);
  if (!text.ok()) return Fail("apply-gradients", text.status());
  auto kjt = ParseKjtJson(*text);
  if (!kjt.ok()) return Fail("apply-gradients", kjt.status());
  auto gtext = ReadFile(FLAGS_grads);
  if (!gtext.ok()) return Fail("apply-gradients", gtext.status());
  auto grads = ParseKeyedTensorJson(*gtext);
  if (!grads.ok()) return Fail("apply-gradients", grads.status());
  auto cl = Connect();
  if (!cl.ok()) return Fail("apply-gradients", cl.status());
  std::string request_id;
  absl::Status s = (*cl)->ApplyGradients(FLAGS_collection, *kjt, *grads, FLAGS_request_id,
                                         &request_id);
  // Printed either way: after a partial failure, a retry with
  // --request_id=<this> applies the rest exactly once.
  std::cout << "request_id " << request_id << std::endl;
  if (!s.ok()) return Fail("apply-gradients", s);
  return 0;
}

std::string FormatBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  snprintf(buf, sizeof(buf), "%.1f %s", bytes, units[u]);
  return buf;
}

void PrintCheckpoint(const ember::v1::CheckpointInfo& c) {
  const double rate = c.write_ms() > 0 ? c.bytes() / (c.write_ms() / 1000.0) : 0;
  std::cout << "checkpoint " << c.path() << "\n  collection '" << c.collection() << "' epoch "
            << c.epoch() << ": " << c.shards() << " shard file(s), " << FormatBytes(c.bytes())
            << "; updates paused " << c.max_pause_ms() << " ms, written in " << c.write_ms()
            << " ms (" << FormatBytes(rate) << "/s), committed after " << c.total_ms() << " ms"
            << std::endl;
  if (!c.base().empty()) {
    std::cout << "  incremental: " << c.delta_shards() << " delta shard(s) holding "
              << c.changed_rows() << " changed row(s), over " << c.base() << " (a restore reads "
              << c.chain_length() << " checkpoints)" << std::endl;
  }
}

int RunCheckpoint() {
  if (FLAGS_collection.empty()) return Usage("checkpoint needs --collection=NAME");
  auto cl = Connect();
  if (!cl.ok()) return Fail("checkpoint", cl.status());
  std::cout << "checkpointing '" << FLAGS_collection << "'..." << std::endl;
  absl::StatusOr<ember::v1::CheckpointInfo> info;
  absl::Notification finished;
  std::thread call([&] {
    info = (*cl)->Checkpoint(FLAGS_collection, FLAGS_dir,
                             absl::Seconds(FLAGS_checkpoint_timeout_s), FLAGS_incremental);
    finished.Notify();
  });
  // Progress once a second while the workers write: bytes, rate, time left.
  const absl::Time start = absl::Now();
  while (!finished.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    auto list = (*cl)->ListCheckpoints(FLAGS_collection);
    if (!list.ok()) continue;
    for (const auto& c : *list) {
      if (!c.in_progress() || c.total_bytes() <= 0) continue;
      const double secs = absl::ToDoubleSeconds(absl::Now() - start);
      const double rate = c.bytes() / std::max(secs, 1e-3);
      const double left = rate > 0 ? (c.total_bytes() - c.bytes()) / rate : 0;
      std::cout << "  written " << FormatBytes(c.bytes()) << " of " << FormatBytes(c.total_bytes())
                << " (" << FormatBytes(rate) << "/s, about " << static_cast<int>(left + 0.5)
                << " s left)" << std::endl;
    }
  }
  call.join();
  if (!info.ok()) return Fail("checkpoint", info.status());
  PrintCheckpoint(*info);
  return 0;
}

int RunCheckpoints() {
  auto cl = Connect();
  if (!cl.ok()) return Fail("checkpoints", cl.status());
  auto list = (*cl)->ListCheckpoints(FLAGS_collection);
  if (!list.ok()) return Fail("checkpoints", list.status());
  std::cout << list->size() << " checkpoint(s) in the coordinator's catalogue" << std::endl;
  for (const auto& c : *list) PrintCheckpoint(c);
  return 0;
}

int RunRestore() {
  if (FLAGS_from.empty()) return Usage("restore needs --from=CHECKPOINT_OR_ROOT");
  auto cl = Connect();
  if (!cl.ok()) return Fail("restore", cl.status());
  std::cout << "restoring from " << FLAGS_from << " (every file is verified first)..."
            << std::endl;
  const absl::Time start = absl::Now();
  absl::StatusOr<ember::v1::RestoreResponse> r;
  absl::Notification finished;
  std::thread call([&] {
    r = (*cl)->Restore(FLAGS_from, FLAGS_collection, FLAGS_sharding_type,
                       absl::Seconds(FLAGS_checkpoint_timeout_s));
    finished.Notify();
  });
  // Progress once a second: bytes verified, then the workers loading.
  std::string last_phase;
  while (!finished.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    auto list = (*cl)->ListRestores(FLAGS_collection);
    if (!list.ok() || list->empty()) continue;
    const ember::v1::RestoreProgress& p = list->front();
    if (p.phase() == "loading") {
      if (last_phase != "loading") {
        std::cout << "  verified; loading on " << p.workers() << " worker(s)" << std::endl;
      }
    } else {
      std::cout << "  verified " << FormatBytes(p.bytes_verified()) << " of "
                << FormatBytes(p.total_bytes()) << std::endl;
    }
    last_phase = p.phase();
  }
  call.join();
  if (!r.ok()) return Fail("restore", r.status());
  PrintPlan(r->collection());
  std::cout << "restored '" << r->collection().spec().name() << "' from "
            << r->checkpoint().path() << " (" << FormatBytes(r->checkpoint().bytes())
            << ", taken at epoch " << r->checkpoint().epoch() << ") in "
            << absl::ToDoubleSeconds(absl::Now() - start) << " s" << std::endl;
  return 0;
}

int RunSetTrainers() {
  if (FLAGS_collection.empty() || FLAGS_trainers < 1 || FLAGS_from_step < 0) {
    return Usage("set-trainers needs --collection=NAME, --trainers=N (>= 1) and --from_step=S (>= 0)");
  }
  auto cl = Connect();
  if (!cl.ok()) return Fail("set-trainers", cl.status());
  auto info = (*cl)->SetTrainers(FLAGS_collection, FLAGS_trainers, FLAGS_from_step);
  if (!info.ok()) return Fail("set-trainers", info.status());
  std::cout << "collection '" << FLAGS_collection << "': " << FLAGS_trainers
            << " trainer(s) from step " << FLAGS_from_step << " on every worker" << std::endl;
  return 0;
}

int RunDrain() {
  if (FLAGS_worker.empty()) return Usage("drain needs --worker=ID (see emberctl status)");
  auto cl = Connect();
  if (!cl.ok()) return Fail("drain", cl.status());
  std::cout << "draining " << FLAGS_worker << "..." << std::endl;
  auto moved = (*cl)->DrainWorker(FLAGS_worker, absl::Seconds(FLAGS_checkpoint_timeout_s));
  if (!moved.ok()) return Fail("drain", moved.status());
  std::cout << "drained " << FLAGS_worker << ": " << moved->size()
            << " collection(s) moved off it; it holds nothing and gets no new shards"
            << std::endl;
  return 0;
}

int RunScale() {
  if (FLAGS_collection.empty()) return Usage("scale needs --collection=NAME");
  if (gflags::GetCommandLineFlagInfoOrDie("workers").is_default || FLAGS_workers < 1) {
    return Usage("scale needs --workers=N (>= 1): the worker count to serve the collection from");
  }
  auto cl = Connect();
  if (!cl.ok()) return Fail("scale", cl.status());
  auto before = (*cl)->GetCollection(FLAGS_collection);
  if (!before.ok()) return Fail("scale", before.status());
  std::cout << "scaling '" << FLAGS_collection << "' to " << FLAGS_workers
            << " worker(s); training goes on while its shards are copied..." << std::endl;
  // Progress: the collection's note (blocks copied, catch-up rounds, the
  // fence) as it changes, from a second connection.
  absl::Notification finished;
  std::thread progress([&] {
    auto watcher = Connect();
    if (!watcher.ok()) return;
    std::string last;
    while (!finished.WaitForNotificationWithTimeout(absl::Milliseconds(500))) {
      auto now = (*watcher)->GetCollection(FLAGS_collection);
      if (!now.ok() || now->note() == last || now->note().empty()) continue;
      last = now->note();
      std::cout << "  " << last << std::endl;
    }
  });
  auto scaled =
      (*cl)->ScaleCollection(FLAGS_collection, FLAGS_workers,
                             absl::Seconds(FLAGS_checkpoint_timeout_s));
  finished.Notify();
  progress.join();
  if (!scaled.ok()) return Fail("scale", scaled.status());
  if (scaled->shards_moved() == 0) {
    std::cout << "'" << FLAGS_collection << "' is served from " << FLAGS_workers
              << " worker(s) already; nothing moved" << std::endl;
    return 0;
  }
  std::cout << absl::StrFormat(
                   "scaled '%s' to %d worker(s) at epoch %d: %d shard(s) filled, %.1f MiB "
                   "copied (%.1f MiB between workers) in %.2f s; updates fenced %.0f ms",
                   FLAGS_collection, FLAGS_workers, scaled->collection().plan().epoch(),
                   scaled->shards_moved(), scaled->bytes_copied() / 1048576.0,
                   scaled->bytes_between_workers() / 1048576.0, scaled->seconds(),
                   scaled->fence_ms())
            << std::endl;
  return 0;
}

namespace {

// 24 random bytes from the kernel, as 48 hex characters.
absl::StatusOr<std::string> RandomToken() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  char bytes[24];
  if (!in.read(bytes, sizeof(bytes))) return absl::UnavailableError("cannot read /dev/urandom");
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

// Writes `text` to a new file readable by its owner only; refuses to
// replace one.
absl::Status WriteSecret(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::AlreadyExistsError(
        absl::StrCat(path, ": ", errno == EEXIST ? "exists (not replaced)" : strerror(errno)));
  }
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok ? absl::OkStatus() : absl::InternalError(absl::StrCat("writing ", path));
}

}  // namespace

int RunTokens() {
  if (FLAGS_dir.empty()) return Usage("tokens needs --dir=DIR (where the token files go)");
  std::vector<std::string> names = absl::StrSplit(FLAGS_worker_names, ',', absl::SkipEmpty());
  if (names.empty()) {
    if (FLAGS_workers < 1) return Usage("--workers must be >= 1");
    for (int i = 0; i < FLAGS_workers; ++i) names.push_back(absl::StrCat("worker-", i));
  }
  auto admin = RandomToken();
  auto trainer = RandomToken();
  if (!admin.ok() || !trainer.ok()) return Fail("tokens", admin.ok() ? trainer.status() : admin.status());
  const std::string roles = absl::StrCat("admin ", *admin, "\ntrainer ", *trainer, "\n");
  std::string workers;  // "worker NAME TOKEN\n" lines
  std::map<std::string, std::string> worker_lines;
  for (const std::string& name : names) {
    const bool plain = name[0] != '.' && name.find_first_not_of(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == std::string::npos;
    if (worker_lines.count(name) || !plain) {
      return Usage(absl::StrCat("worker name '", name,
                                "' is repeated, or not letters, digits, '.', '_' and '-'"));
    }
    auto t = RandomToken();
    if (!t.ok()) return Fail("tokens", t.status());
    worker_lines[name] = absl::StrCat("worker ", name, " ", *t, "\n");
    workers += worker_lines[name];
  }
  const std::string header = "# Ember tokens (emberctl tokens); keep this file secret.\n";
  // The servers' file (coordinator; `up`); each worker's own (its line
  // only, so a worker's host holds no other worker's token); the clients'.
  std::vector<std::pair<std::string, std::string>> files = {
      {"servers.tokens", header + roles + workers},
      {"admin.token", *admin + "\n"},
      {"trainer.token", *trainer + "\n"}};
  for (const std::string& name : names) {
    files.push_back({absl::StrCat("workers/", name, ".tokens"), header + roles + worker_lines[name]});
  }
  // All or nothing: no file is replaced, none written if one exists.
  for (const auto& [file, text] : files) {
    if (std::filesystem::exists(FLAGS_dir + "/" + file)) {
      return Fail("tokens", absl::AlreadyExistsError(absl::StrCat(
                                FLAGS_dir, "/", file, " exists; nothing written (use a new --dir)")));
    }
  }
  std::error_code made;
  std::filesystem::create_directories(FLAGS_dir + "/workers", made);
  if (made) {
    return Fail("tokens", absl::InvalidArgumentError(
                              absl::StrCat("cannot create ", FLAGS_dir, "/workers: ", made.message())));
  }
  for (const auto& [file, text] : files) {
    if (absl::Status s = WriteSecret(FLAGS_dir + "/" + file, text); !s.ok()) {
      return Fail("tokens", s);
    }
  }
  std::cout << "wrote " << files.size() << " files to " << FLAGS_dir
            << ": servers.tokens (the coordinator, `up`), workers/NAME.tokens (each worker's "
               "own: --auth_token_file, with --worker_name=NAME), admin.token and trainer.token "
               "(clients)"
            << std::endl;
  return 0;
}

int RunExport() {
  if (FLAGS_collection.empty() || FLAGS_table.empty() || FLAGS_output.empty()) {
    return Usage("export needs --collection, --table and --output=FILE.npy");
  }
  auto cl = Connect();
  if (!cl.ok()) return Fail("export", cl.status());
  auto info = (*cl)->GetCollection(FLAGS_collection);
  if (!info.ok()) return Fail("export", info.status());
  for (const auto& t : info->spec().tables()) {
    if (t.name() != FLAGS_table || !t.has_dynamic()) continue;
    // A dynamic table: its rows, and the ids they hold beside them.
    std::vector<int64_t> ids;
    std::vector<float> rows;
    int64_t dim = 0;
    if (absl::Status s = (*cl)->ExportDynamicTable(FLAGS_collection, FLAGS_table, &ids, &rows, &dim);
        !s.ok()) {
      return Fail("export", s);
    }
    std::string ids_path = FLAGS_output;
    if (absl::EndsWith(ids_path, ".npy")) ids_path.resize(ids_path.size() - 4);
    ids_path += ".ids.npy";
    if (absl::Status s = WriteFile(FLAGS_output, NpyFloat32(rows, ids.size(), dim)); !s.ok()) {
      return Fail("export", s);
    }
    if (absl::Status s = WriteFile(ids_path, NpyInt64(ids)); !s.ok()) return Fail("export", s);
    std::cout << "exported dynamic table " << FLAGS_table << ": " << ids.size() << " rows of "
              << dim << " to " << FLAGS_output << ", their ids to " << ids_path << std::endl;
    return 0;
  }
  int64_t rows = 0, dim = 0;
  auto values = (*cl)->ExportTable(FLAGS_collection, FLAGS_table, &rows, &dim);
  if (!values.ok()) return Fail("export", values.status());
  if (absl::Status s = WriteFile(FLAGS_output, NpyFloat32(*values, rows, dim)); !s.ok()) {
    return Fail("export", s);
  }
  std::cout << "exported " << FLAGS_table << " [" << rows << ", " << dim << "] to " << FLAGS_output
            << std::endl;
  return 0;
}

}  // namespace cli
}  // namespace ember
