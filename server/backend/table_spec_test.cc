// A table's config as a shard spec: the optimizer's documented defaults fill
// only what the spec leaves unset; a value given is kept, 0 included.
#include "server/backend/table_spec.h"

#include "gtest/gtest.h"

namespace ember {
namespace {

ember::v1::TableConfig Table() {
  ember::v1::TableConfig t;
  t.set_name("t");
  t.set_num_embeddings(10);
  t.set_embedding_dim(4);
  t.add_feature_names("f");
  return t;
}

TEST(TableSpecTest, UnsetOptimizerFieldsTakeTheDocumentedDefaults) {
  const backend::ShardSpec s = ShardSpecFromTable(Table(), 0, 0, 10, 4);
  EXPECT_FLOAT_EQ(s.optimizer.learning_rate, 0.01f);
  EXPECT_FLOAT_EQ(s.optimizer.eps, 1e-8f);
  EXPECT_FLOAT_EQ(s.optimizer.beta1, 0.9f);
  EXPECT_FLOAT_EQ(s.optimizer.beta2, 0.999f);
}

TEST(TableSpecTest, ZeroGivenIsZero) {
  ember::v1::TableConfig t = Table();
  t.mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAM);
  t.mutable_optimizer()->set_learning_rate(0);
  t.mutable_optimizer()->set_beta1(0);
  t.mutable_optimizer()->set_beta2(0.5);
  const backend::ShardSpec s = ShardSpecFromTable(t, 0, 0, 10, 4);
  EXPECT_EQ(s.optimizer.learning_rate, 0.0f);
  EXPECT_EQ(s.optimizer.beta1, 0.0f);
  EXPECT_FLOAT_EQ(s.optimizer.beta2, 0.5f);
  EXPECT_FLOAT_EQ(s.optimizer.eps, 1e-8f);  // unset
}

TEST(TableSpecTest, FillOptimizerDefaultsKeepsWhatIsSet) {
  ember::v1::CollectionSpec spec;
  *spec.add_tables() = Table();
  *spec.add_tables() = Table();
  spec.mutable_tables(1)->mutable_optimizer()->set_learning_rate(0);
  spec.mutable_tables(1)->mutable_optimizer()->set_eps(1e-3);
  FillOptimizerDefaults(&spec);
  const auto& a = spec.tables(0).optimizer();
  EXPECT_TRUE(a.has_learning_rate() && a.has_eps() && a.has_beta1() && a.has_beta2());
  EXPECT_EQ(a.learning_rate(), 0.01);
  EXPECT_EQ(a.eps(), 1e-8);
  EXPECT_EQ(a.beta1(), 0.9);
  EXPECT_EQ(a.beta2(), 0.999);
  const auto& b = spec.tables(1).optimizer();
  EXPECT_EQ(b.learning_rate(), 0.0);
  EXPECT_EQ(b.eps(), 1e-3);
  EXPECT_EQ(b.beta1(), 0.9);
}

// Worked by hand: ceil(rows * factor), at least the floor, at most rows.
TEST(TableSpecTest, CacheRowsForAKeyValueShard) {
  EXPECT_EQ(CacheRowsFor(1000000, 0.2), 200000);
  EXPECT_EQ(CacheRowsFor(1000000, 0.0), 200000);  // 0: the default 0.2
  EXPECT_EQ(CacheRowsFor(1000000, 0.01), 65536);  // the floor
  EXPECT_EQ(CacheRowsFor(1000, 0.2), 1000);       // a shard under the floor: all of it
  EXPECT_EQ(CacheRowsFor(1000, 0.2, 1), 200);
  EXPECT_EQ(CacheRowsFor(1001, 0.2, 1), 201);  // rounded up
  EXPECT_EQ(CacheRowsFor(10, 0.0001, 1), 1);
  EXPECT_EQ(CacheRowsFor(10, 5.0, 1), 10);
  ember::v1::ShardAssignment a;
  a.mutable_table()->set_name("t");
  a.mutable_table()->set_num_embeddings(4000);
  a.mutable_table()->set_embedding_dim(8);
  a.set_rows(2000);
  a.set_row_offset(2000);
  a.set_cols(8);
  a.set_cache_load_factor(0.25);
  EXPECT_EQ(ShardSpecOf(a, 1).cache_rows, 0);  // fused (the default kernel)
  a.set_compute_kernel("key_value");
  EXPECT_EQ(ShardSpecOf(a, 1).cache_rows, 500);
  EXPECT_EQ(ShardSpecOf(a).cache_rows, 2000);
  EXPECT_EQ(ShardSpecOf(a, 1).row_offset, 2000);
  EXPECT_FALSE(ShardSpecOf(a, 1).host_mapped);
}

// The one shard of table "t" of `rows` x `dim`.
ember::v1::ShardAssignment WholeTable(int64_t rows, int64_t dim) {
  ember::v1::ShardAssignment a;
  a.mutable_table()->set_name("t");
  a.mutable_table()->set_num_embeddings(rows);
  a.mutable_table()->set_embedding_dim(dim);
  a.set_rows(rows);
  a.set_cols(dim);
  return a;
}

// fused_uvm: the whole shard in mapped host memory, no cache;
// fused_uvm_caching: the same under a cache.
TEST(TableSpecTest, AFusedUvmShardIsHostMapped) {
  ember::v1::ShardAssignment a = WholeTable(100, 8);
  EXPECT_FALSE(ShardSpecOf(a).host_mapped);
  a.set_compute_kernel("fused_uvm");
  EXPECT_TRUE(ShardSpecOf(a).host_mapped);
  EXPECT_EQ(ShardSpecOf(a).cache_rows, 0);
  EXPECT_EQ(ShardSpecOf(a).rows, 100);
  // fused_uvm_caching: mapped too, with a cache as key_value's is sized.
  a.set_compute_kernel("fused_uvm_caching");
  a.set_cache_load_factor(0.25);
  EXPECT_TRUE(ShardSpecOf(a, 1).host_mapped);
  EXPECT_EQ(ShardSpecOf(a, 1).cache_rows, 25);
  EXPECT_EQ(ShardSpecOf(a).cache_rows, 100);  // the floor: all of a small shard
}

// Where a shard's bytes go, worked by hand: 100 rows x 8 fp32 columns with
// SGD are 3200 bytes. fused: all in memory; fused_uvm: all mapped;
// fused_uvm_caching (25 rows cached): all mapped, and in device memory
// the cache's 25 rows (its bookkeeping is host memory, as the planner
// prices it).
TEST(TableSpecTest, ShardBytesByPlacement) {
  ember::v1::ShardAssignment a = WholeTable(100, 8);
  backend::ShardSpec s = ShardSpecOf(a);
  EXPECT_EQ(backend::DeviceShardBytes(s), 3200);
  EXPECT_EQ(backend::MappedShardBytes(s), 0);
  a.set_compute_kernel("fused_uvm");
  s = ShardSpecOf(a);
  EXPECT_EQ(backend::DeviceShardBytes(s), 0);
  EXPECT_EQ(backend::MappedShardBytes(s), 3200);
  a.set_compute_kernel("fused_uvm_caching");
  a.set_cache_load_factor(0.25);
  s = ShardSpecOf(a, 1);
  EXPECT_EQ(backend::MappedShardBytes(s), 3200);
  EXPECT_EQ(backend::DeviceShardBytes(s), 25 * 32);
}

}  // namespace
}  // namespace ember
