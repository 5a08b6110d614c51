#include "server/common/host_memory.h"

#include "gtest/gtest.h"

namespace ember {
namespace {

const char kMeminfo[] =
    "MemTotal:       24000000 kB\n"
    "MemFree:         1000000 kB\n"
    "MemAvailable:   20000000 kB\n";

TEST(HostMemoryTest, TheTighterOfMemAvailableAndTheCgroupLimit) {
  EXPECT_EQ(HostMemoryBytesFrom(kMeminfo, "", ""), int64_t{20000000} * 1024);
  EXPECT_EQ(HostMemoryBytesFrom(kMeminfo, "max\n", "9223372036854771712\n"),
            int64_t{20000000} * 1024);
  EXPECT_EQ(HostMemoryBytesFrom(kMeminfo, "4294967296\n", ""), int64_t{4294967296});
  EXPECT_EQ(HostMemoryBytesFrom(kMeminfo, "", "1073741824\n"), int64_t{1073741824});
  EXPECT_EQ(HostMemoryBytesFrom(kMeminfo, "2147483648", "1073741824"), int64_t{1073741824});
  EXPECT_EQ(HostMemoryBytesFrom("", "", ""), 0);
  EXPECT_EQ(HostMemoryBytesFrom("MemAvailable: lots\n", "garbage", ""), 0);
}

TEST(HostMemoryTest, ThisMachineHasSome) {
  const int64_t bytes = HostMemoryBytes();
  EXPECT_GT(bytes, int64_t{64} << 20);
  EXPECT_LT(bytes, int64_t{1} << 50);
}

}  // namespace
}  // namespace ember
