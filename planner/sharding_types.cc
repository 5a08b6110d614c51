#include "planner/sharding_types.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ember {
namespace planner {

const std::vector<ShardingType>& AllShardingTypes() {
  static const std::vector<ShardingType>* const kAll =
      new std::vector<ShardingType>{
          ShardingType::kTableWise,       ShardingType::kRowWise,
          ShardingType::kColumnWise,      ShardingType::kTableRowWise,
          ShardingType::kTableColumnWise, ShardingType::kDataParallel};
  return *kAll;
}

const std::vector<ComputeKernel>& AllComputeKernels() {
  static const std::vector<ComputeKernel>* const kAll =
      new std::vector<ComputeKernel>{
          ComputeKernel::kDense, ComputeKernel::kFused,
          ComputeKernel::kFusedUvmCaching, ComputeKernel::kFusedUvm,
          ComputeKernel::kKeyValue};
  return *kAll;
}

absl::string_view ShardingTypeName(ShardingType type) {
  switch (type) {
    case ShardingType::kTableWise:
      return "table_wise";
    case ShardingType::kRowWise:
      return "row_wise";
    case ShardingType::kColumnWise:
      return "column_wise";
    case ShardingType::kTableRowWise:
      return "table_row_wise";
    case ShardingType::kTableColumnWise:
      return "table_column_wise";
    case ShardingType::kDataParallel:
      return "data_parallel";
  }
  return "unknown";
}

absl::string_view ShardingTypeShortName(ShardingType type) {
  switch (type) {
    case ShardingType::kTableWise:
      return "TW";
    case ShardingType::kRowWise:
      return "RW";
    case ShardingType::kColumnWise:
      return "CW";
    case ShardingType::kTableRowWise:
      return "TWRW";
    case ShardingType::kTableColumnWise:
      return "TWCW";
    case ShardingType::kDataParallel:
      return "DP";
  }
  return "?";
}

absl::string_view ComputeKernelName(ComputeKernel kernel) {
  switch (kernel) {
    case ComputeKernel::kDense:
      return "dense";
    case ComputeKernel::kFused:
      return "fused";
    case ComputeKernel::kFusedUvmCaching:
      return "fused_uvm_caching";
    case ComputeKernel::kFusedUvm:
      return "fused_uvm";
    case ComputeKernel::kKeyValue:
      return "key_value";
  }
  return "unknown";
}

std::string ValidShardingTypeNames() {
  std::vector<std::string> names;
  for (ShardingType t : AllShardingTypes()) {
    names.emplace_back(ShardingTypeName(t));
  }
  return absl::StrJoin(names, ", ");
}

std::string ValidComputeKernelNames() {
  std::vector<std::string> names;
  for (ComputeKernel k : AllComputeKernels()) {
    names.emplace_back(ComputeKernelName(k));
  }
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<ShardingType> ParseShardingType(absl::string_view name) {
  for (ShardingType t : AllShardingTypes()) {
    if (ShardingTypeName(t) == name) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sharding type '", name,
                   "' (valid: ", ValidShardingTypeNames(), ")"));
}

absl::StatusOr<ComputeKernel> ParseComputeKernel(absl::string_view name) {
  for (ComputeKernel k : AllComputeKernels()) {
    if (ComputeKernelName(k) == name) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown compute kernel '", name,
                   "' (valid: ", ValidComputeKernelNames(), ")"));
}

bool DynamicTableTakes(ShardingType type) {
  return type == ShardingType::kTableWise || type == ShardingType::kRowWise;
}

bool DynamicTableTakes(ComputeKernel kernel) { return kernel != ComputeKernel::kDense; }

}  // namespace planner
}  // namespace ember
