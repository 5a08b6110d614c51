// The request validation shared by both backends, against naive references.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {
namespace {

int64_t NaiveFirstNonFinite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i]) || std::isinf(v[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(FirstNonFiniteTest, MatchesNaiveScanAtEveryPositionAndLength) {
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::quiet_NaN()};
  // Lengths around the 16-element blocks; every position; every kind.
  for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 47, 100}) {
    std::vector<float> v(n, 1.5f);
    EXPECT_EQ(FirstNonFinite(v), -1) << n;
    for (size_t p = 0; p < n; ++p) {
      for (float bad : bad_values) {
        v[p] = bad;
        ASSERT_EQ(FirstNonFinite(v), static_cast<int64_t>(p)) << "n=" << n << " p=" << p;
        v[p] = 1.5f;
      }
    }
  }
}

TEST(FirstNonFiniteTest, ExtremeFiniteValuesPassAndFirstOfSeveralIsReported) {
  std::vector<float> v = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f,
                          std::numeric_limits<float>::min()};
  EXPECT_EQ(FirstNonFinite(v), -1);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e30f, 1e30f);
  std::vector<float> r(1000);
  for (float& x : r) x = u(rng);
  r[700] = std::numeric_limits<float>::infinity();
  r[345] = std::numeric_limits<float>::quiet_NaN();
  r[999] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FirstNonFinite(r), NaiveFirstNonFinite(r));
  EXPECT_EQ(FirstNonFinite(r), 345);
}

TEST(CheckFiniteTest, MessageNamesArrayAndPosition) {
  std::vector<float> v(40, 0.25f);
  v[33] = std::numeric_limits<float>::infinity();
  const absl::Status s = CheckFinite(v, "gradient request 2", "gradient");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("gradient[33]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("gradient request 2"), std::string::npos) << s.message();
}

TEST(CheckLengthsTest, RefusesNegativeOverflowingAndMismatchedLengths) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_TRUE(CheckLengths(std::vector<int64_t>{2, 0, 3}, 5, "f").ok());
  EXPECT_TRUE(CheckLengths(std::vector<int64_t>{}, 0, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{2, 0, 3}, 4, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{}, 1, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{3, -1}, 2, "f").ok());
  // Sums that wrap around to the id count must not pass.
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{big, big, 4}, 2, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{big, 1}, std::numeric_limits<int64_t>::min(), "f").ok());
}

}  // namespace
}  // namespace backend
}  // namespace ember
