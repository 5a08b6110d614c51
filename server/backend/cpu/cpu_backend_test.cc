// The CPU backend's concurrency (concurrency_checks.h): creating a large
// shard does not stall the calls on the shards held, and concurrent calls
// give what serial ones give. Validation of output strides; the lookups'
// prefetch distance; updates split among threads.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "math/half.h"
#include "server/backend/concurrency_checks.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_kernels.h"
#include "server/backend/forwarding_backend.h"

namespace ember {
namespace backend {
namespace {

// Strided outputs against packed ones are the parity suite's
// (StridedOutputsMatchPackedOnes, every backend). Here: validation refuses a
// stride unless the backend says it writes strided rows.
TEST(CpuBackendTest, ValidationRefusesAStrideUnlessTheBackendWritesThem) {
  // Backends that write packed rows only refuse a stride.
  const ShardSpec spec{"t", 4, 4};
  std::vector<float> out(8);
  const std::vector<int64_t> lengths = {1, 1}, ids = {0, 3};
  LookupRequest r{FeatureRequest{1, Pooling::kSum, lengths, ids, {}}, absl::MakeSpan(out)};
  r.output_stride = 4;
  auto find = [&](ShardId) { return &spec; };
  EXPECT_TRUE(ValidateRequests(absl::MakeConstSpan(&r, 1), find, Checks::kAll, true).ok());
  const absl::Status s = ValidateRequests(absl::MakeConstSpan(&r, 1), find);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), testing::HasSubstr("packed outputs"));
  // Outputs in device memory are packed, whatever the backend.
  r.output_on_device = true;
  const absl::Status d = ValidateRequests(absl::MakeConstSpan(&r, 1), find, Checks::kAll,
                                          /*strided_outputs=*/true, /*device_memory=*/true);
  EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.message(), testing::HasSubstr("outputs on the device are packed"));
}

// Device outputs are a CUDA backend's: the CPU backend refuses them.
TEST(CpuBackendTest, OutputsOnTheDeviceAreRefused) {
  auto be = CreateCpuBackend(CpuBackendOptions());
  ASSERT_TRUE(be.ok()) << be.status();
  EXPECT_EQ((*be)->OutputMemory(), EmbeddingBackend::Memory::kHost);
  ShardSpec spec;
  spec.table = "t";
  spec.rows = 4;
  spec.dim = 4;
  spec.table_rows = 4;
  auto id = (*be)->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<int64_t> lengths = {1}, ids = {2};
  std::vector<float> out(4, -1.0f);
  LookupRequest r{FeatureRequest{*id, Pooling::kSum, lengths, ids, {}}, absl::MakeSpan(out)};
  r.output_on_device = true;
  const absl::Status s = (*be)->Lookup({r});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(out, std::vector<float>(4, -1.0f));
}

// fused_uvm shards (rows in host memory a GPU maps) are a CUDA backend's:
// the CPU backend refuses them, allocating nothing.
TEST(CpuBackendTest, MappedShardsAreRefused) {
  CpuBackendOptions o;
  o.memory_limit_bytes = 1 << 20;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok()) << be.status();
  EXPECT_FALSE((*be)->MapsHostMemory());
  EXPECT_EQ((*be)->AvailableMappedBytes(), 0);
  ShardSpec spec;
  spec.table = "t";
  spec.rows = 4;
  spec.dim = 4;
  spec.table_rows = 4;
  spec.host_mapped = true;
  auto id = (*be)->CreateShard(spec);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  EXPECT_THAT(id.status().message(), testing::HasSubstr("fused_uvm kernel"));
  EXPECT_THAT(id.status().message(), testing::HasSubstr("needs a CUDA worker"));
  EXPECT_EQ((*be)->AvailableBytes(), 1 << 20);
}

// The lookups' prefetch by style, row bytes and shard size, as cpu_backend.h
// states it (worked out by hand); bad distances and styles are refused.
TEST(CpuBackendTest, PrefetchByRow) {
  const int64_t mib = int64_t{1} << 20;
  // (outer, l1, 1 if every line goes into L1 else 0)
  using P = std::tuple<int, int, int>;
  const auto of = [](const PrefetchAhead& p) { return P(p.outer, p.l1, p.outer_into_l1 ? 1 : 0); };
  // A shard read alone (the call's bytes are its own).
  auto ahead = [&](PrefetchStyle style, int64_t row_bytes, int64_t rows) {
    return of(LookupPrefetchFor(style, row_bytes, rows, row_bytes * rows));
  };
  const PrefetchStyle two = PrefetchStyle::kTwoStage, outer = PrefetchStyle::kOuterOnly,
                      l1 = PrefetchStyle::kIntoL1;
  EXPECT_EQ(ahead(two, 64, 4 * mib / 64), P(24, 12, 0));  // 4 MiB: in the caches
  EXPECT_EQ(ahead(two, 64, 4 * mib / 64 + 1), P(64, 16, 0));
  EXPECT_EQ(ahead(two, 512, 6 * mib / 512), P(24, 12, 0));  // not outer: no L1 rule
  EXPECT_EQ(ahead(two, 128, 1000000), P(64, 16, 0));
  EXPECT_EQ(ahead(two, 129, 1000000), P(32, 16, 0));
  EXPECT_EQ(ahead(two, 256, 1000000), P(32, 16, 0));
  EXPECT_EQ(ahead(two, 257, 1000000), P(24, 12, 0));
  EXPECT_EQ(ahead(two, 1024, 1000000), P(24, 12, 0));
  // outer: up to 6 MiB of rows up to 512 bytes, every line 16 ahead into L1;
  // else up to 4 MiB 24 ahead; else 64.
  EXPECT_EQ(ahead(outer, 64, 4 * mib / 64), P(16, 0, 1));
  EXPECT_EQ(ahead(outer, 512, 6 * mib / 512), P(16, 0, 1));
  EXPECT_EQ(ahead(outer, 512, 6 * mib / 512 + 1), P(64, 0, 0));
  EXPECT_EQ(ahead(outer, 64, 6 * mib / 64 + 1), P(64, 0, 0));
  EXPECT_EQ(ahead(outer, 516, 4 * mib / 516), P(24, 0, 0));
  EXPECT_EQ(ahead(outer, 1024, 4 * mib / 1024), P(24, 0, 0));
  EXPECT_EQ(ahead(outer, 1024, 4 * mib / 1024 + 1), P(64, 0, 0));
  EXPECT_EQ(ahead(outer, 1024, 1000000), P(64, 0, 0));
  // A small shard in a call that reads more than 6 MiB in all: the rules
  // without the L1 one.
  EXPECT_EQ(of(LookupPrefetchFor(outer, 64, 4 * mib / 64, 6 * mib)), P(16, 0, 1));
  EXPECT_EQ(of(LookupPrefetchFor(outer, 64, 4 * mib / 64, 6 * mib + 1)), P(24, 0, 0));
  EXPECT_EQ(of(LookupPrefetchFor(outer, 64, 5 * mib / 64, 64 * mib)), P(64, 0, 0));
  EXPECT_EQ(ahead(l1, 64, 1000000), P(16, 0, 1));  // l1: 16 ahead, any shard
  EXPECT_EQ(ahead(l1, 1024, 10), P(16, 0, 1));
  EXPECT_EQ(of(FixedPrefetch(two, 40)), P(40, 16, 0));
  EXPECT_EQ(of(FixedPrefetch(outer, 40)), P(40, 0, 0));
  EXPECT_EQ(of(FixedPrefetch(l1, 40)), P(40, 0, 1));
  EXPECT_EQ(FixedPrefetch(two, 10).l1, 5);
  // What a shard gets under the options: the rule by row, or the fixed distance.
  EXPECT_EQ(of(ShardLookupPrefetch(CpuBackendOptions::kPrefetchByRow, two, 129, 1000000,
                                   129 * 1000000)),
            P(32, 16, 0));
  EXPECT_EQ(of(ShardLookupPrefetch(40, two, 129, 1000000, 129 * 1000000)), P(40, 16, 0));
  EXPECT_EQ(of(ShardLookupPrefetch(CpuBackendOptions::kPrefetchByRow, outer, 64, 1000, 64000)),
            P(16, 0, 1));
  EXPECT_EQ(of(ShardLookupPrefetch(40, outer, 64, 1000, 64000)), P(40, 0, 0));

  EXPECT_EQ(*ParsePrefetchStyle("outer"), outer);
  EXPECT_EQ(*ParsePrefetchStyle("two_stage"), two);
  EXPECT_EQ(*ParsePrefetchStyle("l1"), l1);
  EXPECT_EQ(*ParsePrefetchStyle("auto"), DefaultPrefetchStyle());
  EXPECT_EQ(CpuIsIntel(), __builtin_cpu_is("intel") != 0);  // the compiler's own CPUID reading
  EXPECT_EQ(DefaultPrefetchStyle(), CpuIsIntel() ? outer : two);
  EXPECT_EQ(ParsePrefetchStyle("l2").status().code(), absl::StatusCode::kInvalidArgument);

  CpuBackendOptions o;
  EXPECT_EQ(o.prefetch_distance, CpuBackendOptions::kPrefetchByRow);
  EXPECT_EQ(o.prefetch_style, "auto");
  EXPECT_TRUE(CreateCpuBackend(o).ok());
  o.prefetch_style = "fast";
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.prefetch_style = "auto";
  o.prefetch_distance = -2;
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.prefetch_distance = 0;
  o.update_prefetch_distance = -1;
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Shards past 6 MiB with narrow rows (the long distances) give the same
// bits as without prefetching, in every style, bags long and short, to the
// last id. (A prefetch cannot change a result: what this guards is that
// prefetching ahead never reads ids past the request's, which shows as a
// crash here or under the sanitizers.)
TEST(CpuBackendTest, LongPrefetchDistancesChangeNoResult) {
  std::mt19937 rng(3);
  for (int dim : {16, 32, 64}) {
    for (WeightType wt : {WeightType::kFp32, WeightType::kFp16}) {
      ShardSpec spec;
      spec.table = "t";
      spec.dim = dim;
      spec.rows = (int64_t{7} << 20) / (dim * (wt == WeightType::kFp32 ? 4 : 2));
      spec.table_rows = spec.rows;
      spec.weight_type = wt;
      std::vector<int64_t> lengths, ids;
      for (int b = 0; b < 200; ++b) {
        lengths.push_back(b % 7 == 0 ? 0 : 1 + rng() % 60);
        for (int64_t k = 0; k < lengths.back(); ++k) ids.push_back(rng() % spec.rows);
      }
      // No prefetch (the reference), then each style's own choice.
      const struct {
        const char* style;
        int distance;
      } runs[] = {{"outer", 0},
                  {"two_stage", CpuBackendOptions::kPrefetchByRow},
                  {"outer", CpuBackendOptions::kPrefetchByRow},
                  {"l1", CpuBackendOptions::kPrefetchByRow}};
      std::vector<float> out[4];
      int k = 0;
      for (const auto& run : runs) {
        CpuBackendOptions o;
        o.prefetch_style = run.style;
        o.prefetch_distance = run.distance;
        auto be = CreateCpuBackend(o);
        ASSERT_TRUE(be.ok());
        auto id = (*be)->CreateShard(spec);
        ASSERT_TRUE(id.ok()) << id.status();
        std::vector<float>& got = out[k++];
        got.assign(lengths.size() * dim, -1.0f);
        FeatureRequest f{*id, Pooling::kSum, lengths, ids, {}};
        ASSERT_TRUE((*be)->Lookup({LookupRequest{f, absl::MakeSpan(got)}}).ok());
      }
      EXPECT_EQ(out[0], out[1]) << "two-stage, dim " << dim << " type " << static_cast<int>(wt);
      EXPECT_EQ(out[0], out[2]) << "outer, dim " << dim << " type " << static_cast<int>(wt);
      EXPECT_EQ(out[0], out[3]) << "l1, dim " << dim << " type " << static_cast<int>(wt);
      EXPECT_GT(std::count_if(out[0].begin(), out[0].end(), [](float v) { return v != 0; }),
                static_cast<long>(out[0].size() / 2));  // initialised rows, not zeros
    }
  }
}

// The update's rows run in a copy compiled for the row kernels' ISA
// (baseline, AVX2, AVX-512; UpdateRowsFor): every optimizer and decay mode,
// on each weight type, ends with the same bits on every ISA the CPU has.
// Ids are distinct within a call, so no duplicate rows are merged (that
// merge is the ISA's own kernel, fused on AVX2 and AVX-512).
TEST(CpuBackendTest, UpdatesGiveTheSameBitsOnEveryIsa) {
  struct Config {
    OptimizerType type;
    WeightDecayMode mode;
    float decay;
  };
  const Config configs[] = {{OptimizerType::kSgd, WeightDecayMode::kDefault, 0.0f},
                            {OptimizerType::kAdagrad, WeightDecayMode::kL2, 0.01f},
                            {OptimizerType::kAdagrad, WeightDecayMode::kDecouple, 0.01f},
                            {OptimizerType::kRowwiseAdagrad, WeightDecayMode::kDefault, 0.01f},
                            {OptimizerType::kAdam, WeightDecayMode::kDefault, 0.01f},
                            {OptimizerType::kAdam, WeightDecayMode::kL2, 0.01f}};
  std::vector<std::string> isas;
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    if (RowKernelsFor(isa).ok()) isas.push_back(isa);
  }
  for (const Config& config : configs) {
    for (WeightType wt : {WeightType::kFp32, WeightType::kFp16, WeightType::kBf16}) {
      for (int64_t dim : {int64_t{36}, int64_t{132}}) {
        ShardSpec spec;
        spec.table = "t";
        spec.rows = 64;
        spec.dim = dim;
        spec.table_rows = 64;
        spec.weight_type = wt;
        spec.optimizer.type = config.type;
        spec.optimizer.learning_rate = 0.05f;
        spec.optimizer.eps = 1e-6f;
        spec.optimizer.weight_decay = config.decay;
        spec.optimizer.weight_decay_mode = config.mode;
        spec.initializer.seed = 5;
        std::vector<float> first_w, first_state;
        for (const std::string& isa : isas) {
          CpuBackendOptions o;
          o.isa = isa;
          auto be = CreateCpuBackend(o);
          ASSERT_TRUE(be.ok()) << be.status();
          auto id = (*be)->CreateShard(spec);
          ASSERT_TRUE(id.ok()) << id.status();
          std::mt19937 rng(9);
          for (int step = 0; step < 3; ++step) {
            std::vector<int64_t> rows(spec.rows);
            for (int64_t r = 0; r < spec.rows; ++r) rows[r] = r;
            std::shuffle(rows.begin(), rows.end(), rng);
            rows.resize(40);  // distinct ids, one a bag
            const std::vector<int64_t> lengths(rows.size(), 1);
            std::vector<float> grad(rows.size() * dim);
            for (float& g : grad) g = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
            const FeatureRequest f{*id, Pooling::kSum, lengths, rows, {}};
            ASSERT_TRUE((*be)->ApplyGradients({GradientRequest{f, grad}}).ok());
          }
          std::vector<float> w(spec.rows * dim);
          std::vector<float> state(spec.rows * OptimizerStateWidth(config.type, dim));
          ASSERT_TRUE((*be)->ExportRows(*id, 0, spec.rows, absl::MakeSpan(w),
                                        absl::MakeSpan(state))
                          .ok());
          if (first_w.empty()) {
            first_w = w;
            first_state = state;
            continue;
          }
          for (size_t i = 0; i < w.size(); ++i) {
            ASSERT_EQ(FloatBits(first_w[i]), FloatBits(w[i]))
                << isa << " against " << isas[0] << ", optimizer "
                << static_cast<int>(config.type) << " type " << static_cast<int>(wt) << " dim "
                << dim << " weight " << i;
          }
          for (size_t i = 0; i < state.size(); ++i) {
            ASSERT_EQ(FloatBits(first_state[i]), FloatBits(state[i])) << isa << " state " << i;
          }
        }
      }
    }
  }
}

// Large updates are split among the threads by row (each thread gathers,
// sorts, merges and updates the rows it owns): every thread count gives the
// bits of one thread's update, whose rows are merged in (request,
// position) order by one sort. Three calls of three requests on one shard
// (weighted SUM, MEAN, NONE; hot rows and cold ones, 30,000 ids: past the
// split's threshold at every thread count here) and a small request on a
// second shard in the same call, then a call whose ids are all one row (one
// part gets them all, the others none), for each weight type and a
// stateless, a row-wise and a per-element optimizer.
TEST(CpuBackendTest, UpdatesSplitAmongThreadsGiveOneThreadsBits) {
  const int64_t dim = 20, rows = 5000;
  for (WeightType wt : {WeightType::kFp32, WeightType::kFp16, WeightType::kBf16}) {
    for (OptimizerType type :
         {OptimizerType::kSgd, OptimizerType::kRowwiseAdagrad, OptimizerType::kAdam}) {
      ShardSpec spec;
      spec.table = "t";
      spec.rows = rows;
      spec.dim = dim;
      spec.table_rows = rows;
      spec.weight_type = wt;
      spec.optimizer.type = type;
      spec.optimizer.learning_rate = 0.05f;
      spec.optimizer.eps = 1e-6f;
      spec.initializer.seed = 11;
      ShardSpec small = spec;
      small.table = "small";
      small.rows = small.table_rows = 100;
      std::vector<uint32_t> first;  // the bits of one thread's weights and state
      for (int threads : {1, 2, 3, 4}) {
        CpuBackendOptions o;
        o.num_threads = threads;
        auto be = CreateCpuBackend(o);
        ASSERT_TRUE(be.ok()) << be.status();
        auto id = (*be)->CreateShard(spec);
        auto small_id = (*be)->CreateShard(small);
        ASSERT_TRUE(id.ok() && small_id.ok());
        std::mt19937 rng(21);
        auto row = [&] {
          return rng() % 2 == 0 ? static_cast<int64_t>(rng() % 8)  // hot
                                : static_cast<int64_t>(rng() % rows);
        };
        auto grads = [&](size_t n) {
          std::vector<float> g(n * dim);
          for (float& x : g) x = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
          return g;
        };
        for (int step = 0; step < 4; ++step) {
          const bool one_row = step == 3;
          std::vector<int64_t> ids_sum(12000), ids_mean(12000), ids_none(6000), ids_small(50);
          for (auto* ids : {&ids_sum, &ids_mean, &ids_none}) {
            for (int64_t& i : *ids) i = one_row ? 4321 : row();
          }
          for (int64_t& i : ids_small) i = static_cast<int64_t>(rng() % 100);
          const std::vector<int64_t> lengths_sum(600, 20), lengths_mean(1000, 12),
              lengths_small(5, 10), none_lengths(ids_none.size(), 1);
          std::vector<float> weights(ids_sum.size());
          for (float& w : weights) w = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
          const std::vector<float> g_sum = grads(600), g_mean = grads(1000),
                                   g_none = grads(ids_none.size()), g_small = grads(5);
          const std::vector<GradientRequest> call = {
              {FeatureRequest{*id, Pooling::kSum, lengths_sum, ids_sum, weights}, g_sum},
              {FeatureRequest{*small_id, Pooling::kSum, lengths_small, ids_small, {}}, g_small},
              {FeatureRequest{*id, Pooling::kMean, lengths_mean, ids_mean, {}}, g_mean},
              {FeatureRequest{*id, Pooling::kNone, none_lengths, ids_none, {}}, g_none}};
          ASSERT_TRUE((*be)->ApplyGradients(call).ok());
        }
        std::vector<uint32_t> bits;
        for (const auto& [shard, n] : {std::pair{*id, rows}, std::pair{*small_id, int64_t{100}}}) {
          std::vector<float> w(n * dim), state(n * OptimizerStateWidth(type, dim));
          ASSERT_TRUE(
              (*be)->ExportRows(shard, 0, n, absl::MakeSpan(w), absl::MakeSpan(state)).ok());
          for (const std::vector<float>* v : {&w, &state}) {
            for (float x : *v) bits.push_back(FloatBits(x));
          }
        }
        if (first.empty()) {
          first = bits;
          continue;
        }
        ASSERT_EQ(bits.size(), first.size());
        for (size_t i = 0; i < bits.size(); ++i) {
          ASSERT_EQ(bits[i], first[i]) << threads << " threads against 1, weight type "
                                       << static_cast<int>(wt) << " optimizer "
                                       << static_cast<int>(type) << " float " << i;
        }
      }
    }
  }
}

// A shard's initial weights are InitialValue's for its global rows and
// columns (rounded to nearest for fp16 / bf16: half.h), with the rows
// split among the creation's threads and cut in blocks of 256 (3,001 rows
// of 64 columns: two threads where the machine has them, a last block of
// a few rows), and its Adagrad accumulators the configured value.
TEST(CpuBackendTest, CreatedShardsHoldTheInitialValues) {
  for (WeightType wt : {WeightType::kFp32, WeightType::kFp16, WeightType::kBf16}) {
    ShardSpec spec;
    spec.table = "t";
    spec.rows = 3001;
    spec.dim = 64;
    spec.row_offset = 17;
    spec.col_offset = 32;
    spec.table_rows = 5000;
    spec.weight_type = wt;
    spec.optimizer.type = OptimizerType::kAdagrad;
    spec.optimizer.initial_accumulator_value = 0.125f;
    spec.initializer.type = InitializerType::kNormal;
    spec.initializer.mean = 0.5f;
    spec.initializer.std = 0.25f;
    spec.initializer.seed = 99;
    auto be = CreateCpuBackend(CpuBackendOptions{});
    ASSERT_TRUE(be.ok()) << be.status();
    auto id = (*be)->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    std::vector<float> w(spec.rows * spec.dim), state(spec.rows * spec.dim);
    ASSERT_TRUE(
        (*be)->ExportRows(*id, 0, spec.rows, absl::MakeSpan(w), absl::MakeSpan(state)).ok());
    for (int64_t r = 0; r < spec.rows; ++r) {
      for (int64_t c = 0; c < spec.dim; ++c) {
        float want = InitialValue(spec.initializer, spec.table_rows, spec.row_offset + r,
                                  spec.col_offset + c);
        if (wt == WeightType::kFp16) want = Fp16ToFloat(FloatToFp16(want));
        if (wt == WeightType::kBf16) want = Bf16ToFloat(FloatToBf16(want));
        ASSERT_EQ(w[r * spec.dim + c], want) << "weight type " << static_cast<int>(wt) << " row "
                                             << r << " column " << c;
        ASSERT_EQ(state[r * spec.dim + c], 0.125f);
      }
    }
  }
}

// Ids another thread rewrites during lookups (as a client may in a shared
// region a worker reads in place): every lookup either succeeds or is
// refused with INVALID_ARGUMENT, and none reads outside the shard. The bad
// value is far past the table, so a read of it would fault. Bounded to
// 300 ms of rewriting.
TEST(CpuBackendTest, IdsRewrittenDuringALookupAreNeverReadOutsideTheShard) {
  CpuBackendOptions o;
  o.num_threads = 2;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok()) << be.status();
  const int64_t rows = 1000, dim = 64, bags = 512, pooling = 20;
  auto shard = (*be)->CreateShard(ShardSpec{"t", rows, dim, 0, 0, rows});
  ASSERT_TRUE(shard.ok()) << shard.status();
  std::vector<int64_t> lengths(bags, pooling), ids(bags * pooling);
  std::mt19937_64 rng(7);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % rows);
  std::vector<float> out(bags * dim), want(bags * dim);
  const LookupRequest r{FeatureRequest{*shard, Pooling::kSum, lengths, ids, {}},
                        absl::MakeSpan(out)};
  const LookupRequest ref{FeatureRequest{*shard, Pooling::kSum, lengths, ids, {}},
                          absl::MakeSpan(want)};
  ASSERT_TRUE((*be)->Lookup({ref}).ok());

  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937_64 wrng(8);
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    while (std::chrono::steady_clock::now() < end) {
      const size_t k = wrng() % ids.size();
      const int64_t kept = ids[k];
      __atomic_store_n(&ids[k], int64_t{1} << 40, __ATOMIC_RELAXED);
      for (int spin = 0; spin < 200; ++spin) std::atomic_signal_fence(std::memory_order_seq_cst);
      __atomic_store_n(&ids[k], kept, __ATOMIC_RELAXED);
    }
    stop = true;
  });
  int ok = 0, refused = 0, other = 0;
  while (!stop) {
    const absl::Status st = (*be)->Lookup({r});
    if (st.ok()) {
      ++ok;
    } else if (st.code() == absl::StatusCode::kInvalidArgument) {
      ++refused;
    } else {
      ++other;
      ADD_FAILURE() << st;
    }
  }
  writer.join();
  EXPECT_EQ(other, 0);
  // The bad id is in place about half the time and a lookup takes far
  // longer than one rewrite: some lookups met it, and were refused.
  EXPECT_GT(refused, 0);
  // The ids as they were: the rows as the first lookup gave them.
  ASSERT_TRUE((*be)->Lookup({r}).ok());
  EXPECT_EQ(out, want);
  std::printf("%d lookups succeeded, %d refused while ids were rewritten\n", ok, refused);
}

TEST(CpuBackendTest, CreatingALargeShardDoesNotStallCallsOnOthers) {
  CpuBackendOptions o;
  o.num_threads = 2;
  o.memory_limit_bytes = int64_t{2} << 30;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok()) << be.status();
  ExpectCreationDoesNotStallCalls(be->get());
}

TEST(CpuBackendTest, ConcurrentCallsMatchSerialOnes) {
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    ExpectConcurrentCallsMatchSerial([threads]() -> std::unique_ptr<EmbeddingBackend> {
      CpuBackendOptions o;
      o.num_threads = threads;
      auto be = CreateCpuBackend(o);
      if (!be.ok()) return nullptr;
      return std::move(*be);
    });
  }
}

// The defect the check exists for: a backend that stages every lookup's
// output in one buffer shared by all calls (as a CUDA backend would that
// reused its staging before the previous call had copied its outputs out).
class SharedStagingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    std::vector<LookupRequest> staged(requests.begin(), requests.end());
    size_t at = 0;
    for (LookupRequest& r : staged) {
      r.output = absl::MakeSpan(staging_).subspan(at, r.output.size());
      at += r.output.size();
    }
    if (absl::Status s = ForwardingBackend::Lookup(staged); !s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the download
    for (size_t i = 0; i < staged.size(); ++i) {
      std::memcpy(requests[i].output.data(), staged[i].output.data(),
                  staged[i].output.size() * sizeof(float));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<float> staging_ = std::vector<float>(1 << 20);
};

TEST(CpuBackendTest, ConcurrencyCheckCatchesASharedStagingBuffer) {
  testing::TestPartResultArray failures;
  {
    testing::ScopedFakeTestPartResultReporter reporter(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ALL_THREADS, &failures);
    ExpectConcurrentCallsMatchSerial([]() -> std::unique_ptr<EmbeddingBackend> {
      auto be = CreateCpuBackend({});
      if (!be.ok()) return nullptr;
      return std::make_unique<SharedStagingBackend>(std::move(*be));
    });
  }
  ASSERT_GT(failures.size(), 0);
  EXPECT_THAT(std::string(failures.GetTestPartResult(0).message()),
              testing::HasSubstr("output"));
}

}  // namespace
}  // namespace backend
}  // namespace ember
