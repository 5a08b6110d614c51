#include "server/backend/shard_registry.h"

#include <memory>

#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace {

struct FakeShard {
  ShardSpec spec;
  int64_t step = 0;
};

std::unique_ptr<FakeShard> Make(const char* table) {
  auto s = std::make_unique<FakeShard>();
  s->spec.table = table;
  return s;
}

TEST(ShardRegistryTest, IdsAreNeverReused) {
  ShardRegistry<FakeShard> r;
  const ShardId a = r.Add(Make("a"));
  const ShardId b = r.Add(Make("b"));
  EXPECT_NE(a, b);
  ASSERT_TRUE(r.Remove(a).ok());
  const ShardId c = r.Add(Make("c"));
  EXPECT_NE(c, a);
  EXPECT_NE(c, b);
  EXPECT_EQ(r.Find(a), nullptr);
  ASSERT_NE(r.Find(c), nullptr);
  EXPECT_EQ(r.Find(c)->spec.table, "c");
  EXPECT_EQ(r.Spec(b)->table, "b");
}

TEST(ShardRegistryTest, RemoveHandsTheShardBack) {
  ShardRegistry<FakeShard> r;
  const ShardId a = r.Add(Make("a"));
  auto removed = r.Remove(a);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ((*removed)->spec.table, "a");
  EXPECT_TRUE(absl::IsNotFound(r.Remove(a).status()));
}

TEST(ShardRegistryTest, UnknownIdsAndBadStepsAreRefused) {
  ShardRegistry<FakeShard> r;
  EXPECT_TRUE(absl::IsNotFound(r.Spec(7).status()));
  EXPECT_TRUE(absl::IsNotFound(r.Step(7).status()));
  EXPECT_TRUE(absl::IsNotFound(r.SetStep(7, 1)));
  EXPECT_TRUE(absl::IsNotFound(r.SetStep(7, -1)));  // NOT_FOUND first
  const ShardId a = r.Add(Make("a"));
  EXPECT_TRUE(absl::IsInvalidArgument(r.SetStep(a, -1)));
  EXPECT_EQ(*r.Step(a), 0);
  ASSERT_TRUE(r.SetStep(a, 41).ok());
  EXPECT_EQ(*r.Step(a), 41);
  r.Clear();
  EXPECT_EQ(r.Find(a), nullptr);
}

}  // namespace
}  // namespace backend
}  // namespace ember
