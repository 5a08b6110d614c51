// ModBy and Router against the % they replace.
#include "server/common/dynamic_route.h"

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace {

TEST(DynamicRouteTest, ModByIsTheRemainderForEveryKindOfDivisorAndValue) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  std::vector<uint64_t> divisors = {1,          2,           3,        7,        1000,
                                    1000003,    1u << 20,    12345678, kMax,     kMax - 1,
                                    kMax / 2,   kMax / 2 + 1, uint64_t{1} << 63, (uint64_t{1} << 32) + 1};
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) divisors.push_back(rng() >> (rng() % 64) | 1);
  for (const uint64_t d : divisors) {
    const ModBy mod(d);
    std::vector<uint64_t> xs = {0, 1, d - 1, d, d + 1, kMax, kMax - 1, 2 * d, 2 * d - 1};
    for (int i = 0; i < 500; ++i) xs.push_back(rng() >> (rng() % 64));
    for (const uint64_t x : xs) ASSERT_EQ(mod(x), x % d) << x << " mod " << d;
  }
}

TEST(DynamicRouteTest, RouterRoutesAsRouteRow) {
  std::mt19937_64 rng(11);
  for (const int64_t capacity : {int64_t{1}, int64_t{3}, int64_t{100000}, int64_t{1} << 40}) {
    const Router router(capacity);
    for (int i = 0; i < 2000; ++i) {
      const int64_t id = static_cast<int64_t>(rng());
      ASSERT_EQ(router.Row(id), RouteRow(id, capacity)) << id << " capacity " << capacity;
    }
    for (const int64_t id : {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
      EXPECT_EQ(router.Row(id), RouteRow(id, capacity));
    }
  }
}

}  // namespace
}  // namespace ember
