// The CUDA backend's kernels and their launchers: device pointers, a stream
// and a cudaError_t, nothing of the server. The adapter that implements
// EmbeddingBackend with them (staging, shards, validation, errors as
// Status) is server/backend/cuda_backend.cc. The kernels are grid-stride
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

#include "cuda/kernel_descs.h"

namespace ember {
namespace cuda {

// Temporary storage CUB needs: the lookup's scan of `bags` lengths; the
// backward pass's scans (`bags` lengths, `ids` run flags and hot chunks) and
// its radix sort of `ids` keys below 2^end_bit.
cudaError_t LookupTempBytes(int64_t bags, size_t* bytes);
cudaError_t BackwardTempBytes(int64_t bags, int64_t ids, int end_bit, size_t* bytes);

// Forward over every request of a call (kernel_bodies.h's LookupWarp):
// scans the lengths into offsets, then one warp per work item writes `out`.
struct LookupLaunch {
  const int64_t* item_begin = nullptr;  // [num_requests + 1]
  const LookupDesc* descs = nullptr;    // [num_requests]
  int64_t num_requests = 0;
  int64_t total_items = 0;
  const int64_t* lengths = nullptr;  // [num_bags]
  int64_t num_bags = 0;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;  // per id, or unread
  int64_t* offsets = nullptr;      // scratch: [num_bags + 1]
  float* out = nullptr;
  void* temp = nullptr;  // LookupTempBytes(num_bags)
  size_t temp_bytes = 0;
};
cudaError_t LaunchLookup(const LookupLaunch& a, int max_blocks, cudaStream_t stream);

// Backward + optimizer over every request and shard of a call: expand ids to
// (key, position) pairs, radix sort them, find the runs of equal keys, sum
// hot runs in chunks, and apply one optimizer step per run (row).
struct BackwardLaunch {
  // Inputs.
  const int64_t* id_begin = nullptr;  // [num_requests + 1]
  const GradDesc* descs = nullptr;    // [num_requests]
  int64_t num_requests = 0;
  const UpdateDesc* updates = nullptr;  // [num_shards]
  const uint64_t* key_base = nullptr;   // [num_shards + 1]
  int64_t num_shards = 0;
  const int64_t* lengths = nullptr;  // [num_bags]
  int64_t num_bags = 0;
  const int64_t* ids = nullptr;  // [total_ids]
  int64_t total_ids = 0;
  const float* weights = nullptr;  // per id, or unread
  const float* grads = nullptr;
  int end_bit = 64;
  int64_t max_dim = 4;
  // Scratch.
  int64_t* offsets = nullptr;  // [num_bags + 1]
  uint64_t* keys_a = nullptr;  // [total_ids] each, to run_id
  uint64_t* keys_b = nullptr;
  int64_t* pos_a = nullptr;
  int64_t* pos_b = nullptr;
  int64_t* src_off = nullptr;
  float* scale = nullptr;
  int64_t* run_id = nullptr;
  int64_t* run_begin = nullptr;  // [total_ids + 1]
  int64_t* hot_units = nullptr;  // [total_ids]
  int64_t* hot_end = nullptr;    // [total_ids]
  float* partials = nullptr;     // [max_units, max_dim]
  int64_t max_units = 1;
  void* temp = nullptr;  // BackwardTempBytes(num_bags, total_ids, end_bit)
  size_t temp_bytes = 0;
};
cudaError_t LaunchBackward(const BackwardLaunch& a, int max_blocks, cudaStream_t stream);

// p[0, n) = value.
cudaError_t LaunchFill(float* p, int64_t n, float value, int max_blocks, cudaStream_t stream);

// A write through a bad pointer: an illegal address, for the test of what
// follows a sticky error.
cudaError_t LaunchFault(cudaStream_t stream);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_TBE_KERNELS_H_
