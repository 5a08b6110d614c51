// The Client: the coordinator's RPCs, plans and retries, and the public
// data calls, each one attempt of RunLookup or RunGradients (data_calls.h)
// inside WithRetries; tables in and out (ImportTable, ExportTable).
#include "client/client.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/call_jobs.h"
#include "client/data_calls.h"
#include "client/device_stage.h"
#include "client/routing.h"
#include "client/shm_channel.h"
#include "client/update_id.h"
#include "server/common/auth.h"
#include "server/common/dynamic_route.h"
#include "server/common/grpc_util.h"
#include "server/common/host_memory.h"
#include "server/common/wire.h"

namespace ember {
namespace client {

using ember::v1::CollectionInfo;

struct Client::Impl {
  Impl(const std::string& address, const ClientOptions& o)
      : coordinator_address(address),
        options(o),
        coordinator(ember::v1::Coordinator::NewStub(MakeChannel(address, o.credentials))) {}

  // A shared-memory or link channel of `bytes` to the worker at `address`
  // for one call, or an empty lease (inline; always with neither on).
  ChannelPool::Lease ChannelTo(Client& client, const std::string& address, uint64_t bytes);
  // The data calls' ways to a worker (fanout.h): its stub, and a channel
  // to it for one call (ChannelTo). Set by the Client's constructor.
  client::StubFor stub_for;  // (the type: Client::StubFor is the method)
  ChannelFor channel_for;

  const std::string coordinator_address;
  const ClientOptions options;
  std::unique_ptr<ember::v1::Coordinator::Stub> coordinator;
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<const Routing>> routing ABSL_GUARDED_BY(mu);
  std::map<std::string, std::unique_ptr<ember::v1::Worker::Stub>> stubs ABSL_GUARDED_BY(mu);
  ChannelPool channels;  // after stubs: closed before the stubs go
  cuda::PeerLinks* link = nullptr;  // options.link's kind
  std::atomic<uint64_t> replica_counter{0};
};

Client::Client(const std::string& coordinator, const ClientOptions& options)
    : impl_(std::make_unique<Impl>(coordinator, options)) {
  impl_->stub_for = [this](const std::string& a) { return StubFor(a); };
  impl_->channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& coordinator,
                                                        const ClientOptions& options) {
  if (coordinator.empty()) return absl::InvalidArgumentError("coordinator address is empty");
  if (options.max_attempts < 1) return absl::InvalidArgumentError("max_attempts must be >= 1");
  if (options.keep_freed_heap_mib < 0) {
    return absl::InvalidArgumentError("keep_freed_heap_mib must be >= 0");
  }
  if (!options.shm_dir.empty() && !std::filesystem::is_directory(options.shm_dir)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_dir ", options.shm_dir, " is not a directory"));
  }
  // (A refusal by the allocator leaves its defaults: only slower.)
  (void)KeepFreedHeapMemory(int64_t{options.keep_freed_heap_mib} << 20);
  std::unique_ptr<Client> c(new Client(coordinator, options));
  if (!options.link.empty()) {
    auto link = cuda::PeerLinksNamed(options.link);
    if (!link.ok()) return link.status();
    c->impl_->link = *link;
  }
  auto workers = c->ListWorkers();  // fails fast when nothing answers
  if (!workers.ok()) return workers.status();
  return c;
}

ChannelPool::Lease Client::Impl::ChannelTo(Client& client, const std::string& address,
                                           uint64_t bytes) {
  if (!options.shared_memory && link == nullptr) return {};
  return channels.Acquire(
      address, bytes, options.shm_dir, client.StubFor(address),
      [this, &client](grpc::ClientContext* ctx) { client.PrepareContext(ctx, options.timeout); },
      link, options.link_device);
}

ember::v1::Worker::Stub* Client::StubFor(const std::string& address) {
  absl::MutexLock lock(&impl_->mu);
  auto& stub = impl_->stubs[address];
  if (!stub) stub = ember::v1::Worker::NewStub(MakeChannel(address, impl_->options.credentials));
  return stub.get();
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallCoordinator(
    grpc::Status (ember::v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Request&,
                                                         Response*),
    const Request& request, absl::Duration timeout) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, timeout);
  Response response;
  grpc::Status s = (impl_->coordinator.get()->*method)(&ctx, request, &response);
  if (!s.ok()) return FromGrpc(s, "coordinator " + impl_->coordinator_address);
  return response;
}

absl::StatusOr<CollectionInfo> Client::CreateCollection(const ember::v1::CollectionSpec& spec,
                                                        const std::string& sharding_type) {
  ember::v1::CreateCollectionRequest req;
  *req.mutable_spec() = spec;
  req.set_sharding_type(sharding_type);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::CreateCollection, req,
                              impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return resp->collection();
}

absl::StatusOr<CollectionInfo> Client::CreateCollectionWithPlan(
    const ember::v1::CollectionSpec& spec, const ember::v1::ShardingPlan& plan) {
  ember::v1::CreateCollectionRequest req;
  *req.mutable_spec() = spec;
  *req.mutable_plan() = plan;
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::CreateCollection, req,
                              impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return resp->collection();
}

absl::StatusOr<CollectionInfo> Client::GetCollection(const std::string& collection) {
  ember::v1::GetCollectionRequest req;
  req.set_collection(collection);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::GetCollection, req,
      impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return resp->collection();
}

absl::StatusOr<std::vector<CollectionInfo>> Client::ListCollections() {
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::ListCollections,
                              ember::v1::ListCollectionsRequest(), impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return std::vector<CollectionInfo>(resp->collections().begin(), resp->collections().end());
}

absl::StatusOr<ember::v1::CheckpointInfo> Client::Checkpoint(const std::string& collection,
                                                             const std::string& dir,
                                                             absl::Duration timeout,
                                                             bool incremental) {
  ember::v1::CheckpointRequest req;
  req.set_collection(collection);
  req.set_dir(dir);
  req.set_incremental(incremental);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::Checkpoint, req, timeout);
  if (!resp.ok()) return resp.status();
  return resp->checkpoint();
}

absl::StatusOr<ember::v1::RestoreResponse> Client::Restore(const std::string& from,
                                                           const std::string& collection,
                                                           const std::string& sharding_type,
                                                           absl::Duration timeout) {
  ember::v1::RestoreRequest req;
  req.set_from(from);
  req.set_collection(collection);
  req.set_sharding_type(sharding_type);
  return CallCoordinator(&ember::v1::Coordinator::Stub::Restore, req, timeout);
}

absl::StatusOr<ember::v1::ListCheckpointsResponse> Client::CatalogueOf(
    const std::string& collection) {
  ember::v1::ListCheckpointsRequest req;
  req.set_collection(collection);
  return CallCoordinator(&ember::v1::Coordinator::Stub::ListCheckpoints, req,
                         impl_->options.timeout);
}

absl::StatusOr<std::vector<ember::v1::CheckpointInfo>> Client::ListCheckpoints(
    const std::string& collection) {
  auto resp = CatalogueOf(collection);
  if (!resp.ok()) return resp.status();
  return std::vector<ember::v1::CheckpointInfo>(resp->checkpoints().begin(),
                                                resp->checkpoints().end());
}

absl::StatusOr<std::vector<ember::v1::RestoreProgress>> Client::ListRestores(
    const std::string& collection) {
  auto resp = CatalogueOf(collection);
  if (!resp.ok()) return resp.status();
  return std::vector<ember::v1::RestoreProgress>(resp->restores().begin(),
                                                 resp->restores().end());
}

absl::StatusOr<ember::v1::CollectionInfo> Client::SetTrainers(const std::string& collection,
                                                              int32_t trainers,
                                                              int64_t from_step) {
  ember::v1::SetTrainersRequest req;
  req.set_collection(collection);
  req.set_trainers(trainers);
  req.set_from_step(from_step);
  auto resp =
      CallCoordinator(&ember::v1::Coordinator::Stub::SetTrainers, req, impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return resp->collection();
}

absl::StatusOr<std::vector<std::string>> Client::DrainWorker(const std::string& worker_id,
                                                             absl::Duration timeout) {
  ember::v1::DrainWorkerRequest req;
  req.set_worker_id(worker_id);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::DrainWorker, req, timeout);
  if (!resp.ok()) return resp.status();
  return std::vector<std::string>(resp->collections().begin(), resp->collections().end());
}

absl::StatusOr<ember::v1::ScaleCollectionResponse> Client::ScaleCollection(
    const std::string& collection, int32_t workers, absl::Duration timeout) {
  ember::v1::ScaleCollectionRequest req;
  req.set_collection(collection);
  req.set_workers(workers);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::ScaleCollection, req, timeout);
  if (resp.ok()) {  // the next call routes by the new plan
    absl::MutexLock lock(&impl_->mu);
    impl_->routing.erase(collection);
  }
  return resp;
}

absl::Status Client::DropCollection(const std::string& collection) {
  ember::v1::DropCollectionRequest req;
  req.set_collection(collection);
  auto resp =
      CallCoordinator(&ember::v1::Coordinator::Stub::DropCollection, req, impl_->options.timeout);
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->routing.erase(collection);
  }
  return resp.status();
}

absl::StatusOr<ember::v1::ListWorkersResponse> Client::ListWorkers() {
  return CallCoordinator(&ember::v1::Coordinator::Stub::ListWorkers,
                         ember::v1::ListWorkersRequest(), impl_->options.timeout);
}

void Client::PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const {
  SetDeadline(ctx, timeout);
  AddToken(ctx, impl_->options.auth_token);
}

absl::StatusOr<ember::v1::ShardStatusResponse> Client::WorkerStatus(const std::string& address) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, impl_->options.timeout);
  ember::v1::ShardStatusResponse resp;
  grpc::Status s = StubFor(address)->ShardStatus(&ctx, ember::v1::ShardStatusRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "worker " + address);
  return resp;
}

absl::StatusOr<ember::v1::ShardingPlan> Client::PreviewPlan(const ember::v1::CollectionSpec& spec,
                                                            const ember::v1::Topology& topology,
                                                            const std::string& sharding_type) {
  ember::v1::PreviewPlanRequest req;
  *req.mutable_spec() = spec;
  *req.mutable_topology() = topology;
  req.set_sharding_type(sharding_type);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::PreviewPlan, req,
      impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return resp->plan();
}

absl::StatusOr<std::shared_ptr<const Client::Routing>> Client::RoutingFor(
    const std::string& collection, bool refresh) {
  if (!refresh) {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->routing.find(collection);
    if (it != impl_->routing.end()) return it->second;
  }
  auto info = GetCollection(collection);
  if (!info.ok()) return info.status();
  if (info->state() != CollectionInfo::SERVING) {
    const bool recovering = info->state() == CollectionInfo::RECOVERING;
    absl::Status s = absl::UnavailableError(absl::StrCat(
        "collection '", collection, "' is ", recovering ? "recovering" : "degraded", ": ",
        info->note()));
    return recovering ? WithSignal(std::move(s), kSignalCollectionRecovering) : s;
  }
  auto routing = BuildRouting(*std::move(info), impl_->options.auth_token);
  if (!routing.ok()) return routing.status();
  absl::MutexLock lock(&impl_->mu);
  impl_->routing[collection] = *routing;
  return *routing;
}

template <typename Fn>
absl::Status Client::WithRetries(const std::string& collection, bool retry_unavailable, Fn&& fn,
                                 bool step_update) {
  const absl::Time start = absl::Now();
  absl::Time deadline = start + impl_->options.timeout;
  absl::Duration backoff = impl_->options.initial_backoff;
  bool refresh = false, refreshed = false;
  for (int attempt = 1;; ++attempt) {
    auto routing = RoutingFor(collection, refresh);
    if (routing.ok() && step_update) {
      const ember::v1::TrainingSpec& t = (*routing)->info.spec().training();
      if (t.mode() != ember::v1::TrainingSpec::ASYNC) {
        const double wait_s = t.step_timeout_s() > 0 ? t.step_timeout_s() : 300;
        deadline = std::max(deadline, start + impl_->options.timeout + absl::Seconds(wait_s));
      }
    }
    absl::Status s = routing.ok() ? fn(**routing, deadline) : routing.status();
    if (s.ok()) return s;
    refresh = false;
    // A stale plan (a worker at another epoch, or one that dropped the
    // collection after a move emptied it): fetch the current one, once.
    if ((s.code() == absl::StatusCode::kFailedPrecondition ||
         s.code() == absl::StatusCode::kNotFound) &&
        !refreshed) {
      refresh = refreshed = true;
      continue;
    }
    // A busy worker (kSignalWorkerBusy) is waited out like an unavailable
    // one.
    const bool busy = s.code() == absl::StatusCode::kResourceExhausted &&
                      HasSignal(s, kSignalWorkerBusy);
    const bool transient = busy || s.code() == absl::StatusCode::kUnavailable ||
                           s.code() == absl::StatusCode::kDeadlineExceeded;
    // A collection being moved or recovered is waited out to the deadline
    // (its fence or reload ends), whatever the attempts; so is an
    // unreachable worker of a replicated collection, whose shards the
    // coordinator hands to their backups within a lease.
    const bool replicated = routing.ok() && (*routing)->info.spec().replicas() > 1;
    const bool recovering = HasSignal(s, kSignalCollectionRecovering) ||
                            (replicated && s.code() == absl::StatusCode::kUnavailable);
    if (!transient || !retry_unavailable ||
        (attempt >= impl_->options.max_attempts && !recovering) ||
        absl::Now() + backoff >= deadline) {
      if (transient) {
        return absl::Status(busy ? s.code() : absl::StatusCode::kUnavailable,
                            absl::StrCat(s.message(), " (after ", attempt, " attempt(s))"));
      }
      return s;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, impl_->options.max_backoff);
    refresh = true;  // a dead worker may have been replaced meanwhile
  }
}

absl::StatusOr<KeyedTensor> Client::Lookup(const std::string& collection, KjtView kjt,
                                           const StepTag& tag) {
  KeyedTensor kt;
  if (absl::Status s = Lookup(collection, kjt, &kt, tag); !s.ok()) return s;
  return kt;
}

absl::Status Client::Lookup(const std::string& collection, KjtView kjt, KeyedTensor* out,
                            const StepTag& tag) {
  KeyedTensor& kt = *out;
  uint64_t pick = impl_->replica_counter.fetch_add(1);
  absl::Status s = WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    if (absl::Status st =
            PrepareJobs(r, collection, kjt, /*sequence=*/false, &jobs, IdCheck::kRowSplit);
        !st.ok()) {
      return st;
    }
    kt.keys.clear();
    kt.length_per_key.clear();
    kt.batch_size = kjt.batch_size();
    for (const FeatureJob& j : jobs) {
      kt.keys.push_back(j.key);
      kt.length_per_key.push_back(j.dim);
    }
    // A kept buffer is not cleared: RunLookup writes every element.
    kt.values.resize(kt.batch_size * kt.row_width());
    const std::vector<int64_t> offsets = kt.offset_per_key();
    for (size_t k = 0; k < jobs.size(); ++k) {
      jobs[k].out = kt.values.data() + offsets[k];
      jobs[k].out_stride = kt.row_width();
      jobs[k].out_zeroed = false;
    }
    bool poisoned = false;
    absl::Status st = ReadPrimariesIfAsked(
        RunLookup(r, &jobs, pick, deadline, impl_->stub_for, impl_->channel_for, &poisoned, tag),
        &pick);
    // A worker may yet write into this buffer: let it go (a retry or the
    // next call takes a fresh one).
    if (poisoned) kt.values = FloatBuffer();
    return st;
  });
  return s;
}

absl::StatusOr<int64_t> Client::Prefetch(const std::string& collection, KjtView kjt) {
  int64_t brought = 0;
  absl::Status s = WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    if (absl::Status st = PrepareJobs(r, collection, kjt, /*sequence=*/std::nullopt, &jobs);
        !st.ok()) {
      return st;
    }
    auto n = RunPrefetch(r, &jobs, deadline, impl_->stub_for);
    if (!n.ok()) return n.status();
    brought = *n;
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return brought;
}

absl::Status Client::ApplyGradients(const std::string& collection, KjtView kjt,
                                    KeyedTensorView grads, const std::string& request_id,
                                    std::string* used_request_id, const StepTag& tag) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  // A fresh id cannot be reused: no digest needed, but for a step, which a
  // rank may send again (its digest tells a retry from a conflict).
  uint64_t digest = 0;
  if (!request_id.empty() || tag.step >= 0) {
    UpdateDigest d;
    d.Add(collection);
    d.Add(kjt);
    for (const std::string& k : grads.keys) d.Add(k);
    d.Add(grads.length_per_key);
    d.Add(grads.values);
    digest = d.value();
  }
  return WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    if (absl::Status st = PrepareJobs(r, collection, kjt, /*sequence=*/false, &jobs); !st.ok()) {
      return st;
    }
    // The gradients must have Lookup's layout (given without keys: taken
    // to be in it).
    std::vector<std::string> keys;
    std::vector<int64_t> dims;
    for (const FeatureJob& j : jobs) {
      keys.push_back(j.key);
      dims.push_back(j.dim);
    }
    KeyedTensorView layout = grads;
    if (grads.keys.empty() && grads.length_per_key.empty()) {
      layout.keys = keys;
      layout.length_per_key = dims;
    }
    if (absl::Status st = CheckGradientLayout(layout, keys, dims, kjt.batch_size()); !st.ok()) {
      return st;
    }
    const std::vector<int64_t> offsets = layout.offset_per_key();
    for (size_t k = 0; k < jobs.size(); ++k) {
      jobs[k].grad = layout.values.data() + offsets[k];
      jobs[k].grad_stride = layout.row_width();
    }
    return RunGradients(r, &jobs, id, digest, deadline, impl_->stub_for, impl_->channel_for,
                        tag);
  }, /*step_update=*/true);
}

namespace {

// A DeviceKjt's lengths copied to the host, and a KjtView over them whose
// values and weights are the device arrays (PrepareJobs reads neither with
// IdCheck::kNone).
struct DeviceView {
  std::vector<int64_t> lengths;
  KjtView view;
};

absl::StatusOr<std::unique_ptr<DeviceView>> ViewOf(DeviceStage* stage) {
  if (!stage->linked()) {
    return absl::FailedPreconditionError(
        "device KJTs travel over link channels: set ClientOptions::link");
  }
  const DeviceKjt& kjt = stage->kjt();
  if (kjt.batch_size < 0 || kjt.num_values < 0) {
    return absl::InvalidArgumentError("a device KJT's batch_size and num_values must be >= 0");
  }
  if ((kjt.values == nullptr && kjt.num_values > 0) ||
      (kjt.lengths == nullptr && kjt.batch_size > 0 && !kjt.keys.empty())) {
    return absl::InvalidArgumentError("a device KJT's lengths or values are null");
  }
  auto v = std::make_unique<DeviceView>();
  if (absl::Status s = stage->ToHost(kjt.lengths, kjt.batch_size * kjt.keys.size(), &v->lengths);
      !s.ok()) {
    return s;
  }
  v->view.keys = kjt.keys;
  v->view.lengths = v->lengths;
  // Never read on the host (device memory): the weights are left out here
  // and set by StageIds.
  v->view.values = absl::MakeConstSpan(kjt.values, kjt.num_values);
  return v;
}

// Points row-split (or, `all`, every) job's ids and weights at their host
// copies and checks them (ids in range, weights finite); the others keep
// their device arrays (the workers check them).
absl::Status StageIds(DeviceStage* stage, std::vector<FeatureJob>* jobs, bool all) {
  const DeviceKjt& kjt = stage->kjt();
  for (FeatureJob& j : *jobs) {
    j.stage = stage;
    const ptrdiff_t at = j.ids - kjt.values;
    if (!all && !j.table->row_split) {
      j.on_device = true;
      j.weights = kjt.weights != nullptr ? kjt.weights + at : nullptr;
      continue;
    }
    auto ids = stage->Ids();
    if (!ids.ok()) return ids.status();
    auto weights = stage->Weights();
    if (!weights.ok()) return weights.status();
    j.ids = *ids + at;
    j.weights = *weights != nullptr ? *weights + at : nullptr;
    if (absl::Status s = CheckJobIds(j); !s.ok()) return s;
    if (j.weights != nullptr) {
      if (absl::Status s = CheckWeights(absl::MakeConstSpan(j.weights, j.num_ids),
                                        absl::StrCat("feature '", j.key, "': "));
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// A device call's jobs (prepared from `view`, their ids staged: `all`,
// every feature's, checked on the host) and the width of their layout.
absl::Status DeviceJobs(const Client::Routing& r, const std::string& collection,
                        const DeviceView& view, DeviceStage* stage, bool all,
                        std::vector<FeatureJob>* jobs, int64_t* width) {
  if (absl::Status st = PrepareJobs(r, collection, view.view, /*sequence=*/false, jobs,
                                    IdCheck::kNone);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = StageIds(stage, jobs, all); !st.ok()) return st;
  *width = 0;
  for (const FeatureJob& j : *jobs) *width += j.dim;
  return absl::OkStatus();
}

}  // namespace

absl::Status Client::LookupOnDevice(const std::string& collection, const DeviceKjt& kjt,
                                    float* out, int64_t out_floats, Layout* layout,
                                    const StepTag& tag) {
  DeviceStage stage(impl_->link, impl_->options.link_device, kjt);
  auto view = ViewOf(&stage);
  if (!view.ok()) return view.status();
  uint64_t pick = impl_->replica_counter.fetch_add(1);
  return WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    int64_t width = 0;
    if (absl::Status st = DeviceJobs(r, collection, **view, &stage, /*all=*/false, &jobs, &width);
        !st.ok()) {
      return st;
    }
    if (kjt.batch_size * width > out_floats) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the output needs ", kjt.batch_size, " x ", width, " floats; out holds ", out_floats));
    }
    if (layout != nullptr) {
      layout->keys.clear();
      layout->dims.clear();
      for (const FeatureJob& j : jobs) {
        layout->keys.push_back(j.key);
        layout->dims.push_back(j.dim);
      }
    }
    // Row-split features pool their partial sums here, then go up whole.
    std::vector<std::vector<float>> partial(jobs.size());
    int64_t col = 0;
    for (size_t k = 0; k < jobs.size(); ++k) {
      FeatureJob& j = jobs[k];
      j.device_out = out + col;
      j.out_stride = width;
      if (j.table->row_split) {
        partial[k].assign(j.batch * j.dim, 0.0f);
        j.out = partial[k].data();
        j.out_stride = j.dim;
      }
      col += j.dim;
    }
    if (absl::Status st = ReadPrimariesIfAsked(
            RunLookup(r, &jobs, pick, deadline, impl_->stub_for, impl_->channel_for, nullptr, tag),
            &pick);
        !st.ok()) {
      return st;
    }
    col = 0;
    for (size_t k = 0; k < jobs.size(); ++k) {
      const FeatureJob& j = jobs[k];
      if (j.table->row_split) {
        if (absl::Status st = stage.RowsToDevice(out + col, width, partial[k].data(), j.dim,
                                                 j.dim, j.batch);
            !st.ok()) {
          return st;
        }
      }
      col += j.dim;
    }
    return absl::OkStatus();
  });
}

absl::Status Client::ApplyGradientsOnDevice(const std::string& collection, const DeviceKjt& kjt,
                                            const float* grads, int64_t grad_floats,
                                            const std::string& request_id,
                                            std::string* used_request_id, const StepTag& tag) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  // A step's digest tells a retry from a conflict; the device arrays are
  // not read here, so it is the id's: a resend carries the same id.
  uint64_t digest = 0;
  if (tag.step >= 0) {
    UpdateDigest d;
    d.Add(collection);
    d.Add(id);
    digest = d.value();
  }
  DeviceStage stage(impl_->link, impl_->options.link_device, kjt);
  auto view = ViewOf(&stage);
  if (!view.ok()) return view.status();
  return WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    int64_t width = 0;
    // Every id checked before any worker is sent anything (all or none).
    if (absl::Status st = DeviceJobs(r, collection, **view, &stage, /*all=*/true, &jobs, &width);
        !st.ok()) {
      return st;
    }
    if (kjt.batch_size * width > grad_floats || (grads == nullptr && kjt.batch_size * width > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the gradients are ", kjt.batch_size, " x ", width, " floats; grads holds ", grad_floats));
    }
    stage.SetGrads(grads, kjt.batch_size * width);
    int64_t col = 0;
    for (FeatureJob& j : jobs) {
      j.device_grad = grads + col;
      j.grad = nullptr;  // its host copy, where one is needed (RunGradients)
      j.grad_stride = width;
      col += j.dim;
    }
    return RunGradients(r, &jobs, id, digest, deadline, impl_->stub_for, impl_->channel_for,
                        tag);
  }, /*step_update=*/true);
}

absl::StatusOr<std::vector<SequenceEmbedding>> Client::LookupSequence(
    const std::string& collection, KjtView kjt, const StepTag& tag) {
  std::vector<SequenceEmbedding> out;
  uint64_t pick = impl_->replica_counter.fetch_add(1);
  absl::Status s = WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    if (absl::Status st =
            PrepareJobs(r, collection, kjt, /*sequence=*/true, &jobs, IdCheck::kRowSplit);
        !st.ok()) {
      return st;
    }
    out.clear();
    for (FeatureJob& j : jobs) out.push_back({j.key, j.dim, std::vector<float>(j.num_ids * j.dim)});
    for (size_t k = 0; k < jobs.size(); ++k) {
      jobs[k].out = out[k].values.data();
      jobs[k].out_stride = jobs[k].dim;
    }
    return ReadPrimariesIfAsked(
        RunLookup(r, &jobs, pick, deadline, impl_->stub_for, impl_->channel_for, nullptr, tag),
        &pick);
  });
  if (!s.ok()) return s;
  return out;
}

absl::Status Client::ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                            const std::vector<SequenceEmbedding>& grads,
                                            const std::string& request_id,
                                            std::string* used_request_id, const StepTag& tag) {
  std::vector<SequenceEmbeddingView> views;
  for (const SequenceEmbedding& g : grads) views.push_back(g.View());
  return ApplySequenceGradients(collection, kjt, views, request_id, used_request_id, tag);
}

absl::Status Client::ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                            absl::Span<const SequenceEmbeddingView> grads,
                                            const std::string& request_id,
                                            std::string* used_request_id, const StepTag& tag) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  uint64_t digest = 0;  // as ApplyGradients'
  if (!request_id.empty() || tag.step >= 0) {
    UpdateDigest d;
    d.Add(collection);
    d.Add(kjt);
    for (const SequenceEmbeddingView& g : grads) {
      d.Add(g.key);
      d.Add(&g.dim, sizeof(g.dim));
      d.Add(g.values);
    }
    digest = d.value();
  }
  return WithRetries(collection, true, [&](const Routing& r, absl::Time deadline) {
    std::vector<FeatureJob> jobs;
    if (absl::Status st = PrepareJobs(r, collection, kjt, /*sequence=*/true, &jobs); !st.ok()) {
      return st;
    }
    if (grads.size() != jobs.size()) {
      return absl::InvalidArgumentError(absl::StrCat(grads.size(), " gradient blocks for ",
                                                     jobs.size(), " sequence features"));
    }
    for (FeatureJob& j : jobs) {
      const SequenceEmbeddingView* g = nullptr;
      for (const auto& candidate : grads) {
        if (candidate.key == j.key) g = &candidate;
      }
      if (g == nullptr || g->dim != j.dim ||
          static_cast<int64_t>(g->values.size()) != j.num_ids * j.dim) {
        return absl::InvalidArgumentError(absl::StrCat(
            "feature '", j.key, "' needs a gradient of [", j.num_ids, ", ", j.dim, "]"));
      }
      for (size_t i = 0; i < g->values.size(); ++i) {
        if (!std::isfinite(g->values[i])) {
          return absl::InvalidArgumentError(absl::StrCat("gradient of feature '", j.key, "' [", i,
                                                         "] is ", g->values[i],
                                                         " (NaN/Inf is refused)"));
        }
      }
      j.grad = g->values.data();
      j.grad_stride = j.dim;
    }
    return RunGradients(r, &jobs, id, digest, deadline, impl_->stub_for, impl_->channel_for,
                        tag);
  }, /*step_update=*/true);
}

namespace {

absl::Status NotDense(const std::string& table) {
  return absl::InvalidArgumentError(absl::StrCat(
      "table '", table, "' is dynamic (hash-keyed): its rows go by id "
      "(ExportDynamicTable / ImportDynamicTable; Python: export_table gives (ids, rows))"));
}

absl::Status NotDynamic(const std::string& table) {
  return absl::InvalidArgumentError(absl::StrCat(
      "table '", table, "' is not dynamic: ExportTable / ImportTable take its [rows, dim]"));
}

}  // namespace

absl::Status Client::ExportRowsOf(const std::string& address, int rank,
                                  const std::string& collection, const std::string& table,
                                  int32_t shard_index, int64_t b, int64_t e,
                                  ember::v1::ExportRowsResponse* resp) {
  ember::v1::ExportRowsRequest req;
  req.set_collection(collection);
  req.mutable_shard()->set_table(table);
  req.mutable_shard()->set_shard_index(shard_index);
  req.set_row_begin(b);
  req.set_row_end(e);
  grpc::ClientContext ctx;
  PrepareContext(&ctx, impl_->options.timeout);
  grpc::Status st = StubFor(address)->ExportRows(&ctx, req, resp);
  if (!st.ok()) return FromGrpc(st, absl::StrCat("worker ", rank, " (", address, ")"));
  return absl::OkStatus();
}

absl::Status Client::ImportTable(const std::string& collection, const std::string& table,
                                 absl::Span<const float> values, int64_t rows, int64_t dim) {
  auto routing = RoutingFor(collection, /*refresh=*/true);
  if (!routing.ok()) return routing.status();
  const Routing& r = **routing;
  auto found = FindTable(r, collection, table);
  if (!found.ok()) return found.status();
  const Routing::Table* t = *found;
  if (t->config->has_dynamic()) return NotDense(table);
  if (rows != t->config->num_embeddings() || dim != t->config->embedding_dim() ||
      static_cast<int64_t>(values.size()) != rows * dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table '", table, "' is [", t->config->num_embeddings(), ", ",
        t->config->embedding_dim(), "]; got [", rows, ", ", dim, "] with ", values.size(),
        " values"));
  }
  for (size_t i = 0; i < values.size(); ++i) {  // before any worker sees a row
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("value [", i / dim, ", ", i % dim, "] is ", values[i], " (NaN/Inf is refused)"));
    }
  }
  // Every shard (every replica of a data-parallel table, every copy of a
  // replicated shard) gets its rows and columns; its optimizer state and
  // step are read back and kept.
  std::vector<Routing::Shard> targets = WithEveryCopy(t->shards);
  targets.insert(targets.end(), t->replicas.begin(), t->replicas.end());
  constexpr int64_t kChunkBytes = 16 << 20;
  std::vector<float> weights;
  for (const auto& s : targets) {
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (s.cols * 4 * 3));
    const std::string& address = r.info.worker_addresses(s.rank);
    for (int64_t b = 0; b < s.rows; b += chunk) {
      const int64_t e = std::min(s.rows, b + chunk);
      ember::v1::ExportRowsResponse got;
      if (absl::Status st = ExportRowsOf(address, s.rank, collection, table, s.index, b, e, &got);
          !st.ok()) {
        return st;
      }
      weights.resize((e - b) * s.cols);
      for (int64_t i = 0; i < e - b; ++i) {
        std::memcpy(weights.data() + i * s.cols,
                    values.data() + (s.row_offset + b + i) * dim + s.col_offset,
                    s.cols * sizeof(float));
      }
      ember::v1::ImportRowsRequest im;
      im.set_collection(collection);
      im.set_epoch(r.info.plan().epoch());
      im.mutable_shard()->set_table(table);
      im.mutable_shard()->set_shard_index(s.index);
      im.set_row_begin(b);
      im.set_row_end(e);
      wire::Encode(absl::Span<const float>(weights), im.mutable_weights());
      im.set_state(std::move(*got.mutable_state()));
      im.set_step(-1);
      ember::v1::ImportRowsResponse done;
      grpc::ClientContext ctx;
      PrepareContext(&ctx, impl_->options.timeout);
      grpc::Status st = StubFor(address)->ImportRows(&ctx, im, &done);
      if (!st.ok()) return FromGrpc(st, absl::StrCat("worker ", s.rank, " (", address, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Client::ExportTable(const std::string& collection,
                                                       const std::string& table, int64_t* rows,
                                                       int64_t* dim) {
  auto routing = RoutingFor(collection, /*refresh=*/true);
  if (!routing.ok()) return routing.status();
  const Routing& r = **routing;
  auto found = FindTable(r, collection, table);
  if (!found.ok()) return found.status();
  const Routing::Table* t = *found;
  if (t->config->has_dynamic()) return NotDense(table);
  *rows = t->config->num_embeddings();
  *dim = t->config->embedding_dim();
  std::vector<float> out(*rows * *dim, 0.0f);
  std::vector<Routing::Shard> sources = t->shards;
  if (!t->replicas.empty()) sources = {t->replicas.front()};
  constexpr int64_t kChunkBytes = 32 << 20;
  std::vector<float> buf;
  for (const auto& s : sources) {
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (s.cols * 4 * 3));
    for (int64_t b = 0; b < s.rows; b += chunk) {
      const int64_t e = std::min(s.rows, b + chunk);
      ember::v1::ExportRowsResponse resp;
      if (absl::Status st = ExportRowsOf(r.info.worker_addresses(s.rank), s.rank, collection,
                                         table, s.index, b, e, &resp);
          !st.ok()) {
        return st;
      }
      if (absl::Status d = wire::Decode(resp.weights(), "weights", &buf); !d.ok()) return d;
      if (static_cast<int64_t>(buf.size()) != (e - b) * s.cols) {
        return absl::InternalError("worker returned a malformed export");
      }
      for (int64_t i = 0; i < e - b; ++i) {
        std::memcpy(out.data() + (s.row_offset + b + i) * *dim + s.col_offset,
                    buf.data() + i * s.cols, s.cols * sizeof(float));
      }
    }
  }
  return out;
}

absl::Status Client::ExportDynamicTable(const std::string& collection, const std::string& table,
                                        std::vector<int64_t>* ids, std::vector<float>* rows,
                                        int64_t* dim) {
  auto routing = RoutingFor(collection, /*refresh=*/true);
  if (!routing.ok()) return routing.status();
  const Routing& r = **routing;
  auto found = FindTable(r, collection, table);
  if (!found.ok()) return found.status();
  const Routing::Table* t = *found;
  if (!t->config->has_dynamic()) return NotDynamic(table);
  *dim = t->config->embedding_dim();
  // slot_meta: int64 [n, 4] (id, last step, updates, order): proto/service.proto.
  constexpr int64_t kSlotFields = 4;
  std::vector<std::pair<int64_t, size_t>> order;  // (id, its row in `all`)
  std::vector<float> all, buf;
  std::vector<int64_t> meta;
  constexpr int64_t kChunkBytes = 32 << 20;
  for (const auto& s : t->shards) {
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (s.cols * 4 * 3 + 32));
    for (int64_t b = 0; b < s.rows; b += chunk) {
      const int64_t e = std::min(s.rows, b + chunk);
      ember::v1::ExportRowsResponse resp;
      if (absl::Status st = ExportRowsOf(r.info.worker_addresses(s.rank), s.rank, collection,
                                         table, s.index, b, e, &resp);
          !st.ok()) {
        return st;
      }
      if (absl::Status d = wire::Decode(resp.weights(), "weights", &buf); !d.ok()) return d;
      if (absl::Status d = wire::Decode(resp.slot_meta(), "slot_meta", &meta); !d.ok()) return d;
      if (static_cast<int64_t>(buf.size()) != (e - b) * s.cols ||
          static_cast<int64_t>(meta.size()) != (e - b) * kSlotFields) {
        return absl::InternalError("worker returned a malformed export");
      }
      for (int64_t i = 0; i < e - b; ++i) {
        if (meta[kSlotFields * i + 2] == 0) continue;  // a free slot (updates 0)
        order.emplace_back(meta[kSlotFields * i], all.size() / *dim);
        all.insert(all.end(), buf.begin() + i * s.cols, buf.begin() + (i + 1) * s.cols);
      }
    }
  }
  std::sort(order.begin(), order.end());
  ids->clear();
  rows->assign(order.size() * *dim, 0.0f);
  for (size_t k = 0; k < order.size(); ++k) {
    ids->push_back(order[k].first);
    std::memcpy(rows->data() + k * *dim, all.data() + order[k].second * *dim,
                *dim * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status Client::ImportDynamicTable(const std::string& collection, const std::string& table,
                                        absl::Span<const int64_t> ids,
                                        absl::Span<const float> rows, int64_t dim) {
  auto routing = RoutingFor(collection, /*refresh=*/true);
  if (!routing.ok()) return routing.status();
  const Routing& r = **routing;
  auto found = FindTable(r, collection, table);
  if (!found.ok()) return found.status();
  const Routing::Table* t = *found;
  if (!t->config->has_dynamic()) return NotDynamic(table);
  if (dim != t->config->embedding_dim() || rows.size() != ids.size() * static_cast<size_t>(dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table '", table, "' takes rows of ", t->config->embedding_dim(), " for ", ids.size(),
        " ids; got ", rows.size(), " values of dim ", dim));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!std::isfinite(rows[i])) {
      return absl::InvalidArgumentError(absl::StrCat("row ", i / dim, " (id ", ids[i / dim],
                                                     "), column ", i % dim, " is ", rows[i],
                                                     " (NaN/Inf is refused)"));
    }
  }
  {
    std::vector<int64_t> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) {
      return absl::InvalidArgumentError(absl::StrCat("id ", *dup, " is given twice"));
    }
  }
  // Each id to the shard holding its routing row; no shard gets more ids
  // than it holds.
  const Router router(t->config->dynamic().capacity());
  std::vector<std::vector<size_t>> of(t->shards.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t row = router.Row(ids[i]);
    for (size_t k = 0; k < t->shards.size(); ++k) {
      const auto& s = t->shards[k];
      if (row >= s.row_offset && row < s.row_offset + s.rows) of[k].push_back(i);
    }
  }
  for (size_t k = 0; k < of.size(); ++k) {
    if (static_cast<int64_t>(of[k].size()) > t->shards[k].rows) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "table '", table, "': ", of[k].size(), " of the ids go to shard ", t->shards[k].index,
          ", which holds ", t->shards[k].rows, " rows"));
    }
  }
  constexpr size_t kChunkIds = 1 << 16;
  std::vector<int64_t> chunk_ids;
  std::vector<float> chunk_rows;
  for (size_t k = 0; k < of.size(); ++k) {
    for (size_t b = 0; b < of[k].size(); b += kChunkIds) {
      const size_t e = std::min(of[k].size(), b + kChunkIds);
      chunk_ids.clear();
      chunk_rows.clear();
      for (size_t j = b; j < e; ++j) {
        chunk_ids.push_back(ids[of[k][j]]);
        chunk_rows.insert(chunk_rows.end(), rows.begin() + of[k][j] * dim,
                          rows.begin() + (of[k][j] + 1) * dim);
      }
      ember::v1::ImportRowsRequest im;
      im.set_collection(collection);
      im.set_epoch(r.info.plan().epoch());
      im.mutable_shard()->set_table(table);
      im.mutable_shard()->set_shard_index(t->shards[k].index);
      wire::Encode(absl::Span<const int64_t>(chunk_ids), im.mutable_ids());
      wire::Encode(absl::Span<const float>(chunk_rows), im.mutable_weights());
      im.set_step(-1);
      // Every copy of a replicated shard alike.
      for (const Routing::Shard& s : WithEveryCopy({t->shards[k]})) {
        const std::string& address = r.info.worker_addresses(s.rank);
        ember::v1::ImportRowsResponse done;
        grpc::ClientContext ctx;
        PrepareContext(&ctx, impl_->options.timeout);
        grpc::Status st = StubFor(address)->ImportRows(&ctx, im, &done);
        if (!st.ok()) return FromGrpc(st, absl::StrCat("worker ", s.rank, " (", address, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace ember
