// Cost model files (round trip, refusals) and the least-squares fit of
// timed calls (recovers constants it was generated from; keeps every term
// >= 0 under noise; refuses samples that cannot tell the terms apart).
#include "planner/cost_model_io.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ember {
namespace planner {
namespace {

using ::testing::HasSubstr;

TEST(CostModelIoTest, RoundTripsEveryField) {
  CostModel m = DefaultCostModel(ember::v1::CPU);
  m.ddr_bw_gbps = 7.25;
  m.network_bw_gbps = 1.5;
  m.per_shard_overhead_ms = 0.125;
  m.bwd_compute_multiplier = 3;
  m.lookup_efficiency = 1;
  m.cache_bytes = 6 << 20;
  m.cache_bw_gbps = 180.5;
  ember::v1::ComputeDevice device = ember::v1::CUDA;
  auto back = CostModelFromJson(CostModelToJson(m, ember::v1::CPU), &device);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(device, ember::v1::CPU);
  EXPECT_EQ(back->ddr_bw_gbps, 7.25);
  EXPECT_EQ(back->network_bw_gbps, 1.5);
  EXPECT_EQ(back->per_shard_overhead_ms, 0.125);
  EXPECT_EQ(back->bwd_compute_multiplier, 3);
  EXPECT_EQ(back->cache_bytes, 6 << 20);
  EXPECT_EQ(back->cache_bw_gbps, 180.5);
  EXPECT_EQ(back->ddr_cap_bytes, m.ddr_cap_bytes);
  EXPECT_EQ(back->access_granularity_bytes, 64);
  EXPECT_FALSE(back->narrow_row_penalty);
  // Fields left out keep the device's defaults.
  auto partial = CostModelFromJson(R"({"device": "cuda", "network_bw_gbps": 3})");
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_EQ(partial->network_bw_gbps, 3);
  EXPECT_EQ(partial->hbm_bw_gbps, DefaultCostModel(ember::v1::CUDA).hbm_bw_gbps);
}

TEST(CostModelIoTest, RoundTripsHitRateCurves) {
  CostModel m = DefaultCostModel(ember::v1::CPU);
  m.hit_rate_curves["t_user"] = {0.25, 0.3, 0.4, 0.5, 0.625, 0.7, 0.8, 0.9, 1};
  m.hit_rate_curves["t_item"] = {0, 0, 0, 0, 0, 0, 0, 0, 0.5};
  auto back = CostModelFromJson(CostModelToJson(m, ember::v1::CPU));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hit_rate_curves, m.hit_rate_curves);
  // A model without curves writes none.
  EXPECT_EQ(CostModelToJson(DefaultCostModel(ember::v1::CPU), ember::v1::CPU)
                .find("hit_rate_curves"),
            std::string::npos);
}

TEST(CostModelIoTest, RefusesWhatWouldMisleadThePlanner) {
  auto bad = [](const std::string& json, const std::string& why) {
    auto m = CostModelFromJson(json);
    ASSERT_FALSE(m.ok()) << json;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(why)) << m.status();
  };
  bad("[]", "not a JSON object");
  bad(R"({"ddr_bw_gbps": 5})", "\"device\" must be");
  bad(R"({"device": "tpu"})", "\"device\" must be");
  bad(R"({"device": "cpu", "ddr_bw_gbsp": 5})", "unknown field 'ddr_bw_gbsp'");
  bad(R"({"device": "cpu", "network_bw_gbps": 0})", "'network_bw_gbps' = 0 is out of range");
  bad(R"({"device": "cpu", "lookup_efficiency": 1.5})", "<= 1");
  bad(R"({"device": "cpu", "id_bytes": 7.5})", "an integer");
  bad(R"({"device": "cpu", "ddr_bw_gbps": "fast"})", "must be a number");
  bad(R"({"device": "cpu", "ddr_bw_gbps": 0})", "CPU workers need ddr_bw_gbps > 0");
  bad(R"({"device": "cpu", "cache_bytes": 8388608})", "cache_bytes > 0 needs cache_bw_gbps > 0");
  bad(R"({"device": "cpu", "cache_bytes": -1, "cache_bw_gbps": 100})", "'cache_bytes' = -1");
  bad(R"({"device": "cpu", "hit_rate_curves": [0.5]})", "must be an object");
  bad(R"({"device": "cpu", "hit_rate_curves": {"t": [0.1, 0.2]}})",
      "'hit_rate_curves' of table 't' must be a list of 9 hit rates");
  bad(R"({"device": "cpu", "hit_rate_curves": {"t": [0, 0, 0, 0, 0, 0, 0, 0, 1.5]}})",
      "a rate outside [0, 1]");
  bad(R"({"device": "cpu", "hit_rate_curves": {"t": [0, 0, 0, "x", 0, 0, 0, 0, 1]}})",
      "a rate outside [0, 1]");
  bad(R"({"device": "cpu", "hit_rate_curves": {"t": [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1]}})",
      "the rate falls as the cache grows (0.5 then 0.4)");
  EXPECT_EQ(LoadCostModel("/nonexistent/model.json").status().code(), absl::StatusCode::kNotFound);
}

TEST(CostModelIoTest, FitRecoversTheConstantsOfItsSamples) {
  // 0.2 ms per call, 2 GB/s gathered (5e-7 ms/B), 0.5 GB/s on the wire.
  const double c0 = 0.2, g = 5e-7, w = 2e-6;
  std::vector<CallSample> samples;
  for (double ids : {1.0, 1e3, 1e4, 1e5}) {
    for (double out : {256.0, 1e5, 1e6, 4e6}) {
      CallSample s;
      s.gathered_bytes = ids * 256 + out;
      s.wire_bytes = ids * 8 + out;
      s.ms = c0 + g * s.gathered_bytes + w * s.wire_bytes;
      samples.push_back(s);
    }
  }
  auto fit = FitCalls(samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->overhead_ms, c0, 1e-9);
  EXPECT_NEAR(fit->ms_per_gathered_byte, g, 1e-15);
  EXPECT_NEAR(fit->ms_per_wire_byte, w, 1e-15);
  EXPECT_NEAR(fit->r2, 1.0, 1e-12);
  const CostModel m = Calibrated(DefaultCostModel(ember::v1::CPU), ember::v1::CPU, *fit, 2.5);
  EXPECT_NEAR(m.ddr_bw_gbps, 2.0, 1e-9);
  EXPECT_NEAR(m.network_bw_gbps, 0.5, 1e-9);
  EXPECT_EQ(m.lookup_efficiency, 1.0);
  EXPECT_NEAR(m.per_shard_overhead_ms, c0, 1e-9);
  EXPECT_EQ(m.bwd_compute_multiplier, 2.5);

  // With noise (10%) the terms stay >= 0 and near.
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(1.0, 0.1);
  for (CallSample& s : samples) s.ms *= noise(rng);
  auto noisy = FitCalls(samples);
  ASSERT_TRUE(noisy.ok());
  EXPECT_GE(noisy->overhead_ms, 0);
  EXPECT_NEAR(noisy->ms_per_wire_byte, w, 0.3 * w);
  EXPECT_GT(noisy->r2, 0.8);
}

// Rows of two widths tell a cost per id from the cost per gathered byte.
TEST(CostModelIoTest, FitRecoversACostPerIdFromTwoRowWidths) {
  // 0.1 ms per call, 20 ns per id, 4 GB/s gathered, 1 GB/s on the wire.
  const double c0 = 0.1, per_id = 2e-5, g = 2.5e-7, w = 1e-6;
  std::vector<CallSample> samples;
  for (double dim : {16.0, 128.0}) {
    for (double ids : {1.0, 1e3, 1e4, 1e5}) {
      for (double bags : {1.0, 1e3, 1e4}) {
        CallSample s;
        s.ids = ids;
        s.gathered_bytes = ids * dim * 4 + bags * dim * 4;
        s.wire_bytes = ids * 8 + bags * 8 + bags * dim * 4;
        s.ms = c0 + per_id * ids + g * s.gathered_bytes + w * s.wire_bytes;
        samples.push_back(s);
      }
    }
  }
  auto fit = FitCalls(samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->overhead_ms, c0, 1e-9);
  EXPECT_NEAR(fit->ms_per_id, per_id, 1e-12);
  EXPECT_NEAR(fit->ms_per_gathered_byte, g, 1e-15);
  EXPECT_NEAR(fit->ms_per_wire_byte, w, 1e-15);
  for (const CallSample& s : samples) EXPECT_NEAR(PredictCall(*fit, s), s.ms, 1e-9);
  const CostModel m = Calibrated(DefaultCostModel(ember::v1::CPU), ember::v1::CPU, *fit, 2.0);
  EXPECT_NEAR(m.per_id_ms, per_id, 1e-12);
  // Without the split measured, the whole fixed time is per shard.
  EXPECT_NEAR(m.per_shard_overhead_ms, c0, 1e-9);
  EXPECT_EQ(m.per_call_overhead_ms, 0);
  // With it: what a second shard adds is per shard, the rest per call; a
  // measured part above the whole (noise) is the whole.
  const CostModel split =
      Calibrated(DefaultCostModel(ember::v1::CPU), ember::v1::CPU, *fit, 2.0, 0.03);
  EXPECT_NEAR(split.per_shard_overhead_ms, 0.03, 1e-12);
  EXPECT_NEAR(split.per_call_overhead_ms, c0 - 0.03, 1e-9);
  const CostModel over =
      Calibrated(DefaultCostModel(ember::v1::CPU), ember::v1::CPU, *fit, 2.0, 5.0);
  EXPECT_NEAR(over.per_shard_overhead_ms, c0, 1e-9);
  EXPECT_NEAR(over.per_call_overhead_ms, 0, 1e-9);
  // And round-trips through the file.
  auto back = CostModelFromJson(CostModelToJson(split, ember::v1::CPU));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_NEAR(back->per_id_ms, per_id, 1e-15);
  EXPECT_NEAR(back->per_call_overhead_ms, c0 - 0.03, 1e-12);

  // With one width (the dim-16 half of the samples) the three terms are
  // linear in ids and bags alone: the full fit cannot tell them apart, and
  // the fit keeps the terms it can tell and still explains the times.
  const std::vector<CallSample> one_width(samples.begin(), samples.begin() + samples.size() / 2);
  auto single = FitCalls(one_width);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_GE(single->ms_per_id, 0);
  EXPECT_GT(single->r2, 0.999);
}

TEST(CostModelIoTest, FitRefusesSamplesThatCannotTellTheTermsApart) {
  EXPECT_EQ(FitCalls({}).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<CallSample> same_ratio;
  for (double b : {1e3, 1e4, 1e5, 1e6}) same_ratio.push_back({b, b, 1 + b * 1e-6});
  // Gathered and wire bytes equal throughout: one byte term can explain
  // them; the fit keeps one and says how well it fits.
  auto fit = FitCalls(same_ratio);
  if (fit.ok()) {
    EXPECT_EQ(fit->ms_per_gathered_byte == 0 || fit->ms_per_wire_byte == 0, true);
  } else {
    EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(FitCalls({{0, 0, 1}, {0, 0, 2}, {0, 0, 3}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace planner
}  // namespace ember
