#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "math/embedding_math.h"
#include "math/hit_rate_curve.h"
#include "math/key_index.h"
#include "math/rowwise_quant.h"

namespace ember {
namespace planner {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// Milliseconds to move `bytes` at `gbps` GB/s.
double TransferMs(double bytes, double gbps) {
  if (bytes <= 0) return 0;
  return bytes / (gbps * 1e6);
}

// Milliseconds per byte gathered from the kernel's memory tier, at
// `hit_rate` for the kernels that cache.
double MsPerByte(const CostModel& m, ComputeKernel kernel,
                 ember::v1::ComputeDevice device, double hit_rate) {
  // key_value: hits from the cache (host memory, or HBM on a GPU), misses
  // from the SSD.
  const double ssd = m.ssd_bw_gbps * 1e6;
  if (device == ember::v1::CPU) {
    double bw = m.ddr_bw_gbps * m.lookup_efficiency;
    if (kernel == ComputeKernel::kDense) bw *= m.dense_kernel_factor;
    if (kernel == ComputeKernel::kKeyValue) {
      return hit_rate / (bw * 1e6) + (1.0 - hit_rate) / ssd;
    }
    return 1.0 / (bw * 1e6);
  }
  const double hbm = m.hbm_bw_gbps * m.lookup_efficiency * 1e6;
  const double uvm = m.pcie_bw_gbps * m.uvm_efficiency * 1e6;
  switch (kernel) {
    case ComputeKernel::kDense:
      return 1.0 / (hbm * m.dense_kernel_factor);
    case ComputeKernel::kFused:
      return 1.0 / hbm;
    case ComputeKernel::kFusedUvm:
      return 1.0 / uvm;
    case ComputeKernel::kFusedUvmCaching:
      // Hits are served from HBM, misses through UVM.
      return hit_rate / hbm + (1.0 - hit_rate) / uvm;
    case ComputeKernel::kKeyValue:
      return hit_rate / hbm + (1.0 - hit_rate) / ssd;
  }
  return 1.0 / hbm;
}

// The fraction of a shard's rows its cache holds: cache_load_factor, but at
// least kKeyValueMinCacheRows rows (the worker's floor,
// server/backend/table_spec.h), at most all.
double CacheFraction(const TableWorkload& w, int64_t rows) {
  if (rows <= 0) return w.cache_load_factor;
  return std::min(1.0, std::max(w.cache_load_factor,
                                static_cast<double>(backend::math::kKeyValueMinCacheRows) /
                                    static_cast<double>(rows)));
}

// The hit rate a cached shard's reads are priced at: its table's learned
// curve at the shard's cache fraction where there is one, else
// cache_load_factor (TorchRec's stand-in).
double HitRate(const TableWorkload& w, int64_t rows) {
  if (w.hit_rate_curve.size() != backend::math::kLruCurveFractions.size()) {
    return w.cache_load_factor;
  }
  return backend::math::HitRateAt(w.hit_rate_curve.data(), CacheFraction(w, rows));
}

double NarrowRowPenalty(const CostModel& m, int64_t cols) {
  if (!m.narrow_row_penalty) return 1.0;
  if (cols < 64) return 1.75;
  if (cols < 128) return 1.15;
  return 1.0;
}

}  // namespace

CostModel DefaultCostModel(ember::v1::ComputeDevice device) {
  CostModel m;
  if (device == ember::v1::CPU) {
    m.hbm_cap_bytes = 0;
    m.ddr_cap_bytes = 128 * kGiB;
    m.hbm_bw_gbps = 0;
    m.ddr_bw_gbps = 100;
    m.pcie_bw_gbps = 0;
    m.network_bw_gbps = 12.5;
    m.lookup_efficiency = 0.5;
    // The CPU backend serves data_parallel replicas with the same fused
    // kernels as every other shard (TorchRec's 0.5 is for GPU `dense`).
    m.dense_kernel_factor = 1.0;
    m.bwd_compute_multiplier = 2.0;
    m.access_granularity_bytes = 64;
    m.narrow_row_penalty = false;
  } else {
    m.hbm_cap_bytes = 80 * kGiB;
    m.ddr_cap_bytes = 128 * kGiB;
    m.hbm_bw_gbps = 3350;
    m.ddr_bw_gbps = 100;
    m.pcie_bw_gbps = 64;
    m.network_bw_gbps = 50;
    m.lookup_efficiency = 0.65;
    m.bwd_compute_multiplier = 2.5;
    m.access_granularity_bytes = 32;
    m.narrow_row_penalty = true;
  }
  return m;
}

int DataTypeBytes(ember::v1::DataType type) {
  switch (type) {
    case ember::v1::FP16:
    case ember::v1::BF16:
      return 2;
    case ember::v1::INT8:
    case ember::v1::INT4:
      return 1;
    default:
      return 4;
  }
}

int QuantBitsOf(ember::v1::DataType type) {
  return type == ember::v1::INT8 ? 8 : type == ember::v1::INT4 ? 4 : 0;
}

int64_t WeightRowBytes(const TableWorkload& w, int64_t cols) {
  return w.quant_bits > 0 ? backend::math::QuantizedRowBytes(w.quant_bits, cols)
                          : cols * w.dtype_bytes;
}

int64_t OptimizerStateBytesPerRow(ember::v1::OptimizerSpec::Type optimizer,
                                  int64_t cols) {
  backend::math::StepOptimizer step = backend::math::kStepSgd;
  switch (optimizer) {
    case ember::v1::OptimizerSpec::ADAGRAD:
      step = backend::math::kStepAdagrad;
      break;
    case ember::v1::OptimizerSpec::ROWWISE_ADAGRAD:
      step = backend::math::kStepRowwiseAdagrad;
      break;
    case ember::v1::OptimizerSpec::ADAM:
      step = backend::math::kStepAdam;
      break;
    default:
      break;
  }
  return 4 * backend::math::StateFloatsPerRow(step, cols);
}

double ExpectedDistinctRows(double rows, double ids) {
  if (rows <= 0 || ids <= 0) return 0;
  return -rows * std::expm1(-ids / rows);
}

ShardCost EstimateShard(const CostModel& m, const TableWorkload& w,
                        ShardingType type, ComputeKernel kernel,
                        ember::v1::ComputeDevice device,
                        const ShardBlock& block, int64_t table_rows,
                        int world_size) {
  ShardCost c;
  const int64_t cols = block.cols;
  const bool replicated = type == ShardingType::kDataParallel;
  const bool row_split =
      type == ShardingType::kRowWise || type == ShardingType::kTableRowWise;

  // Share of the table's ids that reach this shard: all of them for whole-row
  // shards, rows/table_rows for row-wise (ids assumed uniform over rows), and
  // 1/W of the lookups for a replica (gradients still reach every replica).
  double row_share = 1.0;
  if (row_split) {
    row_share = table_rows > 0 ? static_cast<double>(block.rows) / table_rows
                               : 0.0;
  }
  const double fwd_share = replicated ? row_share / world_size : row_share;
  const double fwd_ids = w.ids * fwd_share;
  const double bwd_ids = w.ids * row_share;

  // Output rows: one per id for sequences (the worker returns the rows of
  // the ids it got); for pooled tables one per bag of the request, on every
  // shard, row-wise ones included: a row-wise shard returns a dense
  // [batch, cols] partial sum, zeros where none of a bag's ids fell in its
  // rows, and takes the gradient back in the same dense shape (client/:
  // Bucketize sends every bag's length; RunGradients slices `batch x cols`
  // gradient rows for pooled features). Measured, this is what decides
  // row-wise against table-wise (docs/lab-notes/2026-11-benchmarks.md, "The cost model
  // against the service").
  // Lookups skip a shard none of whose rows are asked for (RunLookup); an
  // update reaches every shard of the table, an empty one too, so that
  // every shard's optimizer step stays the table's (RunGradients).
  const bool empty = block.rows == 0 || cols == 0;
  const double bags_per_request = empty ? 0.0 : replicated ? w.bags / world_size : w.bags;
  const double fwd_out_rows = w.sequence ? fwd_ids : bags_per_request;
  const double bwd_out_rows = w.sequence ? bwd_ids : w.bags;

  const int g = std::max(1, m.access_granularity_bytes);
  const int64_t row_bytes =
      (WeightRowBytes(w, cols) + g - 1) / g * static_cast<int64_t>(g);
  const int64_t state_row_bytes = OptimizerStateBytesPerRow(w.optimizer, cols);
  const double ms_per_byte = MsPerByte(m, kernel, device, HitRate(w, block.rows));
  const double penalty = device == ember::v1::CUDA ? NarrowRowPenalty(m, cols) : 1.0;
  const double id_bytes = m.id_bytes + (w.weighted ? m.weight_bytes : 0);

  const double fwd_out_bytes = fwd_out_rows * cols * m.output_bytes;
  const double bwd_grad_bytes = bwd_out_rows * cols * m.output_bytes;

  c.fwd_compute_ms =
      (fwd_ids * row_bytes * penalty + fwd_out_bytes) * ms_per_byte + fwd_ids * m.per_id_ms;
  // Backward: every occurrence goes through the sort and merge (an id's
  // worth of traffic), then each distinct row touched is read and written
  // once with its optimizer state (cpu_backend.cc ApplyGradients, the CUDA
  // backend's UpdateKernel): a small table hit by many ids costs its rows,
  // not its ids.
  const double touched = ExpectedDistinctRows(static_cast<double>(block.rows), bwd_ids);
  c.bwd_compute_ms = m.bwd_compute_multiplier *
                     ((touched * (row_bytes * penalty + state_row_bytes) +
                       bwd_ids * m.id_bytes + bwd_grad_bytes) *
                          ms_per_byte +
                      bwd_ids * m.per_id_ms);
  if (!empty) c.fwd_compute_ms += m.per_shard_overhead_ms;
  // The caches: the same row reads at their rate, where that is faster.
  if (m.cache_bytes > 0 && m.cache_bw_gbps > 0 && ms_per_byte > 0) {
    const double faster = std::max(0.0, 1.0 - 1.0 / (m.cache_bw_gbps * 1e6) / ms_per_byte);
    c.fwd_cache_saving_ms = faster * fwd_ids * row_bytes * penalty * ms_per_byte;
    c.bwd_cache_saving_ms = faster * m.bwd_compute_multiplier * touched *
                            (row_bytes * penalty + state_row_bytes) * ms_per_byte;
  }
  // On the wire, per shard request: the ids it gets (with their weights),
  // one int64 length per bag of the feature whatever the shard's rows
  // (Bucketize), and the outputs back. Updates carry the same ids and
  // lengths again with the gradients (the worker keeps no state between a
  // lookup and its update).
  const double fwd_length_bytes = bags_per_request * m.id_bytes;
  const double bwd_length_bytes = w.bags * m.id_bytes;
  c.fwd_comms_ms =
      TransferMs(fwd_ids * id_bytes + fwd_length_bytes + fwd_out_bytes, m.network_bw_gbps);
  c.bwd_comms_ms =
      TransferMs(bwd_grad_bytes + bwd_ids * id_bytes + bwd_length_bytes, m.network_bw_gbps);

  // Storage.
  const int64_t weights = block.rows * WeightRowBytes(w, cols);
  const int64_t state = block.rows * state_row_bytes;
  c.resident_bytes = weights + state;
  const int64_t io = static_cast<int64_t>(
      std::ceil(std::max(fwd_ids, bwd_ids) * id_bytes +
                std::max(fwd_out_bytes, bwd_grad_bytes))) *
      m.io_buffer_copies;
  // A dynamic table's bookkeeping (dynamic-tables.md): the zero row beside
  // the rows (in whichever tier holds them), the index and each slot's
  // record on the host, and on a CUDA worker a copy of the index in HBM
  // (it finds lookup ids there) unless the rows are under a cache, whose
  // slots the index does not name (ids are then found on the host).
  int64_t zero_row = 0, index = 0, host_books = 0;
  if (w.dynamic && block.rows > 0) {
    zero_row = WeightRowBytes(w, cols) + state_row_bytes;
    index = backend::math::kKeyEntryBytes *
            static_cast<int64_t>(backend::math::KeyIndexEntries(block.rows));
    host_books = index + backend::math::kKeySlotMetaBytes * block.rows;
  }
  // key_value (server/backend/key_value/): cache_load_factor of the rows
  // with their state in memory; bookkeeping on the host of 24 bytes a
  // cached row, 8 a row and 4 a record of the file; the file holds the
  // rows and half again (KeyValueSlackRows: at least the cache's rows) as
  // records of fp32 weights and state padded to 512-byte sectors.
  // fused_uvm_caching is the same cache in HBM over the rows held whole in
  // host memory (a fused_uvm shard: a record a row, in place), as the
  // worker builds it; unlike TorchRec's, the cache holds the rows' state.
  if (kernel == ComputeKernel::kKeyValue ||
      (kernel == ComputeKernel::kFusedUvmCaching && device != ember::v1::CPU)) {
    const double clf = CacheFraction(w, block.rows);
    const int64_t cached = static_cast<int64_t>(std::ceil(clf * (weights + state)));
    const int64_t cache_rows = static_cast<int64_t>(std::ceil(clf * block.rows));
    const bool on_ssd = kernel == ComputeKernel::kKeyValue;
    const int64_t records =
        block.rows +
        (on_ssd ? backend::math::KeyValueSlackRows(block.rows, cache_rows) : 0);
    const int64_t books =
        static_cast<int64_t>(std::ceil(block.rows * (8.0 + 24.0 * clf))) + 4 * records;
    const int64_t stride = backend::math::KeyValueRecordStride(cols * 4 + state_row_bytes);
    if (!on_ssd) {
      c.ddr_bytes = books + weights + state + zero_row + host_books;
      c.hbm_bytes = cached + io;
      return c;
    }
    c.ssd_bytes = (records + (zero_row > 0 ? 1 : 0)) * stride;
    c.ddr_bytes = books + host_books + (device == ember::v1::CPU ? cached + io : 0);
    c.hbm_bytes = device == ember::v1::CPU ? 0 : cached + io;
    return c;
  }
  if (device == ember::v1::CPU) {
    c.ddr_bytes = weights + state + io + zero_row + host_books;
    return c;
  }
  c.ddr_bytes = host_books;
  switch (kernel) {
    case ComputeKernel::kDense:
    case ComputeKernel::kFused:
      c.hbm_bytes = weights + state + io + zero_row + index;
      break;
    case ComputeKernel::kFusedUvm:
      c.ddr_bytes += weights + state + zero_row;
      c.hbm_bytes = io + index;
      break;
    case ComputeKernel::kKeyValue:  // (above)
      break;
    case ComputeKernel::kFusedUvmCaching:  // (above)
      break;
  }
  return c;
}

std::vector<double> CachedFractions(const CostModel& m,
                                    const std::vector<const ShardCost*>& shards) {
  std::vector<double> fraction(shards.size(), 0.0);
  if (m.cache_bytes <= 0) return fraction;
  std::vector<int> order;
  for (int i = 0; i < static_cast<int>(shards.size()); ++i) {
    const ShardCost& s = *shards[i];
    if (s.resident_bytes > 0 && s.fwd_cache_saving_ms + s.bwd_cache_saving_ms > 0) {
      order.push_back(i);
    }
  }
  auto density = [&](int i) {
    const ShardCost& s = *shards[i];
    return (s.fwd_cache_saving_ms + s.bwd_cache_saving_ms) / static_cast<double>(s.resident_bytes);
  };
  // Hottest per byte first; ties in the shards' order, so the result does
  // not depend on the sort.
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return density(a) > density(b); });
  double left = static_cast<double>(m.cache_bytes);
  for (int i : order) {
    if (left <= 0) break;
    const double bytes = static_cast<double>(shards[i]->resident_bytes);
    fraction[i] = std::min(1.0, left / bytes);
    left -= bytes;
  }
  return fraction;
}

double FillDensest(std::vector<std::pair<double, double>> offers, double capacity) {
  std::stable_sort(offers.begin(), offers.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  double saved = 0;
  for (const auto& [density, bytes] : offers) {
    if (capacity <= 0) break;
    saved += density * std::min(bytes, capacity);
    capacity -= bytes;
  }
  return saved;
}

double CacheSavingMs(const CostModel& m, const std::vector<const ShardCost*>& shards) {
  if (m.cache_bytes <= 0) return 0;
  std::vector<std::pair<double, double>> offers;
  offers.reserve(shards.size());
  for (const ShardCost* s : shards) {
    const double saving = s->fwd_cache_saving_ms + s->bwd_cache_saving_ms;
    if (s->resident_bytes > 0 && saving > 0) {
      offers.emplace_back(saving / s->resident_bytes, static_cast<double>(s->resident_bytes));
    }
  }
  return FillDensest(std::move(offers), static_cast<double>(m.cache_bytes));
}

}  // namespace planner
}  // namespace ember
