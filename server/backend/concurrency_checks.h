// Checks every backend's tests run (cpu_backend_test, cuda_backend_test):
// - creating a large shard (allocation and initialisation, seconds for a
//   large table) leaves the calls on the shards already held running, with
//   its memory reserved from the start, and what no longer fits is refused
//   without keeping a reservation;
// - calls from several threads at once give exactly what the same calls
//   give one at a time (the CUDA backend overlaps one call's staging with
//   the previous call's kernels: a buffer reused too early shows here).
#ifndef EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_
#define EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

inline ShardSpec SgdSpec(const std::string& table, int64_t rows, int64_t dim) {
  ShardSpec s;
  s.table = table;
  s.rows = rows;
  s.table_rows = rows;
  s.dim = dim;
  s.optimizer.type = OptimizerType::kSgd;
  s.optimizer.learning_rate = 0.1f;
  return s;
}

// `be` has room for at least 600 MiB of shards and at most 2 GiB.
inline void ExpectCreationDoesNotStallCalls(EmbeddingBackend* be) {
  auto small = be->CreateShard(SgdSpec("small", 100, 8));
  ASSERT_TRUE(small.ok()) << small.status();
  const int64_t before = be->AvailableBytes();

  // 4M rows x 32 fp32: 512 MiB to allocate and initialise.
  const ShardSpec big = SgdSpec("big", int64_t{4} << 20, 32);
  const int64_t big_bytes = big.rows * big.dim * 4;
  std::atomic<bool> done{false};
  absl::StatusOr<ShardId> big_id;
  std::thread creator([&] {
    big_id = be->CreateShard(big);
    done = true;
  });
  // Reserved as soon as the creation starts (AvailableBytes would wait for
  // the whole creation if it held the backend's lock).
  while (!done && be->AvailableBytes() > before - big_bytes) std::this_thread::yield();
  const bool reserved_while_creating = !done;

  std::vector<int64_t> lengths = {2, 1}, ids = {3, 97, 50};
  std::vector<float> out(2 * 8);
  int during = 0;
  while (!done) {
    LookupRequest r;
    r.feature.shard = *small;
    r.feature.lengths = lengths;
    r.feature.ids = ids;
    r.output = absl::MakeSpan(out);
    ASSERT_TRUE(be->Lookup({&r, 1}).ok());
    if (!done) ++during;
  }
  creator.join();
  ASSERT_TRUE(big_id.ok()) << big_id.status();
  EXPECT_TRUE(reserved_while_creating);
  EXPECT_GE(during, 10) << "lookups waited for the creation of another shard";
  EXPECT_EQ(be->AvailableBytes(), before - big_bytes);

  // What no longer fits is refused, and the reservation is not kept.
  EXPECT_EQ(be->CreateShard(SgdSpec("too_big", int64_t{16} << 20, 32)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(be->AvailableBytes(), before - big_bytes);
  // Initialised as the initializer defines it, at both ends (rows are
  // spread over the creating threads).
  std::vector<float> row(32);
  for (int64_t r : {int64_t{0}, big.rows - 1}) {
    ASSERT_TRUE(be->ExportRows(*big_id, r, r + 1, absl::MakeSpan(row), {}).ok());
    for (int64_t c = 0; c < 32; ++c) {
      ASSERT_EQ(row[c], InitialValue(big.initializer, big.table_rows, r, c)) << r << "," << c;
    }
  }
  EXPECT_TRUE(be->DropShard(*big_id).ok());
  EXPECT_EQ(be->AvailableBytes(), before);
}


// What one thread of ExpectConcurrentCallsMatchSerial saw: every lookup's
// outputs, then its shard's final weights and optimizer state.
struct CallTrace {
  std::vector<std::vector<float>> outputs;
  std::vector<float> weights, state;
  std::string error;  // the first failed call, if any
};

// Thread `t`'s calls, on its own shard `own` (lookups and updates) and on
// `shared` (lookups only): `rounds` of a lookup over both shards followed
// by an update of `own`, with batches (1 to max_batch bags), lengths, ids,
// weights and gradients drawn from a generator seeded by t.
inline CallTrace RunCallSequence(EmbeddingBackend* be, int t, ShardId own, ShardId shared,
                                 int rounds, int64_t max_batch) {
  CallTrace trace;
  std::mt19937_64 rng(1000 + t);
  auto fail = [&](const std::string& what, const absl::Status& s) {
    if (trace.error.empty()) trace.error = what + ": " + s.ToString();
  };
  const ShardSpec own_spec = *be->GetShardSpec(own);
  const ShardSpec shared_spec = *be->GetShardSpec(shared);
  for (int round = 0; round < rounds; ++round) {
    const int64_t batch = 1 + static_cast<int64_t>(rng() % max_batch);
    const Pooling pooling = round % 3 == 0 ? Pooling::kMean : Pooling::kSum;
    std::vector<int64_t> lengths(batch), shared_lengths(batch);
    std::vector<int64_t> ids, shared_ids;
    std::vector<float> weights;
    for (int64_t b = 0; b < batch; ++b) {
      lengths[b] = static_cast<int64_t>(rng() % 6);  // empty bags too
      shared_lengths[b] = static_cast<int64_t>(rng() % 4);
      for (int64_t k = 0; k < lengths[b]; ++k) {
        // A few hot rows, so that updates merge duplicates.
        ids.push_back(rng() % 4 == 0 ? static_cast<int64_t>(rng() % 3)
                                     : static_cast<int64_t>(rng() % own_spec.rows));
        weights.push_back(0.25f + static_cast<float>(rng() % 8) / 8.0f);
      }
      for (int64_t k = 0; k < shared_lengths[b]; ++k) {
        shared_ids.push_back(static_cast<int64_t>(rng() % shared_spec.rows));
      }
    }
    const bool weighted = round % 2 == 1;
    std::vector<float> out(batch * own_spec.dim), shared_out(batch * shared_spec.dim);
    LookupRequest r[2];
    r[0].feature = {own, pooling, lengths, ids, weighted ? absl::MakeConstSpan(weights)
                                                         : absl::Span<const float>()};
    r[0].output = absl::MakeSpan(out);
    r[1].feature = {shared, Pooling::kSum, shared_lengths, shared_ids, {}};
    r[1].output = absl::MakeSpan(shared_out);
    if (absl::Status s = be->Lookup(r); !s.ok()) fail("lookup", s);
    trace.outputs.push_back(out);
    trace.outputs.push_back(shared_out);

    std::vector<float> grad(batch * own_spec.dim);
    for (float& g : grad) g = static_cast<float>(static_cast<int>(rng() % 17) - 8) / 16.0f;
    GradientRequest g;
    g.feature = r[0].feature;
    g.grad = grad;
    if (absl::Status s = be->ApplyGradients({&g, 1}); !s.ok()) fail("update", s);
  }
  trace.weights.resize(own_spec.rows * own_spec.dim);
  trace.state.resize(own_spec.rows * OptimizerStateWidth(own_spec.optimizer.type, own_spec.dim));
  if (absl::Status s = be->ExportRows(own, 0, own_spec.rows, absl::MakeSpan(trace.weights),
                                      absl::MakeSpan(trace.state));
      !s.ok()) {
    fail("export", s);
  }
  return trace;
}

// Four threads, each looking up and updating a shard of its own (a
// different dim and optimizer each) and looking up one shard they share,
// give bit for bit what the same calls give run one thread after another
// on a second backend from `make`.
inline void ExpectConcurrentCallsMatchSerial(
    const std::function<std::unique_ptr<EmbeddingBackend>()>& make, int rounds = 40,
    int64_t max_batch = 300) {
  constexpr int kThreads = 4;
  const int64_t dims[kThreads] = {8, 20, 64, 132};
  const OptimizerType optimizers[kThreads] = {OptimizerType::kSgd, OptimizerType::kAdagrad,
                                              OptimizerType::kRowwiseAdagrad,
                                              OptimizerType::kAdam};
  auto setup = [&](EmbeddingBackend* be, std::vector<ShardId>* own, ShardId* shared) {
    for (int t = 0; t < kThreads; ++t) {
      ShardSpec spec = SgdSpec("own" + std::to_string(t), 500, dims[t]);
      spec.optimizer.type = optimizers[t];
      spec.initializer.seed = 7 + t;
      auto id = be->CreateShard(spec);
      ASSERT_TRUE(id.ok()) << id.status();
      own->push_back(*id);
    }
    auto id = be->CreateShard(SgdSpec("shared", 300, 16));
    ASSERT_TRUE(id.ok()) << id.status();
    *shared = *id;
  };

  std::unique_ptr<EmbeddingBackend> serial_be = make(), concurrent_be = make();
  ASSERT_NE(serial_be, nullptr);
  ASSERT_NE(concurrent_be, nullptr);
  std::vector<ShardId> serial_own, concurrent_own;
  ShardId serial_shared = 0, concurrent_shared = 0;
  setup(serial_be.get(), &serial_own, &serial_shared);
  setup(concurrent_be.get(), &concurrent_own, &concurrent_shared);
  if (testing::Test::HasFatalFailure()) return;

  std::vector<CallTrace> serial(kThreads), concurrent(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    serial[t] =
        RunCallSequence(serial_be.get(), t, serial_own[t], serial_shared, rounds, max_batch);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      concurrent[t] = RunCallSequence(concurrent_be.get(), t, concurrent_own[t],
                                      concurrent_shared, rounds, max_batch);
    });
  }
  for (std::thread& th : threads) th.join();

  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE("thread " + std::to_string(t));
    EXPECT_EQ(serial[t].error, "");
    EXPECT_EQ(concurrent[t].error, "");
    ASSERT_EQ(serial[t].outputs.size(), concurrent[t].outputs.size());
    for (size_t k = 0; k < serial[t].outputs.size(); ++k) {
      // Bit for bit: the same calls on the same values.
      ASSERT_EQ(serial[t].outputs[k], concurrent[t].outputs[k])
          << "output " << k << " (round " << k / 2 << (k % 2 ? ", shared shard)" : ")");
    }
    EXPECT_EQ(serial[t].weights, concurrent[t].weights);
    EXPECT_EQ(serial[t].state, concurrent[t].state);
  }
  // The updates did something, so the comparison above means something.
  for (int t = 0; t < kThreads; ++t) {
    const ShardSpec spec = *serial_be->GetShardSpec(serial_own[t]);
    int64_t changed = 0;
    for (int64_t r = 0; r < spec.rows; ++r) {
      for (int64_t c = 0; c < spec.dim; ++c) {
        changed += serial[t].weights[r * spec.dim + c] !=
                   InitialValue(spec.initializer, spec.table_rows, r, c);
      }
    }
    EXPECT_GT(changed, spec.rows * spec.dim / 4) << "thread " << t;
  }
}

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_
