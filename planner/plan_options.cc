// The options a table may take (sharding type x compute kernel) and what
// each costs, per plan_internal.h.
#include "planner/plan_internal.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "planner/cost_model.h"
#include "planner/shard_geometry.h"
#include "planner/sharding_types.h"

namespace ember {
namespace planner {
namespace internal {

const ParameterConstraints& ConstraintsFor(const CollectionSpec& spec,
                                           const std::string& table) {
  static const ParameterConstraints* const kNone = new ParameterConstraints();
  auto it = spec.constraints().find(table);
  return it == spec.constraints().end() ? *kNone : it->second;
}

std::vector<ShardBlock> BlocksFor(ShardingType type, const TableConfig& t,
                                  const ParameterConstraints& c, int w,
                                  int lw) {
  const int64_t rows = t.num_embeddings(), cols = t.embedding_dim();
  switch (type) {
    case ShardingType::kTableWise:
      return {ShardBlock{0, 0, rows, cols}};
    case ShardingType::kRowWise:
      return RowWiseBlocks(rows, cols, w);
    case ShardingType::kTableRowWise:
      return RowWiseBlocks(rows, cols, lw);
    case ShardingType::kColumnWise:
      return ColumnWiseBlocks(rows, cols, c.min_partition(), w);
    case ShardingType::kTableColumnWise:
      return ColumnWiseBlocks(rows, cols, c.min_partition(), lw);
    case ShardingType::kDataParallel:
      return std::vector<ShardBlock>(w, ShardBlock{0, 0, rows, cols});
  }
  return {};
}

Placement PlacementFor(ShardingType type) {
  switch (type) {
    case ShardingType::kTableWise:
    case ShardingType::kColumnWise:
      return Placement::kFree;
    case ShardingType::kRowWise:
    case ShardingType::kDataParallel:
      return Placement::kFixed;
    case ShardingType::kTableRowWise:
      return Placement::kHostFixed;
    case ShardingType::kTableColumnWise:
      return Placement::kHostFree;
  }
  return Placement::kFree;
}

std::vector<ComputeKernel> KernelsFor(
    ShardingType type, ComputeDevice device, const ParameterConstraints& c,
    const google::protobuf::RepeatedPtrField<std::string>& served) {
  std::vector<ComputeKernel> wanted;
  if (type == ShardingType::kDataParallel) {
    wanted = {ComputeKernel::kDense};
  } else if (device == ember::v1::CPU) {
    wanted = {ComputeKernel::kFused};
  } else {
    wanted = {ComputeKernel::kFused, ComputeKernel::kFusedUvmCaching,
              ComputeKernel::kFusedUvm};
  }
  // key_value (rows on the workers' SSDs) only where a table's constraints
  // ask for it: it trades speed for room, which the cost model does not yet
  // price from measurement.
  for (const std::string& name : c.compute_kernels()) {
    if (name == ComputeKernelName(ComputeKernel::kKeyValue) &&
        type != ShardingType::kDataParallel) {
      wanted.push_back(ComputeKernel::kKeyValue);
      break;
    }
  }
  if (!served.empty()) {
    wanted.erase(std::remove_if(wanted.begin(), wanted.end(),
                                [&](ComputeKernel k) {
                                  return std::find(served.begin(), served.end(),
                                                   ComputeKernelName(k)) == served.end();
                                }),
                 wanted.end());
  }
  if (c.compute_kernels_size() == 0) return wanted;
  std::vector<ComputeKernel> allowed;
  for (const std::string& name : c.compute_kernels()) {
    ComputeKernel k = *ParseComputeKernel(name);  // validated earlier
    if (device == ember::v1::CPU && k != ComputeKernel::kDense && k != ComputeKernel::kKeyValue) {
      k = ComputeKernel::kFused;
    }
    allowed.push_back(k);
  }
  std::vector<ComputeKernel> out;
  for (ComputeKernel k : wanted) {
    if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) {
      out.push_back(k);
    }
  }
  return out;
}

TableWorkload WorkloadFor(const TableConfig& t, const ParameterConstraints& c,
                          const Topology& topo, const CostModel& model) {
  TableWorkload w;
  for (int f = 0; f < t.feature_names_size(); ++f) {
    const double batch =
        static_cast<double>(c.batch_sizes_size() ? c.batch_sizes(f)
                                                 : topo.batch_size()) *
        topo.num_trainers();
    const double pf = c.pooling_factors_size() ? c.pooling_factors(f) : 1.0;
    const double np = c.num_poolings_size() ? c.num_poolings(f) : 1.0;
    w.ids += batch * pf * np;
    w.bags += batch * np;
  }
  w.pooling_factor = w.bags > 0 ? w.ids / w.bags : 0.0;
  w.weighted = c.is_weighted();
  w.sequence = t.pooling() == TableConfig::NONE;
  w.dtype_bytes = DataTypeBytes(t.data_type());
  w.quant_bits = QuantBitsOf(t.data_type());
  w.optimizer = t.optimizer().type();
  w.dynamic = t.has_dynamic();
  w.cache_load_factor = c.cache_load_factor() > 0
                            ? c.cache_load_factor()
                            : model.default_cache_load_factor;
  if (auto curve = model.hit_rate_curves.find(t.name()); curve != model.hit_rate_curves.end()) {
    w.hit_rate_curve = curve->second;
  }
  return w;
}

Option MakeOption(ShardingType type, ComputeKernel kernel,
                  const std::vector<ShardBlock>& blocks,
                  const TableWorkload& work, const TableConfig& t,
                  const CostModel& model, ComputeDevice device, int w) {
  Option o;
  o.type = type;
  o.kernel = kernel;
  o.placement = PlacementFor(type);
  o.blocks = blocks;
  o.num_shards = static_cast<int>(blocks.size());
  for (const ShardBlock& b : blocks) {
    if (!o.runs.empty() && o.runs.back().rows == b.rows &&
        o.runs.back().cols == b.cols) {
      ++o.runs.back().count;
      continue;
    }
    Run run;
    run.count = 1;
    run.rows = b.rows;
    run.cols = b.cols;
    run.cost = EstimateShard(model, work, type, kernel, device, b,
                             t.num_embeddings(), w);
    o.runs.push_back(run);
  }
  for (const Run& r : o.runs) {
    o.total_cost += r.count * r.cost.total_ms();
    o.max_shard_cost = std::max(o.max_shard_cost, r.cost.total_ms());
    o.total_hbm += r.count * r.cost.hbm_bytes;
    o.total_ddr += r.count * r.cost.ddr_bytes;
    o.max_shard_hbm = std::max(o.max_shard_hbm, r.cost.hbm_bytes);
    o.max_shard_ddr = std::max(o.max_shard_ddr, r.cost.ddr_bytes);
    o.max_shard_ssd = std::max(o.max_shard_ssd, r.cost.ssd_bytes);
  }
  return o;
}

std::string OptionName(const Option& o) {
  return absl::StrCat(ShardingTypeName(o.type), "/", ComputeKernelName(o.kernel));
}

void Summarize(TableInfo* info) {
  info->min_total_cost = kInf;
  info->min_max_shard_cost = kInf;
  info->min_total_hbm = std::numeric_limits<int64_t>::max();
  info->min_total_ddr = std::numeric_limits<int64_t>::max();
  for (const Option& o : info->options) {
    info->min_total_cost = std::min(info->min_total_cost, o.total_cost);
    info->min_max_shard_cost = std::min(info->min_max_shard_cost, o.max_shard_cost);
    info->min_total_hbm = std::min(info->min_total_hbm, o.total_hbm);
    info->min_total_ddr = std::min(info->min_total_ddr, o.total_ddr);
  }
}

std::vector<int64_t> SsdCapacities(const Topology& topo) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> cap(topo.world_size(),
                           topo.ssd_cap_bytes() > 0 ? topo.ssd_cap_bytes() : kNone);
  for (const auto& d : topo.devices()) {
    if (d.rank() >= 0 && d.rank() < topo.world_size() && d.ssd_bytes() > 0) {
      cap[d.rank()] = d.ssd_bytes();
    }
  }
  return cap;
}

void Capacities(const Topology& topo, const CostModel& model, std::vector<int64_t>* hbm_cap,
                std::vector<int64_t>* ddr_cap) {
  const int w = topo.world_size();
  const ComputeDevice device = topo.compute_device();
  hbm_cap->assign(w, 0);
  ddr_cap->assign(w, 0);
  for (int r = 0; r < w; ++r) {
    (*hbm_cap)[r] = device == ember::v1::CUDA ? topo.hbm_cap_bytes() : 0;
    (*ddr_cap)[r] = topo.ddr_cap_bytes();
  }
  for (const auto& d : topo.devices()) {
    (*hbm_cap)[d.rank()] = device == ember::v1::CUDA ? d.hbm_bytes() : 0;
    (*ddr_cap)[d.rank()] = d.ddr_bytes();
  }
  for (int r = 0; r < w; ++r) {
    (*hbm_cap)[r] = static_cast<int64_t>((*hbm_cap)[r] * (1.0 - model.hbm_reserved_fraction));
    (*ddr_cap)[r] = static_cast<int64_t>((*ddr_cap)[r] * (1.0 - model.ddr_reserved_fraction));
  }
}

absl::StatusOr<std::vector<TableInfo>> EnumerateOptions(const CollectionSpec& spec,
                                                        const Topology& topo,
                                                        const CostModel& model) {
  const ComputeDevice device = topo.compute_device();
  const int w = topo.world_size();
  const int lw = topo.local_world_size();
  std::vector<TableInfo> tables(spec.tables_size());
  for (int t = 0; t < spec.tables_size(); ++t) {
    const TableConfig& tc = spec.tables(t);
    const ParameterConstraints& c = ConstraintsFor(spec, tc.name());
    std::vector<ShardingType> types;
    for (const std::string& name : c.sharding_types()) {
      const ShardingType type = *ParseShardingType(name);  // validated
      if (std::find(types.begin(), types.end(), type) == types.end()) {
        types.push_back(type);
      }
    }
    const bool free_choice = types.empty();
    if (free_choice) types = AllShardingTypes();
    const TableWorkload work = WorkloadFor(tc, c, topo, model);
    tables[t].cache_load_factor = work.cache_load_factor;
    for (ShardingType type : types) {
      std::vector<ComputeKernel> kernels = KernelsFor(type, device, c, topo.compute_kernels());
      if (tc.has_dynamic()) {
        if (!DynamicTableTakes(type)) continue;
        kernels.erase(std::remove_if(kernels.begin(), kernels.end(),
                                     [](ComputeKernel k) { return !DynamicTableTakes(k); }),
                      kernels.end());
      }
      if (kernels.empty()) continue;
      // Column splits: chosen freely, every width FreeColumnWidths offers
      // (wide blocks as TorchRec makes them, down to the even split); forced
      // or with a min_partition, the one split ColumnShardWidth gives.
      std::vector<std::vector<ShardBlock>> splits;
      const bool column = type == ShardingType::kColumnWise ||
                          type == ShardingType::kTableColumnWise;
      if (column && free_choice && c.min_partition() == 0) {
        const int workers = type == ShardingType::kColumnWise ? w : lw;
        for (int64_t width : FreeColumnWidths(tc.embedding_dim(), workers)) {
          splits.push_back(ColumnBlocksOfWidth(tc.num_embeddings(), tc.embedding_dim(), width));
        }
      }
      if (splits.empty()) splits.push_back(BlocksFor(type, tc, c, w, lw));
      for (const std::vector<ShardBlock>& blocks : splits) {
        for (ComputeKernel k : kernels) {
          tables[t].options.push_back(
              MakeOption(type, k, blocks, work, tc, model, device, w));
        }
      }
    }
    if (tables[t].options.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", tc.name(),
          "': its constraints allow no (sharding type, compute kernel) pair "
          "on ", ember::v1::ComputeDevice_Name(device),
          " workers: sharding_types [", absl::StrJoin(c.sharding_types(), ", "),
          "], compute_kernels [", absl::StrJoin(c.compute_kernels(), ", "),
          "]; data_parallel uses dense, the other types fused",
          device == ember::v1::CUDA ? ", fused_uvm_caching or fused_uvm" : "",
          tc.has_dynamic() ? "; a dynamic table takes table_wise or row_wise (not dense)" : ""));
    }
    auto& opts = tables[t].options;
    std::stable_sort(opts.begin(), opts.end(), [](const Option& a, const Option& b) {
      if (a.total_cost != b.total_cost) return a.total_cost < b.total_cost;
      return a.total_hbm + a.total_ddr < b.total_hbm + b.total_ddr;
    });
    Summarize(&tables[t]);
  }
  return tables;
}

}  // namespace internal
}  // namespace planner
}  // namespace ember
