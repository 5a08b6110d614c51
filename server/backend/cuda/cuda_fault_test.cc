// A sticky device error loses the CUDA backend for good: the failing call
// and every later one answer UNAVAILABLE, Health() says so, and nothing
// reaches the device again. Its own binary: the process's CUDA context is
// unusable afterwards. Skips where no GPU is usable.
#include <vector>

#include "absl/status/status.h"
#include "cuda/device_query.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backend/cuda/cuda_backend.h"

namespace ember {
namespace backend {
namespace {


TEST(CudaFaultTest, StickyErrorMakesTheBackendUnavailableForGood) {
  auto be = CreateCudaBackend({});
  if (!be.ok()) {
    EXPECT_EQ(be.status().code(), absl::StatusCode::kUnavailable) << be.status();
    EXPECT_EQ(InjectDeviceFaultForTest(nullptr).code(),
              cuda::BuiltWithCuda() ? absl::StatusCode::kInvalidArgument
                                     : absl::StatusCode::kUnavailable);
    GTEST_SKIP() << "no usable GPU";
  }
  backend::ShardSpec spec;
  spec.table = "t";
  spec.rows = 8;
  spec.dim = 4;
  spec.table_rows = 8;
  auto id = (*be)->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<int64_t> lengths = {2}, ids = {1, 3};
  FeatureRequest f;
  f.shard = *id;
  f.pooling = Pooling::kSum;
  f.lengths = lengths;
  f.ids = ids;
  std::vector<float> out(4);
  ASSERT_TRUE((*be)->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
  EXPECT_TRUE((*be)->Health().ok());

  const absl::Status fault = InjectDeviceFaultForTest(be->get());
  EXPECT_EQ(fault.code(), absl::StatusCode::kUnavailable) << fault;
  EXPECT_THAT(std::string(fault.message()), testing::HasSubstr("lost"));
  EXPECT_EQ((*be)->Health().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*be)->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).code(),
            absl::StatusCode::kUnavailable);
  std::vector<float> grad(4, 1.0f);
  EXPECT_EQ((*be)->ApplyGradients({GradientRequest{f, grad}}).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ((*be)->CreateShard(spec).status().code(), absl::StatusCode::kUnavailable);
  std::vector<float> rows(8 * 4), none;
  EXPECT_EQ((*be)->ExportRows(*id, 0, 8, absl::MakeSpan(rows), absl::MakeSpan(none)).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace backend
}  // namespace ember
