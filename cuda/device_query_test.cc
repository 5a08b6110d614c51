#include "cuda/device_query.h"

#include "gtest/gtest.h"

namespace ember {
namespace cuda {
namespace {

// Where no GPU is visible the query must fail cleanly with UNAVAILABLE (the
// CPU backend then serves); where one is, its properties must be sane.
TEST(DeviceQueryTest, ReportsDevicesOrUnavailable) {
  auto devices = QueryDevices();
  if (!devices.ok()) {
    EXPECT_EQ(devices.status().code(), absl::StatusCode::kUnavailable)
        << devices.status();
    EXPECT_FALSE(devices.status().message().empty());
    GTEST_SKIP() << "no GPU: " << devices.status();
  }
  ASSERT_TRUE(BuiltWithCuda());
  for (const DeviceInfo& d : *devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_memory_bytes, int64_t{1} << 30);
    EXPECT_GE(d.compute_capability_major, 7);
    EXPECT_GT(d.multiprocessors, 0);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace ember
