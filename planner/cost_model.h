// Storage and cost estimation for one shard.
//
// The model is closed-form, bytes over bandwidth, like TorchRec's
// EmbeddingPerfEstimator/EmbeddingStorageEstimator, but it models Ember's own
// data flow: trainers send ids to the workers that hold a shard and receive
// pooled (or, for row-wise, partial) results back over the network or NCCL;
// gradients of those results come back the same way; the worker gathers rows
// from its memory tier and applies the table's optimizer in place.
//
// Units: bytes, milliseconds, bandwidth in GB/s (1e9 bytes per second).
// Every constant lives in CostModel; DefaultCostModel() documents where each
// default comes from.
//
// Thread-safe: pure functions.
#ifndef EMBER_PLANNER_COST_MODEL_H_
#define EMBER_PLANNER_COST_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "planner/shard_geometry.h"
#include "planner/sharding_types.h"
#include "proto/collection.pb.h"
#include "proto/plan.pb.h"

namespace ember {
namespace planner {

// Constants of the storage and cost model. One comment per field.
struct CostModel {
  // Per-worker memory before the reserved fraction, in bytes.
  int64_t hbm_cap_bytes = 0;
  int64_t ddr_cap_bytes = 0;
  // Fraction of each capacity kept free for the runtime (allocator slack,
  // CUDA context, request buffers). TorchRec reserves 15% of HBM.
  double hbm_reserved_fraction = 0.15;
  double ddr_reserved_fraction = 0.10;

  // Peak bandwidths, GB/s.
  double hbm_bw_gbps = 0;      // device memory (0 on CPU workers)
  double ddr_bw_gbps = 0;      // host memory as read by the worker's kernels
  double pcie_bw_gbps = 0;     // host <-> device, one direction (UVM reads)
  // Rows read from the key_value kernel's file on local SSD, random row
  // reads and write-backs together (an NVMe drive's 4 KiB random reads at
  // queue depth 32, ~500k IOPS: about 2 GB/s).
  double ssd_bw_gbps = 2;
  double network_bw_gbps = 0;  // per worker, trainers <-> worker (NIC/NCCL)

  // Fraction of peak memory bandwidth a forward gather reaches.
  double lookup_efficiency = 0.65;
  // The unfused `dense` kernel (data_parallel) reaches this fraction of the
  // fused kernel's bandwidth (TorchRec: 0.5).
  double dense_kernel_factor = 0.5;
  // Fraction of the PCIe bandwidth that random row reads through UVM reach
  // (TorchRec divides HBM_TO_DDR_MEM_BW by 10).
  double uvm_efficiency = 0.1;
  // Backward + optimizer time relative to a forward gather of the same bytes.
  double bwd_compute_multiplier = 2.5;
  // Rows are read in units of this many bytes (GPU sector 32, CPU line 64).
  int access_granularity_bytes = 32;
  // TorchRec's thread-block penalty for narrow rows on GPUs: x1.15 below 128
  // columns, x1.75 below 64. Off on CPU workers.
  bool narrow_row_penalty = true;
  // Fixed time per non-empty shard per step (kernel bookkeeping), ms.
  double per_shard_overhead_ms = 0.0;
  // Fixed time per step of every worker that holds a non-empty shard, ms:
  // the worker gets one lookup RPC (and one update RPC) per step however
  // many shards it holds (client/fanout.h: one call per worker).
  // Added twice to such workers' costs in the plan's statistics (forward
  // and backward time); the same for every busy worker, so it moves the
  // slowest worker's cost and no choice of the search. 0 by default; `emberctl
  // calibrate` measures how a call's fixed time splits between call and
  // shard and prints it, but keeps the whole per shard in the file it
  // writes (cli/calibrate.cc says why).
  double per_call_overhead_ms = 0.0;
  // Time per id a shard receives beyond the bytes it moves (validation,
  // the loop around each row, the sort of the backward), ms. Every column
  // shard of a table receives all of its ids, so this is what prices
  // column-wise splits above their bytes. 0 by default (bandwidth-only,
  // as TorchRec's estimators); `emberctl calibrate` fits it by timing
  // lookups on rows of two widths.
  double per_id_ms = 0.0;
  // A worker's caches (CPU: the last-level cache and the cores' own; a GPU's
  // L2), in bytes, and the bandwidth that row reads served from them reach,
  // GB/s (what a gather reaches: no efficiency is applied to it). A
  // worker's shards share its caches: the hottest rows per byte stay in
  // them (CachedFractions), and those rows' reads cost their bytes (with
  // the narrow-row penalty where it applies) / cache_bw_gbps instead of the
  // memory tier's rate. 0 bytes
  // (the default, as in TorchRec's estimators): every row is read from
  // memory. `emberctl calibrate` measures both on the workers.
  int64_t cache_bytes = 0;
  double cache_bw_gbps = 0;
  // Default fraction of rows cached in HBM by fused_uvm_caching.
  double default_cache_load_factor = 0.2;
  // Copies of each step's input/output buffers kept alive (double buffering).
  int io_buffer_copies = 2;
  // Bytes per id on the wire and in buffers (int64), per per-sample weight
  // (fp32), and per output/gradient element (fp32).
  int id_bytes = 8;
  int weight_bytes = 4;
  int output_bytes = 4;
  // Hit-rate curves learned on live workers (`emberctl calibrate`, from
  // each key_value / fused_uvm_caching shard's traffic), by table name:
  // the hit rate at each of math::kLruCurveFractions of a shard's rows. A
  // cached table (key_value, fused_uvm_caching) with a curve has its reads
  // priced at the curve's rate for its cache's fraction; one without, at
  // the fraction itself (TorchRec's assumption).
  std::map<std::string, std::vector<double>> hit_rate_curves;
};

// Defaults for a device kind:
//  CUDA: an H100 SXM 80 GB: HBM3 3.35 TB/s and 80 GB (NVIDIA H100 datasheet),
//    PCIe Gen5 x16 ~64 GB/s per direction, a 400 Gb/s ConnectX-7 NIC per GPU
//    (50 GB/s), 128 GiB of host memory per GPU worker (TorchRec's DDR_CAP).
//    Efficiencies: forward gathers reach ~65% of HBM peak and backward ~26%
//    (FBGEMM TBE measurements quoted in ../shared/research), hence the 2.5x
//    backward multiplier.
//  CPU: a server socket's DDR4/DDR5 (~100 GB/s STREAM, 0.5 efficiency for
//    random row gathers), a 100 Gb/s NIC (12.5 GB/s), 128 GiB per worker, no
//    HBM; row reads in 64-byte cache lines and no GPU block penalty; one
//    kernel for every layout (dense_kernel_factor 1). `emberctl calibrate`
//    measures the bandwidths, overhead and backward multiplier of a real
//    deployment (planner/cost_model_io.h).
CostModel DefaultCostModel(ember::v1::ComputeDevice device);

// What one table asks of the service per training step, summed over its
// features and over every trainer's batch.
struct TableWorkload {
  double ids = 0;              // ids looked up per step
  double bags = 0;             // pooled outputs per step (bags)
  double pooling_factor = 1;   // mean ids per bag (ids / bags)
  bool weighted = false;       // per-sample weights travel with the ids
  bool sequence = false;       // pooling NONE: one output row per id
  int dtype_bytes = 4;         // weight element size
  int quant_bits = 0;          // INT8 / INT4 rows (8, 4; math/rowwise_quant.h); 0: none
  ember::v1::OptimizerSpec::Type optimizer = ember::v1::OptimizerSpec::SGD;
  double cache_load_factor = 0.2;  // for fused_uvm_caching
  // The table's learned hit-rate curve (CostModel::hit_rate_curves), or
  // empty.
  std::vector<double> hit_rate_curve;
  // A dynamic (hash-keyed) table: its shards also hold a zero row, an id
  // index and each slot's bookkeeping (math/key_index.h), in host memory;
  // a CUDA worker keeps a copy of the index in HBM too.
  bool dynamic = false;
};

// Estimated time and memory of one shard, per step.
struct ShardCost {
  double fwd_compute_ms = 0;
  double fwd_comms_ms = 0;
  double bwd_compute_ms = 0;
  double bwd_comms_ms = 0;
  int64_t hbm_bytes = 0;
  int64_t ddr_bytes = 0;
  int64_t ssd_bytes = 0;  // the key_value kernel's file
  // What the compute times above would shrink by were every row this
  // shard reads served from the worker's caches (the row reads of the
  // forward gather and of the backward's read-modify-write, at the
  // caches' rate instead of the memory tier's), and the bytes those rows
  // occupy (weights and optimizer state). The worker's share of its caches
  // decides how much of it applies (CachedFractions). 0 when the model has
  // no caches.
  double fwd_cache_saving_ms = 0;
  double bwd_cache_saving_ms = 0;
  int64_t resident_bytes = 0;

  double total_ms() const {
    return fwd_compute_ms + fwd_comms_ms + bwd_compute_ms + bwd_comms_ms;
  }
};

// fp32 optimizer state bytes per row of `cols` columns, by the backends'
// own formula (math::StateFloatsPerRow): SGD 0, Adagrad 4*cols, row-wise
// Adagrad 4, Adam 8*cols (two moments).
int64_t OptimizerStateBytesPerRow(ember::v1::OptimizerSpec::Type optimizer,
                                  int64_t cols);

// Distinct rows `ids` uniform draws over `rows` rows hit on average:
// rows * (1 - exp(-ids / rows)), below min(ids, rows). An update reads and
// writes each touched row once, however many of its ids repeat it; skewed
// ids touch fewer, so for them this is an upper bound.
double ExpectedDistinctRows(double rows, double ids);

// Bytes per weight element of a data type (fp32 4, fp16/bf16 2, INT8 and
// INT4 1: their rows are QuantBitsOf's).
int DataTypeBytes(ember::v1::DataType type);
// The bits of a quantized data type's values (INT8 8, INT4 4), else 0.
int QuantBitsOf(ember::v1::DataType type);
// Bytes of a stored row of `cols` weights (a quantized row: its values,
// scale and bias).
int64_t WeightRowBytes(const TableWorkload& w, int64_t cols);

// Estimates one shard `block` of a table with `table_rows` rows placed with
// `type` and `kernel` on a `device` worker; `world_size` is the number of
// replicas for data_parallel (lookups are spread over them, gradients go to
// all). Row-wise shards see ids in proportion to their rows (uniform ids).
ShardCost EstimateShard(const CostModel& model, const TableWorkload& workload,
                        ShardingType type, ComputeKernel kernel,
                        ember::v1::ComputeDevice device,
                        const ShardBlock& block, int64_t table_rows,
                        int world_size);

// How much of each of one worker's shards sits in its caches, each in
// [0, 1]: the shards in order of cache saving per resident byte, hottest
// first, each taking as much of model.cache_bytes as is left (a hot small
// table stays cached; a large table read at random gets the rest, a hit
// rate of what is left over its size). The worker's compute is its shards'
// less sum(fraction * (fwd + bwd)_cache_saving_ms). All zeros when the
// model has no caches. Non-additive by design: shards on one worker
// compete for one cache, which a per-shard term cannot express (measured:
// docs/lab-notes/2026-11-benchmarks.md, "A cache term per worker").
std::vector<double> CachedFractions(const CostModel& model,
                                    const std::vector<const ShardCost*>& shards);

// sum(fraction * saving) over `shards` on one worker: CachedFractions'
// fill, summed (FillDensest).
double CacheSavingMs(const CostModel& model, const std::vector<const ShardCost*>& shards);

// A fractional knapsack: `capacity` bytes filled from `offers` (saving per
// byte, bytes), densest first; the saving. What one worker's caches save
// (CacheSavingMs), and the planner's bound on what any could.
double FillDensest(std::vector<std::pair<double, double>> offers, double capacity);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_COST_MODEL_H_
