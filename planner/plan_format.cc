#include "planner/plan_format.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
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

namespace {
// A shard's placement, its backups' after it (a replicated collection).
std::string Placement(const ShardingPlan& plan, const ember::v1::Shard& s) {
  std::string out = PlacementString(plan, s.rank());
  for (int i = 0; i < s.backups_size(); ++i) {
    absl::StrAppend(&out, i == 0 ? " backups " : ", ", PlacementString(plan, s.backups(i)));
  }
  return out;
}
}  // namespace

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
                        Placement(plan, s)});
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
          s.backups_size() > 0
              ? absl::StrCat(", \"backups\": [", absl::StrJoin(s.backups(), ", "), "]")
              : std::string(),
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

namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

absl::Status Bad(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("plan JSON: ", where, ": ", what));
}

const Value* Field(const Struct& s, const char* name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

absl::StatusOr<std::string> String(const Struct& s, const char* name, const std::string& where) {
  const Value* v = Field(s, name);
  if (v == nullptr || v->kind_case() != Value::kStringValue) {
    return Bad(where, absl::StrCat("'", name, "' must be a string"));
  }
  return v->string_value();
}

absl::StatusOr<std::vector<int64_t>> Ints(const Value* v, const std::string& where, size_t want) {
  if (v == nullptr || v->kind_case() != Value::kListValue) return Bad(where, "must be an array");
  std::vector<int64_t> out;
  for (const Value& x : v->list_value().values()) {
    if (x.kind_case() != Value::kNumberValue || std::floor(x.number_value()) != x.number_value() ||
        std::abs(x.number_value()) > 9007199254740992.0) {
      return Bad(where, "holds a value that is not an integer");
    }
    out.push_back(static_cast<int64_t>(x.number_value()));
  }
  if (want > 0 && out.size() != want) {
    return Bad(where, absl::StrCat("must hold ", want, " integers, not ", out.size()));
  }
  return out;
}

// One table's sharding from either form's fields.
absl::Status ParseTable(const Struct& t, bool torchrec, const std::string& where,
                        ember::v1::TableSharding* out) {
  if (!torchrec) {
    for (const auto& [name, v] : t.fields()) {
      if (name != "table" && name != "sharding_type" && name != "compute_kernel" &&
          name != "ranks" && name != "shards") {
        return Bad(where, absl::StrCat("unknown field '", name.substr(0, 64), "'"));
      }
    }
  }
  auto type = String(t, "sharding_type", where);
  if (!type.ok()) return type.status();
  auto kernel = String(t, "compute_kernel", where);
  if (!kernel.ok()) return kernel.status();
  out->set_sharding_type(*type);
  out->set_compute_kernel(*kernel);
  if (const Value* r = Field(t, "ranks"); r != nullptr && r->kind_case() != Value::kNullValue) {
    auto ranks = Ints(r, where + ".ranks", 0);
    if (!ranks.ok()) return ranks.status();
    for (int64_t x : *ranks) out->add_ranks(static_cast<int32_t>(x));
  }
  const Value* shards = nullptr;
  if (torchrec) {
    const Value* spec = Field(t, "sharding_spec");
    if (spec != nullptr && spec->kind_case() == Value::kStructValue) {
      shards = Field(spec->struct_value(), "shards");
    } else if (spec != nullptr && spec->kind_case() != Value::kNullValue) {
      return Bad(where, "'sharding_spec' must be an object or null");
    }
  } else {
    shards = Field(t, "shards");
  }
  if (shards == nullptr || shards->kind_case() == Value::kNullValue) return absl::OkStatus();
  if (shards->kind_case() != Value::kListValue) return Bad(where, "'shards' must be an array");
  for (int i = 0; i < shards->list_value().values_size(); ++i) {
    const std::string at = absl::StrCat(where, ".shards[", i, "]");
    const Value& sv = shards->list_value().values(i);
    if (sv.kind_case() != Value::kStructValue) return Bad(at, "must be an object");
    const Struct& sh = sv.struct_value();
    auto offsets = Ints(Field(sh, torchrec ? "shard_offsets" : "offsets"), at + " offsets", 2);
    if (!offsets.ok()) return offsets.status();
    auto sizes = Ints(Field(sh, torchrec ? "shard_sizes" : "sizes"), at + " sizes", 2);
    if (!sizes.ok()) return sizes.status();
    int64_t rank = -1;
    if (torchrec) {
      auto placement = String(sh, "placement", at);
      if (!placement.ok()) return placement.status();
      absl::string_view p = *placement;
      if (!absl::ConsumePrefix(&p, "rank:") || !absl::SimpleAtoi(p.substr(0, p.find('/')), &rank)) {
        return Bad(at, absl::StrCat("placement '", placement->substr(0, 64),
                                    "' is not of the form rank:N/device"));
      }
    } else {
      const Value* rv = Field(sh, "rank");
      if (rv == nullptr || rv->kind_case() != Value::kNumberValue ||
          std::floor(rv->number_value()) != rv->number_value() ||
          std::abs(rv->number_value()) > 1e9) {
        return Bad(at, "'rank' must be an integer");
      }
      rank = static_cast<int64_t>(rv->number_value());
    }
    auto* s = out->add_shards();
    s->set_row_offset((*offsets)[0]);
    s->set_col_offset((*offsets)[1]);
    s->set_rows((*sizes)[0]);
    s->set_cols((*sizes)[1]);
    s->set_rank(static_cast<int32_t>(rank));
    if (const Value* b = Field(sh, "backups");
        !torchrec && b != nullptr && b->kind_case() != Value::kNullValue) {
      auto backups = Ints(b, at + " backups", 0);
      if (!backups.ok()) return backups.status();
      for (int64_t x : *backups) {
        if (std::abs(x) > 1e9) return Bad(at, "'backups' must be ranks");
        s->add_backups(static_cast<int32_t>(x));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ember::v1::ShardingPlan> ParsePlanJson(const std::string& json) {
  Struct root;
  if (auto st = google::protobuf::util::JsonStringToMessage(json, &root); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan JSON: not a JSON object: ", st.message().as_string().substr(0, 200)));
  }
  ember::v1::ShardingPlan plan;
  const Value* list = Field(root, "plan");
  if (list != nullptr && list->kind_case() == Value::kListValue) {  // Ember's form
    for (const auto& [name, v] : root.fields()) {
      if (name != "plan" && name != "stats") {
        return Bad("top level", absl::StrCat("unknown field '", name.substr(0, 64), "'"));
      }
    }
    for (int i = 0; i < list->list_value().values_size(); ++i) {
      const std::string where = absl::StrCat("plan[", i, "]");
      const Value& v = list->list_value().values(i);
      if (v.kind_case() != Value::kStructValue) return Bad(where, "must be an object");
      auto* t = plan.add_tables();
      auto table = String(v.struct_value(), "table", where);
      if (!table.ok()) return table.status();
      t->set_table(*table);
      if (absl::Status s = ParseTable(v.struct_value(), false, where, t); !s.ok()) return s;
    }
    return plan;
  }
  // TorchRec's: table name -> ParameterSharding, in the file's order (the
  // planner orders by the spec anyway).
  std::vector<std::string> names;
  for (const auto& [name, v] : root.fields()) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const Value& v = root.fields().at(name);
    const std::string where = absl::StrCat("'", name.substr(0, 64), "'");
    if (v.kind_case() != Value::kStructValue) {
      return Bad(where, "must be an object (a ParameterSharding)");
    }
    auto* t = plan.add_tables();
    t->set_table(name);
    if (absl::Status s = ParseTable(v.struct_value(), true, where, t); !s.ok()) return s;
  }
  if (plan.tables_size() == 0) return Bad("top level", "no tables");
  return plan;
}

}  // namespace planner
}  // namespace ember
