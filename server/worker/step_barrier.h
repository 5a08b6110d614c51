// StepBarrier: the step discipline of one collection on one worker
// (TrainingSpec SYNC and BOUNDED, proto/collection.proto).
//
// Every trainer rank sends each step to every worker of the plan (its
// gradients for this worker's shards, or none). The barrier holds a step's
// contributions until all `trainers` ranks sent theirs and every earlier
// step is applied, then hands them to the apply function in rank order as
// one update: the backend merges the gradients of a row from all ranks and
// steps its optimizer once, and the result does not depend on the order in
// which the ranks arrived. SYNC: Submit returns once the step is applied (or
// aborted). BOUNDED: Submit returns once the contribution is held, and a
// lookup for step s waits only for step s - 1 - max_staleness.
//
// A step not complete within the timeout after its first contribution is
// aborted: its contributions are dropped (nothing of it applied), its
// waiters get ABORTED naming the ranks that did not arrive, and it can be
// sent again. A rank that sends a step again with the same digest is a
// retry (answered as the first); with another digest it is refused.
// Contributions held are bounded in bytes (RESOURCE_EXHAUSTED past it).
//
// A BOUNDED contribution is acknowledged once held, so it is never dropped
// but by its step's timeout: an apply that fails UNAVAILABLE (a backup copy
// that did not confirm the step, docs/reliability.md) leaves the step held,
// tried again on the next call; when the collection moves to another epoch
// the held steps go to the new barrier (CarryAndAbort, Resume).
//
// Thread-safe. The apply function runs with no lock of the barrier held,
// one step at a time, in step order.
#ifndef EMBER_SERVER_WORKER_STEP_BARRIER_H_
#define EMBER_SERVER_WORKER_STEP_BARRIER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/collection.pb.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace worker {

// One shard's part of a rank's contribution, its arrays copied (the gRPC
// message or channel region it came in is reused once its call returns).
struct HeldPart {
  std::string table;
  int32_t shard_index = 0;
  std::string feature;  // the KJT key it came from
  backend::Pooling pooling = backend::Pooling::kSum;
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grad;
  // A row-split MEAN feature (sent as SUM): each bag's whole length; its
  // rows are scaled by 1/length when applied (ShardGradient.mean_lengths).
  std::vector<int64_t> mean_lengths;
  int64_t Bytes() const;
  // A backend request viewing this part's arrays (its shard not set; the
  // part must outlive it), and a part holding a copy of a request's (its
  // table, shard index and feature not set).
  backend::GradientRequest View() const;
  static HeldPart CopyOf(const backend::GradientRequest& r);
};

struct Contribution {
  int32_t rank = 0;
  std::string request_id;
  uint64_t digest = 0;  // of the whole update, as the client sent it
  // The trainer's token, where tokens are on: a replicated collection's
  // step is forwarded to its backups with it.
  std::optional<std::string> authorization;
  std::vector<HeldPart> parts;
  // Carried to a new epoch from some of the copies that held the rank's
  // update but not all (Resume): its step is not complete until the rank
  // sends it again, which replaces it.
  bool partial = false;
  int64_t Bytes() const;
  // This contribution with only its parts of `shards` (table, shard index).
  Contribution PartsOf(const std::set<std::pair<std::string, int32_t>>& shards) const;
};

class StepBarrier {
 public:
  struct Options {
    ember::v1::TrainingSpec::Mode mode = ember::v1::TrainingSpec::ASYNC;
    int32_t trainers = 1;
    int32_t max_staleness = 0;  // BOUNDED
    absl::Duration timeout = absl::Seconds(300);
    bool mean = true;  // gradient_reduction MEAN: each rank's gradients / trainers
    int64_t max_pending_bytes = int64_t{1} << 30;
  };
  static Options OptionsOf(const ember::v1::TrainingSpec& spec, int64_t max_pending_bytes);

  explicit StepBarrier(const Options& options) : options_(options) {}
  StepBarrier(const StepBarrier&) = delete;
  StepBarrier& operator=(const StepBarrier&) = delete;

  const Options& options() const { return options_; }
  // SYNC or BOUNDED: data calls must carry steps (and updates ranks).
  bool stepped() const { return options_.mode != ember::v1::TrainingSpec::ASYNC; }
  // The trainers step `step` waits for: options().trainers, or the count
  // SetTrainers gave from a step at or before it.
  int32_t TrainersAt(int64_t step) const;

  // How far a lookup may run ahead of the last applied step (SYNC 0).
  int32_t staleness() const {
    return options_.mode == ember::v1::TrainingSpec::BOUNDED ? options_.max_staleness : 0;
  }

  // Applies a complete step: its contributions in rank order. Its status is
  // the answer of every contributor still waiting; an error drops the step
  // (it can be sent again).
  using ApplyFn =
      std::function<absl::Status(int64_t step, const std::vector<const Contribution*>& ranks)>;

  // Holds `c` as its rank's contribution to `step` (rank in [0, trainers),
  // step >= 0: the caller checked) and applies every step it completes.
  // SYNC: returns once the step is applied, aborted or `deadline` passed
  // (then DEADLINE_EXCEEDED; the contribution stays held). BOUNDED: once
  // held. *duplicate: it was a retry of a contribution held or applied.
  // Refused, nothing held: a step applied before with another digest, a
  // step too far ahead of the last applied one (at once when it is two or
  // more too far; one too far waits, at most until `deadline` or a step's
  // timeout, for the step before it: its last rank's part may be on its
  // way here), two different
  // contributions of one rank to a step (INVALID_ARGUMENT), more bytes
  // held than max_pending_bytes (RESOURCE_EXHAUSTED).
  absl::Status Submit(int64_t step, Contribution c, absl::Time deadline, const ApplyFn& apply,
                      bool* duplicate);

  // Waits until a lookup for `step` may read: step - 1 - staleness()
  // applied (nothing to wait for before the first step applied here, but
  // the steps held below it). ABORTED when that step is aborted, as its
  // waiters, or after the step timeout; DEADLINE_EXCEEDED at `deadline`.
  // INVALID_ARGUMENT for a step no trainer can be at yet (further than
  // 2 + staleness() past the last applied). With `kick`, a complete step
  // held after a failed apply is tried again while it waits.
  absl::Status WaitForLookup(int64_t step, absl::Time deadline, const ApplyFn* kick = nullptr);

  // Applies the complete steps held (a step whose apply failed UNAVAILABLE
  // is tried again at most every 50 ms).
  void ApplyReady(const ApplyFn& apply);

  // Drops every contribution held; every waiter gets `why` (the collection
  // moved or was dropped: clients refresh their plan and send again).
  void AbortAll(const absl::Status& why);

  // `trainers` ranks from step `from_step` on (the steps before keep
  // theirs); then applies the steps that completes. The same change again
  // is accepted. FAILED_PRECONDITION: from_step applied already, or a held
  // step from it on holds a rank >= trainers (nothing changed).
  absl::Status SetTrainers(int32_t trainers, int64_t from_step, const ApplyFn& apply);

  // A move's step fence (the coordinator's, before a BOUNDED collection's
  // rows are copied: docs/training.md). HighestStep: the highest step held
  // or applied here, -1 for none. FenceAt: from now on a contribution to a
  // step past `last` is refused UNAVAILABLE (the trainer retries, on the
  // moved collection); returns HighestStep. WaitApplied: until step `last`
  // is applied here (every rank's contributions up to it arrived and
  // applied), DEADLINE_EXCEEDED at `deadline`.
  int64_t HighestStep() const;
  int64_t FenceAt(int64_t last);
  absl::Status WaitApplied(int64_t last, absl::Time deadline, const ApplyFn* kick = nullptr);

  // Whether every step up to `step` is applied here.
  bool AppliedThrough(int64_t step) const;
  // The last step applied here and its ranks' digests (none: nothing
  // applied).
  using RankDigests = std::map<int32_t, uint64_t>;
  std::optional<std::pair<int64_t, RankDigests>> LastApplied() const;
  // A fresh barrier (nothing held or applied) taking over from another
  // that applied through `step` with these ranks' contributions (a new
  // epoch of a collection whose every shard here had applied it): a rank
  // that sends `step` again is answered as a retry of what was applied.
  void Seed(int64_t step, RankDigests digests);

  // BOUNDED steps across a move to another epoch: what a barrier applied
  // and held, taken by CarryAndAbort (which then aborts it as AbortAll) and
  // given to the new epoch's fresh barrier by Resume. A step being applied
  // meanwhile is carried too (the shards' applied request ids skip what it
  // applied).
  struct Carried {
    std::optional<int64_t> applied;
    // Steps up to this were applied to some of the shards (the lookups'
    // and the staleness bound's base; applied may lag it).
    std::optional<int64_t> horizon;
    std::map<int64_t, RankDigests> digests;  // of recent applied steps
    std::map<int64_t, std::map<int32_t, Contribution>> held;
  };
  Carried CarryAndAbort(const absl::Status& why);
  void Resume(Carried carried);

  struct Stats {
    int64_t steps_applied = 0;
    int64_t steps_aborted = 0;
    int64_t pending_bytes = 0;
    int64_t wait_ns = 0;       // time updates and lookups waited here
    int64_t ranks_missing = 0;  // ranks absent from aborted steps, summed
    int64_t apply_retries = 0;  // BOUNDED applies failed UNAVAILABLE, held again
    std::optional<int64_t> applied_through;  // the last step applied
  };
  Stats GetStats() const;

 private:
  struct Pending {
    std::map<int32_t, Contribution> by_rank;
    absl::Time first;
  };
  // Every rank's contribution is held, none partial.
  bool CompleteLocked(int64_t step, const Pending& p) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The step the staleness bound counts from: the last applied or the
  // horizon carried, the later.
  std::optional<int64_t> BaseLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Applies every complete step in order while no other thread does.
  void ApplyReadyLocked(const ApplyFn& apply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a held step with `why` (its waiters' answer).
  void AbortLocked(int64_t step, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the held steps whose timeout passed.
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When a waiter wakes: `deadline`, or the first held step's timeout, or
  // (`kicks`: the waiter tries held steps again) the next retry of a failed
  // apply.
  absl::Time WakeLocked(absl::Time deadline, bool kicks = false) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The step's outcome once it has one: OK (applied) or why it was not.
  std::optional<absl::Status> OutcomeLocked(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string MissingRanksLocked(int64_t step, const Pending& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int32_t TrainersAtLocked(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int32_t> trainers_from_ ABSL_GUARDED_BY(mu_);  // SetTrainers' changes
  std::optional<int64_t> applied_ ABSL_GUARDED_BY(mu_);
  std::optional<int64_t> horizon_ ABSL_GUARDED_BY(mu_);  // Carried::horizon
  // The step being applied, while one is (its contributions, read by the
  // applying thread without mu_; nothing else changes them until it ends).
  std::optional<std::pair<int64_t, Pending>> in_apply_ ABSL_GUARDED_BY(mu_);
  absl::Time retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // after a failed apply
  // Recent outcomes: steps dropped (and why), and the digests of applied
  // steps' contributions (retries are answered from them).
  std::map<int64_t, absl::Status> dropped_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::map<int32_t, uint64_t>> applied_digests_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> all_aborted_ ABSL_GUARDED_BY(mu_);
  std::optional<int64_t> fence_ ABSL_GUARDED_BY(mu_);  // FenceAt's last step
  int64_t HighestStepLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_applied_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_aborted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wait_ns_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ranks_missing_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t apply_retries_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_STEP_BARRIER_H_
