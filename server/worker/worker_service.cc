// WorkerService's data plane: channels (shared memory, id buffers, links),
// the lease and fence, and the Lookup and ApplyGradients handlers: auth,
// busy, decode (request_codec.h, which owns every transport) -> backend ->
// outputs back, exactly-once, metrics. Shard bookkeeping is
// worker_shards.cc; rows in and out (export, import, checkpoints) are
// worker_rows.cc.
#include "server/worker/worker_service.h"

#include <chrono>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/backend/overflow_guard.h"
#include "server/common/grpc_util.h"

namespace ember {
namespace worker {

WorkerService::WorkerService(std::unique_ptr<backend::EmbeddingBackend> backend,
                             const WorkerServiceOptions& options)
    : backend_(std::move(backend)),
      options_(options),
      channels_(options.channel_idle_timeout, kMaxMessageBytes, options.max_channels,
                options.shm_dir, options.links),
      codec_(&channels_, backend_.get(),
             CodecOptions{options.max_response_bytes, options.skip_nonfinite}) {}

namespace {

// Whose a shared-memory channel is: the call's credentials (empty without
// tokens, or in tests that call the service directly).
std::string OwnerOf(const grpc::ServerContext* ctx) {
  return std::string(AuthorizationOf(ctx).value_or(""));
}

}  // namespace

grpc::Status WorkerService::OpenChannel(grpc::ServerContext* ctx,
                                        const ember::v1::OpenChannelRequest* req,
                                        ember::v1::OpenChannelResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  if (!options_.shared_memory && req->link().empty()) {
    return ToGrpc(absl::FailedPreconditionError(
        "this worker offers no shared-memory channels (--shared_memory=false)"));
  }
  std::string link_id;
  auto id = channels_.Open(*req, OwnerOf(ctx), &link_id);
  if (!id.ok()) return ToGrpc(id.status());
  resp->set_channel_id(*id);
  resp->set_link_id(std::move(link_id));
  resp->set_idle_timeout_ms(absl::ToInt64Milliseconds(channels_.idle_timeout()));
  // Opened through /proc/<pid>/fd: the client's id buffers can be too.
  resp->set_reads_id_buffers(req->pid() != 0);
  return grpc::Status::OK;
}

grpc::Status WorkerService::CloseChannel(grpc::ServerContext* ctx,
                                         const ember::v1::CloseChannelRequest* req,
                                         ember::v1::CloseChannelResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  return ToGrpc(channels_.Close(req->channel_id(), OwnerOf(ctx)));
}

WorkerService::~WorkerService() = default;

namespace {

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void WorkerService::SetLease(absl::Duration lease) {
  last_tick_ns_.store(SteadyNanos());
  lease_ns_.store(absl::ToInt64Nanoseconds(lease));
}

absl::Duration WorkerService::Tick() {
  const int64_t now = SteadyNanos();
  return absl::Nanoseconds(now - last_tick_ns_.exchange(now));
}

void WorkerService::Fence() { fenced_.store(true); }

void WorkerService::Unfence(const std::map<std::string, int64_t>& keep) {
  {
    absl::MutexLock lock(&mu_);
    for (auto it = collections_.begin(); it != collections_.end();) {
      auto k = keep.find(it->first);
      // A newer copy than the coordinator named is a create that raced
      // this answer: kept.
      if (k != keep.end() && it->second->epoch >= k->second) {
        ++it;
        continue;
      }
      LOG(WARNING) << "collection '" << it->first << "' epoch " << it->second->epoch
                   << ": moved elsewhere while this worker was paused; dropped";
      it = EraseCollection(it);
    }
  }
  (void)Tick();
  fenced_.store(false);
}

absl::StatusOr<WorkerService::DataCall> WorkerService::EnterDataCall(const char* what) {
  const int64_t lease = lease_ns_.load();
  if (lease > 0 && (fenced_.load() || SteadyNanos() - last_tick_ns_.load() > lease)) {
    return absl::UnavailableError(absl::StrCat(
        "this worker was paused past its lease (the coordinator may have moved its shards); ",
        what, " refused until the coordinator confirms what it holds: retry, refreshing the "
              "plan"));
  }
  const int64_t n = calls_in_progress_.fetch_add(1) + 1;
  DataCall call(&calls_in_progress_);
  if (options_.max_queued_calls > 0 && n > options_.max_queued_calls) {
    busy_refused_.fetch_add(1, std::memory_order_relaxed);
    return WithSignal(absl::ResourceExhaustedError(absl::StrCat(
                          kWorkerBusy, ": ", options_.max_queued_calls,
                          " data calls in progress (--max_queued_calls); ", what,
                          " refused, retry with back-off")),
                      kSignalWorkerBusy);
  }
  return call;
}

absl::Status WorkerService::RefuseBusy(const std::string& owner, uint64_t channel, uint64_t seq,
                                      const ember::v1::ShmSlice& sent, const absl::Status& busy) {
  if (channel == 0 || !channels_.IsLink(channel, owner)) return busy;
  // At most kMaxBusyReceives at once (they run outside max_queued_calls);
  // past that the channel is given up, its bytes not received.
  struct Held {
    std::atomic<int>* n;
    ~Held() { n->fetch_sub(1); }
  } held{&busy_receives_};
  if (busy_receives_.fetch_add(1) >= kMaxBusyReceives) {
    channels_.Abandon(channel, owner);
    return busy;
  }
  // Received, and nothing of it copied to the host (none of it is read).
  const std::vector<ember::v1::ShmSlice> none;
  auto taken = channels_.Use(channel, owner, seq, sent, &none);
  if (!taken.ok()) return taken.status();
  link_busy_kept_.fetch_add(1, std::memory_order_relaxed);
  return WithSignal(
      WithSignal(absl::ResourceExhaustedError(absl::StrCat(busy.message(), "; ", kLinkBytesTaken)),
                 kSignalWorkerBusy),
      kSignalLinkBytesTaken);
}

grpc::Status WorkerService::Lookup(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest* req,
                                   ember::v1::WorkerLookupResponse* resp) {
  const absl::Time handler_start = absl::Now();
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("lookup");
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  LookupCall in;
  if (absl::Status s = codec_.ReceiveLookup(*req, OwnerOf(ctx), &in); !s.ok()) return ToGrpc(s);
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  std::vector<const ShardEntry*> entries;  // each feature's shard
  if (absl::Status s = in.Decode(ShapesOf(**c, &entries), resp); !s.ok()) return ToGrpc(s);
  const absl::Time lookup_start = absl::Now();
  const absl::Status looked_up = backend_->Lookup(in.requests());
  backend_lookup_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - lookup_start),
                               std::memory_order_relaxed);
  if (!looked_up.ok()) {
    resp->clear_outputs();
    return ToGrpc(looked_up);
  }
  if (absl::Status s = in.Finish(resp); !s.ok()) return ToGrpc(s);
  int64_t ids = 0;
  for (size_t i = 0; i < in.requests().size(); ++i) {
    const int64_t n = static_cast<int64_t>(in.requests()[i].feature.ids.size());
    ids += n;
    entries[i]->traffic->lookup_ids.fetch_add(n, std::memory_order_relaxed);
  }
  lookups_.fetch_add(1, std::memory_order_relaxed);
  if (in.placed()) placed_lookups_.fetch_add(1, std::memory_order_relaxed);
  if (in.from_id_buffer()) id_buffer_lookups_.fetch_add(1, std::memory_order_relaxed);
  if (in.linked()) link_lookups_.fetch_add(1, std::memory_order_relaxed);
  lookup_ids_.fetch_add(ids, std::memory_order_relaxed);
  lookup_bytes_.fetch_add(in.output_bytes() + ids * 8, std::memory_order_relaxed);
  lookup_handler_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - handler_start),
                               std::memory_order_relaxed);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ApplyGradients(grpc::ServerContext* ctx,
                                           const ember::v1::WorkerApplyGradientsRequest* req,
                                           ember::v1::WorkerApplyGradientsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("gradient update");
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  if (req->request_id().empty()) {
    channels_.Abandon(req->channel_id(), OwnerOf(ctx));
    return ToGrpc(absl::InvalidArgumentError("request_id is empty (needed for exactly-once)"));
  }
  GradientCall in;
  if (absl::Status s = codec_.ReceiveGradients(*req, OwnerOf(ctx), &in); !s.ok()) {
    return ToGrpc(s);
  }
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  Collection& coll = **c;
  absl::MutexLock apply(coll.apply_mu.get());
  const uint64_t id = RequestIdHash(req->request_id());
  std::vector<backend::GradientRequest> requests;
  std::vector<const ShardEntry*> found;    // gradient i's shard
  std::vector<const ShardEntry*> entries;  // requests[i]'s shard
  std::set<const ShardEntry*> touched;
  bool seen = false;
  // Counts a refusal for NaN/Inf (the message says so) and passes it on.
  auto refuse = [this](const absl::Status& s) {
    if (backend::IsNonFiniteRefusal(s)) {
      nonfinite_refused_.fetch_add(1, std::memory_order_relaxed);
    }
    if (backend::IsOverflowRefusal(s)) overflow_refused_.fetch_add(1, std::memory_order_relaxed);
    return ToGrpc(s);
  };
  // The whole request is checked; then only the parts whose shards have not
  // applied this id run (a retry after a partial failure or a move).
  for (int i = 0; i < in.request().gradients_size(); ++i) {
    auto part = in.Decode(i, ShapesOf(coll, &found));
    if (!part.ok()) return refuse(part.status());
    const ShardEntry* entry = found.back();
    if (entry->applied->Conflicts(id, req->request_digest())) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "request id '", req->request_id().substr(0, 128),
          "' was applied before to other ids or gradients; a request id names one update "
          "(retry it unchanged, or use a new id)")));
    }
    if (entry->applied->Contains(id)) {
      seen = true;
      continue;
    }
    requests.push_back(*part);
    entries.push_back(entry);
    touched.insert(entry);
  }
  if (requests.empty() && seen) {
    resp->set_duplicate(true);
    duplicates_.fetch_add(1, std::memory_order_relaxed);
    return grpc::Status::OK;
  }
  const absl::Time update_start = absl::Now();
  const absl::Status applied = backend_->ApplyGradients(requests);
  backend_update_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - update_start),
                               std::memory_order_relaxed);
  if (!applied.ok()) return refuse(applied);
  int64_t ids = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t n = static_cast<int64_t>(requests[i].feature.ids.size());
    ids += n;
    entries[i]->traffic->gradient_ids.fetch_add(n, std::memory_order_relaxed);
  }
  updates_.fetch_add(1, std::memory_order_relaxed);
  update_ids_.fetch_add(ids, std::memory_order_relaxed);
  if (const int64_t skipped = in.skipped(); skipped > 0) {
    nonfinite_skipped_ids_.fetch_add(skipped, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 100) << "collection '" << req->collection() << "': " << skipped
                              << " id(s) with NaN/Inf gradients or weights left out of an update";
  }
  const absl::Time now = absl::Now();
  int64_t early = 0;
  for (const ShardEntry* e : touched) {
    early += e->applied->Add(id, now, options_.dedup_ttl, options_.dedup_window,
                             req->request_digest());
  }
  if (early > 0) {
    dedup_forgotten_early_.fetch_add(early, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 1000) << "collection '" << req->collection() << "': more than "
                               << options_.dedup_window << " update ids within "
                               << options_.dedup_ttl << " on a shard; forgetting the oldest early";
  }
  return grpc::Status::OK;
}

}  // namespace worker
}  // namespace ember
