// The CUDA embedding backend: shards in GPU memory, one fused forward kernel
// over every lookup of a call, and a fused backward (sort ids, merge
// duplicate rows, one optimizer update per touched row) over every gradient
// of a call. Same semantics as the CPU backend (embedding_backend.h), which
// is the reference of the parity suite.
//
// Host header: exposes no CUDA types, so plain C++ (and builds without nvcc,
// which get cuda_backend_nocuda.cc) compile against it.
//
// A sticky device error (illegal address, launch failure, uncorrectable ECC)
// loses the backend for good: Health() and every later data call answer
// UNAVAILABLE, and the worker stops heartbeating so that the coordinator
// recovers the shards elsewhere.
//
// Memory: shards (weights + optimizer state) within memory_limit_bytes less
// a fixed device scratch of scratch_bytes, reserved when the backend starts
// together with two pinned host staging buffers of as much (host memory,
// outside the limit); a call too large for them runs in pieces
// (call_split.h) and one that cannot be cut small enough (a single
// bag or row beyond the scratch) is RESOURCE_EXHAUSTED. A fused_uvm shard
// (ShardSpec::host_mapped) keeps its weights and state in pinned host
// memory mapped into the device instead, within mapped_memory_limit_bytes:
// the same kernels read and write it over the bus, and only a dynamic
// shard's key index copy stays in device memory.
//
// Thread-safe: data calls queue their GPU work in turn, under one internal
// mutex, on the backend's own CUDA stream, so the device runs them in the
// order they were queued; the staging is double-buffered, so one call
// stages its inputs while the previous call's kernels run and its outputs
// are copied back. Shard initialisation runs apart, on a stream of its own.
// Each call returns only once the GPU work it queued has finished. Request
// buffers (ids, lengths, weights, gradients, outputs) are host memory,
// borrowed for the call.
#ifndef EMBER_SERVER_BACKEND_CUDA_CUDA_BACKEND_H_
#define EMBER_SERVER_BACKEND_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

constexpr int64_t kDefaultCudaScratchBytes = int64_t{256} << 20;
constexpr int64_t kMinCudaScratchBytes = int64_t{4} << 10;

struct CudaBackendOptions {
  // CUDA device ordinal (as cudaSetDevice counts them).
  int device = 0;
  // Upper bound on the device bytes the backend uses: scratch_bytes plus
  // the shards' weights + optimizer state (the CPU backend's accounting:
  // rows * (dim * weight bytes + state floats * 4)). CreateShard beyond it
  // fails with RESOURCE_EXHAUSTED. 0: whatever the card has (a failing
  // cudaMalloc is RESOURCE_EXHAUSTED too).
  int64_t memory_limit_bytes = 0;
  // The fixed scratch, on the device, and the size of each of the two
  // pinned host staging buffers.
  int64_t scratch_bytes = kDefaultCudaScratchBytes;
  // As the CPU backend's (CpuBackendOptions::skip_overflow).
  bool skip_overflow = false;
  // Upper bound on the bytes of fused_uvm shards (ShardSpec::host_mapped:
  // weights + optimizer state in pinned host memory mapped into the
  // device, outside memory_limit_bytes). 0: no limit (a failing
  // cudaHostAlloc is RESOURCE_EXHAUSTED).
  int64_t mapped_memory_limit_bytes = 0;
};

// UNAVAILABLE when built without CUDA, when no driver or device is usable,
// or when `device` is not among the visible devices; INVALID_ARGUMENT for
// a negative device or memory limit, a scratch below kMinCudaScratchBytes,
// or a memory limit that does not exceed the scratch.
absl::StatusOr<std::unique_ptr<backend::EmbeddingBackend>> CreateCudaBackend(
    const CudaBackendOptions& options);

// Tests only: makes a CUDA backend's device fail as a faulty kernel would
// (an illegal address, a sticky error), so that Health() and every later
// call answer UNAVAILABLE. The process's CUDA context is unusable after it.
// UNAVAILABLE without CUDA; INVALID_ARGUMENT for another backend.
absl::Status InjectDeviceFaultForTest(backend::EmbeddingBackend* backend);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CUDA_CUDA_BACKEND_H_
