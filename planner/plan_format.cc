#include "planner/plan_format.h"

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "planner/sharding_types.h"

namespace ember {
namespace planner {
namespace {

using ember::v1::ShardingPlan;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Left-aligned columns separated by " | ", a dashed rule under the header.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      if (c > 0) line += " | ";
      line += row[c];
      if (c + 1 < row.size()) line.append(width[c] - row[c].size(), ' ');
    }
    absl::StrAppend(&out, line, "\n");
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    emit(rows[i]);
    if (i == 0) {
      std::vector<std::string> rule;
      for (size_t c = 0; c < rows[0].size(); ++c) rule.emplace_back(width[c], '-');
      emit(rule);
    }
  }
  return out;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          out += absl::StrFormat("\\u%04x", ch);
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) { return absl::StrFormat("%.6g", v); }

std::string RanksList(const ember::v1::TableSharding& t) {
  return absl::StrCat("[", absl::StrJoin(t.ranks(), ", "), "]");
}

}  // namespace

std::string PlacementString(const ShardingPlan& plan, int rank) {
  if (plan.topology().compute_device() == ember::v1::CPU) {
    return absl::StrCat("rank:", rank, "/cpu");
  }
  const int local = std::max(1, plan.topology().local_world_size());
  return absl::StrCat("rank:", rank, "/cuda:", rank % local);
}

std::string FormatPlanTable(const ShardingPlan& plan) {
  std::vector<std::vector<std::string>> params = {
      {"param", "sharding type", "compute kernel", "ranks"}};
  std::vector<std::vector<std::string>> shards = {
      {"param", "shard offsets", "shard sizes", "placement"}};
  for (const auto& t : plan.tables()) {
    params.push_back({t.table(), t.sharding_type(), t.compute_kernel(), RanksList(t)});
    for (const auto& s : t.shards()) {
      shards.push_back({t.table(),
                        absl::StrCat("[", s.row_offset(), ", ", s.col_offset(), "]"),
                        absl::StrCat("[", s.rows(), ", ", s.cols(), "]"),
                        PlacementString(plan, s.rank())});
    }
  }
  std::string out = absl::StrCat("collection: ", plan.collection(), "\n\n");
  absl::StrAppend(&out, RenderTable(params), "\n");
  if (shards.size() > 1) absl::StrAppend(&out, RenderTable(shards), "\n");

  // Shard counts by type per rank ("TW: 2 RW: 1").
  const int w = plan.topology().world_size();
  std::vector<std::map<std::string, int>> by_type(w);
  for (const auto& t : plan.tables()) {
    auto type = ParseShardingType(t.sharding_type());
    const std::string abbr =
        type.ok() ? std::string(ShardingTypeShortName(*type)) : t.sharding_type();
    for (int r : t.ranks()) {
      if (r >= 0 && r < w) ++by_type[r][abbr];
    }
  }
  const bool cuda = plan.topology().compute_device() == ember::v1::CUDA;
  std::vector<std::vector<std::string>> ranks = {
      {"rank", "HBM (GiB)", "DDR (GiB)",
       "cost ms (fwd compute, fwd comms, bwd compute, bwd comms)", "shards"}};
  auto mem = [](int64_t used, int64_t cap) {
    if (cap <= 0) return absl::StrFormat("%.3f", used / kGiB);
    return absl::StrFormat("%.3f (%.0f%%)", used / kGiB, 100.0 * used / cap);
  };
  for (const auto& rs : plan.stats().per_rank()) {
    std::vector<std::string> counts;
    if (rs.rank() < w) {
      for (const auto& [abbr, count] : by_type[rs.rank()]) {
        counts.push_back(absl::StrCat(abbr, ": ", count));
      }
    }
    ranks.push_back(
        {absl::StrCat(rs.rank()), cuda ? mem(rs.hbm_bytes(), rs.hbm_cap_bytes()) : "-",
         mem(rs.ddr_bytes(), rs.ddr_cap_bytes()),
         absl::StrFormat("%.4f (%.4f, %.4f, %.4f, %.4f)", rs.cost_ms(),
                         rs.fwd_compute_ms(), rs.fwd_comms_ms(),
                         rs.bwd_compute_ms(), rs.bwd_comms_ms()),
         absl::StrJoin(counts, " ")});
  }
  absl::StrAppend(&out, RenderTable(ranks));
  const auto& st = plan.stats();
  absl::StrAppendFormat(
      &out,
      "estimated step: max %.4f ms, mean %.4f ms, balance (max/mean) %.3f\n"
      "lower bounds: %.4f ms = max(total / W, largest shard), %.4f ms "
      "layout-aware; max is %.1f%% above the latter\n",
      st.max_cost_ms(), st.mean_cost_ms(), st.balance(), st.lower_bound_ms(),
      st.option_lower_bound_ms(),
      st.option_lower_bound_ms() > 0
          ? 100.0 * (st.max_cost_ms() / st.option_lower_bound_ms() - 1.0)
          : 0.0);
  return out;
}

std::string FormatPlanJson(const ShardingPlan& plan) {
  std::vector<std::string> tables;
  for (const auto& t : plan.tables()) {
    std::vector<std::string> shards;
    for (const auto& s : t.shards()) {
      shards.push_back(absl::StrCat(
          "{\"offsets\": [", s.row_offset(), ", ", s.col_offset(),
          "], \"sizes\": [", s.rows(), ", ", s.cols(), "], \"rank\": ", s.rank(),
          "}"));
    }
    tables.push_back(absl::StrCat(
        "{\"table\": ", JsonString(t.table()),
        ", \"sharding_type\": ", JsonString(t.sharding_type()),
        ", \"compute_kernel\": ", JsonString(t.compute_kernel()),
        ", \"ranks\": [", absl::StrJoin(t.ranks(), ", "), "], \"shards\": [",
        absl::StrJoin(shards, ", "), "]}"));
  }
  std::vector<std::string> ranks;
  for (const auto& rs : plan.stats().per_rank()) {
    ranks.push_back(absl::StrCat("{\"rank\": ", rs.rank(),
                                 ", \"hbm_bytes\": ", rs.hbm_bytes(),
                                 ", \"ddr_bytes\": ", rs.ddr_bytes(),
                                 ", \"cost_ms\": ", JsonNumber(rs.cost_ms()),
                                 ", \"fwd_compute_ms\": ", JsonNumber(rs.fwd_compute_ms()),
                                 ", \"fwd_comms_ms\": ", JsonNumber(rs.fwd_comms_ms()),
                                 ", \"bwd_compute_ms\": ", JsonNumber(rs.bwd_compute_ms()),
                                 ", \"bwd_comms_ms\": ", JsonNumber(rs.bwd_comms_ms()), "}"));
  }
  const auto& st = plan.stats();
  return absl::StrCat(
      "{\"plan\": [", absl::StrJoin(tables, ", "), "], \"stats\": {\"per_rank\": [",
      absl::StrJoin(ranks, ", "), "], \"balance\": ", JsonNumber(st.balance()),
      ", \"max_cost_ms\": ", JsonNumber(st.max_cost_ms()),
      ", \"mean_cost_ms\": ", JsonNumber(st.mean_cost_ms()),
      ", \"lower_bound_ms\": ", JsonNumber(st.lower_bound_ms()),
      ", \"option_lower_bound_ms\": ", JsonNumber(st.option_lower_bound_ms()), "}}");
}

}  // namespace planner
}  // namespace ember
