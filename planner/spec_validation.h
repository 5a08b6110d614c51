// Validation of collection specs and topologies before planning.
//
// Thread-safe: pure functions.
#ifndef EMBER_PLANNER_SPEC_VALIDATION_H_
#define EMBER_PLANNER_SPEC_VALIDATION_H_

#include "absl/status/status.h"
#include "proto/collection.pb.h"
#include "proto/plan.pb.h"

#include <cstdint>

namespace ember {
namespace planner {

// Limits on what one collection spec or topology may ask for, checked before
// anything is allocated: a plan's memory grows with tables x world size and
// its time faster than linearly with tables, so the limits keep one request
// from holding the coordinator for long (the sizes behind them:
// docs/lab-notes/2026-11-benchmarks.md). docs/security.md lists them.
inline constexpr int kMaxWorldSize = 4096;                   // workers (ranks)
inline constexpr int kMaxTables = 1 << 14;                   // per collection
inline constexpr int kMaxFeaturesPerTable = 1 << 12;
inline constexpr int64_t kMaxTableRanks = int64_t{1} << 18;  // tables x world_size
inline constexpr int64_t kMaxRows = int64_t{1} << 40;        // num_embeddings
inline constexpr int kMaxEmbeddingDim = 1 << 16;
inline constexpr int kMaxBatchSize = 1 << 24;                // topology.batch_size
inline constexpr int kMaxTrainers = 1 << 20;                 // topology.num_trainers
inline constexpr int kCudaColumnMultiple = 4;  // the CUDA kernels' column step
inline constexpr int kMaxTrainingRanks = 1 << 16;         // training.trainers
inline constexpr int kMaxReplicas = 8;                     // replicas
inline constexpr int kMaxStaleness = 1024;                // training.max_staleness
inline constexpr double kMaxStepTimeoutS = 86400;         // training.step_timeout_s

// Checks every rule below and reports all violations at once, one per line,
// in an INVALID_ARGUMENT status. OK when the spec can be planned.
//  - at least one table; table names non-empty and unique;
//  - at most kMaxTables tables of at most kMaxFeaturesPerTable features;
//  - num_embeddings in (0, kMaxRows]; embedding_dim in (0, kMaxEmbeddingDim]
//    (any dim, as TorchRec's CPU modules take; ValidatePlanInputs asks CUDA
//    workers' tables for multiples of kCudaColumnMultiple);
//  - at least one feature per table; feature names non-empty and unique
//    across the collection;
//  - optimizer hyper-parameters in range (learning_rate, eps, weight_decay
//    >= 0; beta1, beta2 in [0, 1)); no weight_decay with SGD, nor with
//    ADAGRAD unless weight_decay_mode names L2 or DECOUPLE (FBGEMM has none);
//  - initializer ranges sane (uniform low <= high, normal std >= 0);
//  - constraints name existing tables; sharding types and compute kernels are
//    known names; min_partition >= 0; pooling_factors / num_poolings /
//    batch_sizes empty or one per feature, finite and >= 0 (batch > 0);
//    cache_load_factor in [0, 1];
//  - replicas in [0, kMaxReplicas];
//  - training: a known mode; trainers in [0, kMaxTrainingRanks], >= 1 for
//    SYNC and BOUNDED; max_staleness in [1, kMaxStaleness] for BOUNDED and
//    0 otherwise; step_timeout_s in [0, kMaxStepTimeoutS]; a known
//    gradient_reduction;
//  - dynamic tables: capacity in [1, kMaxRows], admit_after and ttl_steps
//    >= 0, a known eviction, num_embeddings 0 or the capacity; constraints
//    that name sharding types name table_wise or row_wise among them.
absl::Status ValidateCollectionSpec(const ember::v1::CollectionSpec& spec);

// `spec` with every dynamic table's num_embeddings set to its capacity where
// 0: the rows that size its shards for the planner, the routing and exports.
// The planner plans (and the coordinator stores) specs so filled.
ember::v1::CollectionSpec WithDynamicRows(const ember::v1::CollectionSpec& spec);

// world_size in [1, kMaxWorldSize]; local_world_size in [0, world_size] and
// dividing it; capacities >= 0; per-rank overrides name distinct ranks in
// range; batch_size in [0, kMaxBatchSize], num_trainers in [0, kMaxTrainers].
absl::Status ValidateTopology(const ember::v1::Topology& topology);

// The two together: both valid, tables x world_size <= kMaxTableRanks, and
// on CUDA every embedding_dim a multiple of kCudaColumnMultiple.
absl::Status ValidatePlanInputs(const ember::v1::CollectionSpec& spec,
                                const ember::v1::Topology& topology);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_SPEC_VALIDATION_H_
