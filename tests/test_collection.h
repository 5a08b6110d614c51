// What the multi-process tests share: the collection they train (four
// tables covering SUM / MEAN / weighted SUM / NONE and the four optimizers),
// random KJTs for it, a float comparison with a relative tolerance, every
// table of a collection exported, and a fresh temporary directory.
#ifndef EMBER_TESTS_TEST_COLLECTION_H_
#define EMBER_TESTS_TEST_COLLECTION_H_

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <stdlib.h>

#include <map>

#include "client/client.h"
#include "client/inprocess.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "client/kjt.h"
#include "gtest/gtest.h"
#include "proto/collection.pb.h"
#include "proto/service.pb.h"
#include "server/common/wire.h"

namespace ember {
namespace testing_util {

using client::KeyedJaggedTensor;
using ember::v1::CollectionSpec;
using ember::v1::OptimizerSpec;
using ember::v1::TableConfig;

// Four tables covering SUM / MEAN / weighted SUM / NONE and the four
// optimizers.
inline CollectionSpec TestSpec(const std::string& name) {
  CollectionSpec spec;
  spec.set_name(name);
  struct T {
    const char* name;
    int rows;
    TableConfig::Pooling pooling;
    OptimizerSpec::Type opt;
  } tables[] = {{"t_sum", 301, TableConfig::SUM, OptimizerSpec::SGD},
                {"t_mean", 200, TableConfig::MEAN, OptimizerSpec::ADAGRAD},
                {"t_rw", 150, TableConfig::SUM, OptimizerSpec::ROWWISE_ADAGRAD},
                {"t_seq", 120, TableConfig::NONE, OptimizerSpec::ADAM}};
  for (const T& t : tables) {
    TableConfig* c = spec.add_tables();
    c->set_name(t.name);
    c->set_num_embeddings(t.rows);
    c->set_embedding_dim(16);
    c->add_feature_names(std::string("f_") + (t.name + 2));
    c->set_pooling(t.pooling);
    c->mutable_optimizer()->set_type(t.opt);
    c->mutable_optimizer()->set_learning_rate(0.05);
    c->mutable_initializer()->set_seed(11);
  }
  spec.mutable_tables(0)->add_feature_names("f_sum2");  // two features share a table
  return spec;
}

inline KeyedJaggedTensor RandomKjt(std::mt19937& rng, const std::vector<std::string>& keys,
                            const std::vector<int>& rows, int batch, bool weighted) {
  std::vector<std::vector<std::vector<int64_t>>> ids(keys.size());
  std::vector<std::vector<std::vector<float>>> w(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    for (int b = 0; b < batch; ++b) {
      const int len = rng() % 4 == 0 ? 0 : 1 + rng() % 6;  // empty bags too
      ids[k].emplace_back();
      w[k].emplace_back();
      for (int i = 0; i < len; ++i) {
        // A narrow range half the time: duplicates within and across bags.
        ids[k][b].push_back(rng() % (rng() % 2 ? 7 : rows[k]));
        w[k][b].push_back(std::uniform_real_distribution<float>(0.5f, 1.5f)(rng));
      }
    }
  }
  auto kjt = KeyedJaggedTensor::FromJagged(keys, ids, weighted ? w : decltype(w){});
  EXPECT_TRUE(kjt.ok()) << kjt.status();
  return *kjt;
}

// The tolerance every comparison with the reference uses.
inline double Tolerance(float want) { return 2e-5 * (1 + std::abs(want)); }

inline void ExpectNear(absl::Span<const float> got, absl::Span<const float> want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], Tolerance(want[i])) << what << " at " << i;
  }
}

// How many values differ beyond ExpectNear's tolerance (for threads, where
// ASSERTs cannot stop the test); a size mismatch counts as one.
inline int Mismatches(absl::Span<const float> got, absl::Span<const float> want) {
  if (got.size() != want.size()) return 1;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > Tolerance(want[i])) ++bad;
  }
  return bad;
}

using Tables = std::map<std::string, std::vector<float>>;

// Every table of a collection, exported through the client.
inline Tables ExportAll(client::Client* c, const std::string& name, const CollectionSpec& spec) {
  Tables out;
  for (const auto& t : spec.tables()) {
    int64_t rows = 0, dim = 0;
    auto v = c->ExportTable(name, t.name(), &rows, &dim);
    EXPECT_TRUE(v.ok()) << name << "/" << t.name() << ": " << v.status();
    if (v.ok()) out[t.name()] = *v;
  }
  return out;
}

// Random gradients in Lookup's layout for `keys` (in the collection's
// order) of widths `dims`, `batch` rows.
inline client::KeyedTensor RandomGradients(std::mt19937& rng, const std::vector<std::string>& keys,
                                           const std::vector<int64_t>& dims, int64_t batch) {
  client::KeyedTensor g;
  g.keys = keys;
  g.length_per_key = dims;
  g.batch_size = batch;
  for (int64_t i = 0; i < batch * g.row_width(); ++i) {
    g.values.push_back(std::uniform_real_distribution<float>(-1, 1)(rng));
  }
  return g;
}

// Retries an update under one request id until it is acknowledged (or 60 s
// pass): UNAVAILABLE, FAILED_PRECONDITION and DEADLINE_EXCEEDED are waited
// out, as a trainer riding through a recovery or a drain would.
inline absl::Status ApplyUntilAcknowledged(client::Client* c, const std::string& name,
                                           const KeyedJaggedTensor& k, const client::KeyedTensor& g,
                                           const std::string& id) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (;;) {
    absl::Status s = c->ApplyGradients(name, k, g, id);
    if (s.ok()) return s;
    if (!absl::IsUnavailable(s) && !absl::IsFailedPrecondition(s) &&
        !absl::IsDeadlineExceeded(s)) {
      return s;
    }
    if (absl::Now() > deadline) return s;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// One training step of TestSpec's collection `name` through `c` and
// `ref` alike: a pooled lookup (the four pooled features, `batch` bags,
// per-sample weights when `weighted`) compared, random gradients applied to
// both, then the same for the sequence feature when `sequence`.
inline void StepAgainstReference(client::Client* c, client::InProcessCollection* ref,
                                 const std::string& name, std::mt19937& rng, int batch,
                                 bool weighted, bool sequence, const std::string& what) {
  const KeyedJaggedTensor kjt =
      RandomKjt(rng, {"f_mean", "f_sum", "f_rw", "f_sum2"}, {200, 301, 150, 301}, batch, weighted);
  auto kt = c->Lookup(name, kjt);
  ASSERT_TRUE(kt.ok()) << kt.status();
  // Collection order: t_sum's f_sum, f_sum2, then t_mean, t_rw.
  ASSERT_EQ(kt->keys, (std::vector<std::string>{"f_sum", "f_sum2", "f_mean", "f_rw"}));
  auto want = ref->Lookup(kjt);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(kt->length_per_key, want->length_per_key);
  ExpectNear(kt->values, want->values, what + " lookup");
  client::KeyedTensor grads = *kt;
  for (float& g : grads.values) g = std::uniform_real_distribution<float>(-1, 1)(rng);
  ASSERT_TRUE(c->ApplyGradients(name, kjt, grads).ok());
  ASSERT_TRUE(ref->ApplyGradients(kjt, grads).ok());
  if (!sequence) return;
  const KeyedJaggedTensor seq = RandomKjt(rng, {"f_seq"}, {120}, batch, false);
  auto se = c->LookupSequence(name, seq);
  ASSERT_TRUE(se.ok()) << se.status();
  auto se_want = ref->LookupSequence(seq);
  ASSERT_TRUE(se_want.ok()) << se_want.status();
  ExpectNear((*se)[0].values, (*se_want)[0].values, what + " sequence lookup");
  auto sg = *se;
  for (float& g : sg[0].values) g = std::uniform_real_distribution<float>(-1, 1)(rng);
  ASSERT_TRUE(c->ApplySequenceGradients(name, seq, sg).ok());
  ASSERT_TRUE(ref->ApplySequenceGradients(seq, sg).ok());
}

// Every table of `spec` exported through `c` equals the reference's.
inline void ExpectTablesMatch(client::Client* c, client::InProcessCollection* ref,
                              const std::string& name, const CollectionSpec& spec,
                              const std::string& what) {
  for (const auto& t : spec.tables()) {
    int64_t rows = 0, dim = 0, ref_rows = 0, ref_dim = 0;
    auto got = c->ExportTable(name, t.name(), &rows, &dim);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(rows, t.num_embeddings());
    auto want = ref->ExportTable(t.name(), &ref_rows, &ref_dim);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectNear(*got, *want, what + " table " + t.name());
  }
}

// A new directory under the test's temporary directory ($TEST_TMPDIR, which
// Bazel empties before each run), so checkpoints the tests write do not pile
// up on the machine.
inline std::string TempDir() {
  std::string tmpl = ::testing::TempDir();
  if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
  tmpl += "ember_test_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr) << tmpl;
  return d == nullptr ? ::testing::TempDir() : std::string(d);
}

// A worker's update of one bag of one id: row `id` of shard `shard_index`
// of `table`, through `feature` (SUM), its gradient `dim` values of
// `value`, arrays inline; as a client (or a forged caller) sends it.
inline ember::v1::WorkerApplyGradientsRequest OneIdUpdate(
    const std::string& collection, int64_t epoch, const std::string& request_id,
    const std::string& table, int32_t shard_index, const std::string& feature, int64_t id,
    int dim, float value) {
  ember::v1::WorkerApplyGradientsRequest req;
  req.set_collection(collection);
  req.set_epoch(epoch);
  req.set_request_id(request_id);
  auto* g = req.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table(table);
  g->mutable_feature()->mutable_shard()->set_shard_index(shard_index);
  g->mutable_feature()->set_feature(feature);
  g->mutable_feature()->set_pooling(ember::v1::TableConfig::SUM);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>({1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>({id}));
  g->set_grad(wire::Encode<float>(std::vector<float>(dim, value)));
  return req;
}

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_TEST_COLLECTION_H_
