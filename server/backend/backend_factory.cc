#include "server/backend/backend_factory.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/device_query.h"
#include "server/backend/changes/change_tracking.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/key_value/key_value_backend.h"
#include "server/common/host_memory.h"

namespace ember {
namespace backend {

namespace {
DynamicShardOptions Dynamic(const BackendConfig& config) {
  DynamicShardOptions o;
  o.max_pending_ids = config.dynamic_exact_pending_ids;
  return o;
}

// The SSD tier: the directory checked and its capacity (given, or 90% of
// its file system's free space); none without a directory.
absl::StatusOr<KeyValueOptions> SsdTier(const BackendConfig& config, MadeBackend* made) {
  KeyValueOptions o;
  if (config.ssd_capacity_bytes < 0) {
    return absl::InvalidArgumentError("the SSD capacity must be >= 0");
  }
  if (config.ssd_dir.empty()) {
    if (config.ssd_capacity_bytes > 0) {
      return absl::InvalidArgumentError("an SSD capacity needs an SSD directory (--ssd_dir)");
    }
    return o;
  }
  struct statvfs fs;
  if (statvfs(config.ssd_dir.c_str(), &fs) != 0 || access(config.ssd_dir.c_str(), W_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--ssd_dir '", config.ssd_dir, "': not a directory this worker can write: ",
        std::strerror(errno)));
  }
  o.dir = config.ssd_dir;
  o.capacity_bytes = config.ssd_capacity_bytes;
  made->ssd_note = "as given";
  if (o.capacity_bytes == 0) {
    o.capacity_bytes = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) / 10 * 9;
    made->ssd_note = "90% of the free space";
  }
  if (o.capacity_bytes <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--ssd_dir '", config.ssd_dir, "': no free space"));
  }
  made->ssd_bytes = o.capacity_bytes;
  return o;
}

// Hash-keyed tables over rows whose changes are tracked (incremental
// checkpoints; below the dynamic shards, so that slots are what is
// tracked), over the key_value shards (so that rows, not cache slots, are).
std::unique_ptr<EmbeddingBackend> Wrap(std::unique_ptr<EmbeddingBackend> b,
                                       const BackendConfig& config, const KeyValueOptions& kv) {
  return WithDynamicShards(WithChangeTracking(WithKeyValueShards(std::move(b), kv)),
                           Dynamic(config));
}
}  // namespace

absl::StatusOr<MadeBackend> CreateBackend(const BackendConfig& config) {
  if (config.memory_limit_bytes < 0 || config.uvm_memory_bytes < 0) {
    return absl::InvalidArgumentError("memory limits must be >= 0");
  }
  MadeBackend made;
  auto kv = SsdTier(config, &made);
  if (!kv.ok()) return kv.status();
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
    made.backend = Wrap(std::move(*b), config, *kv);
    made.ddr_bytes = o.memory_limit_bytes;
    return made;
  }
  if (config.device == "cuda") {
    backend::CudaBackendOptions o;
    o.device = config.cuda_device;
    o.memory_limit_bytes = config.memory_limit_bytes;
    o.skip_overflow = config.skip_overflow;
    o.scratch_bytes = config.cuda_scratch_bytes;
    auto devices = cuda::QueryDevices();
    o.mapped_memory_limit_bytes = config.uvm_memory_bytes;
    made.uvm_note = "as given";
    if (o.mapped_memory_limit_bytes == 0) {
      const int64_t gpus = devices.ok() ? std::max<int64_t>(1, devices->size()) : 1;
      o.mapped_memory_limit_bytes = HostMemoryBytes() / 10 * 9 / gpus;
      made.uvm_note = absl::StrCat("90% of the host's available memory over ", gpus, " GPU(s)");
    }
    if (o.mapped_memory_limit_bytes <= 0) {
      return absl::FailedPreconditionError(
          "cannot tell how much host memory there is; give --uvm_memory_gib");
    }
    auto b = backend::CreateCudaBackend(o);
    if (!b.ok()) return b.status();
    made.backend = Wrap(std::move(*b), config, *kv);
    made.cuda = true;
    made.ddr_bytes = o.mapped_memory_limit_bytes;
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
  if (config.device == "cuda_emulated") {
    // The CUDA backend's kernels on the CPU (emulated_backend.h), serving
    // as a CUDA worker does: for tests of CUDA workers' kernels through
    // the whole service where there is no GPU. Slow.
    EmulatedCudaOptions o;
    o.skip_overflow = config.skip_overflow;
    o.memory_limit_bytes = config.memory_limit_bytes > 0 ? config.memory_limit_bytes
                                                         : int64_t{16} << 30;
    o.mapped_memory_limit_bytes = config.uvm_memory_bytes > 0
                                      ? config.uvm_memory_bytes
                                      : HostMemoryBytes() / 10 * 9;
    made.backend = Wrap(CreateEmulatedCudaBackend(o), config, *kv);
    made.cuda = true;
    made.hbm_bytes = o.memory_limit_bytes;
    made.ddr_bytes = o.mapped_memory_limit_bytes;
    made.capacity_note = config.memory_limit_bytes > 0 ? "as given" : "16 GiB (emulated)";
    made.uvm_note = config.uvm_memory_bytes > 0 ? "as given" : "90% of the host's available memory";
    return made;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--device must be cpu, cuda or cuda_emulated, got '", config.device.substr(0, 64), "'"));
}

}  // namespace backend
}  // namespace ember
