// HostWarp against the shuffle semantics of the device (__shfl_sync,
// __shfl_xor_sync with the full mask), worked by hand.
#include <cstdint>
#include <vector>

#include "cuda/warp.h"
#include "gtest/gtest.h"

namespace ember {
namespace cuda {
namespace {

TEST(HostWarpTest, BroadcastRotateAndXorButterfly) {
  std::vector<int> from_zero(kWarpSize), rotated(kWarpSize);
  std::vector<double> sums(kWarpSize);
  std::vector<int64_t> wide(kWarpSize);
  HostWarp::Run([&](HostWarp& w) {
    const int l = w.lane();
    from_zero[l] = w.shfl(100 + l, 0);
    rotated[l] = w.shfl(l * 10, (l + 1) % kWarpSize);
    double v = l;  // butterfly sum: every lane ends with 0 + 1 + ... + 31
    for (int m = 1; m < kWarpSize; m <<= 1) v += w.shfl_xor(v, m);
    sums[l] = v;
    wide[l] = w.shfl(int64_t{1} << 40 | l, 31 - l);
  });
  for (int l = 0; l < kWarpSize; ++l) {
    EXPECT_EQ(from_zero[l], 100);
    EXPECT_EQ(rotated[l], ((l + 1) % kWarpSize) * 10);
    EXPECT_EQ(sums[l], 496.0);
    EXPECT_EQ(wide[l], (int64_t{1} << 40) | (31 - l));
  }
}

TEST(HostWarpTest, LanesRunAheadWithoutClobberingEachOther) {
  // Each lane shuffles twice in a row: the second write must not change what
  // slower lanes read for the first.
  std::vector<int> first(kWarpSize), second(kWarpSize);
  HostWarp::Run([&](HostWarp& w) {
    const int l = w.lane();
    first[l] = w.shfl(l, kWarpSize - 1 - l);
    second[l] = w.shfl(1000 + l, kWarpSize - 1 - l);
  });
  for (int l = 0; l < kWarpSize; ++l) {
    EXPECT_EQ(first[l], kWarpSize - 1 - l);
    EXPECT_EQ(second[l], 1000 + kWarpSize - 1 - l);
  }
}

TEST(HostWarpTest, RunsAgainAndWithNoShuffleAtAll) {
  int calls = 0;
  for (int round = 0; round < 3; ++round) {
    HostWarp::Run([&](HostWarp&) { ++calls; });
  }
  EXPECT_EQ(calls, 3 * kWarpSize);
}

TEST(HostWarpDeathTest, DivergentShuffleAborts) {
  EXPECT_DEATH(HostWarp::Run([](HostWarp& w) {
                 if (w.lane() < 16) w.shfl(1, 0);
               }),
               "divergent shuffle");
}

}  // namespace
}  // namespace cuda
}  // namespace ember
