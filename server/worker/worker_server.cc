#include "server/worker/worker_server.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <utility>

#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/backend/backend_factory.h"
#include "server/common/grpc_util.h"
#include "server/common/host_memory.h"

namespace ember {
namespace worker {
namespace {

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// The worker's own series: traffic, memory, shards, exactly-once records.
void AddWorkerMetrics(const WorkerService* service, ServerMetrics* m) {
  using Stats = WorkerService::Stats;
  auto one = [service](int64_t Stats::*field) {
    return [service, field]() {
      return std::vector<ServerMetrics::Sample>{{{}, static_cast<double>(service->GetStats().*field)}};
    };
  };
  m->AddCounter("ember_worker_lookups_total", "Lookup calls served", one(&Stats::lookups));
  m->AddCounter("ember_worker_lookup_ids_total", "Ids looked up", one(&Stats::lookup_ids));
  m->AddCounter("ember_worker_prefetches_total",
                "Prefetch calls served (rows brought into caches for the next call)",
                one(&Stats::prefetches));
  m->AddCounter("ember_worker_prefetch_ids_total", "Ids named by prefetch calls",
                one(&Stats::prefetch_ids));
  m->AddCounter("ember_worker_lookup_bytes_total", "Bytes of lookup ids and outputs",
                one(&Stats::lookup_bytes));
  m->AddCounter("ember_worker_optimizer_steps_total", "ApplyGradients calls applied",
                one(&Stats::updates));
  m->AddCounter("ember_worker_gradient_ids_total", "Ids of applied gradients",
                one(&Stats::update_ids));
  m->AddCounter("ember_worker_duplicate_updates_total",
                "Updates answered from the exactly-once record (not applied again)",
                one(&Stats::duplicates));
  m->AddCounter("ember_worker_nonfinite_refused_total", "Calls refused for NaN/Inf",
                one(&Stats::nonfinite_refused));
  m->AddCounter("ember_worker_nonfinite_skipped_ids_total", "Ids left out for NaN/Inf",
                one(&Stats::nonfinite_skipped_ids));
  m->AddCounter("ember_worker_overflow_refused_total",
                "Updates refused because a result would overflow its type or state",
                one(&Stats::overflow_refused));
  m->AddCounter("ember_worker_overflow_skipped_rows_total",
                "Update rows left as they were because their update would overflow",
                one(&Stats::overflow_skipped_rows));
  // Per table, labelled by collection and table.
  auto per_table = [service](int64_t WorkerService::TableStats::*field) {
    return [service, field]() {
      std::vector<ServerMetrics::Sample> out;
      for (const WorkerService::TableStats& t : service->GetTableStats()) {
        out.push_back({{{"collection", t.collection}, {"table", t.table}},
                       static_cast<double>(t.*field)});
      }
      return out;
    };
  };
  m->AddCounter("ember_worker_table_lookup_ids_total",
                "Ids looked up, per collection and table (this worker's shards)",
                per_table(&WorkerService::TableStats::lookup_ids));
  m->AddCounter("ember_worker_table_gradient_ids_total",
                "Ids of applied gradients, per collection and table (this worker's shards)",
                per_table(&WorkerService::TableStats::gradient_ids));
  m->AddGauge("ember_worker_table_shards", "Shards held, per collection and table",
              per_table(&WorkerService::TableStats::shards));
  // key_value tables (rows on local SSD under a cache) and fused_uvm_caching
  // ones (rows in host memory under a cache in GPU memory), per collection
  // and table.
  auto tier = [service](int64_t backend::TierStats::*f) {
    return [service, f]() {
      std::vector<ServerMetrics::Sample> out;
      for (const WorkerService::TableStats& t : service->GetTableStats()) {
        if (!t.key_value) continue;
        out.push_back({{{"collection", t.collection}, {"table", t.table}},
                       static_cast<double>(t.tier.*f)});
      }
      return out;
    };
  };
  m->AddGauge("ember_worker_key_value_cache_rows",
              "Rows a key_value (or fused_uvm_caching) table may cache in memory (GPU memory "
              "for fused_uvm_caching)",
              tier(&backend::TierStats::cache_rows));
  m->AddGauge("ember_worker_key_value_cached_rows", "Rows of a key_value table in memory now",
              tier(&backend::TierStats::cached_rows));
  m->AddCounter("ember_worker_key_value_hits_total",
                "Rows a call found in memory (each row once a call)",
                tier(&backend::TierStats::hits));
  m->AddCounter("ember_worker_key_value_fills_total", "Rows a call brought into memory",
                tier(&backend::TierStats::fills));
  m->AddCounter("ember_worker_key_value_prefetched_rows_total",
                "Fills that a prefetch made ahead of the call that uses them (also in fills)",
                tier(&backend::TierStats::prefetched));
  m->AddCounter("ember_worker_key_value_disk_reads_total",
                "Fills read from the SSD file, or from host memory for fused_uvm_caching (the "
                "others were never written)",
                tier(&backend::TierStats::disk_reads));
  m->AddCounter("ember_worker_key_value_write_backs_total",
                "Changed rows written to the SSD file (host memory for fused_uvm_caching) as "
                "they left the cache",
                tier(&backend::TierStats::write_backs));
  m->AddCounter("ember_worker_key_value_evictions_total", "Rows that left memory",
                tier(&backend::TierStats::evictions));
  m->AddGauge("ember_worker_key_value_file_bytes", "Bytes of a key_value table's SSD files",
              tier(&backend::TierStats::file_bytes));
  m->AddGauge(
      "ember_worker_key_value_lru_hit_rate",
      "The hit rate an LRU cache of cache_fraction of a key_value table's rows would have had "
      "on its traffic since it was created (learned from sampled rows; for choosing "
      "cache_load_factor)",
      [service]() {
        std::vector<ServerMetrics::Sample> out;
        for (const WorkerService::TableStats& t : service->GetTableStats()) {
          if (!t.key_value || t.tier.sampled == 0) continue;
          for (size_t i = 0; i < backend::kLruCurveFractions.size(); ++i) {
            out.push_back({{{"collection", t.collection},
                            {"table", t.table},
                            {"cache_fraction", absl::StrCat(backend::kLruCurveFractions[i])}},
                           static_cast<double>(t.tier.curve_hits[i]) /
                               static_cast<double>(t.tier.sampled)});
          }
        }
        return out;
      });
  // Dynamic (hash-keyed) tables, per collection and table.
  using Dyn = backend::DynamicStats;
  auto dynamic = [service](auto value) {
    return [service, value]() {
      std::vector<ServerMetrics::Sample> out;
      for (const WorkerService::TableStats& t : service->GetTableStats()) {
        if (!t.dynamic) continue;
        for (auto& [labels, v] : value(t.dyn)) {
          ServerMetrics::Sample s{{{"collection", t.collection}, {"table", t.table}}, v};
          s.labels.insert(labels.begin(), labels.end());
          out.push_back(std::move(s));
        }
      }
      return out;
    };
  };
  using Labelled = std::vector<std::pair<std::map<std::string, std::string>, double>>;
  auto field = [](int64_t Dyn::*f) {
    return [f](const Dyn& d) { return Labelled{{{}, static_cast<double>(d.*f)}}; };
  };
  m->AddGauge("ember_worker_dynamic_rows", "Rows a dynamic table holds on this worker",
              dynamic(field(&Dyn::rows_held)));
  m->AddGauge("ember_worker_dynamic_capacity", "Rows a dynamic table may hold on this worker",
              dynamic(field(&Dyn::capacity)));
  m->AddGauge("ember_worker_dynamic_load_factor",
              "Rows held / hash index entries (the index is kept at most half full)",
              dynamic([](const Dyn& d) {
                return Labelled{{{}, d.index_slots > 0 ? static_cast<double>(d.rows_held) /
                                                             static_cast<double>(d.index_slots)
                                                       : 0.0}};
              }));
  m->AddCounter("ember_worker_dynamic_admitted_total",
                "Rows created for ids that reached admit_after (imports: reason=import)",
                dynamic([](const Dyn& d) {
                  return Labelled{{{{"reason", "update"}}, static_cast<double>(d.admitted)},
                                  {{{"reason", "import"}}, static_cast<double>(d.imported)}};
                }));
  m->AddCounter("ember_worker_dynamic_evicted_total", "Rows evicted, by reason",
                dynamic([](const Dyn& d) {
                  return Labelled{{{{"reason", "ttl"}}, static_cast<double>(d.evicted_ttl)},
                                  {{{"reason", "lru"}}, static_cast<double>(d.evicted_lru)},
                                  {{{"reason", "lfu"}}, static_cast<double>(d.evicted_lfu)},
                                  {{{"reason", "import"}}, static_cast<double>(d.evicted_import)}};
                }));
  m->AddCounter("ember_worker_dynamic_dropped_gradient_ids_total",
                "Gradient ids left out: ids still below admit_after, or with no room in their step",
                dynamic(field(&Dyn::dropped_pending)));
  m->AddCounter("ember_worker_dynamic_no_room_total",
                "Admitted ids that found no row in their step (every row was that step's)",
                dynamic(field(&Dyn::dropped_no_room)));
  m->AddGauge("ember_worker_dynamic_pending_ids",
              "Ids counted toward admission exactly (past the bound: the sketch)",
              dynamic(field(&Dyn::pending_ids)));
  m->AddCounter("ember_worker_dynamic_sketch_counts_total",
                "Occurrences counted by the approximate (count-min) admission sketch",
                dynamic(field(&Dyn::sketch_counts)));
  m->AddGauge("ember_worker_available_bytes", "Shard memory still free on the worker's device",
              one(&Stats::available_bytes));
  m->AddGauge("ember_worker_available_mapped_bytes",
              "Host memory still free for fused_uvm shards (mapped into the GPU; 0 where the "
              "kernel is not served)",
              one(&Stats::available_mapped_bytes));
  m->AddGauge("ember_worker_shards", "Shards held", one(&Stats::shards));
  m->AddGauge("ember_worker_collections", "Collections with shards here", one(&Stats::collections));
  m->AddGauge("ember_worker_request_ids", "Update ids remembered for exactly-once",
              one(&Stats::request_ids));
  m->AddGauge("ember_worker_calls_in_progress",
              "Lookups and gradient updates in the worker, running or waiting for the backend",
              one(&Stats::calls_in_progress));
  m->AddGauge("ember_worker_shm_channels", "Shared-memory channels open (trainers on this host)",
              one(&Stats::shm_channels));
  m->AddGauge("ember_worker_link_channels",
              "Link channels open (bulk arrays over an NCCL or socket link)",
              one(&Stats::link_channels));
  m->AddCounter("ember_worker_link_lookups_total", "Lookups served through link channels",
                one(&Stats::link_lookups));
  m->AddCounter("ember_worker_link_channels_opened_total",
                "Link channels opened (each joins a new NCCL or socket link)",
                one(&Stats::link_channels_opened));
  m->AddCounter("ember_worker_placed_lookups_total",
                "Lookups whose outputs went straight into the trainer's output buffer (same host)",
                one(&Stats::placed_lookups));
  m->AddCounter("ember_worker_id_buffer_lookups_total",
                "Lookups that read their ids straight from the trainer's KeyedJaggedTensor (same host)",
                one(&Stats::id_buffer_lookups));
  m->AddCounter("ember_worker_backend_seconds_total",
                "Time inside the embedding backend (the worker's compute, without transport)",
                [service]() {
                  const Stats s = service->GetStats();
                  return std::vector<ServerMetrics::Sample>{
                      {{{"call", "lookup"}}, s.backend_lookup_ns * 1e-9},
                      {{{"call", "update"}}, s.backend_update_ns * 1e-9}};
                });
  m->AddCounter("ember_worker_steps_applied_total",
                "Training steps applied (SYNC and BOUNDED collections: every rank's update merged)",
                one(&Stats::steps_applied));
  m->AddCounter("ember_worker_steps_aborted_total",
                "Training steps dropped: a rank missing past step_timeout_s, or the step failed",
                one(&Stats::steps_aborted));
  m->AddCounter("ember_worker_step_ranks_missing_total",
                "Ranks absent from aborted steps, summed", one(&Stats::step_ranks_missing));
  m->AddCounter("ember_worker_step_wait_seconds_total",
                "Time updates and lookups waited for training steps (SYNC and BOUNDED)",
                [service]() {
                  return std::vector<ServerMetrics::Sample>{
                      {{}, service->GetStats().step_wait_ns * 1e-9}};
                });
  m->AddGauge("ember_worker_step_pending_bytes",
              "Bytes of updates held until their training step completes",
              one(&Stats::step_pending_bytes));
  m->AddCounter("ember_worker_busy_refused_total",
                "Data calls refused because --max_queued_calls were in progress",
                one(&Stats::busy_refused));
  m->AddCounter("ember_worker_replica_forwards_total",
                "Updates a primary forwarded to the backups of its shards",
                one(&Stats::forwards));
  m->AddCounter("ember_worker_replica_forward_seconds_total",
                "Time primaries waited for their backups to apply forwarded updates",
                [service]() {
                  return std::vector<ServerMetrics::Sample>{
                      {{}, service->GetStats().forward_ns * 1e-9}};
                });
  m->AddCounter("ember_worker_replica_forward_failures_total",
                "Forwards to a backup that failed (the collection's updates then wait for "
                "the coordinator to re-form its copies)",
                one(&Stats::forward_failures));
  m->AddCounter("ember_worker_replica_busy_forward_retries_total",
                "Forwards sent again to a backup that refused them as busy with a move of its "
                "collections (nothing applied there)",
                one(&Stats::busy_forward_retries));
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(
    const WorkerServerOptions& options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("a worker needs --coordinator=HOST:PORT");
  }
  std::unique_ptr<backend::EmbeddingBackend> backend;
  ember::v1::WorkerInfo info;
  bool ssd_tier = false;
  if (options.backend_factory) {
    auto b = options.backend_factory();
    if (!b.ok()) return b.status();
    backend = std::move(*b);
    info.set_device(options.device == "cuda" ? ember::v1::CUDA : ember::v1::CPU);
    info.set_ddr_bytes(backend->AvailableBytes());
  } else {
    backend::BackendConfig config;
    config.device = options.device;
    config.threads = options.threads;
    config.cuda_device = options.cuda_device;
    config.cuda_scratch_bytes = options.cuda_scratch_bytes;
    config.memory_limit_bytes = options.memory_limit_bytes;
    config.uvm_memory_bytes = options.uvm_memory_bytes;
    config.skip_overflow = options.service.skip_nonfinite;
    config.dynamic_exact_pending_ids = options.dynamic_exact_pending_ids;
    config.ssd_dir = options.ssd_dir;
    config.ssd_capacity_bytes = options.ssd_capacity_bytes;
    auto made = backend::CreateBackend(config);
    if (!made.ok()) return made.status();
    backend = std::move(made->backend);
    info.set_device(made->cuda ? ember::v1::CUDA : ember::v1::CPU);
    info.set_hbm_bytes(made->hbm_bytes);
    info.set_ddr_bytes(made->ddr_bytes);
    info.set_ssd_bytes(made->ssd_bytes);
    ssd_tier = made->ssd_bytes > 0;
    if (ssd_tier) {
      LOG(INFO) << "SSD tier for key_value shards: " << made->ssd_bytes / (1 << 20) << " MiB in "
                << options.ssd_dir << " (" << made->ssd_note << ")";
    }
    // Shard memory the host's by default: the coordinator checks it against
    // the other workers of this host (WorkerInfo.host_memory_bytes). A CUDA
    // worker's ddr_bytes is its fused_uvm shards' host memory.
    if (made->cuda ? options.uvm_memory_bytes == 0 : options.memory_limit_bytes == 0) {
      info.set_host_memory_bytes(HostMemoryBytes());
    }
    LOG(INFO) << "shard memory: " << (made->cuda ? made->hbm_bytes : made->ddr_bytes) / (1 << 20)
              << " MiB (" << made->capacity_note << ")";
    if (made->cuda) {
      LOG(INFO) << "fused_uvm shards' host memory (mapped into the GPU): "
                << made->ddr_bytes / (1 << 20) << " MiB (" << made->uvm_note << ")";
    }
  }

  if (options.max_message_bytes < (1 << 20) || options.max_message_bytes > kMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1 MiB, ",
                                                   kMaxMessageBytes, "], got ",
                                                   options.max_message_bytes));
  }
  std::unique_ptr<WorkerServer> w(new WorkerServer());
  w->options_ = options;
  const std::string backend_name = backend->Name();
  WorkerServiceOptions service = options.service;
  service.ssd_tier = service.ssd_tier || ssd_tier;
  // Room for the response's framing around the arrays.
  service.max_response_bytes =
      std::min(service.max_response_bytes, options.max_message_bytes - (int64_t{64} << 10));
  // A primary calls its backups as it calls the coordinator (TLS alike).
  if (service.peer_credentials == nullptr) service.peer_credentials = options.coordinator_credentials;
  w->service_ = std::make_unique<WorkerService>(std::move(backend), service);
  auto metrics = ServerMetrics::Start(options.metrics_bind, "worker");
  if (!metrics.ok()) return metrics.status();
  w->metrics_ = std::move(*metrics);
  AddWorkerMetrics(w->service_.get(), w->metrics_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.experimental().SetInterceptorCreators(w->metrics_->Interceptors());
  int port = 0;
  builder.AddListeningPort(options.listen,
                           options.server_credentials != nullptr
                               ? options.server_credentials
                               : grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // As the clients' channels (MakeChannel, grpc_util.h).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
  builder.RegisterService(w->service_.get());
  w->server_ = builder.BuildAndStart();
  if (!w->server_ || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  const std::string listen_host = std::string(options.listen.substr(0, options.listen.rfind(':')));
  w->address_ = absl::StrCat(listen_host, ":", port);
  if (!options.advertise_address.empty()) w->address_ = options.advertise_address;
  w->service_->SetOwnAddress(w->address_);
  info.set_address(w->address_);
  info.set_host(options.host.empty() ? HostName() : options.host);
  info.set_pid(getpid());
  for (const std::string& k : w->service_->ServedComputeKernels()) info.add_compute_kernels(k);
  info.add_transports("grpc");
  if (options.service.shared_memory) info.add_transports("shm");
  for (cuda::PeerLinks* kind : options.service.links.kinds) info.add_transports(kind->name());
  auto health = StartHealthServer(options.health_bind);
  if (!health.ok()) {
    w->server_->Shutdown();
    return health.status();
  }
  w->health_server_ = std::move(*health);
  w->coordinator_ = ember::v1::Coordinator::NewStub(
      // Reconnected within a second of a coordinator's restart: it gives
      // workers two leases to heartbeat again.
      MakeChannel(options.coordinator, options.coordinator_credentials, absl::Seconds(1)));

  // Register, retrying until the coordinator answers or the timeout passes.
  const absl::Time deadline = absl::Now() + options.register_timeout;
  absl::Status last;
  for (;;) {
    grpc::ClientContext ctx;
    w->PrepareContext(&ctx, absl::Seconds(2));
    ember::v1::RegisterWorkerRequest req;
    *req.mutable_worker() = info;
    ember::v1::RegisterWorkerResponse resp;
    const grpc::Status s = w->coordinator_->RegisterWorker(&ctx, req, &resp);
    if (s.ok()) {
      absl::MutexLock lock(&w->id_mu_);
      w->worker_id_ = resp.worker_id();
      w->lease_ = absl::Milliseconds(resp.lease_ms());
      break;
    }
    last = FromGrpc(s, "coordinator " + options.coordinator);
    // Bad arguments or credentials will not get better by retrying.
    if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED || absl::Now() > deadline) {
      w->server_->Shutdown();
      return absl::UnavailableError(absl::StrCat("cannot register: ", last.message()));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  LOG(INFO) << "worker " << w->worker_id() << " serving at " << w->address_ << " on "
            << backend_name << ", registered with " << options.coordinator;
  w->info_ = info;
  w->heartbeat_ = std::thread([raw = w.get()] { raw->HeartbeatLoop(); });
  return w;
}

void WorkerServer::PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const {
  SetDeadline(ctx, timeout);
  AddToken(ctx, options_.service.auth.SelfToken());
}

void WorkerServer::SetServing(bool serving) {
  server_->GetHealthCheckService()->SetServingStatus(serving);
  if (health_server_ != nullptr) health_server_->GetHealthCheckService()->SetServingStatus(serving);
}

std::string WorkerServer::worker_id() const {
  absl::MutexLock lock(&id_mu_);
  return worker_id_;
}

void WorkerServer::HeartbeatLoop() {
  service_->SetLease(lease_);
  bool after_pause = false;  // until a heartbeat saying so is answered
  // Fault injection (tests): EMBER_WORKER_SILENT_AFTER_MS=N stops the
  // heartbeats N ms after this point while the worker serves on, as a
  // worker cut off from the coordinator and from nothing else.
  absl::Time silent_at = absl::InfiniteFuture();
  if (const char* ms = std::getenv("EMBER_WORKER_SILENT_AFTER_MS"); ms != nullptr) {
    silent_at = absl::Now() + absl::Milliseconds(std::atoi(ms));
  }
  while (!stop_.WaitForNotificationWithTimeout(lease_ / 4)) {
    // Woken a lease or more after the last round: this process was paused
    // (or starved) long enough for the coordinator to move its shards.
    const absl::Duration gap = service_->Tick();
    if (gap >= lease_ && !after_pause) {
      after_pause = true;
      service_->Fence();
      LOG(WARNING) << "worker " << worker_id() << ": no heartbeat for " << gap
                   << " (paused?); serving nothing until the coordinator says what it holds";
    }
    if (backend_lost_) continue;
    if (absl::Status h = service_->BackendHealth(); !h.ok()) {
      // No heartbeat from now on: the lease lapses and the coordinator
      // recovers this worker's shards elsewhere. Data calls already answer
      // UNAVAILABLE (the backend's status).
      backend_lost_ = true;
      SetServing(false);
      LOG(ERROR) << "worker " << worker_id() << ": backend lost (" << h.message()
                 << "); NOT_SERVING, heartbeats stopped so the coordinator recovers its shards";
      continue;
    }
    if (absl::Now() >= silent_at) {
      LOG_FIRST_N(WARNING, 1) << "EMBER_WORKER_SILENT_AFTER_MS: heartbeats stop here, serving "
                                 "goes on";
      continue;
    }
    grpc::ClientContext ctx;
    PrepareContext(&ctx, lease_ / 4);
    ember::v1::HeartbeatRequest req;
    req.set_worker_id(worker_id());
    req.set_after_pause(after_pause);
    for (const WorkerService::BrokenReplication& b : service_->BrokenReplications()) {
      ember::v1::BrokenReplication* out = req.add_broken();
      out->set_collection(b.collection);
      out->set_epoch(b.epoch);
      out->set_behind(b.backup);
      out->set_why(b.why);
    }
    ember::v1::HeartbeatResponse resp;
    const grpc::Status s = coordinator_->Heartbeat(&ctx, req, &resp);
    if (s.ok() && after_pause) {
      std::map<std::string, int64_t> keep;
      for (const auto& h : resp.holds()) keep[h.collection()] = h.epoch();
      service_->Unfence(keep);
      after_pause = false;
      LOG(WARNING) << "worker " << worker_id() << ": serving again (" << keep.size()
                   << " collection(s) still here)";
    } else if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "the coordinator forgot this worker; registering again";
      grpc::ClientContext rctx;
      PrepareContext(&rctx, absl::Seconds(2));
      ember::v1::RegisterWorkerRequest rreq;
      *rreq.mutable_worker() = info_;
      ember::v1::RegisterWorkerResponse rresp;
      if (coordinator_->RegisterWorker(&rctx, rreq, &rresp).ok()) {
        absl::MutexLock lock(&id_mu_);
        worker_id_ = rresp.worker_id();
      }
    } else if (!s.ok()) {
      LOG(WARNING) << "heartbeat to " << options_.coordinator << ": " << s.error_message();
    }
  }
}

absl::Status WorkerServer::Drain(absl::Duration timeout) {
  SetServing(false);
  grpc::ClientContext ctx;
  PrepareContext(&ctx, timeout);
  ember::v1::DrainWorkerRequest req;
  req.set_worker_id(worker_id());
  ember::v1::DrainWorkerResponse resp;
  const grpc::Status s = coordinator_->DrainWorker(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "coordinator " + options_.coordinator);
  LOG(INFO) << "worker " << worker_id() << " drained: " << resp.collections_size()
            << " collection(s) moved off it";
  return absl::OkStatus();
}

void WorkerServer::Shutdown(absl::Duration grace) {
  if (shut_down_.exchange(true)) return;
  stop_.Notify();
  if (heartbeat_.joinable()) heartbeat_.join();
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(grace)));
  server_->Wait();
  if (health_server_ != nullptr) health_server_->Shutdown();
}

WorkerServer::~WorkerServer() { Shutdown(); }

}  // namespace worker
}  // namespace ember
