// WorkerService's data plane: channels (shared memory, id buffers, links),
// the lease and fence, and the Lookup and ApplyGradients handlers: auth,
// busy, decode (request_codec.h, which owns every transport) -> backend ->
// outputs back, exactly-once, metrics. Shard bookkeeping is
// worker_shards.cc; rows in and out (export, import, checkpoints) are
// worker_rows.cc.
#include "server/worker/worker_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/backend/overflow_guard.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"

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

// The row ranges whose record (a shard a live move filled from several)
// holds request `id`.
std::vector<std::pair<int64_t, int64_t>> AppliedRanges(const std::vector<RowsRecord>& records,
                                                       uint64_t id) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const RowsRecord& r : records) {
    if (r.applied.Contains(id)) out.push_back({r.begin, r.end});
  }
  return out;
}

// `part` less its ids in `ranges` (with NONE pooling, their gradient rows
// too): what a retried update still owes the rows whose record lacks it.
// A pooled bag keeps its gradient, so each remaining id gets what it would
// have had: a MEAN bag becomes SUM with the mean's factor of its whole
// length folded into each id's weight (the same product the backend forms;
// a row-split MEAN part, sent as SUM with mean_lengths, keeps those).
HeldPart WithoutRanges(const HeldPart& part,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  auto applied = [&](int64_t row) {
    for (const auto& [b, e] : ranges) {
      if (row >= b && row < e) return true;
    }
    return false;
  };
  HeldPart out;
  out.table = part.table;
  out.shard_index = part.shard_index;
  out.feature = part.feature;
  out.mean_lengths = part.mean_lengths;
  const bool mean = part.pooling == backend::Pooling::kMean;
  out.pooling = mean ? backend::Pooling::kSum : part.pooling;
  const bool per_id = part.pooling == backend::Pooling::kNone;
  const bool weighted = !part.weights.empty();
  const size_t n = per_id ? part.ids.size() : part.lengths.size();
  const size_t cols = n == 0 ? 0 : part.grad.size() / n;
  size_t at = 0;
  for (size_t b = 0; b < part.lengths.size(); ++b) {
    int64_t kept = 0;
    // The backend's factors (math::MeanScale, IdScale), formed alike here.
    const float mean_scale =
        mean && part.lengths[b] > 0 ? 1.0f / static_cast<float>(part.lengths[b]) : 1.0f;
    for (int64_t k = 0; k < part.lengths[b]; ++k, ++at) {
      if (applied(part.ids[at])) continue;
      out.ids.push_back(part.ids[at]);
      if (mean) {
        out.weights.push_back(weighted ? part.weights[at] * mean_scale : mean_scale);
      } else if (weighted) {
        out.weights.push_back(part.weights[at]);
      }
      if (per_id) {
        out.grad.insert(out.grad.end(), part.grad.begin() + at * cols,
                        part.grad.begin() + (at + 1) * cols);
      }
      ++kept;
    }
    out.lengths.push_back(kept);
    if (!per_id) {
      out.grad.insert(out.grad.end(), part.grad.begin() + b * cols,
                      part.grad.begin() + (b + 1) * cols);
    }
  }
  return out;
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

absl::StatusOr<WorkerService::DataCall> WorkerService::EnterDataCall(const char* what,
                                                                       bool bounded) {
  const int64_t lease = lease_ns_.load();
  if (lease > 0 && (fenced_.load() || SteadyNanos() - last_tick_ns_.load() > lease)) {
    return absl::UnavailableError(absl::StrCat(
        "this worker was paused past its lease (the coordinator may have moved its shards); ",
        what, " refused until the coordinator confirms what it holds: retry, refreshing the "
              "plan"));
  }
  const int64_t n = calls_in_progress_.fetch_add(1) + 1;
  DataCall call(&calls_in_progress_);
  if (bounded && options_.max_queued_calls > 0 && n > options_.max_queued_calls) {
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

namespace {

// The call's deadline (none, or no context: the infinite future).
absl::Time DeadlineOf(const grpc::ServerContext* ctx) {
  if (ctx == nullptr) return absl::InfiniteFuture();
  const auto d = ctx->deadline();
  if (d >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(d);
}

}  // namespace

grpc::Status WorkerService::Lookup(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest* req,
                                   ember::v1::WorkerLookupResponse* resp) {
  const absl::Time handler_start = absl::Now();
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("lookup");
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  if (req->prefetch()) return Prefetch(ctx, *req, resp);
  LookupCall in;
  if (absl::Status s = codec_.ReceiveLookup(*req, OwnerOf(ctx), &in); !s.ok()) return ToGrpc(s);
  if (absl::Status s = WaitForStep(*req, DeadlineOf(ctx)); !s.ok()) return ToGrpc(s);
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

grpc::Status WorkerService::Prefetch(grpc::ServerContext* ctx,
                                     const ember::v1::WorkerLookupRequest& req,
                                     ember::v1::WorkerLookupResponse* resp) {
  if (req.channel_id() != 0 || req.has_id_buffer() || req.has_step()) {
    return ToGrpc(absl::InvalidArgumentError(
        "a prefetch is sent without a channel, an id buffer or a step"));
  }
  LookupCall in;
  if (absl::Status s = codec_.ReceiveLookup(req, OwnerOf(ctx), &in); !s.ok()) return ToGrpc(s);
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req.collection(), req.epoch());
  if (!c.ok()) return ToGrpc(c.status());
  std::vector<const ShardEntry*> entries;
  auto features = in.DecodePrefetch(ShapesOf(**c, &entries));
  if (!features.ok()) return ToGrpc(features.status());
  auto brought = backend_->Prefetch(*features);
  if (!brought.ok()) return ToGrpc(brought.status());
  resp->set_prefetched_rows(*brought);
  int64_t ids = 0;
  for (const backend::FeatureRequest& f : *features) ids += static_cast<int64_t>(f.ids.size());
  prefetches_.fetch_add(1, std::memory_order_relaxed);
  prefetch_ids_.fetch_add(ids, std::memory_order_relaxed);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ApplyGradients(grpc::ServerContext* ctx,
                                           const ember::v1::WorkerApplyGradientsRequest* req,
                                           ember::v1::WorkerApplyGradientsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("gradient update", /*bounded=*/req->from_primary().empty());
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  if (req->request_id().empty()) {
    channels_.Abandon(req->channel_id(), OwnerOf(ctx));
    return ToGrpc(absl::InvalidArgumentError("request_id is empty (needed for exactly-once)"));
  }
  // An update held for a step (SYNC / BOUNDED) outlives the channel's
  // transfer, and a dynamic table's update keeps its bookkeeping
  // (admission, eviction) on the host, so either comes to the host whole,
  // even from a link's device memory (only a link's transfer can leave it
  // there).
  bool to_host = false;
  if (req->has_link_sent()) {
    absl::ReaderMutexLock lock(&mu_);
    auto c = FindCollection(req->collection(), req->epoch());
    to_host = c.ok() && ((*c)->steps->stepped() || TouchesDynamicTable(**c, *req) ||
                         ForwardsUpdates(**c));
  }
  GradientCall in;
  if (absl::Status s = codec_.ReceiveGradients(*req, OwnerOf(ctx), &in, to_host); !s.ok()) {
    return ToGrpc(s);
  }
  std::shared_ptr<StepBarrier> steps;
  Contribution held;
  std::map<std::string, ember::v1::WorkerApplyGradientsRequest> mirror;  // BOUNDED replicas
  {
    // A forwarded update never waits behind a writer of the collection map
    // (a move's UpdateShards): its primary holds its own map while it
    // waits, so two workers forwarding to each other with moves pending on
    // both would wait on each other. Refused as busy instead, nothing
    // applied (the primary refuses likewise; its trainer retries).
    if (req->from_primary().empty()) {
      mu_.ReaderLock();
    } else if (!mu_.ReaderTryLock()) {
      busy_refused_.fetch_add(1, std::memory_order_relaxed);
      return ToGrpc(WithSignal(
          absl::ResourceExhaustedError(absl::StrCat(
              kWorkerBusy, ": the collections are being moved on this backup; a forwarded "
                           "update is refused rather than waited for, retry with back-off")),
          kSignalWorkerBusy));
    }
    auto unlock = absl::MakeCleanup([this] { mu_.ReaderUnlock(); });
    auto c = FindCollection(req->collection(), req->epoch());
    if (!c.ok()) return ToGrpc(c.status());
    if ((*c)->steps->stepped() != req->has_step() && !req->from_primary().empty()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "a forwarded update of collection '", req->collection(), "', which trains ",
          ember::v1::TrainingSpec::Mode_Name((*c)->steps->options().mode),
          (req->has_step() ? ", carries a step" : ", carries no step"))));
    }
    if (!req->from_primary().empty()) {
      if (absl::Status sender = CheckForwardSender(**c, *req); !sender.ok()) {
        return ToGrpc(sender);
      }
      if (req->hold()) return ToGrpc(KeepHeld(**c, in, *req));
    } else if (req->step_ranks_size() > 0 || req->hold()) {
      return ToGrpc(absl::InvalidArgumentError(
          "step_ranks and hold are a primary's forwards (from_primary); a trainer sends its own "
          "update under its request id"));
    }
    // A backup applies a forwarded step as it comes: its primary's barrier
    // completed it.
    if (!(*c)->steps->stepped() || !req->from_primary().empty()) {
      return ApplyNow(ctx, **c, in, *req, resp);
    }
    if (absl::Status s = HoldContribution(**c, in, *req, &held); !s.ok()) return ToGrpc(s);
    if (auto t = AuthorizationOf(ctx); t.has_value()) held.authorization = std::string(*t);
    steps = (*c)->steps;
    mirror = MirrorRequests(**c, *req, held);
  }
  // SYNC / BOUNDED: held until every rank sent the step, waited for
  // without mu_ (the collection may move meanwhile: its barrier is then
  // aborted and the caller refreshes its plan and sends again).
  bool duplicate = false;
  const std::optional<std::string> token = held.authorization;
  absl::Status s = steps->Submit(req->step(), std::move(held), DeadlineOf(ctx),
                                 StepApplier(req->collection(), steps.get()), &duplicate);
  // BOUNDED: acknowledged once every backup keeps it too (a retry, held
  // here already, is sent on again), unless its step is applied here
  // already (the update that completed it, or a retry): every backup then
  // applied it, forwarded merged.
  if (s.ok() && !mirror.empty() && !steps->AppliedThrough(req->step())) {
    s = SendMirror(std::move(mirror), req->collection(), req->epoch(), token, DeadlineOf(ctx));
  }
  if (duplicate) {
    resp->set_duplicate(true);
    duplicates_.fetch_add(1, std::memory_order_relaxed);
  }
  return ToGrpc(s);
}

absl::Status WorkerService::WaitForStep(const ember::v1::WorkerLookupRequest& req,
                                        absl::Time deadline) {
  std::shared_ptr<StepBarrier> steps;
  std::shared_ptr<ForwardedSteps> forwarded;
  std::set<std::string> primaries;  // of the backup copies it reads
  bool own = req.features_size() == 0;  // it reads copies stepped here
  {
    absl::ReaderMutexLock lock(&mu_);
    auto c = FindCollection(req.collection(), req.epoch());
    if (!c.ok()) return c.status();
    if (!(*c)->steps->stepped()) return absl::OkStatus();
    steps = (*c)->steps;
    forwarded = (*c)->forwarded;
    for (const ember::v1::ShardFeature& f : req.features()) {
      auto entry = FindShard(**c, f.shard());
      const std::string primary =
          entry.ok() ? (*entry)->assignment.replication().primary() : std::string();
      if (primary.empty()) {
        own = true;  // (a shard not held: the lookup refuses it after)
      } else {
        primaries.insert(primary);
      }
    }
  }
  if (!req.has_step() || req.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "collection '", req.collection(), "' trains ",
        ember::v1::TrainingSpec::Mode_Name(steps->options().mode),
        ": a lookup carries the step it reads for (>= 0)",
        req.has_step() ? absl::StrCat(", got ", req.step()) : std::string()));
  }
  if (own) {
    // (A step held after a failed apply is tried again meanwhile.)
    const StepBarrier::ApplyFn kick = StepApplier(req.collection(), steps.get());
    if (absl::Status s = steps->WaitForLookup(req.step(), deadline, &kick); !s.ok()) return s;
  }
  if (primaries.empty()) return absl::OkStatus();
  // A backup applies each step its primary forwards before the primary
  // does: what the primary's barrier waits for, the forwarded step says.
  return WaitForwarded(forwarded.get(), primaries, req.step() - 1 - steps->staleness(),
                       req.step(), std::min(deadline, absl::Now() + steps->options().timeout));
}

absl::Status WorkerService::RunUpdate(const std::vector<backend::GradientRequest>& requests,
                                      const std::vector<const ShardEntry*>& entries) {
  const absl::Time update_start = absl::Now();
  const absl::Status applied = backend_->ApplyGradients(requests);
  backend_update_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - update_start),
                               std::memory_order_relaxed);
  if (!applied.ok()) return CountRefusal(applied);
  int64_t ids = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t n = static_cast<int64_t>(requests[i].feature.ids.size());
    ids += n;
    entries[i]->traffic->gradient_ids.fetch_add(n, std::memory_order_relaxed);
  }
  updates_.fetch_add(1, std::memory_order_relaxed);
  update_ids_.fetch_add(ids, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status WorkerService::CountRefusal(const absl::Status& s) {
  if (backend::IsNonFiniteRefusal(s)) nonfinite_refused_.fetch_add(1, std::memory_order_relaxed);
  if (backend::IsOverflowRefusal(s)) overflow_refused_.fetch_add(1, std::memory_order_relaxed);
  return s;
}

grpc::Status WorkerService::ApplyNow(const grpc::ServerContext* ctx, Collection& coll,
                                     GradientCall& in,
                                     const ember::v1::WorkerApplyGradientsRequest& req,
                                     ember::v1::WorkerApplyGradientsResponse* resp) {
  // A primary's updates reach its backups in the order it applies them:
  // forward_mu orders them, held across the forward. apply_mu is not held
  // while a forward waits: a backup's apply takes it, and two workers
  // forwarding to each other would wait on each other for ever.
  std::optional<absl::MutexLock> order;
  if (req.from_primary().empty() && ForwardsUpdates(coll)) order.emplace(coll.forward_mu.get());
  coll.apply_mu->Lock();
  auto unlock = absl::MakeCleanup([&coll] { coll.apply_mu->Unlock(); });
  if (req.from_primary().empty()) {
    if (absl::Status broken = RefuseWhileBroken(coll, req.collection()); !broken.ok()) {
      return ToGrpc(broken);
    }
  }
  const uint64_t id = RequestIdHash(req.request_id());
  std::vector<int> gradient;  // requests[i]'s index in the request
  std::vector<backend::GradientRequest> requests;
  std::vector<const ShardEntry*> found;    // gradient i's shard
  std::vector<const ShardEntry*> entries;  // requests[i]'s shard
  std::set<const ShardEntry*> touched;
  std::deque<HeldPart> trimmed;  // parts some of whose rows applied this id before
  bool seen = false;
  // The whole request is checked; then only the parts whose shards have not
  // applied this id run (a retry after a partial failure or a move).
  for (int i = 0; i < in.request().gradients_size(); ++i) {
    if (!in.request().gradients(i).mean_lengths().empty()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "gradient ", i, " carries mean_lengths, which only SYNC and BOUNDED updates take; "
          "collection '", req.collection(), "' trains ASYNC")));
    }
    auto part = in.Decode(i, ShapesOf(coll, &found));
    if (!part.ok()) return ToGrpc(CountRefusal(part.status()));
    const ShardEntry* entry = found.back();
    if (absl::Status r = CheckReplicationRole(*entry, req); !r.ok()) return ToGrpc(r);
    if (entry->applied->Conflicts(id, req.request_digest())) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "request id '", req.request_id().substr(0, 128),
          "' was applied before to other ids or gradients; a request id names one update "
          "(retry it unchanged, or use a new id)")));
    }
    if (entry->applied->Contains(id)) {
      seen = true;
      continue;
    }
    if (!entry->rows_applied->empty()) {
      const auto ranges = AppliedRanges(*entry->rows_applied, id);
      if (!ranges.empty()) {  // a retry after a live move merged this shard: the rest only
        if (part->feature.on_device) {
          return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
              "request id '", req.request_id().substr(0, 128),
              "' was applied to part of shard ", entry->assignment.ref().shard_index(),
              " of table '", entry->assignment.ref().table(),
              "' before it was re-cut; send it again with its ids in host memory")));
        }
        trimmed.push_back(WithoutRanges(HeldPart::CopyOf(*part), ranges));
        const HeldPart& t = trimmed.back();
        part->feature.pooling = t.pooling;  // a MEAN bag's factor is in its weights now
        part->feature.lengths = t.lengths;
        part->feature.ids = t.ids;
        part->feature.weights = t.weights;
        part->grad = t.grad;
        seen = true;
      }
    }
    requests.push_back(*part);
    gradient.push_back(i);
    entries.push_back(entry);
    touched.insert(entry);
  }
  if (requests.empty() && seen) {
    NoteForwardedStep(coll, req);  // applied before, at an earlier epoch
    resp->set_duplicate(true);
    duplicates_.fetch_add(1, std::memory_order_relaxed);
    return grpc::Status::OK;
  }
  // A replicated shard's backups apply it first (replication.cc), then
  // this copy: applying here at the same time would save the wait, but a
  // backup's refusal (a move's fence reaching it first) would then leave
  // this copy ahead of it.
  ForwardingPtr forward;
  if (ForwardsUpdates(coll)) {
    ember::v1::WorkerApplyGradientsRequest header;
    header.set_collection(req.collection());
    header.set_epoch(req.epoch());
    header.set_request_id(req.request_id());
    header.set_request_digest(req.request_digest());
    std::vector<std::string> features;
    for (int i : gradient) features.push_back(in.request().gradients(i).feature().feature());
    std::optional<std::string> token;
    if (auto t = AuthorizationOf(ctx); t.has_value()) token = std::string(*t);
    forward = StartForward(header, token, DeadlineOf(ctx), features, requests, entries);
  }
  if (absl::Status s =
          ApplyAfterBackups(std::move(forward), req.collection(), &coll, requests, entries);
      !s.ok()) {
    return ToGrpc(s);
  }
  RecordApplied(touched, id, req.request_digest(), req.collection());
  // A forwarded step: its ranks' updates are applied here too (a promoted
  // copy answers their retries as the primary would), and lookups of the
  // copies its primary forwards to may read for the next step.
  for (const ember::v1::StepRankUpdate& rank : req.step_ranks()) {
    RecordApplied(touched, RequestIdHash(rank.request_id()), rank.request_digest(),
                  req.collection());
  }
  NoteForwardedStep(coll, req);
  if (const int64_t skipped = in.skipped(); skipped > 0) {
    nonfinite_skipped_ids_.fetch_add(skipped, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 100) << "collection '" << req.collection() << "': " << skipped
                              << " id(s) with NaN/Inf gradients or weights left out of an update";
  }
  return grpc::Status::OK;
}

void WorkerService::RecordApplied(const std::set<const ShardEntry*>& touched, uint64_t id,
                                  uint64_t digest, const std::string& collection) {
  const absl::Time now = absl::Now();
  int64_t early = 0;
  for (const ShardEntry* e : touched) {
    early += e->applied->Add(id, now, options_.dedup_ttl, options_.dedup_window, digest);
    // A re-cut's per-rows records go once their newest id is past the ttl.
    std::vector<RowsRecord>& rows = *e->rows_applied;
    rows.erase(std::remove_if(rows.begin(), rows.end(),
                              [&](const RowsRecord& r) {
                                const auto entries = r.applied.Entries();
                                return entries.empty() ||
                                       now - entries.back().second > options_.dedup_ttl;
                              }),
               rows.end());
  }
  if (early > 0) {
    dedup_forgotten_early_.fetch_add(early, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 1000) << "collection '" << collection << "': more than "
                               << options_.dedup_window << " update ids within "
                               << options_.dedup_ttl << " on a shard; forgetting the oldest early";
  }
}

std::shared_ptr<StepBarrier> WorkerService::MakeSteps(
    const ember::v1::TrainingSpec& training) const {
  return std::make_shared<StepBarrier>(
      StepBarrier::OptionsOf(training, options_.max_pending_step_bytes));
}

absl::Status WorkerService::HoldContribution(const Collection& coll, GradientCall& in,
                                             const ember::v1::WorkerApplyGradientsRequest& req,
                                             Contribution* held) const {
  const StepBarrier::Options& o = coll.steps->options();
  const char* mode = ember::v1::TrainingSpec::Mode_Name(o.mode).c_str();
  if (!req.has_step() || !req.has_rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "collection '", req.collection(), "' trains ", mode,
        ": an update carries its step and the trainer's rank"));
  }
  if (req.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step must be >= 0, got ", req.step()));
  }
  const int32_t trainers = coll.steps->TrainersAt(req.step());
  if (req.rank() < 0 || req.rank() >= trainers) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(), " is outside 0..",
                                                   trainers - 1, " (the collection's ", trainers,
                                                   " trainers at step ", req.step(), ")"));
  }
  held->rank = req.rank();
  held->request_id = req.request_id();
  held->digest = req.request_digest();
  std::vector<const ShardEntry*> found;
  for (int i = 0; i < in.request().gradients_size(); ++i) {
    auto part = in.Decode(i, ShapesOf(coll, &found));
    if (!part.ok()) return part.status();
    if (part->feature.on_device) {  // the collection was re-made stepped during the call
      return absl::UnavailableError(absl::StrCat(
          "collection '", req.collection(), "' began training in steps during this update; "
          "send it again"));
    }
    const ShardEntry* entry = found.back();
    if (absl::Status r = CheckReplicationRole(*entry, req); !r.ok()) return r;
    HeldPart h = HeldPart::CopyOf(*part);
    h.table = entry->assignment.ref().table();
    h.shard_index = entry->assignment.ref().shard_index();
    h.feature = in.request().gradients(i).feature().feature();
    const std::string& mean_lengths = in.request().gradients(i).mean_lengths();
    if (!mean_lengths.empty()) {
      if (absl::Status s = wire::Decode(mean_lengths, "mean_lengths", &h.mean_lengths); !s.ok()) {
        return s;
      }
      if (h.pooling != backend::Pooling::kSum || h.mean_lengths.size() != h.lengths.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient ", i, ": mean_lengths goes with a SUM-pooled feature, one per bag (",
            h.lengths.size(), "), got ", h.mean_lengths.size()));
      }
      for (size_t b = 0; b < h.lengths.size(); ++b) {
        if (h.mean_lengths[b] < h.lengths[b]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "gradient ", i, ": mean_lengths[", b, "] (", h.mean_lengths[b],
              ") is less than the bag's ", h.lengths[b], " id(s) here"));
        }
      }
    }
    held->parts.push_back(std::move(h));
  }
  return absl::OkStatus();
}

absl::Status WorkerService::ApplyStep(const std::string& name, const StepBarrier* steps,
                                      int64_t step,
                                      const std::vector<const Contribution*>& ranks) {
  absl::ReaderMutexLock lock(&mu_);
  auto c = HeldCollection(name);
  if (!c.ok() || (*c)->steps.get() != steps) {
    return absl::FailedPreconditionError(absl::StrCat(
        "collection '", name, "' moved or was dropped on this worker during the step; "
        "refresh the plan and send the step again"));
  }
  Collection& coll = **c;
  // A replicated collection's step reaches its backups before it applies
  // here, as an ASYNC update does (ApplyNow).
  std::optional<absl::MutexLock> order;
  if (ForwardsUpdates(coll)) order.emplace(coll.forward_mu.get());
  coll.apply_mu->Lock();
  auto unlock = absl::MakeCleanup([&coll] { coll.apply_mu->Unlock(); });
  if (absl::Status broken = RefuseWhileBroken(coll, name); !broken.ok()) return broken;  // held
  // The ranks' parts of one (shard, feature) become one request, their bags
  // (or ids) concatenated in rank order: what one trainer sending the
  // global batch sends, so the backend sums every row's occurrences in the
  // same order, and the tables match that trainer's bit for bit. Parts that
  // cannot be joined (weights on some ranks only) stay requests of their
  // own, after.
  struct Group {
    const ShardEntry* entry;
    std::vector<const HeldPart*> parts;
  };
  std::vector<Group> groups;
  std::map<std::tuple<std::string, int32_t, std::string>, size_t> group_of;
  std::vector<std::set<const ShardEntry*>> touched(ranks.size());
  std::deque<HeldPart> trimmed;  // parts some of whose rows applied their id before
  for (size_t k = 0; k < ranks.size(); ++k) {
    const uint64_t id = RequestIdHash(ranks[k]->request_id);
    for (const HeldPart& held : ranks[k]->parts) {
      const HeldPart* part = &held;
      auto it = coll.shards.find({part->table, part->shard_index});
      if (it == coll.shards.end()) {
        return absl::FailedPreconditionError(absl::StrCat("shard ", part->shard_index,
                                                          " of table '", part->table,
                                                          "' left this worker during the step"));
      }
      const ShardEntry* entry = &it->second;
      if (entry->applied->Contains(id)) continue;  // applied before it moved here
      if (!entry->rows_applied->empty()) {  // or to some of its rows, before a re-cut
        const auto ranges = AppliedRanges(*entry->rows_applied, id);
        if (!ranges.empty()) {
          trimmed.push_back(WithoutRanges(*part, ranges));
          part = &trimmed.back();
        }
      }
      const HeldPart& h = *part;
      touched[k].insert(entry);
      auto [g, inserted] = group_of.emplace(std::make_tuple(h.table, h.shard_index, h.feature),
                                            groups.size());
      if (inserted) groups.push_back({entry, {}});
      Group& group = groups[g->second];
      if (!group.parts.empty() &&
          (group.parts[0]->pooling != h.pooling ||
           group.parts[0]->weights.empty() != h.weights.empty() ||
           group.parts[0]->mean_lengths.empty() != h.mean_lengths.empty())) {
        groups.push_back({entry, {&h}});  // not joinable
        continue;
      }
      group.parts.push_back(&h);
    }
  }
  // MEAN: each rank's gradients divided by the step's trainers (as
  // TorchRec's gradient division and DDP do: a division, not a product
  // with a rounded 1/N).
  const float divisor =
      steps->options().mean ? static_cast<float>(steps->TrainersAt(step)) : 1.0f;
  std::vector<HeldPart> joined(groups.size());
  std::vector<backend::GradientRequest> requests;
  std::vector<const ShardEntry*> entries;  // requests[i]'s shard
  std::vector<std::string> features;       // requests[i]'s KJT key
  for (size_t g = 0; g < groups.size(); ++g) {
    HeldPart& j = joined[g];
    for (const HeldPart* p : groups[g].parts) {
      j.pooling = p->pooling;
      j.lengths.insert(j.lengths.end(), p->lengths.begin(), p->lengths.end());
      j.ids.insert(j.ids.end(), p->ids.begin(), p->ids.end());
      j.weights.insert(j.weights.end(), p->weights.begin(), p->weights.end());
      j.grad.insert(j.grad.end(), p->grad.begin(), p->grad.end());
      j.mean_lengths.insert(j.mean_lengths.end(), p->mean_lengths.begin(), p->mean_lengths.end());
    }
    if (divisor != 1.0f) {
      for (float& g : j.grad) g /= divisor;
    }
    if (!j.mean_lengths.empty() && !j.lengths.empty()) {
      // Row-split MEAN: d(sum / length) = 1 / length, after the division
      // (what one trainer's client does to its divided gradient).
      const size_t cols = j.grad.size() / j.lengths.size();
      for (size_t b = 0; b < j.lengths.size(); ++b) {
        const float inv =
            j.mean_lengths[b] > 0 ? 1.0f / static_cast<float>(j.mean_lengths[b]) : 0.0f;
        for (size_t c = 0; c < cols; ++c) j.grad[b * cols + c] *= inv;
      }
    }
    backend::GradientRequest r = j.View();
    r.feature.shard = groups[g].entry->id;
    requests.push_back(r);
    entries.push_back(groups[g].entry);
    features.push_back(groups[g].parts.empty() ? std::string() : groups[g].parts[0]->feature);
  }
  ForwardingPtr forward;
  if (order.has_value()) {
    ember::v1::WorkerApplyGradientsRequest header;
    header.set_collection(name);
    header.set_epoch(coll.epoch);
    header.set_step(step);
    // The forward's own id names the ranks' updates, at any epoch: a
    // backup that applied the step when its primary did not (a forward
    // that failed on another backup drops the step) skips it when the
    // trainers send it again.
    std::string id = absl::StrCat("step ", step, " of '", name, "':");
    uint64_t digest = 0;
    std::optional<std::string> token;
    for (const Contribution* rank : ranks) {
      ember::v1::StepRankUpdate* u = header.add_step_ranks();
      u->set_request_id(rank->request_id);
      u->set_request_digest(rank->digest);
      u->set_rank(rank->rank);
      absl::StrAppend(&id, " ", rank->request_id.size(), ":", rank->request_id);
      digest = digest * 0x100000001b3ULL ^ rank->digest;
      if (!token.has_value()) token = rank->authorization;
    }
    header.set_request_id(id);
    header.set_request_digest(digest);
    // Every worker backing a shard of this primary hears of every step,
    // parts or none: their lookups wait for it.
    forward = StartForward(header, token, absl::InfiniteFuture(), features, requests, entries,
                           BackupWorkers(coll));
  }
  bool forwarded = true;
  if (absl::Status s =
          ApplyAfterBackups(std::move(forward), name, &coll, requests, entries, &forwarded);
      !s.ok()) {
    // A BOUNDED step was acknowledged to its ranks: one its backups did not
    // all take (an epoch or a move under way there, a backup gone) stays
    // held and is tried again (StepBarrier), until the copies are re-formed
    // at a new epoch, which takes it over.
    // (Backups refusing its content alike, as this worker would, drop it.)
    if (!forwarded && steps->options().mode == ember::v1::TrainingSpec::BOUNDED &&
        s.code() != absl::StatusCode::kInvalidArgument &&
        s.code() != absl::StatusCode::kOutOfRange) {
      return absl::UnavailableError(s.message());
    }
    return s;
  }
  for (size_t k = 0; k < ranks.size(); ++k) {
    RecordApplied(touched[k], RequestIdHash(ranks[k]->request_id), ranks[k]->digest, name);
  }
  return absl::OkStatus();
}

}  // namespace worker
}  // namespace ember
