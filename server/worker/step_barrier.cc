#include "server/worker/step_barrier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace ember {
namespace worker {
namespace {

// Outcomes and applied digests kept for retries and late waiters.
constexpr size_t kHistory = 4096;
// Applied steps' digests carried to a new epoch (retries reach back at
// most a few steps: a trainer runs at most max_staleness ahead).
constexpr size_t kCarriedHistory = 256;
// How soon a complete step whose apply failed UNAVAILABLE is tried again.
constexpr absl::Duration kRetryApply = absl::Milliseconds(50);

template <typename Map>
void Trim(Map* m) {
  while (m->size() > kHistory) m->erase(m->begin());
}

}  // namespace

int64_t HeldPart::Bytes() const {
  return static_cast<int64_t>(sizeof(HeldPart) + table.size() + feature.size() +
                              8 * (lengths.size() + ids.size() + mean_lengths.size()) +
                              4 * (weights.size() + grad.size()));
}

backend::GradientRequest HeldPart::View() const {
  backend::GradientRequest r;
  r.feature.pooling = pooling;
  r.feature.lengths = lengths;
  r.feature.ids = ids;
  r.feature.weights = weights;
  r.grad = grad;
  return r;
}

HeldPart HeldPart::CopyOf(const backend::GradientRequest& r) {
  HeldPart h;
  h.pooling = r.feature.pooling;
  h.lengths.assign(r.feature.lengths.begin(), r.feature.lengths.end());
  h.ids.assign(r.feature.ids.begin(), r.feature.ids.end());
  h.weights.assign(r.feature.weights.begin(), r.feature.weights.end());
  h.grad.assign(r.grad.begin(), r.grad.end());
  return h;
}

int64_t Contribution::Bytes() const {
  int64_t b = static_cast<int64_t>(sizeof(Contribution) + request_id.size());
  for (const HeldPart& p : parts) b += p.Bytes();
  return b;
}

Contribution Contribution::PartsOf(const std::set<std::pair<std::string, int32_t>>& shards) const {
  Contribution out;
  out.rank = rank;
  out.request_id = request_id;
  out.digest = digest;
  out.authorization = authorization;
  out.partial = partial;
  for (const HeldPart& p : parts) {
    if (shards.count({p.table, p.shard_index})) out.parts.push_back(p);
  }
  return out;
}

StepBarrier::Options StepBarrier::OptionsOf(const ember::v1::TrainingSpec& spec,
                                            int64_t max_pending_bytes) {
  Options o;
  o.mode = spec.mode();
  o.trainers = std::max(spec.trainers(), 1);
  o.max_staleness = spec.max_staleness();
  o.timeout = absl::Seconds(spec.step_timeout_s() > 0 ? spec.step_timeout_s() : 300);
  o.mean = spec.gradient_reduction() == ember::v1::TrainingSpec::MEAN;
  o.max_pending_bytes = max_pending_bytes;
  return o;
}

int32_t StepBarrier::TrainersAtLocked(int64_t step) const {
  auto it = trainers_from_.upper_bound(step);
  if (it == trainers_from_.begin()) return options_.trainers;
  return std::prev(it)->second;
}

int32_t StepBarrier::TrainersAt(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return TrainersAtLocked(step);
}

std::string StepBarrier::MissingRanksLocked(int64_t step, const Pending& p) const {
  const int32_t trainers = TrainersAtLocked(step);
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < trainers && missing.size() < 16; ++r) {
    if (!p.by_rank.count(r)) missing.push_back(r);
  }
  const int64_t absent = trainers - static_cast<int64_t>(p.by_rank.size());
  return absl::StrCat(absl::StrJoin(missing, ", "),
                      absent > static_cast<int64_t>(missing.size()) ? ", ..." : "");
}

void StepBarrier::AbortLocked(int64_t step, const absl::Status& why) {
  auto it = pending_.find(step);
  if (it == pending_.end()) return;
  for (const auto& [rank, c] : it->second.by_rank) pending_bytes_ -= c.Bytes();
  ranks_missing_ += TrainersAtLocked(step) - static_cast<int64_t>(it->second.by_rank.size());
  pending_.erase(it);
  dropped_[step] = why;
  Trim(&dropped_);
  ++steps_aborted_;
  changed_.SignalAll();
}

void StepBarrier::ExpireLocked(absl::Time now) {
  std::vector<int64_t> expired;
  for (const auto& [step, p] : pending_) {
    // A complete step waits for its apply (a failed one is tried again),
    // not for ranks.
    if (now - p.first >= options_.timeout && !CompleteLocked(step, p)) expired.push_back(step);
  }
  for (int64_t step : expired) {
    const Pending& p = pending_.at(step);
    const absl::Status why = absl::AbortedError(absl::StrCat(
        "step ", step, " aborted after ", absl::FormatDuration(options_.timeout),
        " (the collection's step_timeout_s): rank(s) ", MissingRanksLocked(step, p),
        " of ", TrainersAtLocked(step), " did not send it; nothing of it was applied; send it again"));
    AbortLocked(step, why);
  }
}

absl::Time StepBarrier::WakeLocked(absl::Time deadline, bool kicks) const {
  for (const auto& [step, p] : pending_) deadline = std::min(deadline, p.first + options_.timeout);
  // A step held after a failed apply is tried again meanwhile.
  if (kicks && retry_at_ > absl::Now()) deadline = std::min(deadline, retry_at_);
  return deadline;
}

std::optional<absl::Status> StepBarrier::OutcomeLocked(int64_t step) const {
  if (all_aborted_.has_value()) return *all_aborted_;
  if (applied_.has_value() && step <= *applied_) return absl::OkStatus();
  if (!pending_.count(step)) {
    auto d = dropped_.find(step);
    if (d != dropped_.end()) return d->second;
  }
  return std::nullopt;
}

bool StepBarrier::CompleteLocked(int64_t step, const Pending& p) const {
  int64_t whole = 0;
  for (const auto& [rank, c] : p.by_rank) whole += c.partial ? 0 : 1;
  return whole >= TrainersAtLocked(step);
}

std::optional<int64_t> StepBarrier::BaseLocked() const {
  if (!horizon_.has_value()) return applied_;
  return applied_.has_value() ? std::max(*applied_, *horizon_) : horizon_;
}

void StepBarrier::ApplyReady(const ApplyFn& apply) {
  absl::MutexLock lock(&mu_);
  ApplyReadyLocked(apply);
}

void StepBarrier::ApplyReadyLocked(const ApplyFn& apply) {
  while (!in_apply_.has_value() && !all_aborted_.has_value() && !pending_.empty()) {
    auto it = pending_.begin();
    const int64_t next = applied_.has_value() ? *applied_ + 1 : it->first;
    if (it->first != next || !CompleteLocked(next, it->second) || absl::Now() < retry_at_) {
      return;
    }
    in_apply_.emplace(next, std::move(it->second));
    pending_.erase(it);
    std::vector<const Contribution*> ranks;
    int64_t bytes = 0;
    for (const auto& [rank, c] : in_apply_->second.by_rank) {
      ranks.push_back(&c);
      bytes += c.Bytes();
    }
    mu_.Unlock();
    const absl::Status s = apply(next, ranks);
    mu_.Lock();
    Pending p = std::move(in_apply_->second);
    in_apply_.reset();
    if (!s.ok() && s.code() == absl::StatusCode::kUnavailable &&
        options_.mode == ember::v1::TrainingSpec::BOUNDED && !all_aborted_.has_value()) {
      // Acknowledged contributions: held, and tried again later.
      pending_[next] = std::move(p);
      retry_at_ = absl::Now() + kRetryApply;
      ++apply_retries_;
      changed_.SignalAll();
      return;
    }
    pending_bytes_ -= bytes;
    if (s.ok()) {
      applied_ = next;
      dropped_.erase(next);
      auto& digests = applied_digests_[next];
      for (const auto& [rank, c] : p.by_rank) digests[rank] = c.digest;
      Trim(&applied_digests_);
      ++steps_applied_;
    } else {
      if (options_.mode == ember::v1::TrainingSpec::BOUNDED && !all_aborted_.has_value()) {
        // Its ranks were answered when it was held: they learn of it only
        // from a lookup that needs it.
        LOG(WARNING) << "BOUNDED step " << next << " dropped, its " << p.by_rank.size()
                     << " held update(s) not applied: " << s;
      }
      dropped_[next] = s;
      Trim(&dropped_);
      ++steps_aborted_;
    }
    changed_.SignalAll();
  }
}

absl::Status StepBarrier::Submit(int64_t step, Contribution c, absl::Time deadline,
                                 const ApplyFn& apply, bool* duplicate) {
  *duplicate = false;
  const int32_t rank = c.rank;
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  const int64_t ahead = 1 + staleness();
  // A step one too far ahead of the last applied waits a while first: the
  // step before it may still be on its way here from the other ranks (a
  // BOUNDED trainer whose lookup saw that step applied on another worker
  // sends this one at once, and the last rank's part of it can reach this
  // worker later). Refused once the call's deadline or a step's timeout
  // passes; a step further ahead no trainer can have sent yet: refused at
  // once.
  const absl::Time wait_until = std::min(deadline, start + options_.timeout);
  while (true) {
    if (all_aborted_.has_value()) return *all_aborted_;
    const absl::Time now = absl::Now();
    ExpireLocked(now);
    if (fence_.has_value() && step > *fence_) {
      return absl::UnavailableError(absl::StrCat(
          "the collection is moving: its steps are fenced at ", *fence_, " until it has moved; "
          "step ", step, " is taken after (retry)"));
    }
    const auto base = BaseLocked();
    if (!base.has_value() || step <= *base + ahead) break;
    if (now >= wait_until || step > *base + ahead + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, " sent step ", step, " while step ", *base + 1,
          " is not applied yet: a trainer may run at most ", staleness(), " step(s) ahead (",
          ember::v1::TrainingSpec::Mode_Name(options_.mode), ")"));
    }
    changed_.WaitWithDeadline(&mu_, WakeLocked(wait_until, /*kicks=*/true));
    ApplyReadyLocked(apply);
  }
  if (applied_.has_value() && step <= *applied_) {
    auto a = applied_digests_.find(step);
    if (a != applied_digests_.end() && a->second.count(rank) && a->second.at(rank) == c.digest) {
      *duplicate = true;  // a retry of what was applied
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " sent step ", step, ", but steps up to ", *applied_,
        " are applied here already", a != applied_digests_.end() && a->second.count(rank)
                                         ? " (with another contribution of this rank)"
                                         : ""));
  }
  // The step's contributions held: waiting, or being applied.
  Pending* held = nullptr;
  if (in_apply_.has_value() && in_apply_->first == step) {
    held = &in_apply_->second;
  } else if (auto found = pending_.find(step); found != pending_.end()) {
    held = &found->second;
  }
  const bool applying = in_apply_.has_value() && held == &in_apply_->second;
  Contribution* before =
      held != nullptr && held->by_rank.count(rank) ? &held->by_rank.at(rank) : nullptr;
  if (before != nullptr && before->digest != c.digest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " sent two different contributions for step ", step,
        " (a retry must resend the same update)"));
  }
  if (before != nullptr && before->partial && !applying) {
    // The rank's whole update at last, for a contribution carried from some
    // of the copies only.
    pending_bytes_ += c.Bytes() - before->Bytes();
    *before = std::move(c);
  } else if (before != nullptr) {
    *duplicate = true;
  } else if (applying) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, " is being applied without rank ",
                                                   rank, " (its trainer count changed)"));
  } else {
    const int64_t bytes = c.Bytes();
    if (pending_bytes_ + bytes > options_.max_pending_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rank ", rank, "'s contribution to step ", step, " (", bytes, " bytes) would take the ",
          "updates held for their steps past this worker's --max_pending_step_bytes (",
          options_.max_pending_bytes, "; held: ", pending_bytes_, ")"));
    }
    Pending& p = pending_[step];
    if (p.by_rank.empty()) {
      p.first = start;
      dropped_.erase(step);  // sent again after an abort
    }
    p.by_rank.emplace(rank, std::move(c));
    pending_bytes_ += bytes;
  }
  ApplyReadyLocked(apply);
  if (options_.mode == ember::v1::TrainingSpec::BOUNDED) {
    auto outcome = OutcomeLocked(step);
    return outcome.has_value() && !outcome->ok() ? *outcome : absl::OkStatus();
  }
  // SYNC: until the step is applied or dropped.
  while (true) {
    if (auto outcome = OutcomeLocked(step); outcome.has_value()) {
      wait_ns_ += absl::ToInt64Nanoseconds(absl::Now() - start);
      return *outcome;
    }
    const absl::Time now = absl::Now();
    ExpireLocked(now);
    if (OutcomeLocked(step).has_value()) continue;
    if (now >= deadline) {
      wait_ns_ += absl::ToInt64Nanoseconds(now - start);
      auto p = pending_.find(step);
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", step, " is still waiting for rank(s) ",
          p == pending_.end() ? std::string("?") : MissingRanksLocked(step, p->second),
          " (or an earlier step); rank ", rank, "'s contribution stays held"));
    }
    changed_.WaitWithDeadline(&mu_, WakeLocked(deadline));
  }
}

absl::Status StepBarrier::WaitForLookup(int64_t step, absl::Time deadline, const ApplyFn* kick) {
  const int64_t target = step - 1 - staleness();  // the last step it must see
  const absl::Time start = absl::Now();
  // A lookup waits at most a step's timeout (a step that never starts
  // times out here as one that started would).
  deadline = std::min(deadline, start + options_.timeout);
  absl::MutexLock lock(&mu_);
  // The furthest step a trainer can have sent: steps up to 1 + staleness
  // past the last applied (or before the lowest held, before any applied).
  std::optional<int64_t> base = BaseLocked();
  if (!base.has_value() && !pending_.empty()) base = pending_.begin()->first - 1;
  if (base.has_value() && target > *base + 1 + staleness()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a lookup for step ", step, " is ahead of every step a trainer can have sent (",
        applied_.has_value() ? absl::StrCat("last applied: ", *applied_)
                             : absl::StrCat("lowest held: ", *base + 1),
        "; a lookup reads for at most ", 2 + staleness(), " step(s) past the last applied)"));
  }
  while (true) {
    if (all_aborted_.has_value()) return *all_aborted_;
    if (kick != nullptr) ApplyReadyLocked(*kick);
    const absl::Time now = absl::Now();
    ExpireLocked(now);
    if (applied_.has_value() ? *applied_ >= target
                             : (pending_.empty() || target < pending_.begin()->first)) {
      wait_ns_ += absl::ToInt64Nanoseconds(now - start);
      return absl::OkStatus();
    }
    // A step it waits for was dropped: it is not coming until sent again.
    for (const auto& [s, why] : dropped_) {
      if (s <= target && (!applied_.has_value() || s > *applied_) && !pending_.count(s)) {
        wait_ns_ += absl::ToInt64Nanoseconds(now - start);
        return absl::AbortedError(absl::StrCat("a lookup for step ", step, " needs step ", s,
                                               ", which was not applied: ", why.message()));
      }
    }
    if (now >= deadline) {
      wait_ns_ += absl::ToInt64Nanoseconds(now - start);
      if (now >= start + options_.timeout) {
        auto p = pending_.find(target);
        return absl::AbortedError(absl::StrCat(
            "a lookup for step ", step, " waited ", absl::FormatDuration(options_.timeout),
            " (the collection's step_timeout_s) for step ", target, ", which ",
            p == pending_.end() ? std::string("no rank sent")
                                : absl::StrCat("rank(s) ", MissingRanksLocked(target, p->second),
                                               " did not send"),
            " (",
            applied_.has_value() ? absl::StrCat("last applied: ", *applied_)
                                 : std::string("none applied yet"),
            ")"));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "a lookup for step ", step, " waited for step ", target, " to be applied (",
          applied_.has_value() ? absl::StrCat("last applied: ", *applied_)
                               : std::string("none applied yet"),
          ")"));
    }
    changed_.WaitWithDeadline(&mu_, WakeLocked(deadline, kick != nullptr));
  }
}

int64_t StepBarrier::HighestStepLocked() const {
  int64_t highest = applied_.value_or(-1);
  if (!pending_.empty()) highest = std::max(highest, pending_.rbegin()->first);
  return highest;
}

int64_t StepBarrier::HighestStep() const {
  absl::MutexLock lock(&mu_);
  return HighestStepLocked();
}

int64_t StepBarrier::FenceAt(int64_t last) {
  absl::MutexLock lock(&mu_);
  fence_ = last;
  return HighestStepLocked();
}

absl::Status StepBarrier::WaitApplied(int64_t last, absl::Time deadline, const ApplyFn* kick) {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (all_aborted_.has_value()) return *all_aborted_;
    if (kick != nullptr) ApplyReadyLocked(*kick);
    const absl::Time now = absl::Now();
    ExpireLocked(now);
    if (last < 0 || (applied_.has_value() && *applied_ >= last)) return absl::OkStatus();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", last, " is not applied here yet (last applied: ",
          applied_.has_value() ? absl::StrCat(*applied_) : std::string("none"), ")"));
    }
    changed_.WaitWithDeadline(&mu_, WakeLocked(deadline, kick != nullptr));
  }
}

absl::Status StepBarrier::SetTrainers(int32_t trainers, int64_t from_step,
                                      const ApplyFn& apply) {
  absl::MutexLock lock(&mu_);
  if (all_aborted_.has_value()) return *all_aborted_;
  if (trainers < 1 || from_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("trainers must be >= 1 and from_step >= 0, got ",
                                                   trainers, " from step ", from_step));
  }
  auto same = trainers_from_.find(from_step);
  if (same != trainers_from_.end() && same->second == trainers) return absl::OkStatus();  // again
  if (applied_.has_value() && from_step <= *applied_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", from_step, " is applied here already (last applied: ", *applied_,
        "); the trainer count can change from step ", *applied_ + 1, " on"));
  }
  for (auto it = pending_.lower_bound(from_step); it != pending_.end(); ++it) {
    if (!it->second.by_rank.empty() && it->second.by_rank.rbegin()->first >= trainers) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", it->first, " holds rank ", it->second.by_rank.rbegin()->first,
          "'s update, past ", trainers, " trainers; change the count from a later step"));
    }
  }
  // Later changes are replaced by this one.
  trainers_from_.erase(trainers_from_.lower_bound(from_step), trainers_from_.end());
  trainers_from_[from_step] = trainers;
  ApplyReadyLocked(apply);  // fewer ranks may complete a held step
  changed_.SignalAll();
  return absl::OkStatus();
}

void StepBarrier::AbortAll(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (all_aborted_.has_value()) return;
  all_aborted_ = why;
  pending_.clear();
  pending_bytes_ = 0;
  changed_.SignalAll();
}

bool StepBarrier::AppliedThrough(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return applied_.has_value() && *applied_ >= step;
}

std::optional<std::pair<int64_t, StepBarrier::RankDigests>> StepBarrier::LastApplied() const {
  absl::MutexLock lock(&mu_);
  if (!applied_.has_value()) return std::nullopt;
  auto d = applied_digests_.find(*applied_);
  return std::make_pair(*applied_, d == applied_digests_.end() ? RankDigests() : d->second);
}

void StepBarrier::Seed(int64_t step, RankDigests digests) {
  absl::MutexLock lock(&mu_);
  if (applied_.has_value() || !pending_.empty()) return;  // not fresh: nothing to take over
  applied_ = step;
  applied_digests_[step] = std::move(digests);
}

StepBarrier::Carried StepBarrier::CarryAndAbort(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  Carried out;
  if (all_aborted_.has_value()) return out;
  out.applied = applied_;
  out.horizon = BaseLocked();
  for (auto it = applied_digests_.rbegin();
       it != applied_digests_.rend() && out.digests.size() < kCarriedHistory; ++it) {
    out.digests.insert(*it);
  }
  for (auto& [step, p] : pending_) out.held[step] = std::move(p.by_rank);
  if (in_apply_.has_value()) out.held[in_apply_->first] = in_apply_->second.by_rank;  // a copy
  all_aborted_ = why;
  pending_.clear();
  pending_bytes_ = 0;
  changed_.SignalAll();
  return out;
}

void StepBarrier::Resume(Carried carried) {
  absl::MutexLock lock(&mu_);
  if (applied_.has_value() || !pending_.empty()) return;  // not fresh
  applied_ = carried.applied;
  horizon_ = carried.horizon;
  applied_digests_ = std::move(carried.digests);
  const absl::Time now = absl::Now();
  for (auto& [step, ranks] : carried.held) {
    if (applied_.has_value() && step <= *applied_) continue;
    Pending& p = pending_[step];
    p.first = now;
    for (auto& [rank, c] : ranks) {
      pending_bytes_ += c.Bytes();
      p.by_rank.emplace(rank, std::move(c));
    }
  }
  changed_.SignalAll();
}

StepBarrier::Stats StepBarrier::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.steps_applied = steps_applied_;
  s.steps_aborted = steps_aborted_;
  s.pending_bytes = pending_bytes_;
  s.wait_ns = wait_ns_;
  s.ranks_missing = ranks_missing_;
  s.apply_retries = apply_retries_;
  s.applied_through = applied_;
  return s;
}

}  // namespace worker
}  // namespace ember
