// The CUDA backend's kernels and their launchers: device pointers, a stream
// and a cudaError_t, nothing of the server. The adapter that implements
// EmbeddingBackend with them (staging, shards, validation, errors as
// Status) is server/backend/cuda/cuda_backend.cc. The kernels are grid-stride
// loops over the bodies in kernel_bodies.h, the code the emulated backend
// runs on the CPU.
//
// Launchers only enqueue on `stream` (and check each launch); they never
// wait for it. `max_blocks` caps the grid (the kernels loop over the rest).
#ifndef EMBER_CUDA_TBE_KERNELS_H_
#define EMBER_CUDA_TBE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/launch_args.h"

namespace ember {
namespace cuda {

// Temporary storage CUB needs: the lookup's scan of `bags` lengths; the
// backward pass's scans (`bags` lengths, `ids` run flags and hot chunks) and
// its radix sort of `ids` keys below 2^end_bit.
cudaError_t LookupTempBytes(int64_t bags, size_t* bytes);
cudaError_t BackwardTempBytes(int64_t bags, int64_t ids, int end_bit, size_t* bytes);

// Forward over every request of a call (kernel_bodies.h's LookupWarp):
// scans the lengths into offsets, then one warp per work item writes `out`.
cudaError_t LaunchLookup(const LookupLaunch& a, int max_blocks, cudaStream_t stream);

// Backward + optimizer over every request and shard of a call: expand ids to
// (key, position) pairs, radix sort them, find the runs of equal keys, sum
// hot runs in chunks, and apply one optimizer step per run (row).
// cudaErrorInvalidValue when a.total_ids is 0 (there is nothing to do).
cudaError_t LaunchBackward(const BackwardLaunch& a, int max_blocks, cudaStream_t stream);

// Checks a call's inputs in device memory before it runs (BadInputOne over
// every element): the first bad one's number, if any, in *a.first_bad.
cudaError_t LaunchCheckInputs(const InputCheckLaunch& a, int max_blocks, cudaStream_t stream);

// A keyed lookup's ids to slots in place (launch_args.h's KeyFindLaunch).
cudaError_t LaunchKeyFind(const KeyFindLaunch& a, int max_blocks, cudaStream_t stream);

// Rows at any positions to or from a packed buffer (CopyRowsLaunch).
cudaError_t LaunchCopyRows(const CopyRowsLaunch& a, int max_blocks, cudaStream_t stream);

// p[0, n) = value.
// Measures a shard's values (launch_args.h's MeasureLaunch).
cudaError_t LaunchMeasure(const MeasureLaunch& a, int max_blocks, cudaStream_t stream);

cudaError_t LaunchFill(float* p, int64_t n, float value, int max_blocks, cudaStream_t stream);

// A write through a bad pointer: an illegal address, for the test of what
// follows a sticky error.
cudaError_t LaunchFault(cudaStream_t stream);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_TBE_KERNELS_H_
