#include "client/client.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/shared_buffer.h"
#include "client/shm_channel.h"
#include "client/routing.h"
#include "client/transport.h"
#include "server/common/auth.h"
#include "server/common/grpc_util.h"
#include "server/common/host_memory.h"
#include "server/common/wire.h"

namespace ember {
namespace client {

using ember::v1::CollectionInfo;
using ember::v1::ShardFeature;
using ember::v1::TableConfig;

namespace {

std::string RandomRequestId() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   (static_cast<uint64_t>(std::random_device{}()) << 32));
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16), absl::Hex(rng(), absl::kZeroPad16));
}

// A stable 64-bit hash of an update's content (the same in every process
// and build), sent with a request id the caller chose so that a worker tells
// a retry from the id's reuse for another update (0 is never a digest).
class UpdateDigest {
 public:
  void Add(const void* data, size_t n) {
    Word(n);
    const char* p = static_cast<const char*>(data);
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      Word(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, p, n);
    Word(tail);
  }
  template <typename T>
  void Add(absl::Span<const T> values) {
    Add(values.data(), values.size() * sizeof(T));
  }
  void Add(absl::string_view s) { Add(s.data(), s.size()); }
  void Add(const KjtView& kjt) {
    for (const std::string& k : kjt.keys) Add(k);
    Add(kjt.lengths);
    Add(kjt.values);
    Add(kjt.weights);
  }
  uint64_t value() const {
    uint64_t h = h_;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return h == 0 ? 1 : h;
  }

 private:
  void Word(uint64_t w) {
    h_ = (h_ ^ w) * 0x9e3779b97f4a7c15ULL;
    h_ ^= h_ >> 29;
  }
  uint64_t h_ = 0x243f6a8885a308d3ULL;
};

// A DeviceKjt's arrays (and an update's gradients) copied to host memory
// when a call needs them there, each once, through the link kind's copies.
class DeviceStage {
 public:
  DeviceStage(cuda::PeerLinks* kind, int device, const DeviceKjt& kjt)
      : kind_(kind), device_(device), kjt_(kjt) {}
  const DeviceKjt& kjt() const { return kjt_; }
  bool linked() const { return kind_ != nullptr; }  // the client has link channels

  // Copies `count` elements at device `src` to the host.
  template <typename T>
  absl::Status ToHost(const T* src, int64_t count, std::vector<T>* out) {
    out->resize(count);
    if (count == 0) return absl::OkStatus();
    const uint64_t bytes = count * sizeof(T);
    return kind_->CopyRowsNow(device_, false, out->data(), bytes, src, bytes, bytes, 1);
  }
  // The whole of the KJT's values / weights / the gradients on the host.
  absl::StatusOr<const int64_t*> Ids() { return ids_.Get(this, kjt_.values, kjt_.num_values); }
  absl::StatusOr<const float*> Weights() {
    if (kjt_.weights == nullptr) return nullptr;
    return weights_.Get(this, kjt_.weights, kjt_.num_values);
  }
  // An update's gradients (device, `count` floats at `base`), and their
  // host copy.
  void SetGrads(const float* base, int64_t count) {
    grads_base_ = base;
    grads_count_ = count;
  }
  const float* grads_base() const { return grads_base_; }
  absl::StatusOr<const float*> Grads() { return grads_.Get(this, grads_base_, grads_count_); }
  // Host rows to device memory, or zeros.
  absl::Status RowsToDevice(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                            int64_t cols, int64_t rows) {
    return kind_->CopyRowsNow(device_, true, dst, dst_stride * sizeof(float), src,
                              src_stride * sizeof(float), cols * sizeof(float), rows);
  }
  absl::Status ZeroRows(float* dst, int64_t dst_stride, int64_t cols, int64_t rows) {
    zeros_.assign(cols * rows, 0.0f);
    return RowsToDevice(dst, dst_stride, zeros_.data(), cols, cols, rows);
  }

 private:
  // A device array's host copy, made on first use.
  template <typename T>
  struct HostCopy {
    absl::StatusOr<const T*> Get(DeviceStage* stage, const T* src, int64_t count) {
      if (!loaded) {
        if (absl::Status s = stage->ToHost(src, count, &copy); !s.ok()) return s;
        loaded = true;
      }
      return copy.data();
    }
    std::vector<T> copy;
    bool loaded = false;
  };

  cuda::PeerLinks* const kind_;
  const int device_;
  const DeviceKjt& kjt_;
  HostCopy<int64_t> ids_;
  HostCopy<float> weights_, grads_;
  std::vector<float> zeros_;
  const float* grads_base_ = nullptr;
  int64_t grads_count_ = 0;
};

// One KJT feature's part in a call.
struct FeatureJob {
  std::string key;
  const Client::Routing::Table* table = nullptr;
  int order = 0;  // position in the collection's feature order
  bool sequence = false;
  int64_t dim = 0, batch = 0, num_ids = 0;
  const int64_t* lengths = nullptr;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;  // nullptr: unweighted
  float* out = nullptr;            // lookup: [batch or num_ids, dim], rows
  int64_t out_stride = 0;          //   out_stride floats apart
  bool out_zeroed = true;          //   false: RunLookup clears what it does not overwrite
  const float* grad = nullptr;     // gradients: same shape, row stride grad_stride
  int64_t grad_stride = 0;
  // LookupOnDevice / ApplyGradientsOnDevice: `stage` copies the call's
  // device arrays to the host where needed. `on_device`: ids and weights
  // are device pointers (an all-rows table's lookup); `device_out`: the
  // pooled output's place in device memory (out_stride floats a row;
  // `out` is then null, or a host matrix for row-split partial sums);
  // `device_grad`: the gradients' (grad_stride a row).
  DeviceStage* stage = nullptr;
  bool on_device = false;
  float* device_out = nullptr;
  const float* device_grad = nullptr;
};

// Zeroes columns [col, col + cols) of `rows` rows `stride` floats apart.
void ClearColumns(float* out, int64_t stride, int64_t rows, int64_t col, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::fill_n(out + r * stride + col, cols, 0.0f);
}

// Where a shard request's output lands (sinks are kept per rank).
struct Sink {
  FeatureJob* job = nullptr;
  int index = 0;  // in the rank's request
  int64_t col_offset = 0, cols = 0;
  int64_t rows = 0;                // of its output: bags, or (sequence) ids
  std::vector<int64_t> positions;  // sequence, row-split: id index in the feature
  bool placed = false;             // placed in the caller's output buffer
};

// Builds the ShardFeature of `job` for `shard` through `t`: the ids in the
// shard's rows (shard-local), their weights, and (sequence) their
// positions. `id_buffer` (lookups through a channel): the shared buffer
// holding job.ids, where a shard of all rows has the worker read them in
// place (buffer_ids) instead of taking a copy.
void Bucketize(const FeatureJob& job, const Client::Routing::Shard& shard, bool send_mean,
               Transport* t, ShardFeature* f, std::vector<int64_t>* positions,
               int64_t* num_local, const SharedBufferInfo* id_buffer = nullptr) {
  f->mutable_shard()->set_table(job.table->config->name());
  f->mutable_shard()->set_shard_index(shard.index);
  f->set_feature(job.key);
  f->set_pooling(job.sequence ? TableConfig::NONE : send_mean ? TableConfig::MEAN : TableConfig::SUM);
  const bool all_rows = shard.rows == job.table->config->num_embeddings();
  const bool weighted = job.weights != nullptr;
  const bool ids_in_buffer = id_buffer != nullptr && all_rows && job.num_ids > 0;
  // A device KJT's ids and weights: straight from device memory over a
  // link channel, else from their host copies (loaded by the caller).
  const bool ids_on_device = job.on_device && t->Linked();
  const int64_t* src_ids = job.ids;
  const float* src_weights = job.weights;
  if (job.on_device && !ids_on_device) {
    const ptrdiff_t at = job.ids - job.stage->kjt().values;
    src_ids = *job.stage->Ids() + at;
    if (weighted) src_weights = *job.stage->Weights() + at;
  }
  auto lengths = t->TakeArray<int64_t>(f->mutable_lengths(), job.batch);
  absl::Span<int64_t> ids;
  absl::Span<float> weights;
  int64_t n = job.num_ids;
  if (ids_on_device) {  // all rows (LookupOnDevice keeps row-split ids on the host)
    if (job.batch > 0) std::memcpy(lengths.data(), job.lengths, job.batch * sizeof(int64_t));
    t->KeepArray<int64_t>(f->mutable_lengths(), [&] { return f->mutable_shm_lengths(); }, lengths);
    t->KeepOnDevice(f->mutable_ids(), [&] { return f->mutable_shm_ids(); }, job.ids,
                    n * sizeof(int64_t), n * sizeof(int64_t), 1);
    if (weighted) {
      t->KeepOnDevice(f->mutable_weights(), [&] { return f->mutable_shm_weights(); }, job.weights,
                      n * sizeof(float), n * sizeof(float), 1);
    }
    *num_local = n;
    return;
  }
  if (!ids_in_buffer) ids = t->TakeArray<int64_t>(f->mutable_ids(), job.num_ids);
  if (weighted) weights = t->TakeArray<float>(f->mutable_weights(), job.num_ids);
  if (all_rows) {
    if (job.batch > 0) std::memcpy(lengths.data(), job.lengths, job.batch * sizeof(int64_t));
    if (ids_in_buffer) {
      f->mutable_buffer_ids()->set_offset(reinterpret_cast<const char*>(job.ids) - id_buffer->base);
      f->mutable_buffer_ids()->set_size(n * sizeof(int64_t));
    } else if (n > 0) {
      std::memcpy(ids.data(), src_ids, n * sizeof(int64_t));
    }
    if (weighted && n > 0) std::memcpy(weights.data(), src_weights, n * sizeof(float));
  } else {
    // Sized for every id, cut to the ones in the shard's rows. Without a
    // branch per id (uniform ids miss a shard half the time, and every
    // mispredicted branch costs more than the id's copy): each id is
    // written at n (n <= k, inside the array), and n moves on when it is
    // the shard's.
    const uint64_t lo = static_cast<uint64_t>(shard.row_offset);
    const uint64_t rows = static_cast<uint64_t>(shard.rows);
    int64_t k = 0;
    n = 0;
    for (int64_t b = 0; b < job.batch; ++b) {
      const int64_t bag_start = n;
      for (const int64_t end = k + job.lengths[b]; k < end; ++k) {
        const uint64_t local = static_cast<uint64_t>(src_ids[k]) - lo;
        const bool in = local < rows;
        ids[n] = static_cast<int64_t>(local);
        if (weighted) weights[n] = src_weights[k];
        if (positions != nullptr && in) positions->push_back(k);
        n += in;
      }
      lengths[b] = n - bag_start;
    }
  }
  t->KeepArray<int64_t>(f->mutable_lengths(), [&] { return f->mutable_shm_lengths(); }, lengths);
  if (!ids_in_buffer) {
    t->KeepArray<int64_t>(f->mutable_ids(), [&] { return f->mutable_shm_ids(); }, ids.first(n));
  }
  if (weighted) {
    t->KeepArray<float>(f->mutable_weights(), [&] { return f->mutable_shm_weights(); },
                        weights.first(n));
  }
  *num_local = n;
}

// The most bytes a shard request of `job` can take (every id in the shard,
// its output or gradient in `cols` columns): sizes a channel's region.
uint64_t MostBytes(const FeatureJob& job, int64_t cols) {
  using A = ShmTransport;
  const int64_t rows = job.sequence ? job.num_ids : job.batch;
  return A::Aligned(job.batch * sizeof(int64_t)) + A::Aligned(job.num_ids * sizeof(int64_t)) +
         (job.weights != nullptr ? A::Aligned(job.num_ids * sizeof(float)) : 0) +
         A::Aligned(rows * cols * sizeof(float));
}

template <typename Request, typename Response>
struct Call {
  grpc::ClientContext ctx;
  Request request;
  Response response;
  grpc::Status status;
  bool used = false;     // the request carries something for this worker
  bool started = false;  // sent; `done` fires when it finishes
  absl::Notification done;
};

// Worst status of a set of calls, named by worker: FAILED_PRECONDITION (a
// stale plan, refresh) first, then any non-UNAVAILABLE error, then
// UNAVAILABLE / DEADLINE_EXCEEDED.
template <typename C, typename Addresses>
absl::Status Combine(const std::vector<std::unique_ptr<C>>& calls, const Addresses& addresses) {
  absl::Status worst;
  auto rank_of = [](absl::StatusCode c) {
    switch (c) {
      case absl::StatusCode::kOk:
        return 0;
      case absl::StatusCode::kUnavailable:
      case absl::StatusCode::kDeadlineExceeded:
        return 1;
      case absl::StatusCode::kFailedPrecondition:
        return 3;
      default:
        return 2;
    }
  };
  for (size_t r = 0; r < calls.size(); ++r) {
    if (!calls[r]->started || calls[r]->status.ok()) continue;
    absl::Status s = FromGrpc(calls[r]->status, absl::StrCat("worker ", r, " (", addresses[r], ")"));
    if (rank_of(s.code()) > rank_of(worst.code())) worst = s;
  }
  return worst;
}

using StubFor = std::function<ember::v1::Worker::Stub*(const std::string&)>;
// A shared-memory channel to a worker for one call, or an empty lease.
using ChannelFor = std::function<ChannelPool::Lease(const std::string&, uint64_t)>;

// The transport of one worker request: a channel to `address` when one is
// to be had for `bytes`, else inline.
std::unique_ptr<Transport> TransportFor(const std::string& address, uint64_t bytes,
                                        const ChannelFor& channel_for) {
  if (bytes > 0) {
    ChannelPool::Lease lease = channel_for(address, bytes);
    if (lease) return std::make_unique<ShmTransport>(std::move(lease));
  }
  return std::make_unique<InlineTransport>();
}

// The calls of one client call, one per worker rank, each sent as soon as
// its request is built (start(stub, call, done)), so that workers compute
// while the client still builds the other requests. The destructor waits
// for every started call: nothing outlives the buffers they use.
template <typename C>
class Fanout {
 public:
  Fanout(const Client::Routing& r, int world, absl::Time deadline, const StubFor& stub_for)
      : routing_(r), deadline_(deadline), stub_for_(stub_for) {
    calls_.reserve(world);
    for (int i = 0; i < world; ++i) calls_.push_back(std::make_unique<C>());
  }
  ~Fanout() {
    for (int rank = 0; rank < size(); ++rank) Wait(rank);
  }

  int size() const { return static_cast<int>(calls_.size()); }
  C& operator[](int rank) { return *calls_[rank]; }

  // Sends rank's call if its request carries anything.
  template <typename StartFn>
  void Start(int rank, StartFn start) {
    C* c = calls_[rank].get();
    if (!c->used || c->started) return;
    c->ctx.set_deadline(absl::ToChronoTime(deadline_));
    AddToken(&c->ctx, routing_.auth_token);
    c->started = true;
    start(stub_for_(routing_.info.worker_addresses(rank)), c, [c](grpc::Status s) {
      c->status = std::move(s);
      c->done.Notify();
    });
  }
  // Waits for rank's call (if sent); true if it succeeded.
  bool Wait(int rank) {
    C* c = calls_[rank].get();
    if (!c->started) return false;
    c->done.WaitForNotification();
    return c->status.ok();
  }
  // Waits for every call; the worst status (Combine).
  absl::Status WaitAll() {
    for (int rank = 0; rank < size(); ++rank) Wait(rank);
    return Combine(calls_, routing_.info.worker_addresses());
  }

 private:
  const Client::Routing& routing_;
  const absl::Time deadline_;
  const StubFor& stub_for_;
  std::vector<std::unique_ptr<C>> calls_;
};

}  // namespace

// ------------------------------------------------------------------- client

struct Client::Impl {
  Impl(const std::string& address, const ClientOptions& o)
      : coordinator_address(address),
        options(o),
        coordinator(ember::v1::Coordinator::NewStub(MakeChannel(address, o.credentials))) {}

  // A shared-memory or link channel of `bytes` to the worker at `address`
  // for one call, or an empty lease (inline; always with neither on).
  ChannelPool::Lease ChannelTo(Client& client, const std::string& address, uint64_t bytes);

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
    : impl_(std::make_unique<Impl>(coordinator, options)) {}

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
                                                             absl::Duration timeout) {
  ember::v1::CheckpointRequest req;
  req.set_collection(collection);
  req.set_dir(dir);
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

absl::StatusOr<std::vector<ember::v1::CheckpointInfo>> Client::ListCheckpoints(
    const std::string& collection) {
  ember::v1::ListCheckpointsRequest req;
  req.set_collection(collection);
  auto resp =
      CallCoordinator(&ember::v1::Coordinator::Stub::ListCheckpoints, req, impl_->options.timeout);
  if (!resp.ok()) return resp.status();
  return std::vector<ember::v1::CheckpointInfo>(resp->checkpoints().begin(),
                                                resp->checkpoints().end());
}

absl::StatusOr<std::vector<std::string>> Client::DrainWorker(const std::string& worker_id,
                                                             absl::Duration timeout) {
  ember::v1::DrainWorkerRequest req;
  req.set_worker_id(worker_id);
  auto resp = CallCoordinator(&ember::v1::Coordinator::Stub::DrainWorker, req, timeout);
  if (!resp.ok()) return resp.status();
  return std::vector<std::string>(resp->collections().begin(), resp->collections().end());
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
    return absl::UnavailableError(absl::StrCat(
        "collection '", collection, "' is ",
        info->state() == CollectionInfo::RECOVERING ? "recovering" : "degraded", ": ",
        info->note()));
  }
  auto routing = BuildRouting(*std::move(info), impl_->options.auth_token);
  if (!routing.ok()) return routing.status();
  absl::MutexLock lock(&impl_->mu);
  impl_->routing[collection] = *routing;
  return *routing;
}

template <typename Fn>
absl::Status Client::WithRetries(const std::string& collection, bool retry_unavailable, Fn&& fn) {
  const absl::Time deadline = absl::Now() + impl_->options.timeout;
  absl::Duration backoff = impl_->options.initial_backoff;
  bool refresh = false, refreshed = false;
  for (int attempt = 1;; ++attempt) {
    auto routing = RoutingFor(collection, refresh);
    absl::Status s = routing.ok() ? fn(**routing, deadline) : routing.status();
    if (s.ok()) return s;
    refresh = false;
    if (s.code() == absl::StatusCode::kFailedPrecondition && !refreshed) {
      refresh = refreshed = true;  // a stale plan: fetch the current one, once
      continue;
    }
    // A busy worker (kSignalWorkerBusy) is waited out like an unavailable
    // one.
    const bool busy = s.code() == absl::StatusCode::kResourceExhausted &&
                      HasSignal(s, kSignalWorkerBusy);
    const bool transient = busy || s.code() == absl::StatusCode::kUnavailable ||
                           s.code() == absl::StatusCode::kDeadlineExceeded;
    if (!transient || !retry_unavailable || attempt >= impl_->options.max_attempts ||
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

namespace {

// Which ids PrepareJobs checks against their table's rows. Lookups leave
// the ids of a table whose every shard holds all its rows to the workers,
// which check each id anyway (NameRefusedIds names one they refuse); a
// row-split table's ids are checked here, as routing would drop an id
// outside every shard. Updates check every id here: a worker refusing one
// would come after others applied their part.
enum class IdCheck { kAll, kRowSplit, kNone };

// The job's ids against its table's rows (CheckFeatureIds).
absl::Status CheckJobIds(const FeatureJob& j) {
  return CheckFeatureIds(absl::MakeConstSpan(j.ids, j.num_ids), j.table->config->num_embeddings(),
                         j.key, j.table->config->name());
}

// The client's own message for the first id outside its table, if any.
absl::Status NameRefusedIds(const std::vector<FeatureJob>& jobs) {
  for (const FeatureJob& j : jobs) {
    FeatureJob host = j;
    if (j.on_device) {  // device ids: their host copy
      auto ids = j.stage->Ids();
      if (!ids.ok()) continue;
      host.ids = *ids + (j.ids - j.stage->kjt().values);
    }
    if (absl::Status s = CheckJobIds(host); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Prepares one job per KJT key. `sequence`: the call is for NONE tables.
absl::Status PrepareJobs(const Client::Routing& r, const std::string& collection,
                         const KjtView& kjt, bool sequence, std::vector<FeatureJob>* jobs,
                         IdCheck check = IdCheck::kAll) {
  if (absl::Status s = kjt.Validate(); !s.ok()) return s;
  const int64_t batch = kjt.batch_size();
  const std::vector<int64_t> off = kjt.key_offsets();
  jobs->clear();
  jobs->reserve(kjt.keys.size());
  for (size_t k = 0; k < kjt.keys.size(); ++k) {
    auto it = r.features.find(kjt.keys[k]);
    if (it == r.features.end()) {
      return absl::NotFoundError(
          absl::StrCat("feature '", kjt.keys[k], "' is not in collection '", collection, "'"));
    }
    FeatureJob j;
    j.key = kjt.keys[k];
    j.table = &r.tables[it->second.first];
    j.order = it->second.second;
    j.sequence = j.table->config->pooling() == TableConfig::NONE;
    if (j.sequence != sequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feature '", j.key, "' is a ", j.sequence ? "sequence (NONE)" : "pooled",
          " feature: use ", j.sequence ? "LookupSequence/ApplySequenceGradients"
                                       : "Lookup/ApplyGradients"));
    }
    j.dim = j.table->config->embedding_dim();
    j.batch = batch;
    j.lengths = kjt.lengths.data() + k * batch;
    j.ids = kjt.values.data() + off[k];
    j.num_ids = off[k + 1] - off[k];
    if (!kjt.weights.empty()) {
      if (j.sequence) {
        return absl::InvalidArgumentError(
            absl::StrCat("feature '", j.key, "' is a sequence feature: per-id weights apply only to pooled features"));
      }
      j.weights = kjt.weights.data() + off[k];
    }
    if (check == IdCheck::kAll || (check == IdCheck::kRowSplit && j.table->row_split)) {
      if (absl::Status s = CheckJobIds(j); !s.ok()) return s;
    }
    jobs->push_back(std::move(j));
  }
  // The collection's order, whatever the KJT's.
  std::sort(jobs->begin(), jobs->end(),
            [](const FeatureJob& a, const FeatureJob& b) { return a.order < b.order; });
  return absl::OkStatus();
}

// How the failed calls of a fan-out ended (EndCalls).
struct CallEnds {
  bool unconfirmed = false;        // a worker may still be running its call
  bool id_buffer_refused = false;  // a worker could not map the ids' buffer
};

// After calls of which some failed: a channel whose call ended without the
// worker's answer (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN,
// INTERNAL: the connection, not the request; PERMISSION_DENIED) is not
// trusted again, and its worker may still be running the call
// (`unconfirmed`). A refusal (INVALID_ARGUMENT, NOT_FOUND,
// FAILED_PRECONDITION, ...) came from the worker's handler, done with the
// call, and leaves the channel as it was; one of the ids' buffer
// (kIdBufferRefused) makes that worker's channels send ids as arrays from
// then on.
template <typename F>
CallEnds EndCalls(F& fan, std::vector<std::unique_ptr<Transport>>* transports,
                  absl::Time deadline) {
  CallEnds ends;
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan[rank].started) continue;
    const grpc::Status& status = fan[rank].status;
    // A link channel whose exchange did not end as agreed (refused, failed,
    // outputs not taken): its link may be out of step, unless the worker
    // took its bytes before refusing the call as busy.
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        HasSignal(status, kSignalLinkBytesTaken)) {
      (*transports)[rank]->Settled(std::min(deadline, absl::Now() + absl::Seconds(10)));
    }
    if ((*transports)[rank]->Unfinished()) (*transports)[rank]->Failed();
    switch (status.error_code()) {
      case grpc::StatusCode::OK:
        break;
      case grpc::StatusCode::UNAVAILABLE:
      case grpc::StatusCode::DEADLINE_EXCEEDED:
      case grpc::StatusCode::CANCELLED:
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::INTERNAL:
        (*transports)[rank]->Failed();
        ends.unconfirmed = true;
        break;
      case grpc::StatusCode::PERMISSION_DENIED:  // perhaps the channel's owner
        (*transports)[rank]->Failed();
        break;
      case grpc::StatusCode::FAILED_PRECONDITION:
        if (HasSignal(status, kSignalIdBufferRefused)) {
          (*transports)[rank]->BuffersRefused();
          ends.id_buffer_refused = true;
        }
        break;
      default:
        break;
    }
  }
  return ends;
}

// `b` as the request names it to a worker.
void SetSharedBuffer(const SharedBufferInfo& b, ember::v1::SharedBuffer* out) {
  out->set_id(b.id);
  out->set_pid(b.pid);
  out->set_fd(b.fd);
  out->set_size(b.size);
  out->set_nonce(b.nonce);
}

// Asks the worker of `request` (through a channel) to write the sinks whose
// job's output lies in a shared buffer straight there: the request's
// out_buffer and one placement per feature (row stride 0: not placed).
// Every sink keeps its channel slice, where a worker that cannot map the
// buffer writes instead. One buffer per request; `*placed_in` names it.
void Place(const std::vector<FeatureJob>& jobs,
           const std::vector<std::optional<SharedBufferInfo>>& shared,
           ember::v1::WorkerLookupRequest* request, std::vector<Sink>* sinks,
           std::optional<SharedBufferInfo>* placed_in) {
  const SharedBufferInfo* buffer = nullptr;
  for (Sink& sink : *sinks) {
    const std::optional<SharedBufferInfo>& b = shared[sink.job - jobs.data()];
    sink.placed = b.has_value() && (buffer == nullptr || b->id == buffer->id);
    if (sink.placed) buffer = &*b;
  }
  if (buffer == nullptr) return;
  SetSharedBuffer(*buffer, request->mutable_out_buffer());
  for (const Sink& sink : *sinks) {
    auto* p = request->add_placements();
    if (!sink.placed) continue;
    const float* first = sink.job->out + sink.col_offset;
    p->set_offset(reinterpret_cast<const char*>(first) - buffer->base);
    p->set_row_stride(sink.job->out_stride);
  }
  *placed_in = *buffer;
}

// Lookup for pooled or sequence jobs into each job's `out`. Where the
// outputs lie in a shared output buffer (shared_buffer.h), workers reached
// through a channel are asked to write their pooled columns straight into
// it; on a failed call the buffer is poisoned (a worker may still write into
// it) and `*poisoned` set: the caller must not keep it. Ids the workers
// refused (PrepareJobs left them to their check) are named in the
// client's words (NameRefusedIds).
absl::Status RunLookup(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                       uint64_t replica_pick, absl::Time deadline, const StubFor& stub_for,
                       const ChannelFor& channel_for, bool* poisoned = nullptr) {
  using LookupCall = Call<ember::v1::WorkerLookupRequest, ember::v1::WorkerLookupResponse>;
  // Transports (their channels) outlive the calls that use them (declared
  // first).
  std::vector<std::unique_ptr<Transport>> transports(r.info.worker_addresses_size());
  Fanout<LookupCall> fan(r, r.info.worker_addresses_size(), deadline, stub_for);
  // Each job's shards: every shard of a sharded table, one replica of a
  // data-parallel one.
  std::vector<std::vector<Client::Routing::Shard>> targets;
  for (const FeatureJob& j : *jobs) {
    targets.push_back(j.table->shards);
    if (!j.table->replicas.empty()) {
      targets.back() = {j.table->replicas[(replica_pick + j.order) % j.table->replicas.size()]};
    }
  }
  // An output the caller did not clear: partial sums start from zero, and
  // a shard given no ids leaves its columns zero (below).
  for (FeatureJob& j : *jobs) {
    if (!j.out_zeroed && (j.table->row_split || j.sequence)) {
      ClearColumns(j.out, j.out_stride, j.sequence ? j.num_ids : j.batch, 0, j.dim);
    }
  }
  // The shared output buffer holding each job's output, if any: a pooled
  // shard's columns can go straight there (a row-split table's partial sums
  // and sequence rows cannot).
  std::vector<std::optional<SharedBufferInfo>> shared(jobs->size());
  for (size_t i = 0; i < jobs->size(); ++i) {
    const FeatureJob& j = (*jobs)[i];
    if (j.sequence || j.table->row_split || j.batch == 0 || j.out == nullptr) continue;
    shared[i] = SharedBuffers::Global().Find(
        j.out, ((j.batch - 1) * j.out_stride + j.dim) * sizeof(float));
  }
  std::optional<SharedBufferInfo> placed_in;  // the buffer any call was asked to write
  // The shared buffer holding the jobs' ids (the caller's KeyedJaggedTensor,
  // when its values are an IdBuffer large enough to be shared): a worker
  // reached through a channel reads those of all-rows shards there, in
  // place. One buffer per call: ids elsewhere are sent as arrays.
  std::optional<SharedBufferInfo> ids_in;
  std::vector<bool> ids_shared(jobs->size(), false);
  for (size_t i = 0; i < jobs->size(); ++i) {
    const FeatureJob& j = (*jobs)[i];
    if (j.num_ids == 0 || j.on_device) continue;
    auto b = SharedBuffers::Global().Find(j.ids, j.num_ids * sizeof(int64_t));
    if (!b.has_value() || (ids_in.has_value() && b->id != ids_in->id)) continue;
    ids_in = b;
    ids_shared[i] = true;
  }
  // Rank by rank: build the rank's request and send it.
  std::vector<std::vector<Sink>> sinks(fan.size());
  absl::Status link_failure;  // a link channel's bytes could not be sent
  absl::Status device_failure;  // a device array could not be copied
  DeviceStage* device_stage = nullptr;  // LookupOnDevice's, where it has device ids
  for (const FeatureJob& j : *jobs) {
    if (j.on_device) device_stage = j.stage;
  }
  for (int rank = 0; rank < fan.size(); ++rank) {
    LookupCall& c = fan[rank];
    c.request.set_collection(r.info.plan().collection());
    c.request.set_epoch(r.info.plan().epoch());
    uint64_t most = 0;
    for (size_t i = 0; i < jobs->size(); ++i) {
      for (const auto& shard : targets[i]) {
        if (shard.rank == rank) most += MostBytes((*jobs)[i], shard.cols);
      }
    }
    transports[rank] = TransportFor(r.info.worker_addresses(rank), most, channel_for);
    Transport* t = transports[rank].get();
    const bool name_ids = ids_in.has_value() && t->NamesBuffers();
    // Device ids for a worker reached without a link channel: from their
    // host copies (Bucketize), made once for the call.
    if (device_stage != nullptr && !t->Linked()) {
      if (auto ids = device_stage->Ids(); !ids.ok()) device_failure = ids.status();
      if (auto w = device_stage->Weights(); !w.ok()) device_failure = w.status();
      if (!device_failure.ok()) continue;  // nothing sent to this worker
    }
    for (size_t i = 0; i < jobs->size(); ++i) {
      FeatureJob& j = (*jobs)[i];
      const bool row_split = j.table->row_split;
      const bool send_mean = !row_split && j.table->config->pooling() == TableConfig::MEAN;
      for (const auto& shard : targets[i]) {
        if (shard.rank != rank) continue;
        Sink sink;
        sink.job = &j;
        sink.col_offset = shard.col_offset;
        sink.cols = shard.cols;
        ShardFeature f;
        int64_t local = 0;
        Bucketize(j, shard, send_mean, t, &f, j.sequence && row_split ? &sink.positions : nullptr,
                  &local, name_ids && ids_shared[i] ? &*ids_in : nullptr);
        if (f.has_buffer_ids() && !c.request.has_id_buffer()) {
          SetSharedBuffer(*ids_in, c.request.mutable_id_buffer());
        }
        if (local == 0) {  // nothing from this shard: its part is 0
          if (j.device_out != nullptr && !row_split) {
            absl::Status z = j.stage->ZeroRows(j.device_out + shard.col_offset, j.out_stride,
                                               shard.cols, j.batch);
            if (!z.ok() && device_failure.ok()) device_failure = z;
          } else if (!j.out_zeroed && !row_split && !j.sequence) {
            ClearColumns(j.out, j.out_stride, j.batch, shard.col_offset, shard.cols);
          }
          continue;
        }
        sink.rows = j.sequence ? local : j.batch;
        sink.index = c.request.features_size();
        *c.request.add_features() = std::move(f);
        c.used = true;
        sinks[rank].push_back(std::move(sink));
      }
    }
    if (c.used) {
      for (const Sink& sink : sinks[rank]) {
        t->AddOutput(&c.request, sink.rows * sink.cols * sizeof(float));
      }
      c.request.set_channel_id(t->channel_id());
      c.request.set_channel_seq(t->channel_seq());
      if (t->channel_id() != 0 && !t->Linked()) {
        Place(*jobs, shared, &c.request, &sinks[rank], &placed_in);
      }
      if (absl::Status s = t->Linked() ? t->Sending(c.request.mutable_link_sent(),
                                                    c.request.mutable_link_reply())
                                       : absl::OkStatus();
          !s.ok()) {
        t->Failed();
        c.used = false;  // not sent: the call fails below and is retried
        if (link_failure.ok()) link_failure = s;
      }
    }
    fan.Start(rank, [](ember::v1::Worker::Stub* stub, LookupCall* call, auto done) {
      stub->async()->Lookup(&call->ctx, &call->request, &call->response, done);
    });
  }
  // Rank by rank (rank 0's output merges while later ranks may still run),
  // each sink's rows land in its job's output: copied where the shard is the
  // only one for its columns, added (partial sums) where rows are split.
  // Any failure waits for every call first, then lets go of what a call
  // may have left unsafe (EndCalls).
  std::vector<bool> device_copies(fan.size(), false);  // queued on rank's link
  // Waits for the copies into the caller's device memory queued on the
  // links (a link that fails it is let go); the first failure.
  auto wait_copies = [&] {
    absl::Status first;
    for (int rank = 0; rank < fan.size(); ++rank) {
      if (!device_copies[rank]) continue;
      if (absl::Status s = transports[rank]->WaitCopies(deadline); !s.ok() && first.ok()) {
        first = absl::UnavailableError(absl::StrCat("worker ", rank, ": ", s.message()));
      }
    }
    return first;
  };
  auto failed = [&](absl::Status s) {
    (void)fan.WaitAll();
    // Queued copies finish before the caller hears of the failure (a retry,
    // or the caller, reuses that memory).
    (void)wait_copies();
    const CallEnds ends = EndCalls(fan, &transports, deadline);
    if (ends.unconfirmed && placed_in.has_value()) {
      // A worker whose call ended unconfirmed may still write into it.
      SharedBuffers::Global().Poison(placed_in->base + SharedBuffers::kHeaderBytes);
      if (poisoned != nullptr) *poisoned = true;
    }
    // A worker that could not map the ids' buffer: retried (UNAVAILABLE),
    // with ids as arrays.
    if (ends.id_buffer_refused) {
      return absl::UnavailableError(absl::StrCat(
          s.message(), "; sending the ids through the channel instead, and retrying"));
    }
    if (absl::IsInvalidArgument(s)) {
      if (absl::Status named = NameRefusedIds(*jobs); !named.ok()) return named;
    }
    return s;
  };
  if (!link_failure.ok()) return failed(link_failure);
  if (!device_failure.ok()) return failed(device_failure);
  std::vector<float> scratch;
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan.Wait(rank)) continue;  // failed or unused: WaitAll reports it
    const LookupCall& c = fan[rank];
    if (absl::Status st = transports[rank]->Received(deadline); !st.ok()) {  // link channels
      return failed(absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message())));
    }
    for (const Sink& s : sinks[rank]) {
      if (s.placed && c.response.placed()) continue;  // already in place
      FeatureJob& dj = *s.job;
      if (dj.device_out != nullptr && !dj.table->row_split) {
        // Into the caller's device memory: over the link from its memory,
        // or from the answer's host bytes.
        const ember::v1::ShmSlice* slice =
            transports[rank]->Linked() && s.index < c.request.shm_outputs_size()
                ? &c.request.shm_outputs(s.index)
                : nullptr;
        absl::Status st;
        if (slice != nullptr) {
          if (slice->size() != static_cast<uint64_t>(dj.batch * s.cols * sizeof(float))) {
            return failed(
                absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
          }
          st = transports[rank]->OutputToDevice(c.request, s.index, dj.device_out + s.col_offset,
                                                dj.out_stride * sizeof(float), s.cols);
          device_copies[rank] = true;
        } else {
          absl::Span<const float> host;
          st = transports[rank]->Output(c.request, c.response, s.index, &scratch, &host);
          if (st.ok() && host.size() != static_cast<size_t>(dj.batch * s.cols)) {
            return failed(
                absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
          }
          if (st.ok()) {
            st = dj.stage->RowsToDevice(dj.device_out + s.col_offset, dj.out_stride, host.data(),
                                        s.cols, s.cols, dj.batch);
          }
        }
        if (!st.ok()) return failed(absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message())));
        continue;
      }
      absl::Span<const float> buf;
      if (absl::Status st =
              transports[rank]->Output(c.request, c.response, s.index, &scratch, &buf);
          !st.ok()) {
        // UNAVAILABLE: a link lost while its outputs were copied out (the
        // call is retried); else the answer lacks the output.
        return failed(absl::Status(
            absl::IsUnavailable(st) ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal,
            absl::StrCat("worker ", rank, ": ", st.message())));
      }
      FeatureJob& j = *s.job;
      const int64_t rows = static_cast<int64_t>(buf.size()) / std::max<int64_t>(1, s.cols);
      if (rows * s.cols != static_cast<int64_t>(buf.size()) || (!j.sequence && rows != j.batch) ||
          (j.sequence && !s.positions.empty() &&
           rows != static_cast<int64_t>(s.positions.size()))) {
        return failed(
            absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
      }
      const bool add = !j.sequence && j.table->row_split;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t dst_row = j.sequence && !s.positions.empty() ? s.positions[i] : i;
        float* dst = j.out + dst_row * j.out_stride + s.col_offset;
        const float* src = buf.data() + i * s.cols;
        if (add) {
          for (int64_t col = 0; col < s.cols; ++col) dst[col] += src[col];
        } else {
          std::memcpy(dst, src, s.cols * sizeof(float));
        }
      }
    }
  }
  if (absl::Status s = fan.WaitAll(); !s.ok()) return failed(s);
  if (absl::Status s = wait_copies(); !s.ok()) return failed(s);
  // Row-split MEAN: the partial sums, divided by the bag's total length.
  for (FeatureJob& j : *jobs) {
    if (j.sequence || !j.table->row_split || j.table->config->pooling() != TableConfig::MEAN) continue;
    for (int64_t b = 0; b < j.batch; ++b) {
      if (j.lengths[b] == 0) continue;
      const float inv = 1.0f / static_cast<float>(j.lengths[b]);
      float* row = j.out + b * j.out_stride;
      for (int64_t c = 0; c < j.dim; ++c) row[c] *= inv;
    }
  }
  return absl::OkStatus();
}

// Gradients for pooled or sequence jobs (each job's grad/grad_stride set).
absl::Status RunGradients(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                          const std::string& request_id, uint64_t digest, absl::Time deadline,
                          const StubFor& stub_for, const ChannelFor& channel_for) {
  using GradCall = Call<ember::v1::WorkerApplyGradientsRequest, ember::v1::WorkerApplyGradientsResponse>;
  std::vector<std::unique_ptr<Transport>> transports(r.info.worker_addresses_size());
  Fanout<GradCall> fan(r, r.info.worker_addresses_size(), deadline, stub_for);
  auto targets_of = [](const FeatureJob& j) -> const std::vector<Client::Routing::Shard>& {
    return j.table->replicas.empty() ? j.table->shards : j.table->replicas;
  };
  // Rank by rank: build the rank's request and send it.
  absl::Status link_failure;  // a link channel's bytes could not be sent
  absl::Status device_failure;  // a device array could not be copied
  const bool defer = std::any_of(jobs->begin(), jobs->end(),
                                 [](const FeatureJob& j) { return j.device_grad != nullptr; });
  // Sends rank's call (its link bytes first) if its request carries anything.
  auto send = [&](int rank) {
    GradCall& call = fan[rank];
    Transport* t = transports[rank].get();
    if (call.used) {
      call.request.set_channel_id(t->channel_id());
      call.request.set_channel_seq(t->channel_seq());
      if (absl::Status s =
              t->Linked() ? t->Sending(call.request.mutable_link_sent(), nullptr) : absl::OkStatus();
          !s.ok()) {
        t->Failed();
        call.used = false;  // not sent: the update fails and is retried
        if (link_failure.ok()) link_failure = s;
      }
    }
    fan.Start(rank, [](ember::v1::Worker::Stub* stub, GradCall* c, auto done) {
      stub->async()->ApplyGradients(&c->ctx, &c->request, &c->response, done);
    });
  };
  for (int rank = 0; rank < fan.size(); ++rank) {
    GradCall& call = fan[rank];
    call.request.set_collection(r.info.plan().collection());
    call.request.set_epoch(r.info.plan().epoch());
    call.request.set_request_id(request_id);
    call.request.set_request_digest(digest);
    uint64_t most = 0;
    for (const FeatureJob& j : *jobs) {
      for (const auto& shard : targets_of(j)) {
        if (shard.rank == rank) most += MostBytes(j, shard.cols);
      }
    }
    transports[rank] = TransportFor(r.info.worker_addresses(rank), most, channel_for);
    Transport* t = transports[rank].get();
    for (FeatureJob& j : *jobs) {
      const std::vector<Client::Routing::Shard>& targets = targets_of(j);
      const bool row_split = j.table->row_split;
      const bool mean = j.table->config->pooling() == TableConfig::MEAN;
      for (const auto& shard : targets) {
        if (shard.rank != rank) continue;
        // Every shard gets a request, ids or not, so its optimizer step
        // stays the table's (Adam's bias correction counts calls).
        auto* g = call.request.add_gradients();
        call.used = true;
        std::vector<int64_t> positions;
        int64_t local = 0;
        Bucketize(j, shard, mean && !row_split, t, g->mutable_feature(),
                  j.sequence ? &positions : nullptr, &local);
        const bool all_rows = shard.rows == j.table->config->num_embeddings();
        const int64_t grad_rows = j.sequence ? local : j.batch;
        if (j.device_grad != nullptr) {
          if (t->Linked() && !(mean && row_split)) {  // device to link, no host copy
            t->KeepOnDevice(g->mutable_grad(), [&] { return g->mutable_shm_grad(); },
                            j.device_grad + shard.col_offset, j.grad_stride * sizeof(float),
                            shard.cols * sizeof(float), j.batch);
            continue;
          }
          if (j.grad == nullptr) {  // their host copy (scaled below, or sent inline)
            auto host = j.stage->Grads();
            if (!host.ok()) {
              if (device_failure.ok()) device_failure = host.status();
              continue;
            }
            j.grad = *host + (j.device_grad - j.stage->grads_base());
          }
        }
        auto dst = t->TakeArray<float>(g->mutable_grad(), grad_rows * shard.cols);
        if (j.sequence) {
          for (int64_t i = 0; i < local; ++i) {
            const int64_t src_row = all_rows ? i : positions[i];
            std::memcpy(dst.data() + i * shard.cols,
                        j.grad + src_row * j.grad_stride + shard.col_offset,
                        shard.cols * sizeof(float));
          }
        } else {
          for (int64_t b = 0; b < j.batch; ++b) {
            const float* src = j.grad + b * j.grad_stride + shard.col_offset;
            float* out = dst.data() + b * shard.cols;
            if (mean && row_split) {  // d(sum/len)/d(row) = 1/len, the bag's total length
              const float inv = j.lengths[b] > 0 ? 1.0f / static_cast<float>(j.lengths[b]) : 0.0f;
              for (int64_t c = 0; c < shard.cols; ++c) out[c] = src[c] * inv;
            } else {
              std::memcpy(out, src, shard.cols * sizeof(float));
            }
          }
        }
        t->KeepArray<float>(g->mutable_grad(), [&] { return g->mutable_shm_grad(); }, dst);
      }
    }
    if (!defer) send(rank);
  }
  // Device gradients: every request built (their host copies made where
  // needed) before any worker is sent anything, so that a failed copy
  // leaves the update unapplied everywhere, not applied in part.
  if (defer && device_failure.ok()) {
    for (int rank = 0; rank < fan.size(); ++rank) send(rank);
  }
  absl::Status s = fan.WaitAll();
  // Link channels: each exchange that was answered waited for (its region
  // is then free, and its link in step, whatever the other ranks' calls
  // did).
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan[rank].started || !fan[rank].status.ok()) continue;
    if (absl::Status st = transports[rank]->Received(deadline); !st.ok() && s.ok()) {
      s = absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message()));
    }
  }
  if (s.ok()) s = link_failure;
  if (s.ok()) s = device_failure;
  if (!s.ok()) (void)EndCalls(fan, &transports, deadline);
  return s;
}

}  // namespace

absl::StatusOr<KeyedTensor> Client::Lookup(const std::string& collection, KjtView kjt) {
  KeyedTensor kt;
  if (absl::Status s = Lookup(collection, kjt, &kt); !s.ok()) return s;
  return kt;
}

absl::Status Client::Lookup(const std::string& collection, KjtView kjt, KeyedTensor* out) {
  KeyedTensor& kt = *out;
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
  const uint64_t pick = impl_->replica_counter.fetch_add(1);
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
    absl::Status st = RunLookup(r, &jobs, pick, deadline, stub_for, channel_for, &poisoned);
    // A worker may yet write into this buffer: let it go (a retry or the
    // next call takes a fresh one).
    if (poisoned) kt.values = FloatBuffer();
    return st;
  });
  return s;
}

absl::Status Client::ApplyGradients(const std::string& collection, KjtView kjt,
                                    KeyedTensorView grads, const std::string& request_id,
                                    std::string* used_request_id) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  uint64_t digest = 0;  // a fresh id cannot be reused: no digest needed
  if (!request_id.empty()) {
    UpdateDigest d;
    d.Add(collection);
    d.Add(kjt);
    for (const std::string& k : grads.keys) d.Add(k);
    d.Add(grads.length_per_key);
    d.Add(grads.values);
    digest = d.value();
  }
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
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
    return RunGradients(r, &jobs, id, digest, deadline, stub_for, channel_for);
  });
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
                                    float* out, int64_t out_floats, Layout* layout) {
  DeviceStage stage(impl_->link, impl_->options.link_device, kjt);
  auto view = ViewOf(&stage);
  if (!view.ok()) return view.status();
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
  const uint64_t pick = impl_->replica_counter.fetch_add(1);
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
    if (absl::Status st = RunLookup(r, &jobs, pick, deadline, stub_for, channel_for); !st.ok()) {
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
                                            std::string* used_request_id) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  DeviceStage stage(impl_->link, impl_->options.link_device, kjt);
  auto view = ViewOf(&stage);
  if (!view.ok()) return view.status();
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
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
    return RunGradients(r, &jobs, id, /*digest=*/0, deadline, stub_for, channel_for);
  });
}

absl::StatusOr<std::vector<SequenceEmbedding>> Client::LookupSequence(
    const std::string& collection, KjtView kjt) {
  std::vector<SequenceEmbedding> out;
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
  const uint64_t pick = impl_->replica_counter.fetch_add(1);
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
    return RunLookup(r, &jobs, pick, deadline, stub_for, channel_for);
  });
  if (!s.ok()) return s;
  return out;
}

absl::Status Client::ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                            const std::vector<SequenceEmbedding>& grads,
                                            const std::string& request_id,
                                            std::string* used_request_id) {
  std::vector<SequenceEmbeddingView> views;
  for (const SequenceEmbedding& g : grads) views.push_back(g.View());
  return ApplySequenceGradients(collection, kjt, views, request_id, used_request_id);
}

absl::Status Client::ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                            absl::Span<const SequenceEmbeddingView> grads,
                                            const std::string& request_id,
                                            std::string* used_request_id) {
  const std::string id = request_id.empty() ? RandomRequestId() : request_id;
  if (used_request_id != nullptr) *used_request_id = id;
  uint64_t digest = 0;  // a fresh id cannot be reused: no digest needed
  if (!request_id.empty()) {
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
  auto stub_for = [this](const std::string& a) { return StubFor(a); };
  auto channel_for = [this](const std::string& a, uint64_t bytes) {
    return impl_->ChannelTo(*this, a, bytes);
  };
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
    return RunGradients(r, &jobs, id, digest, deadline, stub_for, channel_for);
  });
}

absl::Status Client::ImportTable(const std::string& collection, const std::string& table,
                                 absl::Span<const float> values, int64_t rows, int64_t dim) {
  auto routing = RoutingFor(collection, /*refresh=*/true);
  if (!routing.ok()) return routing.status();
  const Routing& r = **routing;
  auto found = FindTable(r, collection, table);
  if (!found.ok()) return found.status();
  const Routing::Table* t = *found;
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
  // Every shard (every replica of a data-parallel table) gets its rows and
  // columns; its optimizer state and step are read back and kept.
  std::vector<Routing::Shard> targets = t->shards;
  targets.insert(targets.end(), t->replicas.begin(), t->replicas.end());
  constexpr int64_t kChunkBytes = 16 << 20;
  std::vector<float> weights;
  for (const auto& s : targets) {
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (s.cols * 4 * 3));
    const std::string& address = r.info.worker_addresses(s.rank);
    for (int64_t b = 0; b < s.rows; b += chunk) {
      const int64_t e = std::min(s.rows, b + chunk);
      ember::v1::ExportRowsRequest ex;
      ex.set_collection(collection);
      ex.mutable_shard()->set_table(table);
      ex.mutable_shard()->set_shard_index(s.index);
      ex.set_row_begin(b);
      ex.set_row_end(e);
      ember::v1::ExportRowsResponse got;
      {
        grpc::ClientContext ctx;
        PrepareContext(&ctx, impl_->options.timeout);
        grpc::Status st = StubFor(address)->ExportRows(&ctx, ex, &got);
        if (!st.ok()) return FromGrpc(st, absl::StrCat("worker ", s.rank, " (", address, ")"));
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
      *im.mutable_shard() = ex.shard();
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
      grpc::ClientContext ctx;
      PrepareContext(&ctx, impl_->options.timeout);
      ember::v1::ExportRowsRequest req;
      req.set_collection(collection);
      req.mutable_shard()->set_table(table);
      req.mutable_shard()->set_shard_index(s.index);
      req.set_row_begin(b);
      req.set_row_end(e);
      ember::v1::ExportRowsResponse resp;
      const std::string& address = r.info.worker_addresses(s.rank);
      grpc::Status st = StubFor(address)->ExportRows(&ctx, req, &resp);
      if (!st.ok()) return FromGrpc(st, absl::StrCat("worker ", s.rank, " (", address, ")"));
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

}  // namespace client
}  // namespace ember
