// Calls cut to fit a fixed scratch: the pieces cover the call exactly once,
// each fits, and running them gives what running the whole call gives
// (checked against naive sums written here, not against the splitter's own
// arithmetic). The parity suite runs the emulated backend through the same
// code on every optimizer (backend_parity_test, cuda_emulated_split).
#include "server/backend/cuda/call_split.h"

#include <map>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace {


struct Fixture {
  std::map<ShardId, ShardSpec> specs;
  std::vector<char> memory = std::vector<char>(64);
  ShardResolver resolver() {
    return [this](ShardId id) {
      ShardView v;
      v.weights = memory.data() + id;
      v.spec = &specs.at(id);
      return v;
    };
  }
  void Add(ShardId id, int64_t rows, int64_t dim) {
    ShardSpec s;
    s.table = "t" + std::to_string(id);
    s.rows = s.table_rows = rows;
    s.dim = dim;
    specs[id] = s;
  }
};

Scratch MakeScratch(size_t bytes) {
  Scratch s;
  s.device_bytes = s.host_bytes = bytes;
  s.lookup_temp = [](const CallSize& c) { return static_cast<size_t>(256 + 8 * c.bags); };
  s.gradient_temp = [](const CallSize& c) { return static_cast<size_t>(256 + 8 * c.ids); };
  return s;
}

FeatureRequest Feature(ShardId shard, Pooling p, const std::vector<int64_t>& lengths,
                       const std::vector<int64_t>& ids, const std::vector<float>& weights = {}) {
  FeatureRequest f;
  f.shard = shard;
  f.pooling = p;
  f.lengths = lengths;
  f.ids = ids;
  f.weights = weights;
  return f;
}

// A lookup against a table whose row r is (r, r, ...): pooled output c of a
// bag is the sum (or mean) of its ids times their weights.
void NaiveLookup(absl::Span<const LookupRequest> requests, const ShardResolver& shards) {
  for (const LookupRequest& r : requests) {
    const FeatureRequest& f = r.feature;
    const int64_t dim = shards(f.shard).spec->dim;
    size_t k = 0;
    for (size_t bag = 0; bag < f.lengths.size(); ++bag) {
      double acc = 0;
      for (int64_t j = 0; j < f.lengths[bag]; ++j, ++k) {
        const double w = f.weights.empty() ? 1.0 : f.weights[k];
        if (f.pooling == Pooling::kNone) {
          for (int64_t c = 0; c < dim; ++c) r.output[k * dim + c] = static_cast<float>(f.ids[k]);
        }
        acc += w * f.ids[k];
      }
      if (f.pooling == Pooling::kMean && f.lengths[bag] > 0) acc /= f.lengths[bag];
      if (f.pooling != Pooling::kNone) {
        for (int64_t c = 0; c < dim; ++c) r.output[bag * dim + c] = static_cast<float>(acc);
      }
    }
  }
}

TEST(CallSplitTest, LookupThatFitsRunsWhole) {
  Fixture fx;
  fx.Add(0, 10, 4);
  const std::vector<int64_t> lengths = {2, 1}, ids = {1, 2, 3};
  std::vector<float> out(8);
  const std::vector<LookupRequest> reqs = {{Feature(0, Pooling::kSum, lengths, ids),
                                            absl::MakeSpan(out)}};
  int calls = 0;
  ASSERT_TRUE(ForEachLookupPiece(reqs, PlanLookup(reqs, fx.resolver()), fx.resolver(),
                                 MakeScratch(1 << 20),
                                 [&](absl::Span<const LookupRequest> piece) {
                                   ++calls;
                                   EXPECT_EQ(piece.data(), reqs.data());  // no copy
                                   return absl::OkStatus();
                                 })
                  .ok());
  EXPECT_EQ(calls, 1);
}

TEST(CallSplitTest, LookupPiecesCoverTheCallAndEachFits) {
  Fixture fx;
  fx.Add(0, 1000, 8);
  fx.Add(1, 1000, 4);
  std::vector<int64_t> l0, i0, l1, i1, l2, i2;
  std::vector<float> w0;
  for (int b = 0; b < 300; ++b) {
    l0.push_back(b % 5);  // empty bags too
    for (int j = 0; j < b % 5; ++j) {
      i0.push_back((b * 7 + j) % 1000);
      w0.push_back(0.5f * j);
    }
    l1.push_back(1);
    i1.push_back(b);
    l2.push_back(b % 3);
    for (int j = 0; j < b % 3; ++j) i2.push_back((b + j) % 1000);
  }
  std::vector<float> o0(300 * 8), o1(300 * 4), o2(i2.size() * 4);
  const std::vector<LookupRequest> reqs = {
      {Feature(0, Pooling::kSum, l0, i0, w0), absl::MakeSpan(o0)},
      {Feature(1, Pooling::kMean, l1, i1), absl::MakeSpan(o1)},
      {Feature(1, Pooling::kNone, l2, i2), absl::MakeSpan(o2)}};
  // What the whole call gives.
  std::vector<float> e0(o0.size()), e1(o1.size()), e2(o2.size());
  const std::vector<LookupRequest> whole = {
      {reqs[0].feature, absl::MakeSpan(e0)},
      {reqs[1].feature, absl::MakeSpan(e1)},
      {reqs[2].feature, absl::MakeSpan(e2)}};
  NaiveLookup(whole, fx.resolver());

  const Scratch scratch = MakeScratch(8 << 10);
  ASSERT_FALSE(scratch.FitsLookup(SizeOf(PlanLookup(reqs, fx.resolver()))));
  int pieces = 0;
  int64_t bags = 0;
  ASSERT_TRUE(ForEachLookupPiece(reqs, PlanLookup(reqs, fx.resolver()), fx.resolver(), scratch,
                                 [&](absl::Span<const LookupRequest> piece) {
                                   ++pieces;
                                   EXPECT_TRUE(scratch.FitsLookup(
                                       SizeOf(PlanLookup(piece, fx.resolver()))));
                                   for (const LookupRequest& r : piece) {
                                     bags += static_cast<int64_t>(r.feature.lengths.size());
                                   }
                                   NaiveLookup(piece, fx.resolver());
                                   return absl::OkStatus();
                                 })
                  .ok());
  EXPECT_GT(pieces, 3);
  EXPECT_EQ(bags, 900);  // every bag once
  EXPECT_EQ(o0, e0);
  EXPECT_EQ(o1, e1);
  EXPECT_EQ(o2, e2);
}

TEST(CallSplitTest, LookupBagLargerThanScratchIsRefusedBeforeAnythingRuns) {
  Fixture fx;
  fx.Add(0, 100000, 4);
  std::vector<int64_t> lengths = {1, 5000}, ids(5001, 3);
  std::vector<float> out(8);
  const std::vector<LookupRequest> reqs = {{Feature(0, Pooling::kSum, lengths, ids),
                                            absl::MakeSpan(out)}};
  bool ran = false;
  const absl::Status s = ForEachLookupPiece(
      reqs, PlanLookup(reqs, fx.resolver()), fx.resolver(), MakeScratch(16 << 10),
      [&](absl::Span<const LookupRequest>) {
        ran = true;
        return absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("bag 1 has 5000 ids"), std::string::npos) << s;
  EXPECT_FALSE(ran);
}

// A NONE feature's output is per id: one long sequence is cut inside its
// bag, where a pooled bag of the same length would be refused.
TEST(CallSplitTest, LongSequenceIsCutInsideItsBag) {
  Fixture fx;
  fx.Add(0, 1000, 16);
  const std::vector<int64_t> lengths = {3, 900, 2};
  std::vector<int64_t> ids(905);
  for (int i = 0; i < 905; ++i) ids[i] = (i * 13) % 1000;
  std::vector<float> out(905 * 16), expected(out.size());
  const FeatureRequest f = Feature(0, Pooling::kNone, lengths, ids);
  NaiveLookup({{f, absl::MakeSpan(expected)}}, fx.resolver());
  const std::vector<LookupRequest> reqs = {{f, absl::MakeSpan(out)}};
  const Scratch scratch = MakeScratch(16 << 10);
  int pieces = 0;
  ASSERT_TRUE(ForEachLookupPiece(reqs, PlanLookup(reqs, fx.resolver()), fx.resolver(), scratch,
                                 [&](absl::Span<const LookupRequest> piece) {
                                   ++pieces;
                                   EXPECT_TRUE(scratch.FitsLookup(
                                       SizeOf(PlanLookup(piece, fx.resolver()))));
                                   NaiveLookup(piece, fx.resolver());
                                   return absl::OkStatus();
                                 })
                  .ok());
  EXPECT_GT(pieces, 4);
  EXPECT_EQ(out, expected);
  // Pooled, the 900-id bag is one sum and cannot be cut.
  std::vector<float> pooled(3 * 16);
  const std::vector<LookupRequest> sum = {
      {Feature(0, Pooling::kSum, lengths, ids), absl::MakeSpan(pooled)}};
  EXPECT_EQ(ForEachLookupPiece(sum, PlanLookup(sum, fx.resolver()), fx.resolver(),
                               MakeScratch(8 << 10),
                               [](absl::Span<const LookupRequest>) { return absl::OkStatus(); })
                .code(),
            absl::StatusCode::kResourceExhausted);
}

// (shard, row) -> the gradient a call gives the row, summed in call order
// in double: the factor (weight, 1/length for MEAN) times its bag's (or,
// for NONE, its own) gradient row.
using Merged = std::map<std::pair<ShardId, int64_t>, std::vector<double>>;

void NaiveMerge(absl::Span<const GradientRequest> requests, const ShardResolver& shards,
                Merged* merged) {
  for (const GradientRequest& r : requests) {
    const FeatureRequest& f = r.feature;
    const int64_t dim = shards(f.shard).spec->dim;
    size_t k = 0;
    for (size_t bag = 0; bag < f.lengths.size(); ++bag) {
      for (int64_t j = 0; j < f.lengths[bag]; ++j, ++k) {
        double factor = f.weights.empty() ? 1.0 : f.weights[k];
        if (f.pooling == Pooling::kMean) factor /= f.lengths[bag];
        const size_t row = f.pooling == Pooling::kNone ? k : bag;
        std::vector<double>& g = (*merged)[{f.shard, f.ids[k]}];
        g.resize(dim, 0.0);
        for (int64_t c = 0; c < dim; ++c) g[c] += factor * r.grad[row * dim + c];
      }
    }
  }
}

TEST(CallSplitTest, GradientPiecesHoldDisjointRowsAndTheWholeGradient) {
  Fixture fx;
  fx.Add(2, 50, 8);
  fx.Add(7, 40, 4);
  std::vector<int64_t> l0, i0, l1, i1, l2, i2;
  std::vector<float> w0, g0, g1, g2;
  for (int b = 0; b < 200; ++b) {
    l0.push_back(b % 4);
    for (int j = 0; j < b % 4; ++j) {
      i0.push_back(b % 9 == 0 ? 11 : (b * 3 + j) % 50);  // row 11 is hot
      w0.push_back(0.25f * (j + 1));
    }
    for (int c = 0; c < 8; ++c) g0.push_back(0.01f * (b + c));
    l1.push_back(2);
    i1.push_back(b % 40);
    i1.push_back((b * 7) % 40);
    for (int c = 0; c < 4; ++c) g1.push_back(0.5f - 0.001f * b * c);
    l2.push_back(1);
    i2.push_back(b % 17);
    for (int c = 0; c < 8; ++c) g2.push_back(0.1f * c - 0.002f * b);
  }
  const std::vector<GradientRequest> reqs = {
      {Feature(2, Pooling::kSum, l0, i0, w0), g0},
      {Feature(7, Pooling::kMean, l1, i1), g1},
      {Feature(2, Pooling::kNone, l2, i2), g2}};
  Merged expected;
  NaiveMerge(reqs, fx.resolver(), &expected);

  const GradientPlan plan = PlanGradients(reqs, fx.resolver());
  const Scratch scratch = MakeScratch(24 << 10);
  ASSERT_FALSE(scratch.FitsGradients(SizeOf(plan)));
  Merged got;
  std::map<std::pair<ShardId, int64_t>, int> piece_of;
  int pieces = 0;
  ASSERT_TRUE(ForEachGradientPiece(
                  reqs, plan, fx.resolver(), scratch,
                  [&](absl::Span<const GradientRequest> piece) {
                    EXPECT_TRUE(
                        scratch.FitsGradients(SizeOf(PlanGradients(piece, fx.resolver()))));
                    Merged mine;
                    NaiveMerge(piece, fx.resolver(), &mine);
                    for (auto& [key, g] : mine) {
                      // A row's occurrences are all in one piece.
                      EXPECT_EQ(piece_of.count(key), 0u) << key.first << "/" << key.second;
                      piece_of[key] = pieces;
                      got[key] = g;
                    }
                    ++pieces;
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_GT(pieces, 2);
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [key, g] : expected) {
    ASSERT_EQ(got[key].size(), g.size());
    for (size_t c = 0; c < g.size(); ++c) {
      EXPECT_NEAR(got[key][c], g[c], 1e-5 * (1 + std::abs(g[c])))
          << "shard " << key.first << " row " << key.second << " col " << c;
    }
  }
}

TEST(CallSplitTest, GradientRowTooHotForScratchIsRefusedBeforeAnythingRuns) {
  Fixture fx;
  fx.Add(4, 10, 4);
  std::vector<int64_t> lengths = {3000}, ids(3000, 6);
  std::vector<float> grad(4, 1.0f);
  const std::vector<GradientRequest> reqs = {{Feature(4, Pooling::kSum, lengths, ids), grad}};
  bool ran = false;
  const absl::Status s = ForEachGradientPiece(
      reqs, PlanGradients(reqs, fx.resolver()), fx.resolver(), MakeScratch(32 << 10),
      [&](absl::Span<const GradientRequest>) {
        ran = true;
        return absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("row 6 of table 't4' occurs 3000 times"), std::string::npos) << s;
  EXPECT_FALSE(ran);
}

// The whole-call check runs only when the call is cut, before any piece;
// its error stops everything.
TEST(CallSplitTest, WholeCallIsCheckedOnlyWhenCut) {
  Fixture fx;
  fx.Add(0, 1000, 8);
  std::vector<int64_t> lengths(500, 1), ids(500);
  for (int i = 0; i < 500; ++i) ids[i] = i;
  std::vector<float> out(500 * 8);
  const std::vector<LookupRequest> reqs = {{Feature(0, Pooling::kSum, lengths, ids),
                                            absl::MakeSpan(out)}};
  const LookupPlan plan = PlanLookup(reqs, fx.resolver());
  int checks = 0, runs = 0;
  auto run = [&](absl::Span<const LookupRequest>) {
    ++runs;
    return absl::OkStatus();
  };
  auto refuse = [&] {
    ++checks;
    return absl::InvalidArgumentError("bad id");
  };
  EXPECT_TRUE(
      ForEachLookupPiece(reqs, plan, fx.resolver(), MakeScratch(1 << 20), run, refuse).ok());
  EXPECT_EQ(checks, 0);  // it fit: the backend checks while staging
  EXPECT_EQ(runs, 1);
  runs = 0;
  EXPECT_EQ(ForEachLookupPiece(reqs, plan, fx.resolver(), MakeScratch(8 << 10), run, refuse).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(checks, 1);
  EXPECT_EQ(runs, 0);

  std::vector<float> grad(500 * 8, 1.0f);
  const std::vector<GradientRequest> greqs = {{Feature(0, Pooling::kSum, lengths, ids), grad}};
  const GradientPlan gplan = PlanGradients(greqs, fx.resolver());
  auto grun = [&](absl::Span<const GradientRequest>) {
    ++runs;
    return absl::OkStatus();
  };
  EXPECT_EQ(ForEachGradientPiece(greqs, gplan, fx.resolver(), MakeScratch(8 << 10), grun, refuse)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(checks, 2);
  EXPECT_EQ(runs, 0);
}

TEST(CallSplitTest, PieceFailureStopsTheRest) {
  Fixture fx;
  fx.Add(0, 1000, 8);
  std::vector<int64_t> lengths(500, 1), ids(500);
  for (int i = 0; i < 500; ++i) ids[i] = i;
  std::vector<float> out(500 * 8);
  const std::vector<LookupRequest> reqs = {{Feature(0, Pooling::kSum, lengths, ids),
                                            absl::MakeSpan(out)}};
  int calls = 0;
  const absl::Status s = ForEachLookupPiece(
      reqs, PlanLookup(reqs, fx.resolver()), fx.resolver(), MakeScratch(8 << 10),
      [&](absl::Span<const LookupRequest>) {
        ++calls;
        return absl::InternalError("device gone");
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace backend
}  // namespace ember
