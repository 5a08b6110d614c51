// The CPU backend's concurrency: creating a large shard (allocation and
// initialisation, which take seconds for a large table) leaves the calls on
// the shards already held running, with its memory reserved from the
// start; a shard that cannot fit is refused before anything is allocated.
#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"

namespace ember {
namespace backend {
namespace {

ShardSpec Spec(const std::string& table, int64_t rows, int64_t dim) {
  ShardSpec s;
  s.table = table;
  s.rows = rows;
  s.table_rows = rows;
  s.dim = dim;
  s.optimizer.type = OptimizerType::kSgd;
  s.optimizer.learning_rate = 0.1f;
  return s;
}

TEST(CpuBackendTest, CreatingALargeShardDoesNotStallCallsOnOthers) {
  CpuBackendOptions o;
  o.num_threads = 2;
  o.memory_limit_bytes = int64_t{2} << 30;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok()) << be.status();
  auto small = (*be)->CreateShard(Spec("small", 100, 8));
  ASSERT_TRUE(small.ok()) << small.status();
  const int64_t before = (*be)->AvailableBytes();

  // 4M rows x 32 fp32: 512 MiB to allocate and initialise.
  const ShardSpec big = Spec("big", int64_t{4} << 20, 32);
  const int64_t big_bytes = big.rows * big.dim * 4;
  std::atomic<bool> done{false};
  absl::StatusOr<ShardId> big_id;
  std::thread creator([&] {
    big_id = (*be)->CreateShard(big);
    done = true;
  });
  // Reserved as soon as the creation starts (AvailableBytes waited for the
  // whole creation when it held the backend's lock).
  while (!done && (*be)->AvailableBytes() > before - big_bytes) std::this_thread::yield();
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
    ASSERT_TRUE((*be)->Lookup({&r, 1}).ok());
    if (!done) ++during;
  }
  creator.join();
  ASSERT_TRUE(big_id.ok()) << big_id.status();
  EXPECT_TRUE(reserved_while_creating);
  EXPECT_GE(during, 10) << "lookups waited for the creation of another shard";
  EXPECT_EQ((*be)->AvailableBytes(), before - big_bytes);

  // What no longer fits is refused, and the reservation is not kept.
  EXPECT_EQ((*be)->CreateShard(Spec("too_big", int64_t{16} << 20, 32)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*be)->AvailableBytes(), before - big_bytes);
  // Initialised on the creating threads as the initializer defines it
  // (rows spread over them: check one row from each end).
  std::vector<float> row(32);
  for (int64_t r : {int64_t{0}, big.rows - 1}) {
    ASSERT_TRUE((*be)->ExportRows(*big_id, r, r + 1, absl::MakeSpan(row), {}).ok());
    for (int64_t c = 0; c < 32; ++c) {
      ASSERT_EQ(row[c], InitialValue(big.initializer, big.table_rows, r, c)) << r << "," << c;
    }
  }
  EXPECT_TRUE((*be)->DropShard(*big_id).ok());
  EXPECT_EQ((*be)->AvailableBytes(), before);
}

}  // namespace
}  // namespace backend
}  // namespace ember
