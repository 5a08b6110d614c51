// The CPU backend's concurrency (concurrency_checks.h): creating a large
// shard does not stall the calls on the shards held.
#include "gtest/gtest.h"
#include "server/backend/concurrency_checks.h"
#include "server/backend/cpu_backend.h"

namespace ember {
namespace backend {
namespace {

TEST(CpuBackendTest, CreatingALargeShardDoesNotStallCallsOnOthers) {
  CpuBackendOptions o;
  o.num_threads = 2;
  o.memory_limit_bytes = int64_t{2} << 30;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok()) << be.status();
  ExpectCreationDoesNotStallCalls(be->get());
}

}  // namespace
}  // namespace backend
}  // namespace ember
