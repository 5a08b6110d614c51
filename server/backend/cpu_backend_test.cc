// The CPU backend's concurrency (concurrency_checks.h): creating a large
// shard does not stall the calls on the shards held, and concurrent calls
// give what serial ones give.
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "server/backend/concurrency_checks.h"
#include "server/backend/cpu_backend.h"
#include "server/backend/forwarding_backend.h"

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

TEST(CpuBackendTest, ConcurrentCallsMatchSerialOnes) {
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    ExpectConcurrentCallsMatchSerial([threads]() -> std::unique_ptr<EmbeddingBackend> {
      CpuBackendOptions o;
      o.num_threads = threads;
      auto be = CreateCpuBackend(o);
      if (!be.ok()) return nullptr;
      return std::move(*be);
    });
  }
}

// The defect the check exists for: a backend that stages every lookup's
// output in one buffer shared by all calls (as a CUDA backend would that
// reused its staging before the previous call had copied its outputs out).
class SharedStagingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    std::vector<LookupRequest> staged(requests.begin(), requests.end());
    size_t at = 0;
    for (LookupRequest& r : staged) {
      r.output = absl::MakeSpan(staging_).subspan(at, r.output.size());
      at += r.output.size();
    }
    if (absl::Status s = ForwardingBackend::Lookup(staged); !s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the download
    for (size_t i = 0; i < staged.size(); ++i) {
      std::memcpy(requests[i].output.data(), staged[i].output.data(),
                  staged[i].output.size() * sizeof(float));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<float> staging_ = std::vector<float>(1 << 20);
};

TEST(CpuBackendTest, ConcurrencyCheckCatchesASharedStagingBuffer) {
  testing::TestPartResultArray failures;
  {
    testing::ScopedFakeTestPartResultReporter reporter(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ALL_THREADS, &failures);
    ExpectConcurrentCallsMatchSerial([]() -> std::unique_ptr<EmbeddingBackend> {
      auto be = CreateCpuBackend({});
      if (!be.ok()) return nullptr;
      return std::make_unique<SharedStagingBackend>(std::move(*be));
    });
  }
  ASSERT_GT(failures.size(), 0);
  EXPECT_THAT(std::string(failures.GetTestPartResult(0).message()),
              testing::HasSubstr("output"));
}

}  // namespace
}  // namespace backend
}  // namespace ember
