// The backend factory: the device names it knows, the capacity each backend
// advertises, and the errors for what it cannot make.
#include "server/backend/backend_factory.h"

#include "gtest/gtest.h"
#include "server/common/host_memory.h"

namespace ember {
namespace backend {
namespace {

TEST(BackendFactoryTest, CpuWithAndWithoutALimit) {
  BackendConfig c;
  c.threads = 2;
  c.memory_limit_bytes = int64_t{3} << 20;
  auto made = CreateBackend(c);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_FALSE(made->cuda);
  EXPECT_EQ(made->ddr_bytes, int64_t{3} << 20);
  EXPECT_EQ(made->hbm_bytes, 0);
  EXPECT_EQ(made->backend->AvailableBytes(), int64_t{3} << 20);
  EXPECT_EQ(made->backend->Name().rfind("cpu/", 0), 0u);

  c.memory_limit_bytes = 0;  // 90% of what the host has
  made = CreateBackend(c);
  ASSERT_TRUE(made.ok()) << made.status();
  // Available memory moves while other processes run (tests in parallel):
  // the second read may differ a little from the one the factory made.
  const double want = static_cast<double>(HostMemoryBytes() / 10 * 9);
  EXPECT_NEAR(static_cast<double>(made->ddr_bytes), want, 0.05 * want);
  EXPECT_EQ(made->capacity_note, "90% of the host's available memory");
}

TEST(BackendFactoryTest, CudaOrUnavailable) {
  BackendConfig c;
  c.device = "cuda";
  c.memory_limit_bytes = int64_t{1} << 30;
  auto made = CreateBackend(c);
  if (!made.ok()) {
    EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << made.status();
    GTEST_SKIP() << "no usable GPU: " << made.status();
  }
  EXPECT_TRUE(made->cuda);
  // The limit (below any GPU's memory) less the default 256 MiB scratch,
  // which the shards cannot have.
  EXPECT_EQ(made->hbm_bytes, (int64_t{1} << 30) - (int64_t{256} << 20));
  EXPECT_EQ(made->backend->AvailableBytes(), made->hbm_bytes);
  EXPECT_EQ(made->backend->Name().rfind("cuda/", 0), 0u);
  EXPECT_TRUE(made->backend->MapsHostMemory());
}

// The CUDA kernels on the CPU, serving as a CUDA worker: the capacities it
// advertises are the limits given (HBM and the fused_uvm shards' host
// memory), and its backend maps host memory and caches over it.
TEST(BackendFactoryTest, CudaEmulatedServesAsACudaWorker) {
  BackendConfig c;
  c.device = "cuda_emulated";
  c.memory_limit_bytes = int64_t{5} << 20;
  c.uvm_memory_bytes = int64_t{7} << 20;
  auto made = CreateBackend(c);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_TRUE(made->cuda);
  EXPECT_EQ(made->hbm_bytes, int64_t{5} << 20);
  EXPECT_EQ(made->ddr_bytes, int64_t{7} << 20);
  EXPECT_EQ(made->backend->AvailableBytes(), int64_t{5} << 20);
  EXPECT_EQ(made->backend->AvailableMappedBytes(), int64_t{7} << 20);
  EXPECT_TRUE(made->backend->MapsHostMemory());
  EXPECT_TRUE(made->backend->CachesOverHostMemory());
  EXPECT_EQ(made->capacity_note, "as given");
}

TEST(BackendFactoryTest, BadConfigsAreRefused) {
  BackendConfig c;
  c.device = "tpu";
  EXPECT_EQ(CreateBackend(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.device = "cpu";
  c.threads = 0;
  EXPECT_EQ(CreateBackend(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.threads = 1;
  c.memory_limit_bytes = -1;
  EXPECT_EQ(CreateBackend(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.memory_limit_bytes = 0;
  c.uvm_memory_bytes = -1;  // --uvm_memory_gib below 0
  for (const char* device : {"cpu", "cuda", "cuda_emulated"}) {
    c.device = device;
    EXPECT_EQ(CreateBackend(c).status().code(), absl::StatusCode::kInvalidArgument) << device;
  }
}

}  // namespace
}  // namespace backend
}  // namespace ember
