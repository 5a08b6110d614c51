#include "server/backend/backend_factory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cuda/device_query.h"
#include "server/backend/changes/change_tracking.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/common/host_memory.h"

namespace ember {
namespace backend {

namespace {
DynamicShardOptions Dynamic(const BackendConfig& config) {
  DynamicShardOptions o;
  o.max_pending_ids = config.dynamic_exact_pending_ids;
  return o;
}
}  // namespace

absl::StatusOr<MadeBackend> CreateBackend(const BackendConfig& config) {
  if (config.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError("the memory limit must be >= 0");
  }
  MadeBackend made;
  if (config.device == "cpu") {
    if (config.threads < 1) {
      return absl::InvalidArgumentError(absl::StrCat("threads must be >= 1, got ", config.threads));
    }
    CpuBackendOptions o;
    o.num_threads = config.threads;
    o.memory_limit_bytes = config.memory_limit_bytes;
    o.skip_overflow = config.skip_overflow;
    made.capacity_note = "as given";
    if (o.memory_limit_bytes == 0) {
      o.memory_limit_bytes = HostMemoryBytes() / 10 * 9;
      made.capacity_note = "90% of the host's available memory";
    }
    if (o.memory_limit_bytes <= 0) {
      return absl::FailedPreconditionError(
          "cannot tell how much host memory there is; give --memory_gib");
    }
    auto b = CreateCpuBackend(o);
    if (!b.ok()) return b.status();
    // Hash-keyed tables over rows whose changes are tracked (incremental
    // checkpoints; below the dynamic shards, so that slots are what is tracked).
    made.backend = WithDynamicShards(WithChangeTracking(std::move(*b)), Dynamic(config));
    made.ddr_bytes = o.memory_limit_bytes;
    return made;
  }
  if (config.device == "cuda") {
    backend::CudaBackendOptions o;
    o.device = config.cuda_device;
    o.memory_limit_bytes = config.memory_limit_bytes;
    o.skip_overflow = config.skip_overflow;
    o.scratch_bytes = config.cuda_scratch_bytes;
    auto b = backend::CreateCudaBackend(o);
    if (!b.ok()) return b.status();
    // Hash-keyed tables over rows whose changes are tracked (incremental
    // checkpoints; below the dynamic shards, so that slots are what is tracked).
    made.backend = WithDynamicShards(WithChangeTracking(std::move(*b)), Dynamic(config));
    made.cuda = true;
    auto devices = cuda::QueryDevices();
    if (devices.ok()) {
      for (const auto& d : *devices) {
        if (d.index == config.cuda_device) made.hbm_bytes = d.total_memory_bytes;
      }
    }
    made.capacity_note = "the device's memory";
    if (config.memory_limit_bytes > 0) {
      made.hbm_bytes = std::min(made.hbm_bytes, config.memory_limit_bytes);
      made.capacity_note = "as given";
    }
    // The scratch is reserved at start: not there for shards.
    made.hbm_bytes = std::max<int64_t>(0, made.hbm_bytes - config.cuda_scratch_bytes);
    made.capacity_note += absl::StrCat(", less ", config.cuda_scratch_bytes >> 20,
                                       " MiB of scratch");
    return made;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be cpu or cuda, got '", config.device.substr(0, 64), "'"));
}

}  // namespace backend
}  // namespace ember
