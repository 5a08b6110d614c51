// UseBatchScheduling: the calling thread and the threads it starts later
// run under SCHED_BATCH; one started before keeps its policy.
#include "server/common/scheduling.h"

#include <sched.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"

namespace ember {
namespace {

TEST(SchedulingTest, BatchPolicyIsTheThreadsAndInheritedByLaterThreads) {
  // Everything in a thread of its own: the test runner's thread keeps its
  // policy.
  std::thread([] {
    const int before = sched_getscheduler(0);
    ASSERT_NE(before, SCHED_BATCH) << "the test needs a thread not already under SCHED_BATCH";
    std::mutex mu;
    std::condition_variable cv;
    bool go = false;
    int earlier_policy = -1;
    // A thread started before the call: its policy stays.
    std::thread earlier([&] {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return go; });
      earlier_policy = sched_getscheduler(0);
    });
    const absl::Status s = UseBatchScheduling();
    {
      std::lock_guard<std::mutex> lock(mu);
      go = true;
    }
    cv.notify_all();
    earlier.join();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(earlier_policy, before);
    EXPECT_EQ(sched_getscheduler(0), SCHED_BATCH);
    int later_policy = -1;
    std::thread([&] { later_policy = sched_getscheduler(0); }).join();
    EXPECT_EQ(later_policy, SCHED_BATCH);
  }).join();
}

}  // namespace
}  // namespace ember
