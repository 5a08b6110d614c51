// Sharding types and compute kernels with TorchRec's names.
//
// Thread-safe: pure functions over constants.
#ifndef EMBER_PLANNER_SHARDING_TYPES_H_
#define EMBER_PLANNER_SHARDING_TYPES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ember {
namespace planner {

enum class ShardingType {
  kTableWise,        // "table_wise": the whole table on one worker
  kRowWise,          // "row_wise": ceil(rows/W) row blocks, shard i on rank i
  kColumnWise,       // "column_wise": column blocks on distinct workers
  kTableRowWise,     // "table_row_wise": row-wise over the ranks of one host
  kTableColumnWise,  // "table_column_wise": column-wise within one host
  kDataParallel,     // "data_parallel": a replica on every worker
};

// Storage tier and kernel family, TorchRec's EmbeddingComputeKernel.
enum class ComputeKernel {
  kDense,            // "dense": unfused replica (data_parallel only)
  kFused,            // "fused": table in HBM (host memory on CPU workers)
  kFusedUvmCaching,  // "fused_uvm_caching": HBM cache over host memory
  kFusedUvm,         // "fused_uvm": table in host memory, GPU reads it
  kKeyValue,         // "key_value": rows on local SSD, a cache of them in memory
};

// Every value, in the order the planner enumerates them.
const std::vector<ShardingType>& AllShardingTypes();

// What a dynamic (hash-keyed) table takes: table_wise and row_wise shards
// (every column: an id's row lives whole on one shard), on every kernel
// but dense (data_parallel's): fused, and the tiers below memory (fused_uvm,
// fused_uvm_caching, key_value). The id index is in host memory (a CUDA
// worker keeps a copy in HBM for fused and fused_uvm shards).
bool DynamicTableTakes(ShardingType type);
bool DynamicTableTakes(ComputeKernel kernel);
const std::vector<ComputeKernel>& AllComputeKernels();

// TorchRec's string names ("table_wise", "fused_uvm_caching", ...).
absl::string_view ShardingTypeName(ShardingType type);
absl::string_view ComputeKernelName(ComputeKernel kernel);

// Abbreviation used in TorchRec's stats ("TW", "RW", "CW", "TWRW", "TWCW", "DP").
absl::string_view ShardingTypeShortName(ShardingType type);

// Parses a name; INVALID_ARGUMENT listing the valid names on failure.
absl::StatusOr<ShardingType> ParseShardingType(absl::string_view name);
absl::StatusOr<ComputeKernel> ParseComputeKernel(absl::string_view name);

// Comma-separated list of valid names, for error messages.
std::string ValidShardingTypeNames();
std::string ValidComputeKernelNames();

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_SHARDING_TYPES_H_
