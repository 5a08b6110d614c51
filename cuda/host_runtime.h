// A CUDA runtime on the CPU, for tests: the subset of the runtime API the
// CUDA backend's adapter (server/backend/cuda/cuda_backend.cc) calls, over host
// memory, with each stream a thread that runs its queued operations in
// order, and the kernels of tbe_kernels.h run by host_kernels.h on those
// threads. Linked instead of cudart and tbe_kernels (the *_on_host test
// targets), it lets CI run the adapter itself where there is no GPU:
// staging, pinned copies and events as asynchronous as on a device, calls
// in pieces, double-buffered staging, the lost-device path.
//
// What it keeps of CUDA's semantics: stream order; copies that touch
// pinned memory (cudaMallocHost, cudaHostAlloc) and device memory run when the stream
// reaches them, while copies from or to pageable host memory finish before
// cudaMemcpyAsync returns; events complete when the stream passes the point
// they were recorded at (one never recorded is complete); cudaFree and
// cudaFreeHost wait for every stream; an illegal address (LaunchFault) is
// sticky: every later call answers it; only a mapped host allocation
// (cudaHostAllocMapped) has a device pointer (cudaHostGetDevicePointer),
// and a copy that names one as device memory by an explicit direction
// (HostToDevice into it, DeviceToHost out of it) is refused
// (cudaErrorInvalidValue): on a device that is undefined. Each queued operation waits a
// random 0-20 us first ($EMBER_HOST_CUDA_DELAY_US sets the bound; 0: none),
// so work runs later than a caller may assume. It shows one device (a "compute
// capability 8.0" named "host runtime"; $EMBER_HOST_CUDA_DEVICES sets how
// many). What it does not model: concurrency
// between streams' kernels beyond threads, device memory as a separate
// address space (a host pointer passed as a device one works here), timing.
#ifndef EMBER_CUDA_HOST_RUNTIME_H_
#define EMBER_CUDA_HOST_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <functional>

namespace ember {
namespace cuda {

// Queues `op` on `stream` (nullptr: the default stream); the sticky error,
// if one is set, instead.
cudaError_t HostLaunch(cudaStream_t stream, std::function<void()> op);

// Bytes of host memory now allocated mapped into the device
// (cudaHostAlloc with cudaHostAllocMapped): where fused_uvm shards live.
size_t HostMappedBytes();

// Makes the device lost, as an illegal address would (every later runtime
// call answers cudaErrorIllegalAddress), when the stream reaches it.
cudaError_t HostLaunchFault(cudaStream_t stream);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_HOST_RUNTIME_H_
