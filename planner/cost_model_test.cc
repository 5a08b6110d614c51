#include "planner/cost_model.h"

#include <cmath>

#include "gtest/gtest.h"

namespace ember {
namespace planner {
namespace {

using ember::v1::OptimizerSpec;

// A model with round numbers so every figure can be worked by hand.
CostModel RoundModel() {
  CostModel m;
  m.hbm_bw_gbps = 1000;  // 1e9 B/ms
  m.ddr_bw_gbps = 100;
  m.pcie_bw_gbps = 50;
  m.network_bw_gbps = 10;  // 1e7 B/ms
  m.lookup_efficiency = 1.0;
  m.dense_kernel_factor = 0.5;
  m.uvm_efficiency = 0.1;
  m.bwd_compute_multiplier = 2.0;
  m.access_granularity_bytes = 32;
  m.narrow_row_penalty = false;
  m.io_buffer_copies = 1;
  return m;
}

TableWorkload Work(double ids, double bags) {
  TableWorkload w;
  w.ids = ids;
  w.bags = bags;
  w.pooling_factor = ids / bags;
  return w;
}

TEST(CostModelTest, TableWiseShardByHand) {
  const CostModel m = RoundModel();
  const TableWorkload w = Work(/*ids=*/1e6, /*bags=*/1e5);
  const ShardBlock block{0, 0, 1000, 64};
  const ShardCost c = EstimateShard(m, w, ShardingType::kTableWise,
                                    ComputeKernel::kFused, ember::v1::CUDA,
                                    block, 1000, 4);
  // Forward: 1e6 rows x 256 B gathered + 1e5 x 64 x 4 B written, at 1e9 B/ms.
  EXPECT_DOUBLE_EQ(c.fwd_compute_ms, (1e6 * 256 + 1e5 * 256) / 1e9);
  // Ids in (8 B each), one length per bag (8 B) and pooled rows out (256 B
  // each) at 1e7 B/ms.
  EXPECT_DOUBLE_EQ(c.fwd_comms_ms, (1e6 * 8 + 1e5 * 8 + 1e5 * 256) / 1e7);
  // Backward (SGD): 2 x (each of the 1000 rows, hit 1000 times over, read
  // and written once (256 B) + every id through the sort (8 B) + the
  // gradients read).
  EXPECT_DOUBLE_EQ(c.bwd_compute_ms, 2.0 * (1000 * 256 + 1e6 * 8 + 1e5 * 256) / 1e9);
  // Gradients, ids and lengths again.
  EXPECT_DOUBLE_EQ(c.bwd_comms_ms, (1e5 * 256 + 1e6 * 8 + 1e5 * 8) / 1e7);
  // Weights plus one copy of the I/O buffers, all in HBM.
  EXPECT_EQ(c.hbm_bytes, 1000 * 64 * 4 + int64_t{1000000} * 8 + 100000 * 256);
  EXPECT_EQ(c.ddr_bytes, 0);
}

// The caches: a shard's saving is its row reads at the caches' rate
// instead of memory's, forward and backward; a worker's shards fill the
// cache hottest per byte first.
TEST(CostModelTest, CacheSavingByHand) {
  CostModel m = RoundModel();
  m.cache_bytes = 100000;
  m.cache_bw_gbps = 400;  // 4e8 B/ms, 4x the DDR rate
  const TableWorkload w = Work(/*ids=*/1e5, /*bags=*/1e4);
  const ShardBlock block{0, 0, 1000, 16};  // 64 B rows, 64000 B resident
  const ShardCost c = EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused,
                                    ember::v1::CPU, block, 1000, 1);
  // Forward row reads: 1e5 x 64 B at 1e8 B/ms; from the caches at 4e8:
  // saving 3/4 of them.
  EXPECT_DOUBLE_EQ(c.fwd_cache_saving_ms, 0.75 * 1e5 * 64 / 1e8);
  // Backward: 2 x the touched rows (all 1000 of them, hit 100 times each:
  // 1000 x (1 - e^-100)) read and written, 3/4 of it saved.
  const double touched = 1000 * -std::expm1(-100.0);
  EXPECT_DOUBLE_EQ(c.bwd_cache_saving_ms, 0.75 * 2.0 * touched * 64 / 1e8);
  EXPECT_EQ(c.resident_bytes, 64000);
  // No caches in the model: no saving.
  const ShardCost none = EstimateShard(RoundModel(), w, ShardingType::kTableWise,
                                       ComputeKernel::kFused, ember::v1::CPU, block, 1000, 1);
  EXPECT_EQ(none.fwd_cache_saving_ms + none.bwd_cache_saving_ms, 0);
  EXPECT_EQ(none.fwd_compute_ms, c.fwd_compute_ms);

  // Filling: a (hot: 2 ms on 50000 B), b (cold: 1 ms on 200000 B), c (warm:
  // 1 ms on 40000 B). By density a, c, b: a whole (50000 left), c whole
  // (10000 left), then b gets 10000 / 200000.
  ShardCost a, b, d;
  a.fwd_cache_saving_ms = 1.5;
  a.bwd_cache_saving_ms = 0.5;
  a.resident_bytes = 50000;
  b.fwd_cache_saving_ms = 1;
  b.resident_bytes = 200000;
  d.bwd_cache_saving_ms = 1;
  d.resident_bytes = 40000;
  const std::vector<double> f = CachedFractions(m, {&b, &a, &d});
  ASSERT_EQ(f.size(), 3u);
  EXPECT_DOUBLE_EQ(f[0], 0.05);
  EXPECT_DOUBLE_EQ(f[1], 1.0);
  EXPECT_DOUBLE_EQ(f[2], 1.0);
  EXPECT_DOUBLE_EQ(CacheSavingMs(m, {&b, &a, &d}), 2 + 1 + 0.05);
  // Alone, each gets all of the cache: the term is not additive.
  EXPECT_DOUBLE_EQ(CacheSavingMs(m, {&b}), 0.5);
  EXPECT_GT(CacheSavingMs(m, {&a}) + CacheSavingMs(m, {&b}) + CacheSavingMs(m, {&d}),
            CacheSavingMs(m, {&b, &a, &d}));
  EXPECT_EQ(CacheSavingMs(RoundModel(), {&b, &a, &d}), 0);
}

// A cost per id is paid by every shard an id reaches: a table split into
// two column shards pays it twice for the same bytes.
TEST(CostModelTest, CostPerIdIsPaidOnEveryShardTheIdsReach) {
  CostModel m = RoundModel();
  const TableWorkload w = Work(/*ids=*/1e6, /*bags=*/1e5);
  auto shard = [&](const CostModel& model, ShardingType type, int64_t cols) {
    return EstimateShard(model, w, type, ComputeKernel::kFused, ember::v1::CUDA,
                         ShardBlock{0, 0, 1000, cols}, 1000, 2);
  };
  const ShardCost whole = shard(m, ShardingType::kTableWise, 64);
  m.per_id_ms = 1e-6;  // 1 ns per id
  const ShardCost priced = shard(m, ShardingType::kTableWise, 64);
  // Forward: + 1e6 ids x 1e-6 ms; backward: the multiplier (2) x the same.
  EXPECT_DOUBLE_EQ(priced.fwd_compute_ms, whole.fwd_compute_ms + 1.0);
  EXPECT_DOUBLE_EQ(priced.bwd_compute_ms, whole.bwd_compute_ms + 2.0);
  EXPECT_DOUBLE_EQ(priced.fwd_comms_ms, whole.fwd_comms_ms);
  // Two 32-column halves move the bytes of the whole between them, and
  // each pays for every id (and, in the backward, sorts every id's 8 B:
  // 2 x 1e6 x 8 B at 1e9 B/ms more).
  const ShardCost half = shard(m, ShardingType::kColumnWise, 32);
  EXPECT_NEAR(2 * half.fwd_compute_ms - priced.fwd_compute_ms, 1.0, 1e-9);
  EXPECT_NEAR(2 * half.bwd_compute_ms - priced.bwd_compute_ms, 2.0 + 2.0 * 1e6 * 8 / 1e9, 1e-9);
}

TEST(CostModelTest, RowWiseShardSeesItsShareOfIds) {
  const CostModel m = RoundModel();
  TableWorkload w = Work(/*ids=*/4e5, /*bags=*/1e5);  // pooling factor 4
  const ShardBlock half{0, 0, 500, 64};
  const ShardCost c = EstimateShard(m, w, ShardingType::kRowWise,
                                    ComputeKernel::kFused, ember::v1::CUDA,
                                    half, 1000, 2);
  // Half the ids, but the partial sums come back dense: one row per bag of
  // the batch (zeros where all of a bag's ids fell in the other half), and
  // every bag's length goes out.
  EXPECT_NEAR(c.fwd_compute_ms, (2e5 * 256 + 1e5 * 256) / 1e9, 1e-12);
  EXPECT_NEAR(c.fwd_comms_ms, (2e5 * 8 + 1e5 * 8 + 1e5 * 256) / 1e7, 1e-12);
  // The gradient goes back dense too, with the shard's ids and every length.
  EXPECT_NEAR(c.bwd_comms_ms, (1e5 * 256 + 2e5 * 8 + 1e5 * 8) / 1e7, 1e-12);
  // A shard without rows gets no lookups, but every update (dense, with the
  // lengths): updates keep every shard's optimizer step the table's.
  const ShardBlock empty{1000, 0, 0, 64};
  const ShardCost e = EstimateShard(m, w, ShardingType::kRowWise,
                                    ComputeKernel::kFused, ember::v1::CUDA,
                                    empty, 1000, 2);
  EXPECT_EQ(e.fwd_compute_ms + e.fwd_comms_ms, 0.0);
  EXPECT_NEAR(e.bwd_comms_ms, (1e5 * 256 + 1e5 * 8) / 1e7, 1e-12);
  EXPECT_NEAR(e.bwd_compute_ms, 2.0 * 1e5 * 256 / 1e9, 1e-12);
  // The half with rows: its 500 rows (hit 400 times each) and 2e5 ids.
  EXPECT_NEAR(c.bwd_compute_ms, 2.0 * (500 * 256 + 2e5 * 8 + 1e5 * 256) / 1e9, 1e-12);
  EXPECT_EQ(e.hbm_bytes, 100000 * 256);  // the gradient buffer
}

TEST(CostModelTest, ExpectedDistinctRowsByHand) {
  EXPECT_EQ(ExpectedDistinctRows(1000, 0), 0.0);
  EXPECT_EQ(ExpectedDistinctRows(0, 50), 0.0);
  // 1000 ids over 1e6 rows: hardly a repeat, 1e6 * (1 - e^-0.001) = 999.50017.
  EXPECT_NEAR(ExpectedDistinctRows(1e6, 1000), 999.50017, 1e-5);
  // As many ids as rows: 1 - 1/e of them, 632.12 of 1000.
  EXPECT_NEAR(ExpectedDistinctRows(1000, 1000), 632.1206, 1e-4);
  // Far more ids than rows: every row.
  EXPECT_NEAR(ExpectedDistinctRows(2500, 49152), 2500, 1e-4);
}

// A small table hit by many ids updates its rows, not its ids: at pooling
// factor 48 over 2500 rows, the backward's row traffic is that of 2500 rows.
TEST(CostModelTest, UpdatesCostTheRowsTheyTouch) {
  const CostModel m = RoundModel();
  const TableWorkload w = Work(/*ids=*/49152, /*bags=*/1024);
  const ShardBlock small{0, 0, 2500, 32}, large{0, 0, 10000000, 32};
  const ShardCost a = EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused,
                                    ember::v1::CUDA, small, 2500, 2);
  const ShardCost b = EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused,
                                    ember::v1::CUDA, large, 10000000, 2);
  const double grads = 1024 * 128;  // bytes of gradient read
  EXPECT_NEAR(a.bwd_compute_ms, 2.0 * (2500 * 128 + 49152 * 8 + grads) / 1e9, 1e-9);
  const double touched = 1e7 * -std::expm1(-49152 / 1e7);
  EXPECT_NEAR(b.bwd_compute_ms, 2.0 * (touched * 128 + 49152 * 8 + grads) / 1e9, 1e-12);
  EXPECT_LT(a.bwd_compute_ms, b.bwd_compute_ms / 5);
  // The forward gathers every id either way.
  EXPECT_DOUBLE_EQ(a.fwd_compute_ms, b.fwd_compute_ms);
}

TEST(CostModelTest, OptimizerStateBytes) {
  EXPECT_EQ(OptimizerStateBytesPerRow(OptimizerSpec::SGD, 64), 0);
  EXPECT_EQ(OptimizerStateBytesPerRow(OptimizerSpec::ADAGRAD, 64), 256);
  EXPECT_EQ(OptimizerStateBytesPerRow(OptimizerSpec::ROWWISE_ADAGRAD, 64), 4);
  EXPECT_EQ(OptimizerStateBytesPerRow(OptimizerSpec::ADAM, 64), 512);
  EXPECT_EQ(DataTypeBytes(ember::v1::FP32), 4);
  EXPECT_EQ(DataTypeBytes(ember::v1::FP16), 2);
  EXPECT_EQ(DataTypeBytes(ember::v1::BF16), 2);
  // Quantized rows: their values, then a 4-byte fp16 scale and bias.
  TableWorkload w;
  w.dtype_bytes = DataTypeBytes(ember::v1::INT8);
  w.quant_bits = QuantBitsOf(ember::v1::INT8);
  EXPECT_EQ(WeightRowBytes(w, 64), 68);
  w.quant_bits = QuantBitsOf(ember::v1::INT4);
  EXPECT_EQ(WeightRowBytes(w, 64), 36);
  EXPECT_EQ(WeightRowBytes(w, 7), 8);
  EXPECT_EQ(QuantBitsOf(ember::v1::FP16), 0);
  w.quant_bits = 0;
  w.dtype_bytes = 2;
  EXPECT_EQ(WeightRowBytes(w, 64), 128);
}

TEST(CostModelTest, StorageTiersByKernel) {
  CostModel m = RoundModel();
  TableWorkload w = Work(0, 1);  // no traffic: storage is weights + state
  w.optimizer = OptimizerSpec::ADAM;
  w.dtype_bytes = 2;
  w.cache_load_factor = 0.25;
  const ShardBlock block{0, 0, 1000, 128};
  const int64_t weights = 1000 * 128 * 2, state = 1000 * 128 * 8;
  auto est = [&](ComputeKernel k, ember::v1::ComputeDevice d) {
    return EstimateShard(m, w, ShardingType::kTableWise, k, d, block, 1000, 1);
  };
  ShardCost fused = est(ComputeKernel::kFused, ember::v1::CUDA);
  EXPECT_EQ(fused.hbm_bytes - 128 * 4, weights + state);  // + one output row
  EXPECT_EQ(fused.ddr_bytes, 0);
  ShardCost uvm = est(ComputeKernel::kFusedUvm, ember::v1::CUDA);
  EXPECT_EQ(uvm.ddr_bytes, weights + state);
  EXPECT_EQ(uvm.hbm_bytes, 128 * 4);
  // fused_uvm_caching as the worker builds it: all the rows in host memory
  // with the cache's bookkeeping (8 B a row, 24 a cached row, 4 a record:
  // one a row), and at least 65,536 rows with their state cached in HBM
  // (here all 1000).
  ShardCost cached = est(ComputeKernel::kFusedUvmCaching, ember::v1::CUDA);
  EXPECT_EQ(cached.ddr_bytes, weights + state + 1000 * (8 + 24 + 4));
  EXPECT_EQ(cached.hbm_bytes - 128 * 4, weights + state);
  const ShardBlock big{0, 0, 1000000, 128};  // past the floor: 25% cached
  ShardCost big_cached = EstimateShard(m, w, ShardingType::kTableWise,
                                       ComputeKernel::kFusedUvmCaching, ember::v1::CUDA, big,
                                       1000000, 1);
  EXPECT_EQ(big_cached.hbm_bytes - 128 * 4, (weights + state) * 1000 / 4);
  EXPECT_EQ(big_cached.ddr_bytes, (weights + state) * 1000 + 1000000 * (8 + 6 + 4));
  ShardCost cpu = est(ComputeKernel::kFused, ember::v1::CPU);
  EXPECT_EQ(cpu.hbm_bytes, 0);
  EXPECT_EQ(cpu.ddr_bytes - 128 * 4, weights + state);
}

// A dynamic table's shard also holds a zero row, its id index (16 bytes
// an entry, a power of two at least twice the rows) and 32 bytes of slot
// bookkeeping a row on the host; a CUDA worker holds a copy of the index
// in HBM beside the rows.
TEST(CostModelTest, DynamicTablesPayForTheirBookkeeping) {
  CostModel m = RoundModel();
  TableWorkload w = Work(0, 1);
  w.optimizer = OptimizerSpec::ROWWISE_ADAGRAD;
  const ShardBlock block{0, 0, 1000, 64};
  auto est = [&](bool dynamic, ember::v1::ComputeDevice d) {
    w.dynamic = dynamic;
    return EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused, d, block, 1000, 1);
  };
  const int64_t zero_row = 64 * 4 + 4, index = 16 * 2048, books = 32 * 1000;
  EXPECT_EQ(est(true, ember::v1::CPU).ddr_bytes - est(false, ember::v1::CPU).ddr_bytes,
            zero_row + index + books);
  const ShardCost gpu = est(true, ember::v1::CUDA), fixed = est(false, ember::v1::CUDA);
  EXPECT_EQ(gpu.hbm_bytes - fixed.hbm_bytes, zero_row + index);
  EXPECT_EQ(gpu.ddr_bytes, index + books);
  EXPECT_EQ(fixed.ddr_bytes, 0);
}

// A cached table whose curve was learned (CostModel::hit_rate_curves via
// TableWorkload::hit_rate_curve) has its reads priced at the curve's rate
// for its cache's fraction, linear between the curve's points and at the
// worker's floor of cached rows; without one, at cache_load_factor. The
// forward's time is its bytes times the cost of a byte, so the ratio of
// two forwards is the ratio of those costs, worked here by hand.
TEST(CostModelTest, ALearnedCurvePricesACachedTablesReads) {
  CostModel m = RoundModel();
  m.per_id_ms = 0;
  m.ssd_bw_gbps = 0.5;
  const std::vector<double> curve = {0.3, 0.4, 0.55, 0.65, 0.8, 0.85, 0.9, 0.95, 1.0};
  // ms a byte at hit rate h: hits from memory (100 GB/s), misses from SSD.
  auto per_byte = [](double h) { return h / 100e6 + (1 - h) / 0.5e6; };
  auto forward = [&](double clf, bool learned, int64_t rows) {
    TableWorkload w = Work(1e5, 1e4);
    w.cache_load_factor = clf;
    if (learned) w.hit_rate_curve = curve;
    const ShardBlock block{0, 0, rows, 64};
    return EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kKeyValue,
                         ember::v1::CPU, block, rows, 1)
        .fwd_compute_ms;
  };
  constexpr int64_t kRows = 10000000;  // the floor of 65,536 rows is under 1%
  EXPECT_NEAR(forward(0.2, true, kRows) / forward(0.2, false, kRows),
              per_byte(0.8) / per_byte(0.2), 1e-9);
  // 0.15: halfway between the points at 0.1 (0.65) and 0.2 (0.8).
  EXPECT_NEAR(forward(0.15, true, kRows) / forward(0.15, false, kRows),
              per_byte(0.725) / per_byte(0.15), 1e-9);
  // A shard of 131,072 rows caches at least 65,536 of them (half): the
  // curve's point at 0.5, whatever cache_load_factor asks.
  EXPECT_NEAR(forward(0.05, true, 131072) / forward(0.05, false, 131072),
              per_byte(0.9) / per_byte(0.05), 1e-9);
  // A table held whole in memory is not priced by a curve.
  TableWorkload w = Work(1e5, 1e4);
  const ShardBlock block{0, 0, kRows, 64};
  const double fused = EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused,
                                     ember::v1::CPU, block, kRows, 1)
                           .fwd_compute_ms;
  w.hit_rate_curve = curve;
  EXPECT_EQ(EstimateShard(m, w, ShardingType::kTableWise, ComputeKernel::kFused, ember::v1::CPU,
                          block, kRows, 1)
                .fwd_compute_ms,
            fused);
}

// Below memory the bookkeeping stays on the host; the zero row goes with
// the rows (a record more in the file, or mapped host memory), and only a
// fused_uvm shard's CUDA worker keeps the index's copy in HBM (under a
// cache the index names no cache slot: ids are found on the host).
TEST(CostModelTest, DynamicTablesBelowMemoryPayForTheirBookkeepingOnTheHost) {
  CostModel m = RoundModel();
  TableWorkload w = Work(0, 1);
  w.optimizer = OptimizerSpec::ROWWISE_ADAGRAD;
  w.cache_load_factor = 0.2;
  const ShardBlock block{0, 0, 1000000, 64};
  auto est = [&](bool dynamic, ComputeKernel k, ember::v1::ComputeDevice d) {
    w.dynamic = dynamic;
    return EstimateShard(m, w, ShardingType::kTableWise, k, d, block, 1000000, 1);
  };
  const int64_t zero_row = 64 * 4 + 4, index = 16 * (int64_t{1} << 21), books = 32 * 1000000;
  for (auto d : {ember::v1::CPU, ember::v1::CUDA}) {
    const ShardCost kv = est(true, ComputeKernel::kKeyValue, d);
    const ShardCost fixed = est(false, ComputeKernel::kKeyValue, d);
    EXPECT_EQ(kv.ddr_bytes - fixed.ddr_bytes, index + books);
    EXPECT_EQ(kv.hbm_bytes, fixed.hbm_bytes);
    EXPECT_EQ(kv.ssd_bytes - fixed.ssd_bytes, 512);  // the zero row's record
  }
  const ShardCost cached = est(true, ComputeKernel::kFusedUvmCaching, ember::v1::CUDA);
  const ShardCost cached_fixed = est(false, ComputeKernel::kFusedUvmCaching, ember::v1::CUDA);
  EXPECT_EQ(cached.ddr_bytes - cached_fixed.ddr_bytes, zero_row + index + books);
  EXPECT_EQ(cached.hbm_bytes, cached_fixed.hbm_bytes);
  const ShardCost uvm = est(true, ComputeKernel::kFusedUvm, ember::v1::CUDA);
  const ShardCost uvm_fixed = est(false, ComputeKernel::kFusedUvm, ember::v1::CUDA);
  EXPECT_EQ(uvm.ddr_bytes - uvm_fixed.ddr_bytes, zero_row + index + books);
  EXPECT_EQ(uvm.hbm_bytes - uvm_fixed.hbm_bytes, index);
}

TEST(CostModelTest, SlowerTiersCostMore) {
  const CostModel m = DefaultCostModel(ember::v1::CUDA);
  TableWorkload w = Work(1e6, 5e4);
  const ShardBlock block{0, 0, 100000, 128};
  auto total = [&](ComputeKernel k) {
    return EstimateShard(m, w, ShardingType::kTableWise, k, ember::v1::CUDA,
                         block, 100000, 8)
        .total_ms();
  };
  EXPECT_LT(total(ComputeKernel::kFused), total(ComputeKernel::kFusedUvmCaching));
  EXPECT_LT(total(ComputeKernel::kFusedUvmCaching), total(ComputeKernel::kFusedUvm));
  EXPECT_LT(total(ComputeKernel::kFused), total(ComputeKernel::kDense));
}

TEST(CostModelTest, DataParallelSpreadsLookupsButNotGradients) {
  const CostModel m = RoundModel();
  const TableWorkload w = Work(1e6, 1e5);
  const ShardBlock block{0, 0, 1000, 64};
  const ShardCost tw = EstimateShard(m, w, ShardingType::kTableWise,
                                     ComputeKernel::kFused, ember::v1::CPU,
                                     block, 1000, 4);
  const ShardCost dp = EstimateShard(m, w, ShardingType::kDataParallel,
                                     ComputeKernel::kFused, ember::v1::CPU,
                                     block, 1000, 4);
  EXPECT_NEAR(dp.fwd_comms_ms, tw.fwd_comms_ms / 4, 1e-12);
  EXPECT_NEAR(dp.bwd_comms_ms, tw.bwd_comms_ms, 1e-12);
}

}  // namespace
}  // namespace planner
}  // namespace ember
