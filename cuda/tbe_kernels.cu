// The CUDA backend's kernels (grid-stride loops over kernel_bodies.h, the
// code the emulated backend runs on the CPU with HostWarp) and their
// launchers; see tbe_kernels.h.
#include "cuda/tbe_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <cub/cub.cuh>

#include "cuda/kernel_bodies.h"
#include "cuda/kernel_descs.h"
#include "cuda/warp.h"

namespace ember {
namespace cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;

__device__ __forceinline__ int64_t WarpIndex() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
}
__device__ __forceinline__ int64_t WarpCount() {
  return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
}
__device__ __forceinline__ int64_t ThreadIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t ThreadCount() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The min-blocks hint (at most 64 registers) is what keeps ptxas from
// spilling on sm_80.
__global__ void __launch_bounds__(kBlockThreads, 4)
    LookupKernel(const int64_t* __restrict__ item_begin, const LookupDesc* __restrict__ descs,
                 int64_t num_requests, const int64_t* __restrict__ offsets,
                 const int64_t* __restrict__ ids, const float* __restrict__ weights,
                 float* __restrict__ out) {
  DeviceWarp w;
  kernels::LookupWarp(w, WarpIndex(), WarpCount(), item_begin, descs, num_requests, offsets, ids,
                      weights, out);
}

__global__ void __launch_bounds__(kBlockThreads)
    ExpandKernel(const int64_t* __restrict__ id_begin, const GradDesc* __restrict__ descs,
                 int64_t num_requests, const int64_t* __restrict__ offsets,
                 const int64_t* __restrict__ ids, const float* __restrict__ weights,
                 uint64_t* __restrict__ keys, int64_t* __restrict__ positions,
                 int64_t* __restrict__ src_off, float* __restrict__ scale) {
  const int64_t total = id_begin[num_requests];
  for (int64_t p = ThreadIndex(); p < total; p += ThreadCount()) {
    kernels::ExpandOne(p, id_begin, descs, num_requests, offsets, ids, weights, keys, positions,
                       src_off, scale);
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    HeadFlagsKernel(const uint64_t* __restrict__ keys, int64_t n, int64_t* __restrict__ flags) {
  for (int64_t k = ThreadIndex(); k < n; k += ThreadCount()) kernels::HeadFlagOne(k, keys, flags);
}

__global__ void __launch_bounds__(kBlockThreads)
    RunBeginKernel(const int64_t* __restrict__ run_id, int64_t n, int64_t* __restrict__ run_begin) {
  for (int64_t k = ThreadIndex(); k < n; k += ThreadCount()) {
    kernels::RunBeginOne(k, run_id, n, run_begin);
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    HotUnitsKernel(const int64_t* __restrict__ run_begin, const int64_t* __restrict__ num_runs,
                   int64_t* __restrict__ hot_units) {
  const int64_t n = *num_runs;
  for (int64_t u = ThreadIndex(); u < n; u += ThreadCount()) {
    kernels::HotUnitsOne(u, run_begin, hot_units);
  }
}

__global__ void __launch_bounds__(kBlockThreads) PartialSumKernel(kernels::UpdateArgs a) {
  DeviceWarp w;
  kernels::PartialSumWarp(w, WarpIndex(), WarpCount(), a);
}

// One kernel per update mode (kernel_descs.h's UpdateMode; kGuarded: a
// guarded apply), so the plain update compiles as it did alone.
template <int kMode, bool kGuarded>
__global__ void __launch_bounds__(kBlockThreads) UpdateKernel(kernels::UpdateArgs a) {
  DeviceWarp w;
  kernels::UpdateWarp<kMode, kGuarded>(w, WarpIndex(), WarpCount(), a);
}

__global__ void __launch_bounds__(kBlockThreads)
    CheckInputsKernel(const int64_t* __restrict__ begin, const InputCheckDesc* __restrict__ descs,
                      int64_t num_requests, int64_t total, unsigned long long* first_bad,
                      unsigned int* max_bits) {
  unsigned int local[2] = {0, 0};  // this thread's maxima, one atomic each at the end
  for (int64_t e = ThreadIndex(); e < total; e += ThreadCount()) {
    if (kernels::BadInputOne(e, begin, descs, num_requests, local)) {
      atomicMin(first_bad, static_cast<unsigned long long>(e));
    }
  }
  if (local[0] != 0) atomicMax(&max_bits[0], local[0]);
  if (local[1] != 0) atomicMax(&max_bits[1], local[1]);
}

__global__ void __launch_bounds__(kBlockThreads) MeasureKernel(MeasureLaunch a, int64_t total) {
  unsigned int local[3] = {0, 0, 0};  // this thread's, one atomic each at the end
  for (int64_t e = ThreadIndex(); e < total; e += ThreadCount()) kernels::MeasureOne(e, a, local);
  for (int k = 0; k < 3; ++k) {
    if (local[k] != 0) atomicMax(&a.out[k], local[k]);
  }
}

__global__ void __launch_bounds__(kBlockThreads) KeyFindKernel(KeyFindLaunch a) {
  for (int64_t e = ThreadIndex(); e < a.n; e += ThreadCount()) {
    kernels::KeyFindOne(e, a.ids, a.lines, a.mask, a.missing);
  }
}

__global__ void __launch_bounds__(kBlockThreads) CopyRowsKernel(CopyRowsLaunch a, int64_t total) {
  for (int64_t e = ThreadIndex(); e < total; e += ThreadCount()) {
    kernels::CopyRowWordOne(e, a.rows, a.words, a.from, a.to, a.gather);
  }
}

__global__ void FaultKernel(float* p) { *p = 1.0f; }

__global__ void __launch_bounds__(kBlockThreads) FillKernel(float* p, int64_t n, float value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    p[i] = value;
  }
}

// Blocks for one thread per element / one warp per element, capped: the
// kernels loop grid-stride.
int ThreadBlocks(int64_t threads, int max_blocks) {
  return static_cast<int>(
      std::clamp<int64_t>((threads + kBlockThreads - 1) / kBlockThreads, 1, max_blocks));
}
int WarpBlocks(int64_t warps, int max_blocks) {
  return static_cast<int>(
      std::clamp<int64_t>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, max_blocks));
}

#define EMBER_CUDA_TRY(expr)                     \
  do {                                           \
    const cudaError_t ember_err_ = (expr);       \
    if (ember_err_ != cudaSuccess) return ember_err_; \
  } while (0)

}  // namespace

cudaError_t LookupTempBytes(int64_t bags, size_t* bytes) {
  *bytes = 0;
  return cub::DeviceScan::InclusiveSum(nullptr, *bytes, static_cast<const int64_t*>(nullptr),
                                       static_cast<int64_t*>(nullptr), bags);
}

cudaError_t BackwardTempBytes(int64_t bags, int64_t ids, int end_bit, size_t* bytes) {
  size_t t = 0;
  *bytes = 0;
  EMBER_CUDA_TRY(cub::DeviceScan::InclusiveSum(nullptr, t, static_cast<const int64_t*>(nullptr),
                                               static_cast<int64_t*>(nullptr), bags));
  *bytes = std::max(*bytes, t);
  EMBER_CUDA_TRY(cub::DeviceScan::InclusiveSum(nullptr, t, static_cast<int64_t*>(nullptr),
                                               static_cast<int64_t*>(nullptr), ids));
  *bytes = std::max(*bytes, t);
  cub::DoubleBuffer<uint64_t> no_keys(nullptr, nullptr);
  cub::DoubleBuffer<int64_t> no_values(nullptr, nullptr);
  EMBER_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, t, no_keys, no_values, ids, 0, end_bit));
  *bytes = std::max(*bytes, t);
  return cudaSuccess;
}

cudaError_t LaunchLookup(const LookupLaunch& a, int max_blocks, cudaStream_t stream) {
  EMBER_CUDA_TRY(cudaMemsetAsync(a.offsets, 0, sizeof(int64_t), stream));
  size_t t = a.temp_bytes;
  EMBER_CUDA_TRY(cub::DeviceScan::InclusiveSum(a.temp, t, a.lengths, a.offsets + 1, a.num_bags,
                                               stream));
  LookupKernel<<<WarpBlocks(a.total_items, max_blocks), kBlockThreads, 0, stream>>>(
      a.item_begin, a.descs, a.num_requests, a.offsets, a.ids, a.weights, a.out);
  return cudaGetLastError();
}

cudaError_t LaunchBackward(const BackwardLaunch& a, int max_blocks, cudaStream_t stream) {
  const int64_t total = a.total_ids;
  if (total <= 0) return cudaErrorInvalidValue;  // the run count is run_id[total - 1]
  const int thread_blocks = ThreadBlocks(total, max_blocks);
  EMBER_CUDA_TRY(cudaMemsetAsync(a.offsets, 0, sizeof(int64_t), stream));
  size_t t = a.temp_bytes;
  EMBER_CUDA_TRY(cub::DeviceScan::InclusiveSum(a.temp, t, a.lengths, a.offsets + 1, a.num_bags,
                                               stream));
  ExpandKernel<<<thread_blocks, kBlockThreads, 0, stream>>>(
      a.id_begin, a.descs, a.num_requests, a.offsets, a.ids, a.weights, a.keys_a, a.pos_a,
      a.src_off, a.scale);
  EMBER_CUDA_TRY(cudaGetLastError());
  // Double-buffered sort (no copy of the pairs in CUB's temp storage); the
  // selector, set on the host, says which buffer ends up sorted. Stable, so
  // a row's occurrences stay in request-then-position order.
  cub::DoubleBuffer<uint64_t> keys(a.keys_a, a.keys_b);
  cub::DoubleBuffer<int64_t> positions(a.pos_a, a.pos_b);
  t = a.temp_bytes;
  EMBER_CUDA_TRY(cub::DeviceRadixSort::SortPairs(a.temp, t, keys, positions, total, 0, a.end_bit,
                                                 stream));
  const uint64_t* sorted_keys = keys.Current();
  const int64_t* sorted_positions = positions.Current();
  HeadFlagsKernel<<<thread_blocks, kBlockThreads, 0, stream>>>(sorted_keys, total, a.run_id);
  EMBER_CUDA_TRY(cudaGetLastError());
  t = a.temp_bytes;
  // In place (CUB's in-place overload passes the same pointer twice).
  EMBER_CUDA_TRY(cub::DeviceScan::InclusiveSum(a.temp, t, a.run_id, a.run_id, total, stream));
  RunBeginKernel<<<thread_blocks, kBlockThreads, 0, stream>>>(a.run_id, total, a.run_begin);
  EMBER_CUDA_TRY(cudaGetLastError());
  // The run count is run_id's last element; warps and threads beyond it exit.
  const int64_t* num_runs = a.run_id + (total - 1);
  EMBER_CUDA_TRY(cudaMemsetAsync(a.hot_units, 0, total * sizeof(int64_t), stream));
  HotUnitsKernel<<<thread_blocks, kBlockThreads, 0, stream>>>(a.run_begin, num_runs, a.hot_units);
  EMBER_CUDA_TRY(cudaGetLastError());
  t = a.temp_bytes;
  EMBER_CUDA_TRY(
      cub::DeviceScan::InclusiveSum(a.temp, t, a.hot_units, a.hot_end, total, stream));
  const kernels::UpdateArgs u = UpdateArgsOf(a, sorted_keys, sorted_positions, num_runs);
  PartialSumKernel<<<WarpBlocks(a.max_units, max_blocks), kBlockThreads, 0, stream>>>(u);
  EMBER_CUDA_TRY(cudaGetLastError());
  const int blocks = WarpBlocks(total, max_blocks);
  if (u.mode == kCheckRows) {
    UpdateKernel<kCheckRows, false><<<blocks, kBlockThreads, 0, stream>>>(u);
  } else if (u.mode == kReportRow) {
    UpdateKernel<kReportRow, false><<<blocks, kBlockThreads, 0, stream>>>(u);
  } else if (u.guarded_apply) {
    UpdateKernel<kApplyRows, true><<<blocks, kBlockThreads, 0, stream>>>(u);
  } else {
    UpdateKernel<kApplyRows, false><<<blocks, kBlockThreads, 0, stream>>>(u);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCheckInputs(const InputCheckLaunch& a, int max_blocks, cudaStream_t stream) {
  if (a.total <= 0) return cudaSuccess;
  CheckInputsKernel<<<ThreadBlocks(a.total, max_blocks), kBlockThreads, 0, stream>>>(
      a.begin, a.descs, a.num_requests, a.total, a.first_bad, a.max_bits);
  return cudaGetLastError();
}

cudaError_t LaunchMeasure(const MeasureLaunch& a, int max_blocks, cudaStream_t stream) {
  const int64_t total = a.rows * (a.dim + a.state_width);
  if (total <= 0) return cudaSuccess;
  MeasureKernel<<<ThreadBlocks(total, max_blocks), kBlockThreads, 0, stream>>>(a, total);
  return cudaGetLastError();
}

cudaError_t LaunchKeyFind(const KeyFindLaunch& a, int max_blocks, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  KeyFindKernel<<<ThreadBlocks(a.n, max_blocks), kBlockThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchCopyRows(const CopyRowsLaunch& a, int max_blocks, cudaStream_t stream) {
  const int64_t total = a.n * a.words;
  if (total <= 0) return cudaSuccess;
  CopyRowsKernel<<<ThreadBlocks(total, max_blocks), kBlockThreads, 0, stream>>>(a, total);
  return cudaGetLastError();
}

cudaError_t LaunchFill(float* p, int64_t n, float value, int max_blocks, cudaStream_t stream) {
  FillKernel<<<ThreadBlocks(n, max_blocks), kBlockThreads, 0, stream>>>(p, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchFault(cudaStream_t stream) {
  FaultKernel<<<1, 1, 0, stream>>>(reinterpret_cast<float*>(uintptr_t{16}));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ember
