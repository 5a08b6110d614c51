// The one place that knows every EmbeddingBackend: a worker names a device
// ("cpu" or "cuda") and gets the backend with the capacity it will
// advertise, and depends on nothing but this and the interface.
#ifndef EMBER_SERVER_BACKEND_BACKEND_FACTORY_H_
#define EMBER_SERVER_BACKEND_BACKEND_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct BackendConfig {
  // "cpu", "cuda", or "cuda_emulated": the CUDA backend's kernels on the
  // CPU (emulated_backend.h) serving as a CUDA worker, for tests where
  // there is no GPU (slow; memory_limit_bytes 0: 16 GiB).
  std::string device = "cpu";
  int threads = 1;             // cpu: threads per call, the caller included
  int cuda_device = 0;         // cuda: the GPU ordinal
  // cuda: the fixed scratch reserved at start (and two pinned host staging
  // buffers of as much); part of the memory limit, not advertised for
  // shards.
  int64_t cuda_scratch_bytes = int64_t{256} << 20;
  // Bytes of weights + optimizer state the backend may hold (cuda: and its
  // scratch). 0: cpu, 90% of the host's available memory (its memory
  // cgroup's limit where there is one); cuda, the whole device.
  int64_t memory_limit_bytes = 0;
  // cuda: bytes of host memory for fused_uvm shards (rows pinned in host
  // memory and mapped into the GPU; advertised as ddr_bytes). 0: 90% of
  // the host's available memory (its cgroup's limit where there is one)
  // over the visible GPUs, one share a worker.
  int64_t uvm_memory_bytes = 0;
  // An update row that would overflow is left alone and counted instead of
  // refusing the call (overflow_guard.h; the worker's --skip_nonfinite).
  bool skip_overflow = false;
  // Dynamic tables (WithDynamicShards): pending ids a shard counts exactly.
  int64_t dynamic_exact_pending_ids = int64_t{1} << 20;
  // key_value shards (key_value/key_value_backend.h): their files go here;
  // empty, the backend refuses them. Bytes their files may take; 0: 90% of
  // the directory's file system's free space.
  std::string ssd_dir;
  int64_t ssd_capacity_bytes = 0;
};

struct MadeBackend {
  std::unique_ptr<EmbeddingBackend> backend;
  bool cuda = false;
  // The capacity the worker advertises (the planner plans against it).
  int64_t hbm_bytes = 0;  // cuda
  int64_t ddr_bytes = 0;  // cpu; cuda: host memory for fused_uvm shards
  int64_t ssd_bytes = 0;  // key_value shards' files (0: no SSD tier)
  std::string ssd_note;   // how that was chosen
  std::string capacity_note;  // how the capacity was chosen, for the log
  std::string uvm_note;       // cuda: how ddr_bytes was chosen
};

// INVALID_ARGUMENT for an unknown device, threads < 1 or a negative limit; UNAVAILABLE for
// cuda without a usable GPU (or a build without CUDA); FAILED_PRECONDITION
// when the host's memory cannot be told and no limit is given.
absl::StatusOr<MadeBackend> CreateBackend(const BackendConfig& config);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_BACKEND_FACTORY_H_
