// INT8 and INT4 (row-wise quantized) shards of the CPU backend, on every
// ISA: lookups (SUM, MEAN, NONE, weighted) against sums in double of the
// rows the shard exports, exports equal to quantizing the imported rows by
// rowwise_quant.h, initial rows the quantized initializer, and the
// refusals: updates (FAILED_PRECONDITION, nothing changed), values beyond
// fp16, an optimizer with state, and the wrappers and backends that hold
// no quantized rows (dynamic, key_value, the emulated CUDA backend).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "math/rowwise_quant.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_kernels.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/key_value/key_value_backend.h"

namespace ember {
namespace backend {
namespace {

using testing::HasSubstr;

ShardSpec Spec(WeightType type, int64_t rows, int64_t dim) {
  ShardSpec s;
  s.table = "q";
  s.rows = rows;
  s.dim = dim;
  s.row_offset = 5;
  s.table_rows = rows + 10;
  s.weight_type = type;
  s.initializer.seed = 3;
  return s;
}

std::vector<std::string> Isas() {
  std::vector<std::string> out;
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    if (RowKernelsFor(isa).ok()) out.push_back(isa);
  }
  return out;
}

std::unique_ptr<EmbeddingBackend> Cpu(const std::string& isa) {
  CpuBackendOptions o;
  o.isa = isa;
  o.num_threads = 2;
  auto b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

TEST(QuantizedBackendTest, LookupsExportsAndImportsOnEveryIsa) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0, 1);
  for (const std::string& isa : Isas()) {
    for (WeightType type : {WeightType::kInt8, WeightType::kInt4}) {
      for (int64_t dim : {3, 16, 64, 67}) {
        SCOPED_TRACE(isa + " " + WeightTypeName(type) + " dim " + std::to_string(dim));
        const int bits = QuantBits(type);
        auto be = Cpu(isa);
        const ShardSpec spec = Spec(type, 50, dim);
        auto id = be->CreateShard(spec);
        ASSERT_TRUE(id.ok()) << id.status();
        // Initial rows: the initializer's, quantized.
        std::vector<float> init(spec.rows * dim), got(spec.rows * dim), none;
        InitialValues(spec.initializer, spec.table_rows, spec.row_offset, spec.rows,
                      spec.col_offset, dim, init.data());
        ASSERT_TRUE(be->ExportRows(*id, 0, spec.rows, absl::MakeSpan(got), {}).ok());
        std::vector<uint8_t> row(math::QuantizedRowBytes(bits, dim));
        std::vector<float> want_row(dim);
        for (int64_t r = 0; r < spec.rows; ++r) {
          math::QuantizeRowKeeping(bits, init.data() + r * dim, dim, row.data());
          math::DequantizeRow(bits, row.data(), dim, want_row.data());
          for (int64_t c = 0; c < dim; ++c) ASSERT_EQ(got[r * dim + c], want_row[c]) << r;
        }
        // Imported rows: quantized as rowwise_quant.h does.
        std::vector<float> w(spec.rows * dim);
        for (float& x : w) x = n(rng) * 3;
        ASSERT_TRUE(be->ImportRows(*id, 0, spec.rows, w, {}).ok());
        ASSERT_TRUE(be->ExportRows(*id, 0, spec.rows, absl::MakeSpan(got), {}).ok());
        for (int64_t r = 0; r < spec.rows; ++r) {
          math::QuantizeRowKeeping(bits, w.data() + r * dim, dim, row.data());
          math::DequantizeRow(bits, row.data(), dim, want_row.data());
          for (int64_t c = 0; c < dim; ++c) ASSERT_EQ(got[r * dim + c], want_row[c]) << r;
        }
        // Lookups against the exported rows, summed in double.
        const std::vector<int64_t> lengths = {3, 0, 1, 4}, ids = {7, 0, 49, 12, 12, 3, 3, 40};
        const std::vector<float> weights = {0.5f, -1, 2, 1, 0.25f, 3, -2, 1};
        for (Pooling p : {Pooling::kSum, Pooling::kMean, Pooling::kNone}) {
          for (bool weighted : {false, true}) {
            if (p == Pooling::kNone && weighted) continue;
            FeatureRequest f{*id, p, lengths, ids, {}};
            if (weighted) f.weights = weights;
            std::vector<float> out(OutputSize(f, dim));
            ASSERT_TRUE(be->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
            size_t k = 0;
            for (size_t b = 0; b < (p == Pooling::kNone ? ids.size() : lengths.size()); ++b) {
              const size_t len = p == Pooling::kNone ? 1 : static_cast<size_t>(lengths[b]);
              for (int64_t c = 0; c < dim; ++c) {
                double want = 0, mag = 0;
                for (size_t j = 0; j < len; ++j) {
                  const double x = (weighted ? weights[k + j] : 1.0) * got[ids[k + j] * dim + c];
                  want += x;
                  mag += std::abs(x) + 8;
                }
                if (p == Pooling::kMean && len > 0) want /= static_cast<double>(len);
                ASSERT_NEAR(out[b * dim + c], want, 2e-6 * mag + 1e-6) << "bag " << b;
              }
              k += len;
            }
          }
        }
        // Updates are refused and change nothing.
        std::vector<float> grad(lengths.size() * dim, 1.0f);
        const absl::Status s =
            be->ApplyGradients({GradientRequest{FeatureRequest{*id, Pooling::kSum, lengths, ids, {}},
                                                grad}});
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr("takes lookups and imports, no updates"));
        std::vector<float> after(got.size());
        ASSERT_TRUE(be->ExportRows(*id, 0, spec.rows, absl::MakeSpan(after), {}).ok());
        EXPECT_EQ(after, got);
        // A value a quantized row cannot hold (its bias and scale are fp16).
        std::vector<float> big(dim, 1.0f);
        big[dim - 1] = 70000.0f;
        const absl::Status i = be->ImportRows(*id, 4, 5, big, {});
        EXPECT_EQ(i.code(), absl::StatusCode::kInvalidArgument) << i;
        EXPECT_THAT(std::string(i.message()), HasSubstr("row 9 column"));
        ASSERT_TRUE(be->ExportRows(*id, 0, spec.rows, absl::MakeSpan(after), {}).ok());
        EXPECT_EQ(after, got);
        // Rows at ids: the same values.
        const std::vector<int64_t> at = {49, 0, 7};
        std::vector<float> some(at.size() * dim);
        ASSERT_TRUE(be->ExportRowsAt(*id, at, absl::MakeSpan(some), {}).ok());
        for (size_t j = 0; j < at.size(); ++j) {
          for (int64_t c = 0; c < dim; ++c) ASSERT_EQ(some[j * dim + c], got[at[j] * dim + c]);
        }
      }
    }
  }
}

TEST(QuantizedBackendTest, MemoryIsTheQuantizedRows) {
  EXPECT_EQ(WeightRowBytes(WeightType::kInt8, 64), 68);
  EXPECT_EQ(WeightRowBytes(WeightType::kInt4, 64), 36);
  EXPECT_EQ(WeightRowBytes(WeightType::kInt4, 5), 7);
  EXPECT_EQ(ShardBytes(Spec(WeightType::kInt8, 1000, 64)), 68000);
  EXPECT_EQ(ShardBytes(Spec(WeightType::kInt4, 1000, 64)), 36000);
  // The CPU backend charges exactly that to its memory limit.
  CpuBackendOptions o;
  o.memory_limit_bytes = 68000;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok());
  ASSERT_TRUE((*be)->CreateShard(Spec(WeightType::kInt8, 1000, 64)).ok());
  EXPECT_EQ((*be)->CreateShard(Spec(WeightType::kInt4, 1, 64)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(QuantizedBackendTest, WhatHoldsNoQuantizedRowsRefusesThem) {
  ShardSpec adagrad = Spec(WeightType::kInt8, 10, 8);
  adagrad.optimizer.type = OptimizerType::kAdagrad;
  auto cpu = Cpu("auto");
  const absl::Status a = cpu->CreateShard(adagrad).status();
  EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument) << a;
  EXPECT_THAT(std::string(a.message()), HasSubstr("INT8 rows are for serving"));

  ShardSpec dynamic = Spec(WeightType::kInt4, 10, 8);
  dynamic.is_dynamic = true;
  const absl::Status d = WithDynamicShards(Cpu("auto"))->CreateShard(dynamic).status();
  EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument) << d;
  EXPECT_THAT(std::string(d.message()), HasSubstr("INT4 rows take no updates"));

  ShardSpec cached = Spec(WeightType::kInt8, 10, 8);
  cached.cache_rows = 4;
  KeyValueOptions kv;
  kv.dir = ::testing::TempDir();
  const absl::Status k = WithKeyValueShards(Cpu("auto"), kv)->CreateShard(cached).status();
  EXPECT_EQ(k.code(), absl::StatusCode::kInvalidArgument) << k;
  EXPECT_THAT(std::string(k.message()), HasSubstr("INT8 tables are held in memory"));

  const absl::Status c =
      CreateEmulatedCudaBackend(EmulatedCudaOptions())->CreateShard(Spec(WeightType::kInt8, 10, 8))
          .status();
  EXPECT_EQ(c.code(), absl::StatusCode::kUnimplemented) << c;
  EXPECT_THAT(std::string(c.message()), HasSubstr("served by CPU workers"));
}

}  // namespace
}  // namespace backend
}  // namespace ember
