#include "server/backend/cuda/slot_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace {

TEST(SlotPoolTest, HandsOutDistinctSlotsUntilAllAreHeld) {
  SlotPool pool(2);
  EXPECT_EQ(pool.size(), 2);
  const int a = pool.Acquire();
  const int b = pool.Acquire();
  EXPECT_NE(a, b);
  EXPECT_GE(a, 0);
  EXPECT_LT(a, 2);
  EXPECT_GE(b, 0);
  EXPECT_LT(b, 2);
  EXPECT_EQ(pool.Held(), 2);
  pool.Release(a);
  EXPECT_EQ(pool.Held(), 1);
  EXPECT_EQ(pool.Acquire(), a);  // the one free slot
  pool.Release(b);
  pool.Release(a);
  EXPECT_EQ(pool.Held(), 0);
}

TEST(SlotPoolTest, NonPositiveSizeMeansOneSlot) {
  SlotPool pool(0);
  EXPECT_EQ(pool.size(), 1);
}

// A third caller waits until one of two holders lets go, and then gets the
// slot that holder released.
TEST(SlotPoolTest, AcquireWaitsWhileEverySlotIsHeld) {
  SlotPool pool(2);
  const int a = pool.Acquire();
  const int b = pool.Acquire();
  absl::Notification got;
  int third = -1;
  std::thread waiter([&] {
    third = pool.Acquire();
    got.Notify();
  });
  EXPECT_FALSE(got.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  pool.Release(b);
  ASSERT_TRUE(got.WaitForNotificationWithTimeout(absl::Seconds(30)));
  waiter.join();
  EXPECT_EQ(third, b);
  pool.Release(a);
  pool.Release(third);
  EXPECT_EQ(pool.Held(), 0);
}

// Many callers through two slots: never more than two inside, never two
// holding the same slot, everyone gets through.
TEST(SlotPoolTest, BoundsConcurrentHoldersAndKeepsSlotsExclusive) {
  SlotPool pool(2);
  std::atomic<int> inside{0}, most{0}, passes{0};
  std::atomic<int> owner[2] = {{-1}, {-1}};
  std::atomic<bool> shared_slot{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const int s = pool.Acquire();
        int expected = -1;
        if (!owner[s].compare_exchange_strong(expected, t)) shared_slot = true;
        const int now = ++inside;
        int m = most.load();
        while (now > m && !most.compare_exchange_weak(m, now)) {
        }
        std::this_thread::yield();
        --inside;
        owner[s] = -1;
        pool.Release(s);
        ++passes;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(shared_slot);
  EXPECT_LE(most.load(), 2);
  EXPECT_EQ(passes.load(), 6 * 200);
  EXPECT_EQ(pool.Held(), 0);
}

TEST(SlotPoolDeathTest, ReleasingASlotNotHeldAborts) {
  SlotPool pool(2);
  EXPECT_DEATH(pool.Release(0), "");
  EXPECT_DEATH(pool.Release(5), "");
}

}  // namespace
}  // namespace backend
}  // namespace ember
