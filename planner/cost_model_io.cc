#include "planner/cost_model_io.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "math/hit_rate_curve.h"

namespace ember {
namespace planner {
namespace {

// A field of CostModel by name: its reader and writer as doubles, and the
// least value it may take (exclusive when `positive`).
struct FieldDef {
  std::function<double(const CostModel&)> get;
  std::function<void(CostModel*, double)> set;
  bool integer = false;
  bool positive = false;   // > 0, else >= 0
  bool at_most_one = false;
};

const std::map<std::string, FieldDef>& Fields() {
  static const auto* fields = new std::map<std::string, FieldDef>{
#define EMBER_FIELD(name, integer, positive, at_most_one)                              \
  {#name, FieldDef{[](const CostModel& m) { return static_cast<double>(m.name); },     \
                   [](CostModel* m, double v) { m->name = static_cast<decltype(m->name)>(v); }, \
                   integer, positive, at_most_one}}
      EMBER_FIELD(hbm_cap_bytes, true, false, false),
      EMBER_FIELD(ddr_cap_bytes, true, false, false),
      EMBER_FIELD(hbm_reserved_fraction, false, false, true),
      EMBER_FIELD(ddr_reserved_fraction, false, false, true),
      EMBER_FIELD(hbm_bw_gbps, false, false, false),
      EMBER_FIELD(ddr_bw_gbps, false, false, false),
      EMBER_FIELD(pcie_bw_gbps, false, false, false),
      EMBER_FIELD(ssd_bw_gbps, false, true, false),
      EMBER_FIELD(network_bw_gbps, false, true, false),
      EMBER_FIELD(lookup_efficiency, false, true, true),
      EMBER_FIELD(dense_kernel_factor, false, true, true),
      EMBER_FIELD(uvm_efficiency, false, true, true),
      EMBER_FIELD(bwd_compute_multiplier, false, true, false),
      EMBER_FIELD(access_granularity_bytes, true, true, false),
      EMBER_FIELD(narrow_row_penalty, false, false, true),
      EMBER_FIELD(per_shard_overhead_ms, false, false, false),
      EMBER_FIELD(per_call_overhead_ms, false, false, false),
      EMBER_FIELD(per_id_ms, false, false, false),
      EMBER_FIELD(cache_bytes, true, false, false),
      EMBER_FIELD(cache_bw_gbps, false, false, false),
      EMBER_FIELD(default_cache_load_factor, false, false, true),
      EMBER_FIELD(io_buffer_copies, true, true, false),
      EMBER_FIELD(id_bytes, true, true, false),
      EMBER_FIELD(weight_bytes, true, true, false),
      EMBER_FIELD(output_bytes, true, true, false),
#undef EMBER_FIELD
  };
  return *fields;
}

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("cost model: ", what));
}

constexpr char kCurvesField[] = "hit_rate_curves";

// "hit_rate_curves": {"table": [rates at math::kLruCurveFractions], ...}:
// each a list of that many numbers in [0, 1], never falling.
absl::Status ReadCurves(const google::protobuf::Value& v, CostModel* m) {
  const size_t n = backend::math::kLruCurveFractions.size();
  if (v.kind_case() != google::protobuf::Value::kStructValue) {
    return Bad(absl::StrCat("'", kCurvesField, "' must be an object of table name -> curve"));
  }
  for (const auto& [table, curve] : v.struct_value().fields()) {
    const std::string what = absl::StrCat("'", kCurvesField, "' of table '", table.substr(0, 64),
                                          "'");
    if (curve.kind_case() != google::protobuf::Value::kListValue ||
        static_cast<size_t>(curve.list_value().values_size()) != n) {
      return Bad(absl::StrCat(what, " must be a list of ", n,
                              " hit rates (at cache fractions 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, "
                              "0.5, 0.75, 1)"));
    }
    std::vector<double> rates;
    for (const auto& x : curve.list_value().values()) {
      const double r = x.kind_case() == google::protobuf::Value::kNumberValue ? x.number_value()
                                                                             : -1;
      if (!(r >= 0 && r <= 1)) return Bad(absl::StrCat(what, ": a rate outside [0, 1]"));
      if (!rates.empty() && r < rates.back()) {
        return Bad(absl::StrCat(what, ": the rate falls as the cache grows (", rates.back(),
                                " then ", r, ")"));
      }
      rates.push_back(r);
    }
    m->hit_rate_curves[table] = std::move(rates);
  }
  return absl::OkStatus();
}

}  // namespace

std::string CostModelToJson(const CostModel& model, ember::v1::ComputeDevice device) {
  std::vector<std::string> parts = {
      absl::StrCat("\"device\": \"", device == ember::v1::CUDA ? "cuda" : "cpu", "\"")};
  for (const auto& [name, f] : Fields()) {
    const double v = f.get(model);
    parts.push_back(absl::StrCat("\"", name, "\": ",
                                 f.integer ? absl::StrCat(static_cast<int64_t>(v))
                                           : absl::StrFormat("%.9g", v)));
  }
  if (!model.hit_rate_curves.empty()) {
    std::vector<std::string> curves;
    for (const auto& [table, curve] : model.hit_rate_curves) {
      std::vector<std::string> points;
      for (double x : curve) points.push_back(absl::StrFormat("%.6g", x));
      curves.push_back(
          absl::StrCat("    \"", absl::CEscape(table), "\": [", absl::StrJoin(points, ", "), "]"));
    }
    parts.push_back(absl::StrCat("\"", kCurvesField, "\": {\n", absl::StrJoin(curves, ",\n"),
                                 "\n  }"));
  }
  return absl::StrCat("{\n  ", absl::StrJoin(parts, ",\n  "), "\n}\n");
}

absl::StatusOr<CostModel> CostModelFromJson(const std::string& json,
                                            ember::v1::ComputeDevice* device_out) {
  google::protobuf::Struct root;
  if (auto st = google::protobuf::util::JsonStringToMessage(json, &root); !st.ok()) {
    return Bad(absl::StrCat("not a JSON object: ", st.message().as_string().substr(0, 200)));
  }
  ember::v1::ComputeDevice device = ember::v1::CPU;
  auto d = root.fields().find("device");
  if (d == root.fields().end() || d->second.kind_case() != google::protobuf::Value::kStringValue ||
      (d->second.string_value() != "cpu" && d->second.string_value() != "cuda")) {
    return Bad("\"device\" must be \"cpu\" or \"cuda\"");
  }
  if (d->second.string_value() == "cuda") device = ember::v1::CUDA;
  CostModel m = DefaultCostModel(device);
  for (const auto& [name, v] : root.fields()) {
    if (name == "device") continue;
    if (name == kCurvesField) {
      if (absl::Status s = ReadCurves(v, &m); !s.ok()) return s;
      continue;
    }
    auto it = Fields().find(name);
    if (it == Fields().end()) return Bad(absl::StrCat("unknown field '", name.substr(0, 64), "'"));
    const FieldDef& f = it->second;
    double x = 0;
    if (v.kind_case() == google::protobuf::Value::kNumberValue) {
      x = v.number_value();
    } else if (v.kind_case() == google::protobuf::Value::kBoolValue) {
      x = v.bool_value() ? 1 : 0;
    } else {
      return Bad(absl::StrCat("'", name, "' must be a number"));
    }
    if (!std::isfinite(x) || x < 0 || (f.positive && x == 0) || (f.at_most_one && x > 1) ||
        (f.integer && (std::floor(x) != x || x > 9.2e18))) {
      return Bad(absl::StrCat("'", name, "' = ", x, " is out of range (",
                              f.positive ? "> 0" : ">= 0", f.at_most_one ? ", <= 1" : "",
                              f.integer ? ", an integer" : "", ")"));
    }
    f.set(&m, x);
  }
  if (device == ember::v1::CPU ? m.ddr_bw_gbps <= 0 : m.hbm_bw_gbps <= 0) {
    return Bad(device == ember::v1::CPU ? "CPU workers need ddr_bw_gbps > 0"
                                        : "CUDA workers need hbm_bw_gbps > 0");
  }
  if (m.cache_bytes > 0 && m.cache_bw_gbps <= 0) {
    return Bad("cache_bytes > 0 needs cache_bw_gbps > 0 (the rate of reads the caches serve)");
  }
  if (device_out != nullptr) *device_out = device;
  return m;
}

absl::StatusOr<CostModel> LoadCostModel(const std::string& path,
                                        ember::v1::ComputeDevice* device) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cost model file ", path));
  std::stringstream text;
  text << in.rdbuf();
  auto m = CostModelFromJson(text.str(), device);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  return m;
}

double PredictCall(const CallFit& fit, const CallSample& s) {
  return fit.overhead_ms + fit.ms_per_id * s.ids + fit.ms_per_gathered_byte * s.gathered_bytes +
         fit.ms_per_wire_byte * s.wire_bytes;
}

absl::StatusOr<CallFit> FitCalls(const std::vector<CallSample>& samples) {
  if (samples.size() < 3) return Bad("a fit needs 3 or more timed calls");
  // Normal equations of the linear model on the columns scaled to unit
  // size (the byte counts are ~1e6 apart from the intercept).
  double si = 0, sg = 0, sw = 0;
  for (const CallSample& s : samples) {
    si = std::max(si, s.ids);
    sg = std::max(sg, s.gathered_bytes);
    sw = std::max(sw, s.wire_bytes);
  }
  if (sg <= 0 || sw <= 0) return Bad("the calls moved no bytes");
  // Terms beyond the intercept: bit 0 ids, bit 1 gathered, bit 2 wire.
  auto solve = [&](int mask, CallFit* fit) {
    std::vector<std::function<double(const CallSample&)>> cols = {
        [](const CallSample&) { return 1.0; }};
    if (mask & 1) cols.push_back([&](const CallSample& s) { return s.ids / si; });
    if (mask & 2) cols.push_back([&](const CallSample& s) { return s.gathered_bytes / sg; });
    if (mask & 4) cols.push_back([&](const CallSample& s) { return s.wire_bytes / sw; });
    const size_t k = cols.size();
    std::vector<std::vector<double>> a(k, std::vector<double>(k + 1, 0.0));
    // Relative errors are what matter (a 0.2 ms call and a 10 ms one are
    // planned with alike): each sample weighs 1 / ms^2.
    for (const CallSample& s : samples) {
      const double weight = s.ms > 0 ? 1.0 / (s.ms * s.ms) : 1.0;
      for (size_t i = 0; i < k; ++i) {
        for (size_t j = 0; j < k; ++j) a[i][j] += weight * cols[i](s) * cols[j](s);
        a[i][k] += weight * cols[i](s) * s.ms;
      }
    }
    // Gauss-Jordan elimination with partial pivoting; a pivot that
    // vanishes against its column's scale means the terms are collinear.
    std::vector<double> scale(k);
    for (size_t c = 0; c < k; ++c) scale[c] = a[c][c];
    for (size_t c = 0; c < k; ++c) {
      size_t p = c;
      for (size_t r = c + 1; r < k; ++r) {
        if (std::abs(a[r][c]) > std::abs(a[p][c])) p = r;
      }
      if (std::abs(a[p][c]) < 1e-9 * std::max(scale[c], 1e-300)) return false;
      std::swap(a[p], a[c]);
      for (size_t r = 0; r < k; ++r) {
        if (r == c) continue;
        const double f = a[r][c] / a[c][c];
        for (size_t j = c; j <= k; ++j) a[r][j] -= f * a[c][j];
      }
    }
    std::vector<double> x(k);
    for (size_t i = 0; i < k; ++i) x[i] = a[i][k] / a[i][i];
    *fit = CallFit();
    fit->overhead_ms = x[0];
    size_t at = 1;
    if (mask & 1) fit->ms_per_id = x[at++] / si;
    if (mask & 2) fit->ms_per_gathered_byte = x[at++] / sg;
    if (mask & 4) fit->ms_per_wire_byte = x[at++] / sw;
    return true;
  };
  // The full fit, or, where a term comes out negative (noise) or cannot be
  // told apart, the best fit without it: every term stays >= 0.
  CallFit best;
  double best_sse = -1;
  for (int mask : {7, 6, 3, 5, 2, 4, 1}) {
    if (mask & 1 && si <= 0) continue;
    CallFit fit;
    if (!solve(mask, &fit)) continue;
    if (fit.overhead_ms < 0 || fit.ms_per_id < 0 || fit.ms_per_gathered_byte < 0 ||
        fit.ms_per_wire_byte < 0) {
      continue;
    }
    double sse = 0;  // of relative errors, as fitted
    for (const CallSample& s : samples) {
      const double e = s.ms - PredictCall(fit, s);
      sse += s.ms > 0 ? e * e / (s.ms * s.ms) : e * e;
    }
    if (best_sse < 0 || sse < best_sse) {
      best = fit;
      best_sse = sse;
    }
    if (mask == 7) break;  // the full model fits with every term >= 0
  }
  if (best_sse < 0 || (best.ms_per_gathered_byte == 0 && best.ms_per_wire_byte == 0)) {
    return Bad("the timed calls cannot tell the terms apart (vary ids and output sizes)");
  }
  double mean = 0, sst = 0, abs_sse = 0;
  for (const CallSample& s : samples) mean += s.ms / samples.size();
  for (const CallSample& s : samples) {
    const double e = s.ms - PredictCall(best, s);
    abs_sse += e * e;
    sst += (s.ms - mean) * (s.ms - mean);
  }
  best.r2 = sst > 0 ? 1.0 - abs_sse / sst : 1.0;
  return best;
}

CostModel Calibrated(CostModel m, ember::v1::ComputeDevice device, const CallFit& fit,
                     double bwd_compute_multiplier, double per_shard_ms) {
  // ms per byte = 1 / (GB/s * 1e6).
  if (fit.ms_per_gathered_byte > 0) {
    const double gbps = 1.0 / (fit.ms_per_gathered_byte * 1e6);
    if (device == ember::v1::CUDA) {
      m.hbm_bw_gbps = gbps;
    } else {
      m.ddr_bw_gbps = gbps;
    }
    m.lookup_efficiency = 1.0;
  }
  if (fit.ms_per_wire_byte > 0) m.network_bw_gbps = 1.0 / (fit.ms_per_wire_byte * 1e6);
  m.per_id_ms = fit.ms_per_id;
  // The fit's fixed time is one call with one shard: the part a second
  // shard in the same call adds is per shard, the rest per call.
  m.per_shard_overhead_ms =
      per_shard_ms >= 0 ? std::min(per_shard_ms, fit.overhead_ms) : fit.overhead_ms;
  m.per_call_overhead_ms = fit.overhead_ms - m.per_shard_overhead_ms;
  if (bwd_compute_multiplier > 0) m.bwd_compute_multiplier = bwd_compute_multiplier;
  return m;
}

}  // namespace planner
}  // namespace ember
