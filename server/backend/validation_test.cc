// The request validation shared by both backends, against naive references.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
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

TEST(CheckIdsTest, FirstOutOfRangeIdAtEveryPositionAroundBlocks) {
  const int64_t rows = 100;
  for (size_t n : {0, 1, 7, 8, 9, 16, 17, 40}) {
    std::vector<int64_t> ids(n);
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i * 37 % rows);
    EXPECT_TRUE(CheckIds(ids, rows, "f").ok()) << n;
    for (size_t p = 0; p < n; ++p) {
      for (int64_t bad : {rows, int64_t{-1}, std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max()}) {
        const int64_t keep = ids[p];
        ids[p] = bad;
        const absl::Status s = CheckIds(ids, rows, "f", /*first_position=*/1000);
        ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n << " " << p;
        EXPECT_NE(s.message().find(absl::StrCat("id ", bad, " at position ", 1000 + p,
                                                " is outside [0, 100)")),
                  std::string::npos)
            << s.message();
        ids[p] = keep;
      }
    }
  }
  // The boundary values themselves are fine.
  EXPECT_TRUE(CheckIds(std::vector<int64_t>{0, 99}, rows, "f").ok());
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
