#include "server/worker/step_barrier.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ember {
namespace worker {
namespace {

using ::testing::HasSubstr;
using ember::v1::TrainingSpec;

StepBarrier::Options Opts(TrainingSpec::Mode mode, int trainers, int staleness = 0,
                          absl::Duration timeout = absl::Seconds(30)) {
  StepBarrier::Options o;
  o.mode = mode;
  o.trainers = trainers;
  o.max_staleness = staleness;
  o.timeout = timeout;
  return o;
}

Contribution Make(int rank, uint64_t digest, int floats = 4) {
  Contribution c;
  c.rank = rank;
  c.request_id = "r" + std::to_string(rank) + "-" + std::to_string(digest);
  c.digest = digest;
  HeldPart p;
  p.table = "t";
  p.grad.assign(floats, static_cast<float>(rank));
  c.parts.push_back(std::move(p));
  return c;
}

// What the apply function saw: (step, ranks in the order handed).
struct Log {
  absl::Mutex mu;
  std::vector<std::pair<int64_t, std::vector<int32_t>>> applied;
  StepBarrier::ApplyFn Fn(absl::Status result = absl::OkStatus()) {
    return [this, result](int64_t step, const std::vector<const Contribution*>& ranks) {
      std::vector<int32_t> order;
      for (const Contribution* c : ranks) order.push_back(c->rank);
      absl::MutexLock lock(&mu);
      applied.push_back({step, order});
      return result;
    };
  }
};

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

// SYNC, three ranks arriving in a different order every step: each step is
// applied once, when the last rank arrives, with the ranks in rank order,
// steps in order; every Submit returns after its step was applied.
TEST(StepBarrierTest, SyncAppliesEachStepOnceInRankOrderWhateverTheArrival) {
  StepBarrier b(Opts(TrainingSpec::SYNC, 3));
  Log log;
  std::mt19937 rng(3);
  for (int64_t step = 0; step < 6; ++step) {
    std::vector<int> order = {0, 1, 2};
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::thread> threads;
    std::vector<absl::Status> results(3);
    for (int k = 0; k < 3; ++k) {
      threads.emplace_back([&, k] {
        absl::SleepFor(absl::Milliseconds(5 * k));  // arrive in `order`
        bool dup = false;
        results[order[k]] = b.Submit(step, Make(order[k], 100 * step + order[k]), Soon(),
                                     log.Fn(), &dup);
        EXPECT_FALSE(dup);
        absl::MutexLock lock(&log.mu);
        // Returned only once its step is in the log.
        EXPECT_TRUE(!log.applied.empty() && log.applied.back().first >= step);
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  }
  ASSERT_EQ(log.applied.size(), 6u);
  for (int64_t step = 0; step < 6; ++step) {
    EXPECT_EQ(log.applied[step].first, step);
    EXPECT_EQ(log.applied[step].second, (std::vector<int32_t>{0, 1, 2}));
  }
  EXPECT_EQ(b.GetStats().steps_applied, 6);
  EXPECT_EQ(b.GetStats().pending_bytes, 0);
  EXPECT_EQ(*b.GetStats().applied_through, 5);
}

// Retries: the same contribution again is a duplicate (held or applied);
// another one for the same step and rank is refused; a step applied
// already, or one too far ahead, is refused.
TEST(StepBarrierTest, RetriesAreDuplicatesAndConflictsAreRefused) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  Log log;
  bool dup = false;
  ASSERT_TRUE(b.Submit(7, Make(0, 1), Soon(), log.Fn(), &dup).ok());
  EXPECT_FALSE(dup);
  ASSERT_TRUE(b.Submit(7, Make(0, 1), Soon(), log.Fn(), &dup).ok());  // a retry, held
  EXPECT_TRUE(dup);
  absl::Status s = b.Submit(7, Make(0, 2), Soon(), log.Fn(), &dup);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0 sent two different contributions for step 7"));
  ASSERT_TRUE(b.Submit(7, Make(1, 3), Soon(), log.Fn(), &dup).ok());  // completes step 7
  EXPECT_EQ(log.applied.size(), 1u);
  ASSERT_TRUE(b.Submit(7, Make(1, 3), Soon(), log.Fn(), &dup).ok());  // a retry, applied
  EXPECT_TRUE(dup);
  s = b.Submit(7, Make(1, 4), Soon(), log.Fn(), &dup);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("steps up to 7 are applied here already"));
  s = b.Submit(10, Make(0, 5), absl::Now() + absl::Milliseconds(50), log.Fn(),
               &dup);  // 8 not applied: at most 9 (waited for, then refused)
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("may run at most 1 step(s) ahead"));
  // Two too far: no trainer can have sent it, refused at once (a long
  // deadline not waited out).
  const absl::Time start = absl::Now();
  s = b.Submit(11, Make(0, 6), absl::Now() + absl::Seconds(30), log.Fn(), &dup);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("sent step 11 while step 8 is not applied yet"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(log.applied.size(), 1u);
}

// A step one too far ahead waits for the step before it to be applied (its
// last rank's part still on its way to this worker: the trainer ahead saw
// it applied on another worker), then is held as any other.
TEST(StepBarrierTest, AStepTooFarAheadWaitsForTheOneBefore) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  Log log;
  bool dup = false;
  ASSERT_TRUE(b.Submit(0, Make(0, 1), Soon(), log.Fn(), &dup).ok());
  ASSERT_TRUE(b.Submit(0, Make(1, 2), Soon(), log.Fn(), &dup).ok());  // step 0 applied
  ASSERT_TRUE(b.Submit(1, Make(0, 3), Soon(), log.Fn(), &dup).ok());
  std::thread late([&] {  // rank 1's step 1, 100 ms later
    absl::SleepFor(absl::Milliseconds(100));
    bool d = false;
    EXPECT_TRUE(b.Submit(1, Make(1, 4), Soon(), log.Fn(), &d).ok());
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(b.Submit(3, Make(0, 5), Soon(), log.Fn(), &dup).ok());  // needs step 1 applied
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
  late.join();
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.applied.size(), 2u);  // steps 0 and 1; 3 waits for 2
}

// BOUNDED(1): updates return once held; a lookup for step s waits for step
// s - 2 only, and proceeds when it is applied.
TEST(StepBarrierTest, BoundedLookupsWaitForTheStepTheyMustSee) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  Log log;
  bool dup = false;
  // Before anything is applied, nothing to wait for.
  EXPECT_TRUE(b.WaitForLookup(0, Soon()).ok());
  for (int64_t step : {0, 1}) {
    ASSERT_TRUE(b.Submit(step, Make(0, 10 + step), Soon(), log.Fn(), &dup).ok());
  }
  EXPECT_TRUE(log.applied.empty());  // rank 1 is behind: held
  // Step 1 reads with step 0 still held (it may be 1 step stale)...
  EXPECT_TRUE(b.WaitForLookup(1, absl::Now() + absl::Milliseconds(50)).ok());
  // ...step 2 needs step 0 applied.
  EXPECT_EQ(b.WaitForLookup(2, absl::Now() + absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Status waited;
  std::thread reader([&] { waited = b.WaitForLookup(2, Soon()); });
  absl::SleepFor(absl::Milliseconds(30));
  ASSERT_TRUE(b.Submit(0, Make(1, 20), Soon(), log.Fn(), &dup).ok());  // step 0 complete
  reader.join();
  EXPECT_TRUE(waited.ok()) << waited;
  ASSERT_EQ(log.applied.size(), 1u);
  EXPECT_EQ(b.WaitForLookup(3, absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);  // step 1 is not complete
  ASSERT_TRUE(b.Submit(1, Make(1, 21), Soon(), log.Fn(), &dup).ok());
  EXPECT_TRUE(b.WaitForLookup(3, absl::Now() + absl::Milliseconds(20)).ok());
  EXPECT_EQ(log.applied.size(), 2u);
  // Step 1 applied: a lookup for step 5 (needing step 3) is possible, one
  // for step 6 (needing step 4) is not.
  EXPECT_EQ(b.WaitForLookup(5, absl::Now() + absl::Milliseconds(5)).code(),
            absl::StatusCode::kDeadlineExceeded);
  const absl::Status far = b.WaitForLookup(6, Soon());
  EXPECT_EQ(far.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(far.message()), HasSubstr("ahead of every step a trainer can have sent"));
}

// A move's fence: steps past it are refused (UNAVAILABLE, retried by the
// trainer), those up to it still taken; WaitApplied returns once the
// fenced step is applied, or at its deadline.
TEST(StepBarrierTest, AFenceTakesStepsUpToItAndWaitsForThemToApply) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  Log log;
  bool dup = false;
  EXPECT_EQ(b.HighestStep(), -1);
  ASSERT_TRUE(b.Submit(0, Make(0, 10), Soon(), log.Fn(), &dup).ok());
  ASSERT_TRUE(b.Submit(1, Make(0, 11), Soon(), log.Fn(), &dup).ok());
  EXPECT_EQ(b.HighestStep(), 1);
  EXPECT_EQ(b.FenceAt(1), 1);
  const absl::Status past = b.Submit(2, Make(0, 12), Soon(), log.Fn(), &dup);
  EXPECT_EQ(past.code(), absl::StatusCode::kUnavailable) << past;
  EXPECT_THAT(std::string(past.message()), HasSubstr("fenced at 1"));
  EXPECT_EQ(b.WaitApplied(1, absl::Now() + absl::Milliseconds(30)).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Status waited;
  std::thread mover([&] { waited = b.WaitApplied(1, Soon()); });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(b.Submit(0, Make(1, 20), Soon(), log.Fn(), &dup).ok());  // still taken
  ASSERT_TRUE(b.Submit(1, Make(1, 21), Soon(), log.Fn(), &dup).ok());
  mover.join();
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_EQ(log.applied.size(), 2u);
  EXPECT_TRUE(b.WaitApplied(-1, Soon()).ok());  // nothing to wait for
}

// A lookup whose step never starts waits the step timeout, then ABORTED.
TEST(StepBarrierTest, ALookupWaitsAtMostTheStepTimeout) {
  StepBarrier b(Opts(TrainingSpec::SYNC, 2, 0, absl::Milliseconds(80)));
  Log log;
  bool d = false;
  std::thread t([&] { (void)b.Submit(0, Make(0, 1), Soon(), log.Fn(), &d); });
  bool d1 = false;
  ASSERT_TRUE(b.Submit(0, Make(1, 2), Soon(), log.Fn(), &d1).ok());
  t.join();
  const absl::Time start = absl::Now();
  const absl::Status s = b.WaitForLookup(2, absl::InfiniteFuture());  // needs step 1
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("for step 1, which no rank sent"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A rank that never comes: the step is aborted at the timeout, its waiter
// told which rank was missing, nothing applied; sent again it applies.
TEST(StepBarrierTest, AMissingRankAbortsTheStepWhichCanBeSentAgain) {
  StepBarrier b(Opts(TrainingSpec::SYNC, 3, 0, absl::Milliseconds(100)));
  Log log;
  bool dup = false;
  absl::Status first, second;
  std::thread t0([&] { first = b.Submit(4, Make(0, 1), Soon(), log.Fn(), &dup); });
  std::thread t1([&] {
    bool d = false;
    second = b.Submit(4, Make(1, 2), Soon(), log.Fn(), &d);
  });
  t0.join();
  t1.join();
  for (const absl::Status& s : {first, second}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank(s) 2 of 3 did not send it"));
  }
  EXPECT_TRUE(log.applied.empty());
  EXPECT_EQ(b.GetStats().steps_aborted, 1);
  EXPECT_EQ(b.GetStats().ranks_missing, 1);
  EXPECT_EQ(b.GetStats().pending_bytes, 0);
  std::vector<std::thread> again;
  std::vector<absl::Status> results(3);
  for (int r = 0; r < 3; ++r) {
    again.emplace_back([&, r] {
      bool d = false;
      results[r] = b.Submit(4, Make(r, r + 1), Soon(), log.Fn(), &d);
    });
  }
  for (auto& t : again) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(log.applied.size(), 1u);
  EXPECT_EQ(log.applied[0].first, 4);
}

// A step whose apply fails: every contributor gets the failure, the step is
// not counted applied, and the ranks can send it again.
TEST(StepBarrierTest, AFailedApplyIsEveryonesAnswer) {
  StepBarrier b(Opts(TrainingSpec::SYNC, 2));
  Log log;
  absl::Status a, c;
  const absl::Status bad = absl::InvalidArgumentError("id 99 is out of range");
  std::thread t([&] {
    bool d = false;
    a = b.Submit(0, Make(0, 1), Soon(), log.Fn(bad), &d);
  });
  absl::SleepFor(absl::Milliseconds(20));
  bool d = false;
  c = b.Submit(0, Make(1, 2), Soon(), log.Fn(bad), &d);
  t.join();
  EXPECT_EQ(a, bad);
  EXPECT_EQ(c, bad);
  EXPECT_FALSE(b.GetStats().applied_through.has_value());
  std::thread t2([&] { a = b.Submit(0, Make(0, 1), Soon(), log.Fn(), &d); });
  absl::SleepFor(absl::Milliseconds(20));
  bool d2 = false;
  EXPECT_TRUE(b.Submit(0, Make(1, 2), Soon(), log.Fn(), &d2).ok());
  t2.join();
  EXPECT_TRUE(a.ok()) << a;
  EXPECT_EQ(*b.GetStats().applied_through, 0);
}

// BOUNDED: a step whose apply fails UNAVAILABLE (a backup copy did not
// confirm it) was acknowledged to its ranks: it stays held past the step
// timeout and is tried again, by a lookup waiting for it, until it applies.
// Any other failure drops it, as before.
TEST(StepBarrierTest, ABoundedStepWhoseApplyFailsUnavailableStaysHeldAndIsTriedAgain) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1, absl::Milliseconds(200)));
  std::atomic<int> calls{0};
  const absl::Time healed = absl::Now() + absl::Milliseconds(500);
  StepBarrier::ApplyFn flaky = [&](int64_t, const std::vector<const Contribution*>& ranks) {
    ++calls;
    EXPECT_EQ(ranks.size(), 2u);
    return absl::Now() < healed ? absl::UnavailableError("backup did not confirm")
                                : absl::OkStatus();
  };
  bool d = false;
  ASSERT_TRUE(b.Submit(0, Make(0, 1), Soon(), flaky, &d).ok());
  ASSERT_TRUE(b.Submit(0, Make(1, 2), Soon(), flaky, &d).ok());  // held: acknowledged
  EXPECT_FALSE(b.GetStats().applied_through.has_value());
  // A retry meanwhile is a duplicate, not a second contribution.
  ASSERT_TRUE(b.Submit(0, Make(1, 2), Soon(), flaky, &d).ok());
  EXPECT_TRUE(d);
  // The lookup for step 2 needs step 0, which outlives the step timeout
  // (it is complete: no rank is missing) while the lookups retry it (each
  // waits at most the step timeout).
  absl::Status looked;
  for (int i = 0; i < 50; ++i) {
    looked = b.WaitForLookup(2, absl::Now() + absl::Seconds(10), &flaky);
    if (looked.ok()) break;
    EXPECT_EQ(looked.code(), absl::StatusCode::kAborted) << looked;
  }
  ASSERT_TRUE(looked.ok()) << looked;
  const StepBarrier::Stats st = b.GetStats();
  EXPECT_EQ(*st.applied_through, 0);
  EXPECT_EQ(st.steps_aborted, 0);
  EXPECT_GE(st.apply_retries, 2);
  EXPECT_EQ(st.apply_retries + 1, calls.load());
  EXPECT_EQ(st.pending_bytes, 0);
  // Refused for another reason: dropped.
  Log log;
  const absl::Status bad = absl::InvalidArgumentError("non-finite gradient");
  ASSERT_TRUE(b.Submit(1, Make(0, 3), Soon(), log.Fn(bad), &d).ok());
  EXPECT_EQ(b.Submit(1, Make(1, 4), Soon(), log.Fn(bad), &d), bad);
  EXPECT_EQ(b.GetStats().steps_aborted, 1);
}

// A move to another epoch carries a BOUNDED barrier's steps: the new
// barrier resumes with what was applied (retries of it are duplicates, a
// conflicting one is refused) and held (completed by the ranks still to
// send). A partial contribution does not complete its step until its rank
// sends the update again; the staleness bound counts from the horizon.
TEST(StepBarrierTest, BoundedStepsAreCarriedToTheNextEpoch) {
  StepBarrier old(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  Log log;
  bool d = false;
  ASSERT_TRUE(old.Submit(0, Make(0, 1), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(old.Submit(0, Make(1, 2), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(old.Submit(1, Make(0, 3), Soon(), log.Fn(), &d).ok());
  ASSERT_EQ(log.applied.size(), 1u);
  const absl::Status moved = absl::FailedPreconditionError("moved to epoch 2");
  StepBarrier::Carried carried = old.CarryAndAbort(moved);
  EXPECT_EQ(old.Submit(1, Make(1, 4), Soon(), log.Fn(), &d), moved);
  EXPECT_EQ(old.CarryAndAbort(moved).held.size(), 0u);  // once
  ASSERT_EQ(*carried.applied, 0);
  ASSERT_EQ(carried.held.size(), 1u);
  ASSERT_EQ(carried.held.at(1).size(), 1u);

  StepBarrier next(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  next.Resume(carried);
  EXPECT_TRUE(next.AppliedThrough(0));
  EXPECT_FALSE(next.AppliedThrough(1));
  EXPECT_EQ(next.GetStats().pending_bytes, Make(0, 3).Bytes());
  ASSERT_TRUE(next.Submit(0, Make(1, 2), Soon(), log.Fn(), &d).ok());
  EXPECT_TRUE(d);  // step 0 was applied at the old epoch
  EXPECT_EQ(next.Submit(0, Make(1, 9), Soon(), log.Fn(), &d).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(next.Submit(1, Make(0, 3), Soon(), log.Fn(), &d).ok());
  EXPECT_TRUE(d);  // carried
  ASSERT_TRUE(next.Submit(1, Make(1, 4), Soon(), log.Fn(), &d).ok());
  ASSERT_EQ(log.applied.size(), 2u);
  EXPECT_EQ(log.applied[1].first, 1);
  EXPECT_EQ(log.applied[1].second, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(next.AppliedThrough(1));

  // Partial: rank 0's step-2 update carried from some copies only.
  StepBarrier::Carried part;
  part.applied = 1;
  part.horizon = 3;
  Contribution some = Make(0, 5, 1);
  some.partial = true;
  part.held[2].emplace(0, some);
  part.held[2].emplace(1, Make(1, 6));
  StepBarrier last(Opts(TrainingSpec::BOUNDED, 2, /*staleness=*/1));
  last.Resume(part);
  std::vector<size_t> floats;
  StepBarrier::ApplyFn sizes = [&](int64_t, const std::vector<const Contribution*>& ranks) {
    for (const Contribution* c : ranks) floats.push_back(c->parts[0].grad.size());
    return absl::OkStatus();
  };
  last.ApplyReady(sizes);
  EXPECT_TRUE(floats.empty());  // rank 0 is not whole yet
  EXPECT_EQ(last.Submit(2, Make(0, 7), Soon(), sizes, &d).code(),
            absl::StatusCode::kInvalidArgument);  // another update
  ASSERT_TRUE(last.Submit(2, Make(0, 5), Soon(), sizes, &d).ok());
  EXPECT_FALSE(d);
  EXPECT_EQ(floats, (std::vector<size_t>{4, 4}));  // rank 0's whole update replaced the part
  // Steps up to horizon 3 + 1 + staleness 1 are taken, not past.
  // (Step 6, one past, waits for its deadline first: step 4 may be on its
  // way.)
  EXPECT_TRUE(last.Submit(5, Make(0, 8), Soon(), sizes, &d).ok());
  EXPECT_EQ(last.Submit(6, Make(0, 9), absl::Now() + absl::Milliseconds(20), sizes, &d).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(last.Submit(7, Make(0, 10), Soon(), sizes, &d).code(),
            absl::StatusCode::kInvalidArgument);  // two past: at once
}

TEST(StepBarrierTest, HeldBytesAreBoundedAndAbortAllWakesEveryWaiter) {
  StepBarrier::Options o = Opts(TrainingSpec::SYNC, 2);
  o.max_pending_bytes = Make(0, 1, 1000).Bytes() + 100;
  StepBarrier b(o);
  Log log;
  absl::Status waiting;
  std::thread t([&] {
    bool d = false;
    waiting = b.Submit(0, Make(0, 1, 1000), Soon(), log.Fn(), &d);
  });
  absl::SleepFor(absl::Milliseconds(20));
  bool d = false;
  const absl::Status full = b.Submit(0, Make(1, 2, 1000), Soon(), log.Fn(), &d);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(std::string(full.message()), HasSubstr("--max_pending_step_bytes"));
  b.AbortAll(absl::FailedPreconditionError("collection moved"));
  t.join();
  EXPECT_EQ(waiting.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.Submit(1, Make(0, 3), Soon(), log.Fn(), &d).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.WaitForLookup(5, Soon()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(log.applied.empty());
}

// The trainer count changes from a step on: earlier steps keep theirs; a
// held step the new count completes is applied at once; the past, or a
// held rank past the new count, refuses the change.
TEST(StepBarrierTest, TheTrainerCountChangesFromAStepOn) {
  StepBarrier b(Opts(TrainingSpec::BOUNDED, 3, /*staleness=*/2));
  Log log;
  bool d = false;
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(b.Submit(0, Make(r, r), Soon(), log.Fn(), &d).ok());
  ASSERT_EQ(log.applied.size(), 1u);
  // Step 1: ranks 0 and 1 held; a third is expected until the change.
  ASSERT_TRUE(b.Submit(1, Make(0, 10), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(b.Submit(1, Make(1, 11), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(b.Submit(2, Make(2, 22), Soon(), log.Fn(), &d).ok());  // rank 2 at step 2
  EXPECT_EQ(log.applied.size(), 1u);
  absl::Status s = b.SetTrainers(2, 0, log.Fn());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("step 0 is applied here already"));
  s = b.SetTrainers(2, 1, log.Fn());  // step 2 holds rank 2
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("step 2 holds rank 2's update"));
  EXPECT_EQ(b.TrainersAt(1), 3);
  EXPECT_EQ(log.applied.size(), 1u);
  // From step 3: steps 1 and 2 keep three trainers.
  ASSERT_TRUE(b.SetTrainers(2, 3, log.Fn()).ok());
  ASSERT_TRUE(b.SetTrainers(2, 3, log.Fn()).ok());  // again: accepted
  EXPECT_EQ(b.TrainersAt(2), 3);
  EXPECT_EQ(b.TrainersAt(3), 2);
  EXPECT_EQ(b.TrainersAt(100), 2);
  EXPECT_EQ(log.applied.size(), 1u);
  ASSERT_TRUE(b.Submit(1, Make(2, 12), Soon(), log.Fn(), &d).ok());  // completes step 1
  ASSERT_EQ(log.applied.size(), 2u);
  // Step 2 has rank 2; dropping the count to 2 from step 2 is refused, to
  // 3 kept; from step 2 with ranks 0, 1 in and the count then 2: applied.
  ASSERT_TRUE(b.Submit(2, Make(0, 20), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(b.Submit(2, Make(1, 21), Soon(), log.Fn(), &d).ok());
  EXPECT_EQ(log.applied.size(), 3u);
  ASSERT_TRUE(b.Submit(3, Make(0, 30), Soon(), log.Fn(), &d).ok());
  ASSERT_TRUE(b.Submit(3, Make(1, 31), Soon(), log.Fn(), &d).ok());  // two trainers now
  ASSERT_EQ(log.applied.size(), 4u);
  EXPECT_EQ(log.applied[3].second, (std::vector<int32_t>{0, 1}));
  // A count lowered under held ranks completes their step.
  ASSERT_TRUE(b.SetTrainers(3, 4, log.Fn()).ok());
  ASSERT_TRUE(b.Submit(4, Make(0, 40), Soon(), log.Fn(), &d).ok());
  EXPECT_EQ(log.applied.size(), 4u);
  ASSERT_TRUE(b.SetTrainers(1, 4, log.Fn()).ok());
  EXPECT_EQ(log.applied.size(), 5u);
}

TEST(StepBarrierTest, OptionsFromTheSpec) {
  TrainingSpec spec;
  spec.set_mode(TrainingSpec::BOUNDED);
  spec.set_trainers(4);
  spec.set_max_staleness(2);
  spec.set_gradient_reduction(TrainingSpec::SUM);
  StepBarrier::Options o = StepBarrier::OptionsOf(spec, 123);
  EXPECT_EQ(o.trainers, 4);
  EXPECT_EQ(o.max_staleness, 2);
  EXPECT_FALSE(o.mean);
  EXPECT_EQ(o.timeout, absl::Seconds(300));  // 0: the default
  EXPECT_EQ(o.max_pending_bytes, 123);
  EXPECT_TRUE(StepBarrier(o).stepped());
  EXPECT_FALSE(StepBarrier(StepBarrier::OptionsOf(TrainingSpec(), 1)).stepped());
}

}  // namespace
}  // namespace worker
}  // namespace ember
