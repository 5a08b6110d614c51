// The learned hit-rate curve against an independent reference: a plain LRU
// cache (a list and a map) simulated at each size over the same accesses.
// Exact where every row is sampled (including across the tree's
// compactions), within a few points where rows are sampled, and a short
// sequence worked by hand.
#include "server/backend/key_value/lru_curve.h"

#include <cmath>
#include <list>
#include <random>
#include <unordered_map>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace {

// Hits of an LRU cache of `capacity` rows over `accesses`.
int64_t LruHits(const std::vector<int64_t>& accesses, int64_t capacity) {
  std::list<int64_t> order;  // most recent first
  std::unordered_map<int64_t, std::list<int64_t>::iterator> at;
  int64_t hits = 0;
  for (int64_t r : accesses) {
    auto it = at.find(r);
    if (it != at.end()) {
      order.splice(order.begin(), order, it->second);
      ++hits;
      continue;
    }
    order.push_front(r);
    at[r] = order.begin();
    if (static_cast<int64_t>(order.size()) > capacity) {
      at.erase(order.back());
      order.pop_back();
    }
  }
  return hits;
}

// Skewed row draws: row = rows * u^3 (low rows far more often).
std::vector<int64_t> Skewed(int64_t rows, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t& r : out) {
    r = static_cast<int64_t>(static_cast<double>(rows) * std::pow(u(rng), 3.0)) % rows;
  }
  return out;
}

int64_t CacheOf(double fraction, int64_t rows) {
  return static_cast<int64_t>(std::ceil(fraction * static_cast<double>(rows)));
}

TEST(LruCurveTest, ASequenceWorkedByHand) {
  LruCurve c(100);  // caches of 1, 2, 5, 10, 20, 30, 50, 75, 100 rows
  for (int64_t r : {1, 2, 3, 1, 1, 3}) c.Access(r);
  // 1, 2, 3: first accesses, misses. 1: rows 2 and 3 since (distance 2),
  // hits from 5 rows up. 1 again: distance 0, hits everywhere. 3: row 1
  // since (distance 1), hits from 2 rows up.
  EXPECT_EQ(c.sampled(), 6);
  const LruCurve::Hits want = {1, 2, 3, 3, 3, 3, 3, 3, 3};
  EXPECT_EQ(c.hits(), want);
}

TEST(LruCurveTest, EveryRowSampledEqualsAnLruAtEverySize) {
  constexpr int64_t kRows = 500;
  const std::vector<int64_t> accesses = Skewed(kRows, 20000, 3);  // many compactions
  LruCurve c(kRows);
  ASSERT_EQ(c.rate(), 1.0);
  for (int64_t r : accesses) c.Access(r);
  EXPECT_EQ(c.sampled(), static_cast<int64_t>(accesses.size()));
  for (size_t i = 0; i < kLruCurveFractions.size(); ++i) {
    EXPECT_EQ(c.hits()[i], LruHits(accesses, CacheOf(kLruCurveFractions[i], kRows)))
        << "fraction " << kLruCurveFractions[i];
  }
}

TEST(LruCurveTest, SampledRowsEstimateTheCurveOfALargeShard) {
  constexpr int64_t kRows = 1000000;
  const std::vector<int64_t> accesses = Skewed(kRows, 1500000, 4);
  LruCurve c(kRows);
  EXPECT_LT(c.rate(), 0.02);
  for (int64_t r : accesses) c.Access(r);
  EXPECT_GT(c.sampled(), 10000);
  EXPECT_LT(c.sampled(), 60000);
  const double n = static_cast<double>(accesses.size());
  for (size_t i : {0, 2, 4, 6}) {
    const double exact =
        static_cast<double>(LruHits(accesses, CacheOf(kLruCurveFractions[i], kRows))) / n;
    const double learned = static_cast<double>(c.hits()[i]) / static_cast<double>(c.sampled());
    EXPECT_NEAR(learned, exact, 0.03) << "fraction " << kLruCurveFractions[i];
  }
}

TEST(LruCurveTest, HitRatesNeverFallAsTheCacheGrows) {
  LruCurve c(3000, 256);  // sampled
  for (int64_t r : Skewed(3000, 50000, 5)) c.Access(r);
  for (size_t i = 1; i < kLruCurveFractions.size(); ++i) {
    EXPECT_LE(c.hits()[i - 1], c.hits()[i]);
  }
  EXPECT_LE(c.hits().back(), c.sampled());
}

TEST(LruCurveTest, ADegenerateShardIsOneRow) {
  LruCurve c(0);
  c.Access(0);
  c.Access(0);
  EXPECT_EQ(c.sampled(), 2);
  EXPECT_EQ(c.hits().back(), 1);
}

}  // namespace
}  // namespace backend
}  // namespace ember
