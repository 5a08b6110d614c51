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
#include "absl/time/clock.h"
#include "client/kjt.h"
#include "gtest/gtest.h"
#include "proto/collection.pb.h"

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

inline void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-5 * (1 + std::abs(want[i]))) << what << " at " << i;
  }
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

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_TEST_COLLECTION_H_
