// A check every backend's tests run (cpu_backend_test, cuda_backend_test):
// creating a large shard (allocation and initialisation, seconds for a
// large table) leaves the calls on the shards already held running, with its
// memory reserved from the start, and what no longer fits is refused without
// keeping a reservation.
#ifndef EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_
#define EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_

#include <atomic>
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

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CONCURRENCY_CHECKS_H_
