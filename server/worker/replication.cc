// WorkerService's part in replicated shards (CollectionSpec.replicas):
// primary-backup through the primary. A trainer sends a shard's updates to
// its primary copy. The primary, holding the collection's forward_mu (so
// that every update of the collection reaches the backups in the order it
// applies them), sends the parts it is about to apply to every backup of
// the shards they touch, waits for all of them to apply them, applies them
// itself and acknowledges. Its apply_mu, which a backup's apply takes, is
// not held while it waits, so two workers forwarding to each other never
// wait on each other. Acknowledged therefore means applied by every copy:
// any copy can take over with nothing acknowledged lost, and a backup is
// never behind its primary. (Applying at the primary meanwhile would save
// the wait, but a backup's refusal, a move's fence reaching it first,
// would then leave the primary ahead of it.) Copies may differ
// only by an update not acknowledged: when a forward's outcome is unknown
// (a timeout, a dead backup) or the copies' answers differ, the primary
// refuses further updates until the coordinator re-forms the copies at a
// new epoch without the one behind (it hears of it by heartbeat, or by a
// backup's death); a copy that applied an update records it, so the
// trainer's retry is applied once. A backup takes updates only from the
// primary it was given, at the collection's current epoch, so a primary
// cut off and replaced can acknowledge nothing (its forwards are refused
// at the newer epoch).
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "server/worker/shard_names.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {

namespace {

ember::v1::TableConfig::Pooling PoolingToProto(backend::Pooling p) {
  switch (p) {
    case backend::Pooling::kMean:
      return ember::v1::TableConfig::MEAN;
    case backend::Pooling::kNone:
      return ember::v1::TableConfig::NONE;
    default:
      return ember::v1::TableConfig::SUM;
  }
}

// A refusal that says nothing was applied, which a backup holding the same
// rows as its primary gives exactly when the primary would.
bool AppliedNothing(grpc::StatusCode code) {
  return code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::OUT_OF_RANGE ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::PERMISSION_DENIED ||
         code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::NOT_FOUND;
}

}  // namespace

absl::Status WorkerService::CheckReplicationRole(
    const ShardEntry& entry, const ember::v1::WorkerApplyGradientsRequest& req) const {
  const std::string& primary = entry.assignment.replication().primary();
  if (req.from_primary().empty() && !primary.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        RefString(entry.assignment.ref()), " is a backup copy on this worker; its updates go to "
        "its primary, ", primary, " (refresh the plan)"));
  }
  if (!req.from_primary().empty() &&
      !TokenTable::SameSecret(req.replication_key(),
                              options_.auth.ReplicationKey(req.collection(), req.epoch()))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "an update claiming to come from the primary ", req.from_primary().substr(0, 256),
        " without the collection's replication key (only servers forward updates)"));
  }
  if (!req.from_primary().empty() && primary != req.from_primary()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "an update forwarded by ", req.from_primary().substr(0, 256), " for ",
        RefString(entry.assignment.ref()), ", which this worker does not hold as its backup ",
        "(the copies were re-formed: refresh the plan)"));
  }
  return absl::OkStatus();
}

absl::Status WorkerService::CheckForwardSender(
    const Collection& c, const ember::v1::WorkerApplyGradientsRequest& req) const {
  if (!TokenTable::SameSecret(req.replication_key(),
                              options_.auth.ReplicationKey(req.collection(), req.epoch()))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "an update claiming to come from the primary ", req.from_primary().substr(0, 256),
        " without the collection's replication key (only servers forward updates)"));
  }
  for (const auto& [key, entry] : c.shards) {
    if (entry.assignment.replication().primary() == req.from_primary()) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "an update forwarded by ", req.from_primary().substr(0, 256), ", which is the primary of "
      "no shard this worker backs in collection '", req.collection(), "' (the copies were "
      "re-formed: refresh the plan)"));
}

void WorkerService::NoteForwardedStep(Collection& c,
                                      const ember::v1::WorkerApplyGradientsRequest& req) {
  if (req.from_primary().empty() || !req.has_step()) return;
  absl::MutexLock lock(&c.forwarded->mu);
  auto [it, fresh] = c.forwarded->through.try_emplace(req.from_primary(), req.step());
  if (!fresh && req.step() < it->second) return;
  it->second = req.step();
  // The updates held for the steps forwarded are applied now.
  auto held = c.forwarded->held.find(req.from_primary());
  if (held != c.forwarded->held.end()) {
    auto& steps = held->second;
    for (auto s = steps.begin(); s != steps.end() && s->first <= req.step(); s = steps.erase(s)) {
      for (const auto& [rank, contribution] : s->second) {
        c.forwarded->held_bytes -= contribution.Bytes();
      }
    }
  }
  StepBarrier::RankDigests& d = c.forwarded->digests[req.from_primary()];
  d.clear();
  for (const ember::v1::StepRankUpdate& rank : req.step_ranks()) {
    d[rank.rank()] = rank.request_digest();
  }
}

absl::Status WorkerService::WaitForwarded(ForwardedSteps* f,
                                          const std::set<std::string>& primaries, int64_t target,
                                          int64_t step, absl::Time deadline) {
  if (target < 0) return absl::OkStatus();  // no step to wait for
  absl::MutexLock lock(&f->mu);
  for (const std::string& p : primaries) {
    if (f->moved.has_value()) return *f->moved;
    if (!f->through.count(p)) {
      return WithSignal(
          absl::UnavailableError(absl::StrCat(
              "a backup copy read for step ", step, " has had no step from its primary ", p,
              " since its epoch began; read the primary")),
          kSignalReadPrimary);
    }
    auto reached = [f, &p, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(f->mu) {
      return f->moved.has_value() || f->through.at(p) >= target;
    };
    const bool in_time = f->mu.AwaitWithDeadline(absl::Condition(&reached), deadline);
    if (f->moved.has_value()) return *f->moved;
    if (!in_time) {
      return absl::DeadlineExceededError(absl::StrCat(
          "a lookup for step ", step, " of a backup copy waited for its primary ", p,
          " to forward step ", target, " (forwarded: ", f->through.at(p), ")"));
    }
  }
  return absl::OkStatus();
}

std::set<std::string> WorkerService::BackupWorkers(const Collection& c) {
  std::set<std::string> out;
  for (const auto& [key, entry] : c.shards) {
    out.insert(entry.assignment.replication().backups().begin(),
               entry.assignment.replication().backups().end());
  }
  return out;
}

bool WorkerService::ForwardsUpdates(const Collection& c) {
  for (const auto& [key, entry] : c.shards) {
    if (entry.assignment.replication().backups_size() > 0) return true;
  }
  return false;
}

void WorkerService::SetOwnAddress(const std::string& address) {
  absl::MutexLock lock(&peers_mu_);
  own_address_ = address;
}

std::string WorkerService::OwnAddress() const {
  absl::MutexLock lock(&peers_mu_);
  return own_address_;
}

ember::v1::Worker::Stub* WorkerService::PeerStub(const std::string& address) {
  absl::MutexLock lock(&peers_mu_);
  std::unique_ptr<ember::v1::Worker::Stub>& stub = peers_[address];
  if (stub == nullptr) {
    stub = ember::v1::Worker::NewStub(MakeChannel(address, options_.peer_credentials));
  }
  return stub.get();
}

struct WorkerService::Forwarding {
  explicit Forwarding(size_t n)
      : requests(n), contexts(n), responses(n), statuses(n), pending(static_cast<int>(n)) {}
  WorkerService* owner = nullptr;
  std::string collection;
  int64_t epoch = 0;
  std::vector<std::string> addresses;
  std::vector<ember::v1::WorkerApplyGradientsRequest> requests;
  std::vector<grpc::ClientContext> contexts;
  std::vector<ember::v1::WorkerApplyGradientsResponse> responses;
  std::vector<grpc::Status> statuses;
  absl::BlockingCounter pending;  // Wait()ed once: `waited` says if it was
  bool waited = false;
  absl::Time start;
  std::optional<std::string> authorization;  // sent with each request
};

std::map<std::string, ember::v1::WorkerApplyGradientsRequest> WorkerService::ForwardRequests(
    const ember::v1::WorkerApplyGradientsRequest& header, const std::vector<std::string>& features,
    const std::vector<backend::GradientRequest>& requests,
    const std::vector<const ShardEntry*>& entries, const std::set<std::string>& everyone,
    const std::vector<absl::Span<const int64_t>>* mean_lengths) const {
  // One request per backup address, with the parts of the shards it holds,
  // arrays inline.
  std::map<std::string, ember::v1::WorkerApplyGradientsRequest> out;
  auto to = [&](const std::string& backup) -> ember::v1::WorkerApplyGradientsRequest& {
    auto [it, fresh] = out.try_emplace(backup);
    if (fresh) {
      it->second = header;
      it->second.set_from_primary(OwnAddress());
      it->second.set_replication_key(
          options_.auth.ReplicationKey(header.collection(), header.epoch()));
    }
    return it->second;
  };
  for (const std::string& backup : everyone) to(backup);
  for (size_t i = 0; i < requests.size(); ++i) {
    for (const std::string& backup : entries[i]->assignment.replication().backups()) {
      ember::v1::WorkerApplyGradientsRequest& f = to(backup);
      const backend::GradientRequest& g = requests[i];
      ember::v1::ShardGradient* sg = f.add_gradients();
      ember::v1::ShardFeature* feature = sg->mutable_feature();
      *feature->mutable_shard() = entries[i]->assignment.ref();
      feature->set_feature(features[i]);
      feature->set_pooling(PoolingToProto(g.feature.pooling));
      wire::Encode(g.feature.lengths, feature->mutable_lengths());
      wire::Encode(g.feature.ids, feature->mutable_ids());
      wire::Encode(g.feature.weights, feature->mutable_weights());
      wire::Encode(g.grad, sg->mutable_grad());
      if (mean_lengths != nullptr && !(*mean_lengths)[i].empty()) {
        wire::Encode((*mean_lengths)[i], sg->mutable_mean_lengths());
      }
    }
  }
  return out;
}

WorkerService::ForwardingPtr WorkerService::StartForward(
    const ember::v1::WorkerApplyGradientsRequest& header,
    const std::optional<std::string>& authorization, absl::Time deadline,
    const std::vector<std::string>& features, const std::vector<backend::GradientRequest>& requests,
    const std::vector<const ShardEntry*>& entries, const std::set<std::string>& everyone) {
  return LaunchForward(ForwardRequests(header, features, requests, entries, everyone),
                       header.collection(), header.epoch(), authorization, deadline);
}

WorkerService::ForwardingPtr WorkerService::LaunchForward(
    std::map<std::string, ember::v1::WorkerApplyGradientsRequest> out,
    const std::string& collection, int64_t epoch, const std::optional<std::string>& authorization,
    absl::Time deadline) {
  if (out.empty()) return nullptr;
  ForwardingPtr f(new Forwarding(out.size()));
  f->owner = this;
  f->collection = collection;
  f->epoch = epoch;
  f->start = absl::Now();
  f->authorization = authorization;
  deadline = std::min(deadline, f->start + options_.forward_timeout);
  size_t n = 0;
  for (auto& [address, r] : out) {
    f->addresses.push_back(address);
    f->requests[n] = std::move(r);
    f->contexts[n].set_deadline(absl::ToChronoTime(deadline));
    if (authorization.has_value()) f->contexts[n].AddMetadata("authorization", *authorization);
    Forwarding* raw = f.get();
    PeerStub(address)->async()->ApplyGradients(&f->contexts[n], &f->requests[n],
                                               &f->responses[n], [raw, n](grpc::Status s) {
                                                 raw->statuses[n] = std::move(s);
                                                 raw->pending.DecrementCount();
                                               });
    ++n;
  }
  absl::MutexLock lock(&in_flight_mu_);
  in_flight_.insert(f.get());
  // A placement under way (CancelForwards) reaches a forward started after
  // it looked too.
  auto placing = placing_.find(f->collection);
  if (placing != placing_.end()) CancelLocked(f.get(), placing->second);
  return f;
}

void WorkerService::ForwardingDeleter::operator()(Forwarding* f) const {
  if (!f->waited) f->pending.Wait();  // the calls write into it until they end
  f->owner->ForgetForward(f);
  delete f;
}

void WorkerService::ForgetForward(Forwarding* f) {
  absl::MutexLock lock(&in_flight_mu_);
  in_flight_.erase(f);
}

void WorkerService::CancelLocked(Forwarding* f, const Placing& placing) {
  if (f->epoch >= placing.epoch) return;
  for (size_t i = 0; i < f->addresses.size(); ++i) {
    if (placing.named.count(f->addresses[i])) continue;
    LOG(WARNING) << "collection '" << f->collection << "': cancelling a forward to "
                 << f->addresses[i] << ", which epoch " << placing.epoch
                 << " no longer names as a backup";
    f->contexts[i].TryCancel();
  }
}

void WorkerService::CancelForwards(const ember::v1::UpdateShardsRequest& placement) {
  if (placement.create().empty()) return;  // a fence: the forwards finish
  Placing placing;
  placing.epoch = placement.epoch();
  for (const auto& a : placement.create()) {
    placing.named.insert(a.replication().backups().begin(), a.replication().backups().end());
  }
  absl::MutexLock lock(&in_flight_mu_);
  for (Forwarding* f : in_flight_) {
    if (f->collection == placement.collection()) CancelLocked(f, placing);
  }
  Placing& held = placing_[placement.collection()];
  if (placing.epoch >= held.epoch) held = std::move(placing);
}

void WorkerService::PlacedForwards(const ember::v1::UpdateShardsRequest& placement) {
  absl::MutexLock lock(&in_flight_mu_);
  auto it = placing_.find(placement.collection());
  if (it != placing_.end() && it->second.epoch <= placement.epoch()) placing_.erase(it);
}

absl::Status WorkerService::FinishForward(ForwardingPtr f, const std::string& collection,
                                          Collection* c) {
  f->pending.Wait();
  f->waited = true;
  ForgetForward(f.get());
  forwards_.fetch_add(1, std::memory_order_relaxed);
  forward_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - f->start),
                        std::memory_order_relaxed);
  const size_t n = f->addresses.size();
  bool any_ok = false, all_refused_alike = true;
  for (size_t i = 0; i < n; ++i) {
    any_ok |= f->statuses[i].ok();
    all_refused_alike &= !f->statuses[i].ok() && AppliedNothing(f->statuses[i].error_code()) &&
                         f->statuses[i].error_code() == f->statuses[0].error_code();
  }
  if (!any_ok && all_refused_alike) {
    // Refused everywhere, nothing applied anywhere: the copies agree.
    return FromGrpc(f->statuses[0], absl::StrCat("backup ", f->addresses[0]));
  }
  // A backup busy with a move of its collections applied nothing: it is
  // sent the update again (with back-off, within the forward timeout)
  // rather than left behind the others.
  for (size_t i = 0; i < n; ++i) {
    absl::Duration backoff = absl::Milliseconds(5);
    while (HasSignal(f->statuses[i], kSignalWorkerBusy) &&
           absl::Now() + backoff < f->start + options_.forward_timeout) {
      absl::SleepFor(backoff);
      backoff = std::min(2 * backoff, absl::Milliseconds(200));
      grpc::ClientContext again;
      again.set_deadline(absl::ToChronoTime(f->start + options_.forward_timeout));
      if (f->authorization.has_value()) again.AddMetadata("authorization", *f->authorization);
      f->responses[i].Clear();
      f->statuses[i] = PeerStub(f->addresses[i])->ApplyGradients(&again, f->requests[i],
                                                                 &f->responses[i]);
      busy_forward_retries_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (f->statuses[i].ok()) continue;
    forward_failures_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock apply(c->apply_mu.get());
    c->broken_backup = f->addresses[i];
    c->broken_why = absl::StrCat(absl::StatusCodeToString(FromGrpc(f->statuses[i]).code()), ": ",
                                 f->statuses[i].error_message().substr(0, 512));
    LOG(WARNING) << "collection '" << collection << "' epoch " << c->epoch
                 << ": forwarding an update to backup " << f->addresses[i] << " failed ("
                 << c->broken_why << "); its updates wait for the coordinator to re-form the "
                 << "copies";
    return absl::UnavailableError(absl::StrCat(
        "collection '", collection, "': backup ", f->addresses[i], " of its shards did not "
        "confirm an update (", c->broken_why, "); updates wait for the coordinator to re-form "
        "the copies (retry)"));
  }
  return absl::OkStatus();
}

absl::Status WorkerService::ApplyAfterBackups(
    ForwardingPtr forward, const std::string& collection, Collection* c,
    const std::vector<backend::GradientRequest>& requests,
    const std::vector<const ShardEntry*>& entries, bool* forwarded) {
  if (forwarded != nullptr) *forwarded = true;
  if (forward == nullptr) return RunUpdate(requests, entries);
  c->apply_mu->Unlock();
  const absl::Status f = FinishForward(std::move(forward), collection, c);
  c->apply_mu->Lock();
  if (!f.ok()) {
    if (forwarded != nullptr) *forwarded = false;
    return f;
  }
  absl::Status local = RunUpdate(requests, entries);
  if (!local.ok()) {
    c->broken_backup = OwnAddress();
    c->broken_why =
        absl::StrCat("the primary refused an update its backups applied: ", local.message());
  }
  return local;
}

absl::Status WorkerService::RefuseWhileBroken(const Collection& c, const std::string& collection) {
  if (c.broken_backup.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "collection '", collection, "': backup ", c.broken_backup, " missed an update (",
      c.broken_why, "); updates wait for the coordinator to re-form the copies (retry)"));
}

std::map<std::string, ember::v1::WorkerApplyGradientsRequest> WorkerService::MirrorRequests(
    const Collection& c, const ember::v1::WorkerApplyGradientsRequest& req,
    const Contribution& held) const {
  if (c.steps->options().mode != ember::v1::TrainingSpec::BOUNDED || !ForwardsUpdates(c)) {
    return {};
  }
  ember::v1::WorkerApplyGradientsRequest header;
  header.set_collection(req.collection());
  header.set_epoch(req.epoch());
  header.set_request_id(req.request_id());
  header.set_request_digest(req.request_digest());
  header.set_step(req.step());
  header.set_rank(req.rank());
  header.set_hold(true);
  std::vector<std::string> features;
  std::vector<backend::GradientRequest> parts;
  std::vector<const ShardEntry*> entries;
  std::vector<absl::Span<const int64_t>> mean_lengths;
  for (const HeldPart& part : held.parts) {
    auto entry = c.shards.find({part.table, part.shard_index});
    if (entry == c.shards.end()) continue;
    parts.push_back(part.View());
    entries.push_back(&entry->second);
    features.push_back(part.feature);
    mean_lengths.push_back(part.mean_lengths);
  }
  // Every worker backing a shard of this primary keeps every rank's update,
  // parts or none: a promoted one completes the steps from them.
  return ForwardRequests(header, features, parts, entries, BackupWorkers(c), &mean_lengths);
}

absl::Status WorkerService::SendMirror(
    std::map<std::string, ember::v1::WorkerApplyGradientsRequest> mirror,
    const std::string& collection, int64_t epoch, const std::optional<std::string>& authorization,
    absl::Time deadline) {
  ForwardingPtr f =
      LaunchForward(std::move(mirror), collection, epoch, authorization, deadline);
  if (f == nullptr) return absl::OkStatus();
  f->pending.Wait();
  f->waited = true;
  for (size_t i = 0; i < f->addresses.size(); ++i) {
    if (f->statuses[i].ok()) continue;
    forward_failures_.fetch_add(1, std::memory_order_relaxed);
    // Held here, and acknowledged once every backup keeps it too: the
    // trainer's retry is a duplicate here and is sent on again.
    return absl::UnavailableError(absl::StrCat(
        "collection '", collection, "': backup ", f->addresses[i], " did not confirm keeping "
        "this update, which its primary holds for its step (",
        absl::StatusCodeToString(FromGrpc(f->statuses[i]).code()), ": ",
        f->statuses[i].error_message().substr(0, 512), "); retry"));
  }
  return absl::OkStatus();
}

absl::Status WorkerService::KeepHeld(const Collection& c, GradientCall& in,
                                     const ember::v1::WorkerApplyGradientsRequest& req) {
  if (c.steps->options().mode != ember::v1::TrainingSpec::BOUNDED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a held update forwarded for collection '", req.collection(), "', which trains ",
        ember::v1::TrainingSpec::Mode_Name(c.steps->options().mode), " (only BOUNDED holds)"));
  }
  Contribution held;
  if (absl::Status s = HoldContribution(c, in, req, &held); !s.ok()) return s;
  ForwardedSteps& f = *c.forwarded;
  absl::MutexLock lock(&f.mu);
  auto through = f.through.find(req.from_primary());
  if (through != f.through.end() && req.step() <= through->second) {
    return absl::OkStatus();  // its step was forwarded already
  }
  std::map<int32_t, Contribution>& ranks = f.held[req.from_primary()][req.step()];
  auto same = ranks.find(req.rank());
  if (same != ranks.end()) {
    if (same->second.digest == held.digest) return absl::OkStatus();  // sent again
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", req.rank(), " has another update held for step ", req.step(), " from primary ",
        req.from_primary()));
  }
  const int64_t bytes = held.Bytes();
  if (f.held_bytes + bytes > options_.max_pending_step_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a backup keeping its primaries' held updates would pass --max_pending_step_bytes (",
        options_.max_pending_step_bytes, "; kept: ", f.held_bytes, ", this one: ", bytes, ")"));
  }
  f.held_bytes += bytes;
  ranks.emplace(req.rank(), std::move(held));
  return absl::OkStatus();
}

std::vector<WorkerService::BrokenReplication> WorkerService::BrokenReplications() const {
  // Called by the heartbeat thread, which must never wait on the data
  // plane (a stalled heartbeat loses the lease): what cannot be read at
  // once is reported next round.
  std::vector<BrokenReplication> out;
  if (!mu_.ReaderTryLock()) return out;
  auto unlock = absl::MakeCleanup([this] { mu_.ReaderUnlock(); });
  for (const auto& [name, c] : collections_) {
    if (!ForwardsUpdates(*c) || !c->apply_mu->TryLock()) continue;
    if (!c->broken_backup.empty()) out.push_back({name, c->epoch, c->broken_backup, c->broken_why});
    c->apply_mu->Unlock();
  }
  return out;
}

}  // namespace worker
}  // namespace ember
