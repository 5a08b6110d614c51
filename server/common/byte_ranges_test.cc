#include "server/common/byte_ranges.h"

#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace {

// Against merges worked by hand: unsorted input, overlapping, touching,
// nested and apart.
TEST(ByteRangesTest, MergesOverlappingAndTouchingRanges) {
  EXPECT_TRUE(MergedRanges({}).empty());
  EXPECT_EQ(MergedRanges({{40, 50}, {0, 8}, {8, 16}, {4, 6}, {20, 30}, {25, 45}}),
            (std::vector<ByteRange>{{0, 16}, {20, 50}}));
  EXPECT_EQ(MergedRanges({{10, 20}, {0, 9}}), (std::vector<ByteRange>{{0, 9}, {10, 20}}));
  EXPECT_EQ(MergedRanges({{0, 100}, {10, 20}, {30, 40}}), (std::vector<ByteRange>{{0, 100}}));
}

}  // namespace
}  // namespace ember
