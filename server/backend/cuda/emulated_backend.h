// The CUDA backend's algorithms on the CPU: the same request planning
// (request_plan.h) and the same kernel bodies (kernel_bodies.h, run with
// HostWarp: 32 lanes in lockstep, shuffles and all) over shards in host
// memory, with a stable sort and scans in place of CUB's. It joins the parity
// suite in every build, so the GPU code is tested where no GPU is; only the
// CUDA runtime calls, CUB and the device intrinsics are not exercised. Slow
// (every shuffle switches 32 fibers): for tests, never for serving.
#ifndef EMBER_SERVER_BACKEND_CUDA_EMULATED_BACKEND_H_
#define EMBER_SERVER_BACKEND_CUDA_EMULATED_BACKEND_H_

#include <cstddef>
#include <memory>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct EmulatedCudaOptions {
  // The fixed scratch the CUDA backend would have (device bytes; the
  // staging is as large): calls that do not fit run in pieces
  // (call_split.h), as on a GPU. 0: no limit.
  size_t scratch_bytes = 0;
  // As the CUDA backend's (CudaBackendOptions::skip_overflow).
  bool skip_overflow = false;
  // As the CUDA backend's memory_limit_bytes (without the scratch) and
  // mapped_memory_limit_bytes (fused_uvm shards): the bytes of shards each
  // may hold (ShardBytes). 0: no limit.
  int64_t memory_limit_bytes = 0;
  int64_t mapped_memory_limit_bytes = 0;
};

std::unique_ptr<backend::EmbeddingBackend> CreateEmulatedCudaBackend(
    const EmulatedCudaOptions& options = {});

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CUDA_EMULATED_BACKEND_H_
