// The CUDA backend's two fused launches run on the CPU, over host memory:
// the steps of tbe_kernels.cu with the same kernel bodies (kernel_bodies.h,
// one HostWarp of 32 lanes in lockstep), and std::stable_sort and
// std::partial_sum where the GPU uses CUB's radix sort and scans. The
// emulated backend calls them directly; the host CUDA runtime
// (host_runtime.h) queues them on its streams. Slow: for tests.
#ifndef EMBER_CUDA_HOST_KERNELS_H_
#define EMBER_CUDA_HOST_KERNELS_H_

#include "cuda/launch_args.h"

namespace ember {
namespace cuda {

// Stands in for CUB's temporary storage when sizing a call against a
// scratch: a fixed part and some bytes per element, as CUB's grow. The
// launches below need none; callers that reserve it see it overwritten.
inline size_t HostTempBytes(int64_t elements) { return 1024 + 16 * static_cast<size_t>(elements); }

// Writes a.offsets and a.out, and scribbles over a.temp (as CUB would use
// it).
void RunLookupOnHost(const LookupLaunch& a);

// Applies the optimizer to every row the ids touch, working in a's scratch
// arrays (the sorted pairs end in keys_b / pos_b), sorting on the low
// a.end_bit bits of the keys as CUB does; scribbles over a.temp.
// total_ids > 0.
void RunBackwardOnHost(const BackwardLaunch& a);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_HOST_KERNELS_H_
