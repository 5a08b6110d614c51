#include "planner/spec_validation.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace ember {
namespace planner {
namespace {

using ::testing::HasSubstr;

ember::v1::CollectionSpec Spec(const std::string& text) {
  ember::v1::CollectionSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

constexpr char kGood[] = R"pb(
  name: "c"
  tables { name: "a" num_embeddings: 10 embedding_dim: 8 feature_names: "fa" }
  tables { name: "b" num_embeddings: 20 embedding_dim: 16 feature_names: "fb" feature_names: "fb2" }
  constraints {
    key: "b"
    value { sharding_types: "row_wise" compute_kernels: "fused" pooling_factors: [ 2, 3 ] }
  }
)pb";

void ExpectInvalid(const ember::v1::CollectionSpec& spec, const std::string& needle) {
  const absl::Status s = ValidateCollectionSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
}

TEST(ValidateCollectionSpecTest, AcceptsGoodSpec) {
  EXPECT_TRUE(ValidateCollectionSpec(Spec(kGood)).ok());
}

TEST(ValidateCollectionSpecTest, RejectsEmptyCollection) {
  ExpectInvalid(Spec("name: 'x'"), "no tables");
}

TEST(ValidateCollectionSpecTest, RejectsZeroRows) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->set_num_embeddings(0);
  ExpectInvalid(spec, "table 'a': num_embeddings must be > 0, got 0");
}

TEST(ValidateCollectionSpecTest, AnyPositiveDimOnCpuMultiplesOfFourOnCuda) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->set_embedding_dim(0);
  ExpectInvalid(spec, "table 'a': embedding_dim must be > 0, got 0");
  spec.mutable_tables(0)->set_embedding_dim(-3);
  ExpectInvalid(spec, "got -3");
  // TorchRec's CPU modules take any dim; so do CPU workers.
  ember::v1::Topology topo;
  topo.set_world_size(2);
  topo.set_compute_device(ember::v1::CPU);
  for (int dim : {1, 2, 3, 6, 10, 13}) {
    spec.mutable_tables(0)->set_embedding_dim(dim);
    EXPECT_TRUE(ValidateCollectionSpec(spec).ok()) << dim;
    EXPECT_TRUE(ValidatePlanInputs(spec, topo).ok()) << dim;
  }
  // CUDA workers' kernels move 4 columns at a time: every table named.
  topo.set_compute_device(ember::v1::CUDA);
  spec.mutable_tables(0)->set_embedding_dim(6);
  spec.mutable_tables(1)->set_embedding_dim(10);
  const absl::Status s = ValidatePlanInputs(spec, topo);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("table 'a': embedding_dim 6 is not a multiple of 4, which CUDA workers "
                        "need (CPU workers take any dim)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("table 'b': embedding_dim 10 is not"));
  spec.mutable_tables(0)->set_embedding_dim(8);
  spec.mutable_tables(1)->set_embedding_dim(12);
  EXPECT_TRUE(ValidatePlanInputs(spec, topo).ok());
}

// INT8 / INT4 tables: fixed, no optimizer state, held in memory, CPU
// workers; an unknown data type is named.
TEST(ValidateCollectionSpecTest, QuantizedTablesAreForServing) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->set_data_type(ember::v1::INT8);
  spec.mutable_tables(1)->set_data_type(ember::v1::INT4);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
  ember::v1::Topology topo;
  topo.set_world_size(2);
  topo.set_compute_device(ember::v1::CPU);
  EXPECT_TRUE(ValidatePlanInputs(spec, topo).ok());
  topo.set_compute_device(ember::v1::CUDA);
  const absl::Status cuda = ValidatePlanInputs(spec, topo);
  EXPECT_THAT(std::string(cuda.message()),
              HasSubstr("table 'a': INT8 tables are served by CPU workers"));

  auto adagrad = spec;
  adagrad.mutable_tables(0)->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAGRAD);
  ExpectInvalid(adagrad, "table 'a': INT8 tables are for serving and take no updates: leave "
                         "optimizer.type unset (SGD), got ADAGRAD");
  auto dynamic = spec;
  dynamic.mutable_tables(1)->set_num_embeddings(0);
  dynamic.mutable_tables(1)->mutable_dynamic()->set_capacity(100);
  ExpectInvalid(dynamic, "table 'b': INT4 tables are fixed");
  auto kv = spec;
  (*kv.mutable_constraints())["b"].add_compute_kernels("key_value");
  ExpectInvalid(kv, "constraints for 'b': key_value holds fp32 rows; INT4 tables are held in "
                    "memory");
  auto unknown = spec;
  unknown.mutable_tables(0)->set_data_type(static_cast<ember::v1::DataType>(9));
  ExpectInvalid(unknown, "table 'a': data_type 9 is not FP32, FP16, BF16, INT8 or INT4");
}

TEST(ValidateCollectionSpecTest, RejectsDuplicateTableName) {
  auto spec = Spec(kGood);
  spec.mutable_tables(1)->set_name("a");
  ExpectInvalid(spec, "table 'a': duplicate table name");
}

TEST(ValidateCollectionSpecTest, RejectsDuplicateFeatureAcrossTables) {
  auto spec = Spec(kGood);
  spec.mutable_tables(1)->set_feature_names(0, "fa");
  ExpectInvalid(spec, "duplicate feature name 'fa' (also in table 'a')");
}

TEST(ValidateCollectionSpecTest, RejectsTableWithoutFeatures) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->clear_feature_names();
  ExpectInvalid(spec, "table 'a': no feature_names");
}

TEST(ValidateCollectionSpecTest, RejectsUnknownShardingType) {
  auto spec = Spec(kGood);
  (*spec.mutable_constraints())["b"].add_sharding_types("diagonal_wise");
  ExpectInvalid(spec, "unknown sharding type 'diagonal_wise' (valid: table_wise, row_wise");
}

TEST(ValidateCollectionSpecTest, RejectsUnknownComputeKernel) {
  auto spec = Spec(kGood);
  (*spec.mutable_constraints())["b"].add_compute_kernels("quantum");
  ExpectInvalid(spec, "unknown compute kernel 'quantum'");
}

TEST(ValidateCollectionSpecTest, RejectsConstraintForUnknownTable) {
  auto spec = Spec(kGood);
  (*spec.mutable_constraints())["nope"].add_sharding_types("row_wise");
  ExpectInvalid(spec, "constraints for 'nope': no table named 'nope'");
}

TEST(ValidateCollectionSpecTest, RejectsPerFeatureListOfWrongLength) {
  auto spec = Spec(kGood);
  (*spec.mutable_constraints())["b"].add_pooling_factors(1.0);
  ExpectInvalid(spec, "pooling_factors has 3 values but the table has 2 feature(s)");
}

TEST(ValidateCollectionSpecTest, RejectsBadOptimizerAndInitializer) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->mutable_optimizer()->set_learning_rate(-1);
  spec.mutable_tables(0)->mutable_optimizer()->set_beta2(1.0);
  spec.mutable_tables(1)->mutable_initializer()->set_type(ember::v1::InitializerSpec::UNIFORM);
  spec.mutable_tables(1)->mutable_initializer()->set_low(1);
  ExpectInvalid(spec, "optimizer.learning_rate must be a finite value >= 0");
  ExpectInvalid(spec, "optimizer.beta2 must be in [0, 1)");
  ExpectInvalid(spec, "initializer uniform needs low <= high");
}

TEST(ValidateCollectionSpecTest, EpsGivenAsZeroIsRefusedAndZeroRatesAccepted) {
  auto spec = Spec(kGood);
  auto* o = spec.mutable_tables(0)->mutable_optimizer();
  o->set_eps(0);
  ExpectInvalid(spec, "optimizer.eps must be > 0, got 0 (leave it unset");
  o->clear_eps();
  o->set_learning_rate(0);  // a frozen table
  o->set_type(ember::v1::OptimizerSpec::ADAM);
  o->set_beta1(0);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
}

TEST(ValidateCollectionSpecTest, WeightDecayOnlyWhereFbgemmHasIt) {
  auto spec = Spec(kGood);
  auto* o = spec.mutable_tables(0)->mutable_optimizer();
  o->set_weight_decay(0.01);
  o->set_type(ember::v1::OptimizerSpec::SGD);
  ExpectInvalid(spec, "optimizer.weight_decay is not supported with SGD");
  o->set_type(ember::v1::OptimizerSpec::ADAGRAD);
  ExpectInvalid(spec, "ADAGRAD has no weight decay in FBGEMM");
  o->set_weight_decay_mode(ember::v1::OptimizerSpec::L2);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
  o->set_weight_decay_mode(ember::v1::OptimizerSpec::DEFAULT_DECAY);
  for (auto type : {ember::v1::OptimizerSpec::ROWWISE_ADAGRAD, ember::v1::OptimizerSpec::ADAM}) {
    o->set_type(type);
    EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
  }
}

TEST(ValidateCollectionSpecTest, ListsEveryProblem) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->set_num_embeddings(-5);
  spec.mutable_tables(1)->set_embedding_dim(0);
  const absl::Status s = ValidateCollectionSpec(spec);
  EXPECT_THAT(std::string(s.message()), HasSubstr("(2 problems)"));
}

TEST(ValidateTopologyTest, Rules) {
  ember::v1::Topology t;
  t.set_world_size(8);
  t.set_local_world_size(4);
  EXPECT_TRUE(ValidateTopology(t).ok());
  t.set_local_world_size(3);
  EXPECT_THAT(std::string(ValidateTopology(t).message()),
              HasSubstr("world_size 8 is not a multiple of local_world_size 3"));
  t.set_local_world_size(0);
  t.set_world_size(0);
  EXPECT_EQ(ValidateTopology(t).code(), absl::StatusCode::kInvalidArgument);
  t.set_world_size(2);
  t.add_devices()->set_rank(2);
  EXPECT_THAT(std::string(ValidateTopology(t).message()),
              HasSubstr("device override for rank 2 is outside [0, 2)"));
}

// Limits: refused before anything is allocated, however large the ask.
TEST(ValidateTopologyTest, Limits) {
  ember::v1::Topology t;
  t.set_world_size(kMaxWorldSize);
  EXPECT_TRUE(ValidateTopology(t).ok());
  t.set_world_size(kMaxWorldSize + 1);
  EXPECT_THAT(std::string(ValidateTopology(t).message()), HasSubstr("world_size must be at most 4096"));
  t.set_world_size(2147483647);
  EXPECT_EQ(ValidateTopology(t).code(), absl::StatusCode::kInvalidArgument);
  t.set_world_size(2);
  t.set_batch_size(kMaxBatchSize + 1);
  EXPECT_THAT(std::string(ValidateTopology(t).message()), HasSubstr("batch_size must be in"));
  t.set_batch_size(0);
  t.set_num_trainers(kMaxTrainers + 1);
  EXPECT_THAT(std::string(ValidateTopology(t).message()), HasSubstr("num_trainers must be in"));
  t.set_num_trainers(0);
  for (int i = 0; i < 3; ++i) t.add_devices()->set_rank(i % 2);
  EXPECT_THAT(std::string(ValidateTopology(t).message()), HasSubstr("3 device overrides for 2 ranks"));
}

TEST(ValidateCollectionSpecTest, Limits) {
  auto spec = Spec(kGood);
  spec.mutable_tables(0)->set_num_embeddings(kMaxRows + 1);
  ExpectInvalid(spec, "num_embeddings must be at most 1099511627776");
  spec = Spec(kGood);
  spec.mutable_tables(0)->set_embedding_dim(kMaxEmbeddingDim + 4);
  ExpectInvalid(spec, "embedding_dim must be at most 65536");
  spec = Spec(kGood);
  for (int i = 0; i < kMaxFeaturesPerTable; ++i) spec.mutable_tables(0)->add_feature_names(absl::StrCat("x", i));
  ExpectInvalid(spec, "feature_names; at most 4096");
  spec = Spec(kGood);
  while (spec.tables_size() <= kMaxTables) *spec.add_tables() = spec.tables(0);
  ExpectInvalid(spec, "tables; at most 16384");
}

TEST(ValidatePlanInputsTest, TablesTimesWorkers) {
  ember::v1::CollectionSpec spec;
  spec.set_name("c");
  for (int i = 0; i < 300; ++i) {
    auto* t = spec.add_tables();
    t->set_name(absl::StrCat("t", i));
    t->set_num_embeddings(10);
    t->set_embedding_dim(8);
    t->add_feature_names(absl::StrCat("f", i));
  }
  ember::v1::Topology t;
  t.set_world_size(kMaxWorldSize);
  const absl::Status s = ValidatePlanInputs(spec, t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("300 tables on 4096 workers"));
  t.set_world_size(1024);  // 307,200 > 2^18
  EXPECT_FALSE(ValidatePlanInputs(spec, t).ok());
  t.set_world_size(512);
  EXPECT_TRUE(ValidatePlanInputs(spec, t).ok());
}

}  // namespace
}  // namespace planner
}  // namespace ember

namespace ember {
namespace planner {
namespace {

TEST(ValidateCollectionSpecTest, ReplicasInRangeAndAsyncOnly) {
  ember::v1::CollectionSpec spec = Spec(kGood);
  for (int r : {0, 1, 2, kMaxReplicas}) {
    spec.set_replicas(r);
    EXPECT_TRUE(ValidateCollectionSpec(spec).ok()) << r;
  }
  spec.set_replicas(-1);
  ExpectInvalid(spec, "replicas must be in [0, 8]");
  spec.set_replicas(kMaxReplicas + 1);
  ExpectInvalid(spec, "replicas must be in [0, 8]");
  spec.set_replicas(2);
  spec.mutable_training()->set_mode(ember::v1::TrainingSpec::SYNC);
  spec.mutable_training()->set_trainers(2);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
  spec.mutable_training()->set_mode(ember::v1::TrainingSpec::BOUNDED);
  spec.mutable_training()->set_max_staleness(1);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());  // every training mode takes copies
  spec.set_replicas(1);
  EXPECT_TRUE(ValidateCollectionSpec(spec).ok());
}

}  // namespace
}  // namespace planner
}  // namespace ember
