// The CUDA embedding backend (see cuda_backend.h and, for the semantics,
// server/backend/embedding_backend.h; cuda/README.md has the design).
//
// Every call stages its host inputs into one pinned buffer laid out exactly
// like the start of one device scratch buffer, uploading it in 1 MiB chunks
// as it fills (the DMA of one chunk overlaps the host copy of the next), runs
// its kernels on the backend's stream, and downloads the result in chunks
// that are handed to the caller's outputs as each lands. Both buffers grow and
// are reused, so a warm backend allocates nothing per call.
//
// Forward (one launch for all requests): a warp per work item (a bag of a
// pooled feature, an id of a NONE feature), found by binary search over the
// per-request item prefix. Rows are read as float4 / 4 x fp16 / 4 x bf16 and
// accumulated in fp32; when dim < 128 the warp splits into groups that each
// take other ids of the bag, reduced with shuffles at the end.
//
// Backward (one pass for all requests and shards): each id becomes a pair
// (key = the shard's key base + row, position); the pairs are radix sorted
// (stable, so a row's occurrences stay in request-then-position order, the
// CPU backend's order), runs of equal keys are found with a head-flag scan,
// and a warp per run sums the run's scaled gradient rows and applies the
// optimizer once to that row.
#include "cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cub/cub.cuh>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cuda/cuda_status.h"
#include "cuda/kernel_bodies.h"
#include "cuda/kernel_descs.h"
#include "cuda/request_plan.h"
#include "cuda/warp.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/embedding_math.h"
#include "server/backend/half.h"

namespace ember {
namespace cuda {
namespace {

using backend::EmbeddingBackend;
using backend::FeatureRequest;
using backend::GradientRequest;
using backend::LookupRequest;
using backend::OptimizerType;
using backend::Pooling;
using backend::ShardId;
using backend::ShardNotFound;
using backend::ShardSpec;
namespace math = backend::math;
using backend::CheckFinite;
using backend::CheckIds;
using backend::Checks;
using backend::RequestWhat;
using backend::ValidateRequests;
using backend::ValidateImport;
using backend::ValidateRowRange;
using backend::WeightType;

constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;

static_assert(kernels::kFp16 == static_cast<int32_t>(WeightType::kFp16) &&
                  kernels::kBf16 == static_cast<int32_t>(WeightType::kBf16) &&
                  kernels::kMean == static_cast<int32_t>(Pooling::kMean) &&
                  kernels::kNone == static_cast<int32_t>(Pooling::kNone),
              "the kernels' enum codes");

// Host <-> device copies of shard rows (init, export, import) go through
// pinned staging in chunks of about this size.
constexpr int64_t kTransferChunkBytes = int64_t{8} << 20;
// Host threads that compute initial values.
constexpr unsigned kMaxInitThreads = 8;

// ---------------------------------------------------------------------------
// Kernels: grid-stride loops over the bodies in kernel_bodies.h (the same
// code the emulated backend runs on the CPU with HostWarp).

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

__global__ void __launch_bounds__(kBlockThreads) UpdateKernel(kernels::UpdateArgs a) {
  DeviceWarp w;
  kernels::UpdateWarp(w, WarpIndex(), WarpCount(), a);
}

// Writes through a bad pointer: InjectFault's illegal address.
__global__ void FaultKernel(float* p) { *p = 1.0f; }

__global__ void __launch_bounds__(kBlockThreads) FillKernel(float* p, int64_t n, float value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    p[i] = value;
  }
}

// ---------------------------------------------------------------------------
// Host side.

// cudaMalloc / cudaMallocHost that turn failure into a Status and clear the
// (non-sticky) error, so a later cudaGetLastError after a launch does not
// report it again.
absl::Status DeviceAlloc(void** p, size_t bytes, bool pinned_host) {
  const cudaError_t err = pinned_host ? cudaMallocHost(p, bytes) : cudaMalloc(p, bytes);
  if (err == cudaSuccess) return absl::OkStatus();
  *p = nullptr;
  cudaGetLastError();
  return CudaErrorToStatus(err, pinned_host ? "cudaMallocHost" : "cudaMalloc");
}

// Owns one cudaMalloc'd (or, when pinned_host, cudaMallocHost'd) block.
// Not copyable; frees in its destructor. The owner makes the right device
// current before the destructor runs.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(bool pinned_host = false) : pinned_host_(pinned_host) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Exactly `bytes` (0: none); previous contents are freed.
  absl::Status Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return absl::OkStatus();
    if (absl::Status s = DeviceAlloc(&ptr_, bytes, pinned_host_); !s.ok()) return s;
    capacity_ = bytes;
    return absl::OkStatus();
  }

  // At least `bytes`, growing by half again to amortise; contents are not
  // kept when it grows.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    const size_t grown = std::max(bytes, capacity_ + capacity_ / 2);
    if (Allocate(grown).ok()) return absl::OkStatus();
    return Allocate(bytes);
  }

  void Reset() {
    if (ptr_ != nullptr) {
      if (pinned_host_) {
        cudaFreeHost(ptr_);
      } else {
        cudaFree(ptr_);
      }
    }
    ptr_ = nullptr;
    capacity_ = 0;
  }

  char* get() const { return static_cast<char*>(ptr_); }

 private:
  const bool pinned_host_;
  void* ptr_ = nullptr;
  size_t capacity_ = 0;
};

// Brackets the GPU work of one public call. On entry it drops any error an
// earlier, already-reported failure left in this thread's last-error slot,
// so each launch check judges that launch alone. On every exit, failures
// included, it waits for the stream: a call never returns while work it
// queued may still read the staging or scratch buffers the next call
// rewrites.
class CallScope {
 public:
  explicit CallScope(cudaStream_t stream) : stream_(stream) { cudaGetLastError(); }
  ~CallScope() {
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  const cudaStream_t stream_;
};

template <typename T>
T* At(char* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Pipelined host <-> device copies through pinned staging. Large calls spend
// most of their time copying between the caller's (pageable) arrays and the
// staging buffer; cutting the transfer into chunks lets the DMA of one chunk
// run while the host copies the next.
constexpr size_t kPipelineChunkBytes = size_t{1} << 20;
constexpr int kMaxDownloadChunks = 32;

// Fills staging in increasing offset order (regions of a Layout, filled in
// layout order) and uploads whatever is filled every kPipelineChunkBytes.
class Uploader {
 public:
  Uploader(char* host, char* device, cudaStream_t stream)
      : host_(host), device_(device), stream_(stream) {}

  // Copies src to staging offset `at` (at >= what was filled before),
  // uploading as it goes. Each 64 KiB piece is handed to
  // check(staged piece, index of its first element) right after it is
  // copied, while it is still in cache: the request's values are checked in
  // the same pass over the bytes as the copy.
  template <typename T, typename Check>
  absl::Status AppendSpan(size_t at, absl::Span<const T> src, Check&& check) {
    constexpr size_t kPiece = (size_t{64} << 10) / sizeof(T);
    for (size_t i = 0; i < src.size(); i += kPiece) {
      const size_t n = std::min(kPiece, src.size() - i);
      std::memcpy(host_ + at, src.data() + i, n * sizeof(T));
      if (absl::Status s = check(absl::Span<const T>(At<const T>(host_, at), n),
                                 static_cast<int64_t>(i));
          !s.ok()) {
        return s;
      }
      at += n * sizeof(T);
      if (at - sent_ >= kPipelineChunkBytes) {
        if (absl::Status s = Flush(at); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status AppendSpan(size_t at, absl::Span<const T> src) {
    return AppendSpan(at, src, [](absl::Span<const T>, int64_t) { return absl::OkStatus(); });
  }

  // Uploads staging [sent, upto).
  absl::Status Flush(size_t upto) {
    if (upto <= sent_) return absl::OkStatus();
    EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(device_ + sent_, host_ + sent_, upto - sent_,
                                               cudaMemcpyHostToDevice, stream_));
    sent_ = upto;
    return absl::OkStatus();
  }

 private:
  char* const host_;
  char* const device_;
  const cudaStream_t stream_;
  size_t sent_ = 0;
};

// Downloads `count` floats from `device` through staging `host` in chunks,
// handing each chunk to the requests' outputs as soon as it has landed.
// `events` holds kMaxDownloadChunks events of the calling backend.
absl::Status DownloadOutputs(const float* device, float* host, int64_t count,
                             absl::Span<const backend::LookupRequest> requests,
                             const cudaEvent_t* events, cudaStream_t stream) {
  const int64_t min_chunk = static_cast<int64_t>(kPipelineChunkBytes / sizeof(float));
  const int64_t chunk =
      std::max(min_chunk, (count + kMaxDownloadChunks - 1) / kMaxDownloadChunks);
  const int64_t chunks = (count + chunk - 1) / chunk;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * chunk, n = std::min(chunk, count - b);
    EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host + b, device + b, n * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream));
    EMBER_RETURN_IF_CUDA_ERROR(cudaEventRecord(events[c], stream));
  }
  // Walk the outputs in concatenated order alongside the chunks.
  size_t r = 0;
  int64_t r_pos = 0;  // floats of requests[r].output already written
  for (int64_t c = 0; c < chunks; ++c) {
    EMBER_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(events[c]));
    int64_t b = c * chunk;
    const int64_t e = std::min(count, b + chunk);
    while (b < e) {
      absl::Span<float> out = requests[r].output;
      const int64_t take = std::min<int64_t>(e - b, static_cast<int64_t>(out.size()) - r_pos);
      if (take > 0) std::memcpy(out.data() + r_pos, host + b, take * sizeof(float));
      b += take;
      r_pos += take;
      if (r_pos == static_cast<int64_t>(out.size())) {
        ++r;
        r_pos = 0;
      }
    }
  }
  return absl::OkStatus();
}

int ElementBytes(WeightType t) { return t == WeightType::kFp32 ? 4 : 2; }

struct Shard {
  ShardSpec spec;
  int elem_bytes = 4;
  int64_t state_width = 0;
  DeviceBuffer weights;  // [rows, dim] in spec.weight_type
  DeviceBuffer state;    // [rows, state_width] fp32
  int64_t step = 0;      // Adam's t

  int64_t RowBytes() const { return spec.dim * elem_bytes; }
  int64_t Bytes() const { return spec.rows * (spec.dim * elem_bytes + state_width * 4); }
};

class CudaBackend : public EmbeddingBackend {
 public:
  CudaBackend(const CudaBackendOptions& options, cudaStream_t stream, cudaStream_t init_stream,
              std::string device_name, int max_blocks)
      : options_(options),
        stream_(stream),
        device_name_(std::move(device_name)),
        max_blocks_(max_blocks),
        budget_(options.memory_limit_bytes),
        staging_(/*pinned_host=*/true),
        init_stream_(init_stream),
        init_staging_(/*pinned_host=*/true) {}

  // The download events; called once by CreateCudaBackend.
  absl::Status CreateEvents() {
    for (cudaEvent_t& e : events_) {
      EMBER_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    shards_.clear();
    scratch_.Reset();
    staging_.Reset();
    init_staging_.Reset();
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    cudaStreamDestroy(stream_);
    cudaStreamDestroy(init_stream_);
  }

  // The data calls, guarded: once the device is lost (a sticky error),
  // each answers UNAVAILABLE without touching it.
  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    return Guarded([&] { return DoCreateShard(spec); });
  }
  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    return Guarded([&] { return DoLookup(requests); });
  }
  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    return Guarded([&] { return DoApplyGradients(requests); });
  }
  absl::Status ExportRows(ShardId id, int64_t row_begin, int64_t row_end,
                          absl::Span<float> weights, absl::Span<float> state) const override {
    return Guarded([&] { return DoExportRows(id, row_begin, row_end, weights, state); });
  }
  absl::Status ImportRows(ShardId id, int64_t row_begin, int64_t row_end,
                          absl::Span<const float> weights,
                          absl::Span<const float> state) override {
    return Guarded([&] { return DoImportRows(id, row_begin, row_end, weights, state); });
  }

  absl::Status Health() const override {
    absl::MutexLock lock(&lost_mu_);
    return lost_;
  }

  // Makes the device fail the way a faulty kernel would (an illegal
  // address): for the test of what follows a sticky error.
  absl::Status InjectFault() {
    return Guarded([&]() -> absl::Status {
      absl::MutexLock lock(&mu_);
      if (absl::Status s = Activate(); !s.ok()) return s;
      FaultKernel<<<1, 1, 0, stream_>>>(reinterpret_cast<float*>(uintptr_t{16}));
      EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    });
  }

  // The memory is reserved under mu_; allocation and initialisation run
  // outside it, on a stream and pinned staging of their own (one creation
  // at a time), so a large shard's creation does not stall the data calls
  // on the shards held. The shard is published when it is ready.
  absl::StatusOr<ShardId> DoCreateShard(const ShardSpec& spec) {
    if (absl::Status s = backend::ValidateShardSpec(spec); !s.ok()) return s;
    auto shard = std::make_unique<Shard>();
    shard->spec = spec;
    shard->elem_bytes = ElementBytes(spec.weight_type);
    shard->state_width = backend::OptimizerStateWidth(spec.optimizer.type, spec.dim);
    const int64_t per_row = spec.dim * shard->elem_bytes + shard->state_width * 4;
    if (spec.rows > std::numeric_limits<int64_t>::max() / per_row) {
      return absl::ResourceExhaustedError(
          absl::StrCat("shard of table '", spec.table, "' is larger than 2^63 bytes"));
    }
    const int64_t bytes = shard->Bytes();
    if (absl::Status s = budget_.Reserve(bytes, spec.table); !s.ok()) return s;
    if (absl::Status s = MakeShard(shard.get(), bytes); !s.ok()) {
      budget_.Release(bytes);
      return s;
    }
    absl::MutexLock lock(&mu_);
    const ShardId id = next_id_++;
    shards_.emplace(id, std::move(shard));
    return id;
  }

  // Allocates and initialises an unpublished shard (DoCreateShard).
  absl::Status MakeShard(Shard* shard, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&init_mu_);
    if (absl::Status s = Activate(); !s.ok()) return s;
    const CallScope scope(init_stream_);
    const ShardSpec& spec = shard->spec;
    absl::Status s = shard->weights.Allocate(static_cast<size_t>(spec.rows * shard->RowBytes()));
    if (s.ok()) s.Update(shard->state.Allocate(static_cast<size_t>(spec.rows * shard->state_width * 4)));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("device memory for shard of table '", spec.table,
                                                 "' (", bytes, " bytes): ", s.message()));
    }
    return InitShard(shard);
  }

  absl::Status DropShard(ShardId id) override {
    absl::MutexLock lock(&mu_);
    auto it = shards_.find(id);
    if (it == shards_.end()) return ShardNotFound(id);
    if (absl::Status s = Activate(); !s.ok()) return s;
    budget_.Release(it->second->Bytes());
    shards_.erase(it);
    return absl::OkStatus();
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    return s->spec;
  }

  absl::Status DoLookup(absl::Span<const LookupRequest> requests) {
    absl::MutexLock lock(&mu_);
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    // Shapes now; ids and weights while they are staged (before any kernel).
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kShapesOnly); !st.ok()) {
      return st;
    }
    const int64_t n = static_cast<int64_t>(requests.size());
    const LookupPlan plan = PlanLookup(requests, Resolver());
    // No bags and no ids anywhere: every output is empty.
    if (plan.total_items == 0) return absl::OkStatus();
    if (absl::Status s = Activate(); !s.ok()) return s;
    const CallScope scope(stream_);

    // Inputs, staged in pinned memory with the same layout as on the device.
    Layout in;
    const size_t item_begin_at = in.Add<int64_t>(n + 1);
    const size_t desc_at = in.Add<LookupDesc>(n);
    const size_t lengths_at = in.Add<int64_t>(plan.total_bags);
    const size_t ids_at = in.Add<int64_t>(plan.total_ids);
    const size_t weights_at = in.Add<float>(plan.any_weighted ? plan.total_ids : 0);
    const size_t in_bytes = in.bytes();
    Layout dev = in, host = in;
    const size_t offsets_at = dev.Add<int64_t>(plan.total_bags + 1);
    const size_t out_at = dev.Add<float>(plan.total_out);
    size_t scan_temp = 0;
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        nullptr, scan_temp, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
        plan.total_bags, stream_));
    const size_t temp_at = dev.Add<char>(static_cast<int64_t>(scan_temp));
    const size_t host_out_at = host.Add<float>(plan.total_out);
    if (absl::Status s = Reserve(dev.bytes(), host.bytes()); !s.ok()) return s;
    char* h = staging_.get();
    char* d = scratch_.get();
    std::memcpy(h + item_begin_at, plan.item_begin.data(), (n + 1) * sizeof(int64_t));
    std::memcpy(h + desc_at, plan.descs.data(), n * sizeof(LookupDesc));
    // The arrays, region by region in layout order, uploaded as they fill.
    Uploader up(h, d, stream_);
    if (absl::Status st = StageFeatures(requests, "lookup", lengths_at, ids_at, weights_at, &up);
        !st.ok()) {
      return st;
    }
    if (absl::Status st = up.Flush(in_bytes); !st.ok()) return st;

    int64_t* offsets = At<int64_t>(d, offsets_at);
    float* out = At<float>(d, out_at);
    EMBER_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(offsets, 0, sizeof(int64_t), stream_));
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        d + temp_at, scan_temp, At<const int64_t>(d, lengths_at), offsets + 1, plan.total_bags,
        stream_));
    LookupKernel<<<WarpBlocks(plan.total_items), kBlockThreads, 0, stream_>>>(
        At<const int64_t>(d, item_begin_at), At<const LookupDesc>(d, desc_at), n, offsets,
        At<const int64_t>(d, ids_at), At<const float>(d, weights_at), out);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return DownloadOutputs(out, At<float>(h, host_out_at), plan.total_out, requests, events_,
                           stream_);
  }

  absl::Status DoApplyGradients(absl::Span<const GradientRequest> requests) {
    absl::MutexLock lock(&mu_);
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    // Shapes now; ids, weights and gradients while they are staged (before
    // any kernel).
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kShapesOnly); !st.ok()) {
      return st;
    }
    const int64_t n = static_cast<int64_t>(requests.size());
    const GradientPlan plan = PlanGradients(requests, Resolver());
    // Every shard the call names takes an Adam step, ids or not (the
    // interface rule, as in the CPU backend); only shards with ids update.
    auto take_steps = [&] {
      for (ShardId id : plan.idle) ++FindShard(id)->step;
      for (ShardId id : plan.slots) ++FindShard(id)->step;
    };
    const int64_t total_ids = plan.total_ids;
    if (total_ids == 0) {
      // Nothing is staged, so the gradients (of empty bags) are checked here.
      for (int64_t i = 0; i < n; ++i) {
        const GradientRequest& r = requests[i];
        if (absl::Status st = CheckFinite(
                r.grad, RequestWhat("gradient", i, FindShard(r.feature.shard)->spec), "gradient");
            !st.ok()) {
          return st;
        }
      }
      take_steps();
      return absl::OkStatus();
    }
    const int64_t num_shards = static_cast<int64_t>(plan.slots.size());
    if (absl::Status s = Activate(); !s.ok()) return s;
    const CallScope scope(stream_);

    Layout in;
    const size_t id_begin_at = in.Add<int64_t>(n + 1);
    const size_t desc_at = in.Add<GradDesc>(n);
    const size_t update_at = in.Add<UpdateDesc>(num_shards);
    const size_t key_base_at = in.Add<uint64_t>(num_shards + 1);
    const size_t lengths_at = in.Add<int64_t>(plan.total_bags);
    const size_t ids_at = in.Add<int64_t>(total_ids);
    const size_t weights_at = in.Add<float>(plan.any_weighted ? total_ids : 0);
    const size_t grads_at = in.Add<float>(plan.total_grad);
    const size_t in_bytes = in.bytes();
    Layout dev = in;
    const size_t offsets_at = dev.Add<int64_t>(plan.total_bags + 1);
    const size_t keys_a_at = dev.Add<uint64_t>(total_ids);
    const size_t keys_b_at = dev.Add<uint64_t>(total_ids);
    const size_t pos_a_at = dev.Add<int64_t>(total_ids);
    const size_t pos_b_at = dev.Add<int64_t>(total_ids);
    const size_t src_off_at = dev.Add<int64_t>(total_ids);
    const size_t scale_at = dev.Add<float>(total_ids);
    const size_t run_id_at = dev.Add<int64_t>(total_ids);
    const size_t run_begin_at = dev.Add<int64_t>(total_ids + 1);
    // Hot rows: chunk counts per run, their scan, and the chunks' partial
    // sums (runs longer than kHotRun hold at most 2 * ids / kHotRun chunks).
    const int64_t max_units = 2 * (total_ids / kernels::kHotRun) + 1;
    const size_t hot_units_at = dev.Add<int64_t>(total_ids);
    const size_t hot_end_at = dev.Add<int64_t>(total_ids);
    const size_t partials_at = dev.Add<float>(max_units * plan.max_dim);
    size_t temp = 0, t = 0;
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        nullptr, t, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
        plan.total_bags, stream_));
    temp = std::max(temp, t);
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        nullptr, t, static_cast<int64_t*>(nullptr), static_cast<int64_t*>(nullptr), total_ids,
        stream_));
    temp = std::max(temp, t);
    {
      cub::DoubleBuffer<uint64_t> no_keys(nullptr, nullptr);
      cub::DoubleBuffer<int64_t> no_values(nullptr, nullptr);
      EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
          nullptr, t, no_keys, no_values, total_ids, 0, plan.end_bit, stream_));
    }
    temp = std::max(temp, t);
    const size_t temp_at = dev.Add<char>(static_cast<int64_t>(temp));
    if (absl::Status s = Reserve(dev.bytes(), in_bytes); !s.ok()) return s;
    char* h = staging_.get();
    char* d = scratch_.get();
    std::memcpy(h + id_begin_at, plan.id_begin.data(), (n + 1) * sizeof(int64_t));
    std::memcpy(h + desc_at, plan.descs.data(), n * sizeof(GradDesc));
    std::memcpy(h + update_at, plan.updates.data(), num_shards * sizeof(UpdateDesc));
    std::memcpy(h + key_base_at, plan.key_base.data(), (num_shards + 1) * sizeof(uint64_t));
    // The arrays, region by region in layout order, uploaded as they fill.
    Uploader up(h, d, stream_);
    if (absl::Status st =
            StageFeatures(requests, "gradient", lengths_at, ids_at, weights_at, &up);
        !st.ok()) {
      return st;
    }
    size_t at = grads_at;
    for (int64_t i = 0; i < n; ++i) {
      const GradientRequest& r = requests[i];
      const ShardSpec& spec = FindShard(r.feature.shard)->spec;
      auto check = [&](absl::Span<const float> g, int64_t first) {
        return CheckFinite(g, RequestWhat("gradient", i, spec), "gradient", first);
      };
      if (absl::Status st = up.AppendSpan(at, r.grad, check); !st.ok()) return st;
      at += r.grad.size() * sizeof(float);
    }
    if (absl::Status st = up.Flush(in_bytes); !st.ok()) return st;

    int64_t* offsets = At<int64_t>(d, offsets_at);
    uint64_t* keys_a = At<uint64_t>(d, keys_a_at);
    uint64_t* keys_b = At<uint64_t>(d, keys_b_at);
    int64_t* pos_a = At<int64_t>(d, pos_a_at);
    int64_t* pos_b = At<int64_t>(d, pos_b_at);
    int64_t* src_off = At<int64_t>(d, src_off_at);
    float* scale = At<float>(d, scale_at);
    int64_t* run_id = At<int64_t>(d, run_id_at);
    int64_t* run_begin = At<int64_t>(d, run_begin_at);
    char* temp_ptr = d + temp_at;
    const int thread_blocks = ThreadBlocks(total_ids);

    EMBER_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(offsets, 0, sizeof(int64_t), stream_));
    t = temp;
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        temp_ptr, t, At<const int64_t>(d, lengths_at), offsets + 1, plan.total_bags, stream_));
    ExpandKernel<<<thread_blocks, kBlockThreads, 0, stream_>>>(
        At<const int64_t>(d, id_begin_at), At<const GradDesc>(d, desc_at), n, offsets,
        At<const int64_t>(d, ids_at), At<const float>(d, weights_at), keys_a, pos_a, src_off,
        scale);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    // Double-buffered sort (no copy of the pairs in CUB's temp storage); the
    // selector, set on the host, says which buffer ends up sorted.
    cub::DoubleBuffer<uint64_t> keys(keys_a, keys_b);
    cub::DoubleBuffer<int64_t> positions(pos_a, pos_b);
    t = temp;
    EMBER_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(temp_ptr, t, keys, positions,
                                                               total_ids, 0, plan.end_bit,
                                                               stream_));
    const uint64_t* sorted_keys = keys.Current();
    const int64_t* sorted_positions = positions.Current();
    HeadFlagsKernel<<<thread_blocks, kBlockThreads, 0, stream_>>>(sorted_keys, total_ids, run_id);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    t = temp;
    // In place (CUB's in-place overload passes the same pointer twice).
    EMBER_RETURN_IF_CUDA_ERROR(
        cub::DeviceScan::InclusiveSum(temp_ptr, t, run_id, run_id, total_ids, stream_));
    RunBeginKernel<<<thread_blocks, kBlockThreads, 0, stream_>>>(run_id, total_ids, run_begin);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    // The run count is run_id's last element; warps and threads beyond it exit.
    const int64_t* num_runs = run_id + (total_ids - 1);
    int64_t* hot_units = At<int64_t>(d, hot_units_at);
    int64_t* hot_end = At<int64_t>(d, hot_end_at);
    float* partials = At<float>(d, partials_at);
    EMBER_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(hot_units, 0, total_ids * sizeof(int64_t), stream_));
    HotUnitsKernel<<<thread_blocks, kBlockThreads, 0, stream_>>>(run_begin, num_runs, hot_units);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    t = temp;
    EMBER_RETURN_IF_CUDA_ERROR(
        cub::DeviceScan::InclusiveSum(temp_ptr, t, hot_units, hot_end, total_ids, stream_));
    kernels::UpdateArgs args;
    args.sorted_keys = sorted_keys;
    args.sorted_positions = sorted_positions;
    args.run_begin = run_begin;
    args.num_runs = num_runs;
    args.hot_end = hot_end;
    args.key_base = At<const uint64_t>(d, key_base_at);
    args.shards = At<const UpdateDesc>(d, update_at);
    args.num_shards = num_shards;
    args.src_off = src_off;
    args.scale = scale;
    args.grads = At<const float>(d, grads_at);
    args.partials = partials;
    args.partial_stride = plan.max_dim;
    PartialSumKernel<<<WarpBlocks(max_units), kBlockThreads, 0, stream_>>>(args);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    UpdateKernel<<<WarpBlocks(total_ids), kBlockThreads, 0, stream_>>>(args);
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    take_steps();
    return absl::OkStatus();
  }

  absl::Status DoExportRows(ShardId id, int64_t row_begin, int64_t row_end,
                            absl::Span<float> weights, absl::Span<float> state) const {
    absl::MutexLock lock(&mu_);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateRowRange(s->spec, row_begin, row_end, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    if (row_end == row_begin) return absl::OkStatus();
    if (absl::Status st = Activate(); !st.ok()) return st;
    const CallScope scope(stream_);
    const int64_t dim = s->spec.dim, row_bytes = s->RowBytes();
    const int64_t chunk_rows = std::max<int64_t>(1, kTransferChunkBytes / row_bytes);
    const int64_t n = row_end - row_begin;
    if (absl::Status st = staging_.Reserve(std::min(n, chunk_rows) * row_bytes); !st.ok()) {
      return st;
    }
    for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n - r0);
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          staging_.get(), s->weights.get() + (row_begin + r0) * row_bytes, rows * row_bytes,
          cudaMemcpyDeviceToHost, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      float* dst = weights.data() + r0 * dim;
      const int64_t count = rows * dim;
      switch (s->spec.weight_type) {
        case WeightType::kFp16: {
          const uint16_t* src = At<const uint16_t>(staging_.get(), 0);
          for (int64_t i = 0; i < count; ++i) dst[i] = backend::Fp16ToFloat(src[i]);
          break;
        }
        case WeightType::kBf16: {
          const uint16_t* src = At<const uint16_t>(staging_.get(), 0);
          for (int64_t i = 0; i < count; ++i) dst[i] = backend::Bf16ToFloat(src[i]);
          break;
        }
        default:
          std::memcpy(dst, staging_.get(), count * sizeof(float));
      }
    }
    if (s->state_width > 0) {
      // Pageable destination: the copy is staged by the driver.
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          state.data(),
          reinterpret_cast<const float*>(s->state.get()) + row_begin * s->state_width,
          n * s->state_width * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    return absl::OkStatus();
  }

  absl::Status DoImportRows(ShardId id, int64_t row_begin, int64_t row_end,
                            absl::Span<const float> weights, absl::Span<const float> state) {
    absl::MutexLock lock(&mu_);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateImport(s->spec, row_begin, row_end, weights, state);
        !st.ok()) {
      return st;
    }
    if (row_end == row_begin) return absl::OkStatus();
    if (absl::Status st = Activate(); !st.ok()) return st;
    const CallScope scope(stream_);
    const int64_t dim = s->spec.dim, row_bytes = s->RowBytes();
    const int64_t chunk_rows = std::max<int64_t>(1, kTransferChunkBytes / row_bytes);
    const int64_t n = row_end - row_begin;
    if (absl::Status st = staging_.Reserve(std::min(n, chunk_rows) * row_bytes); !st.ok()) {
      return st;
    }
    for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n - r0);
      StoreRows(s->spec.weight_type, weights.data() + r0 * dim, rows * dim, staging_.get());
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(s->weights.get() + (row_begin + r0) * row_bytes,
                                                 staging_.get(), rows * row_bytes,
                                                 cudaMemcpyHostToDevice, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    if (s->state_width > 0) {
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          reinterpret_cast<float*>(s->state.get()) + row_begin * s->state_width, state.data(),
          n * s->state_width * sizeof(float), cudaMemcpyHostToDevice, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> ExportStep(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    return s->step;
  }

  absl::Status ImportStep(ShardId id, int64_t step) override {
    absl::MutexLock lock(&mu_);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (step < 0) return absl::InvalidArgumentError("step must be >= 0");
    s->step = step;
    return absl::OkStatus();
  }

  int64_t AvailableBytes() const override { return budget_.Available(); }

  std::string Name() const override { return absl::StrCat("cuda/", device_name_); }

 private:
  // The calling thread's current device is per thread: every call that
  // touches the GPU makes ours current first.
  absl::Status Activate() const {
    EMBER_RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device));
    return absl::OkStatus();
  }

  absl::Status Reserve(size_t device_bytes, size_t host_bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (absl::Status s = scratch_.Reserve(device_bytes); !s.ok()) return s;
    return staging_.Reserve(host_bytes);
  }

  // Blocks for one thread per element / one warp per element, capped: the
  // kernels loop grid-stride.
  int ThreadBlocks(int64_t threads) const {
    return static_cast<int>(std::clamp<int64_t>((threads + kBlockThreads - 1) / kBlockThreads,
                                                1, max_blocks_));
  }
  int WarpBlocks(int64_t warps) const {
    return static_cast<int>(
        std::clamp<int64_t>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, max_blocks_));
  }

  // fp32 values into `dst` in the weight type, rounded to nearest even by
  // the same functions as the CPU backend.
  static void StoreRows(WeightType type, const float* src, int64_t count, char* dst) {
    switch (type) {
      case WeightType::kFp16: {
        uint16_t* out = reinterpret_cast<uint16_t*>(dst);
        for (int64_t i = 0; i < count; ++i) out[i] = backend::FloatToFp16(src[i]);
        break;
      }
      case WeightType::kBf16: {
        uint16_t* out = reinterpret_cast<uint16_t*>(dst);
        for (int64_t i = 0; i < count; ++i) out[i] = backend::FloatToBf16(src[i]);
        break;
      }
      default:
        std::memcpy(dst, src, count * sizeof(float));
    }
  }

  // Initial weights (InitialValue, computed on host threads, converted as
  // the CPU backend converts, uploaded chunk by chunk) and optimizer state
  // (initial_accumulator_value for the Adagrad variants, zeros for Adam).
  absl::Status InitShard(Shard* shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(init_mu_) {
    const ShardSpec& sp = shard->spec;
    const int64_t dim = sp.dim, row_bytes = shard->RowBytes();
    const int64_t chunk_rows = std::max<int64_t>(1, kTransferChunkBytes / row_bytes);
    if (absl::Status s = init_staging_.Reserve(std::min(sp.rows, chunk_rows) * row_bytes); !s.ok()) {
      return s;
    }
    std::vector<float> values;
    const unsigned threads =
        std::max(1u, std::min(kMaxInitThreads, std::thread::hardware_concurrency()));
    for (int64_t r0 = 0; r0 < sp.rows; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, sp.rows - r0);
      values.resize(static_cast<size_t>(rows * dim));
      auto fill = [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          for (int64_t c = 0; c < dim; ++c) {
            values[r * dim + c] = backend::InitialValue(sp.initializer, sp.table_rows,
                                                        sp.row_offset + r0 + r, sp.col_offset + c);
          }
        }
      };
      const int64_t per_thread = (rows + threads - 1) / threads;
      if (threads == 1 || rows * dim < 65536) {
        fill(0, rows);
      } else {
        std::vector<std::thread> pool;
        for (int64_t b = per_thread; b < rows; b += per_thread) {
          pool.emplace_back(fill, b, std::min(rows, b + per_thread));
        }
        fill(0, std::min(rows, per_thread));
        for (std::thread& t : pool) t.join();
      }
      StoreRows(sp.weight_type, values.data(), rows * dim, init_staging_.get());
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(shard->weights.get() + r0 * row_bytes,
                                                 init_staging_.get(), rows * row_bytes,
                                                 cudaMemcpyHostToDevice, init_stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(init_stream_));
    }
    const int64_t state_elems = sp.rows * shard->state_width;
    if (state_elems > 0) {
      float* state = reinterpret_cast<float*>(shard->state.get());
      const bool adagrad = sp.optimizer.type == OptimizerType::kAdagrad ||
                           sp.optimizer.type == OptimizerType::kRowwiseAdagrad;
      const float init = adagrad ? sp.optimizer.initial_accumulator_value : 0.0f;
      if (init == 0.0f) {
        EMBER_RETURN_IF_CUDA_ERROR(
            cudaMemsetAsync(state, 0, state_elems * sizeof(float), init_stream_));
      } else {
        FillKernel<<<ThreadBlocks(state_elems), kBlockThreads, 0, init_stream_>>>(state, state_elems,
                                                                            init);
        EMBER_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      }
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(init_stream_));
    }
    return absl::OkStatus();
  }

  // Runs one data call; a failure that left the context with a sticky error
  // marks the backend lost (Health) for every later call.
  template <typename Fn>
  auto Guarded(Fn&& fn) const -> decltype(fn()) {
    if (absl::Status lost = Health(); !lost.ok()) return lost;
    auto result = fn();
    if (!result.ok()) {
      const cudaError_t err = cudaStreamQuery(stream_);  // sticky errors persist
      if (IsStickyError(err)) {
        absl::MutexLock lock(&lost_mu_);
        lost_.Update(absl::UnavailableError(absl::StrCat(  // the first loss is kept
            "CUDA device ", options_.device, " lost (", cudaGetErrorName(err), ": ",
            cudaGetErrorString(err), "); its shards must be recovered on another worker")));
        return lost_;
      }
    }
    return result;
  }

  // Stages the requests' lengths, ids and per-id weights into their layout
  // regions, in order, checking ids (in range) and weights (finite) piece by
  // piece as they are copied. `kind` names the requests in messages.
  template <typename Request>
  absl::Status StageFeatures(absl::Span<const Request> requests, const char* kind,
                             size_t lengths_at, size_t ids_at, size_t weights_at,
                             Uploader* up) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t n = static_cast<int64_t>(requests.size());
    size_t at = lengths_at;
    for (const Request& r : requests) {
      if (absl::Status st = up->AppendSpan(at, r.feature.lengths); !st.ok()) return st;
      at += r.feature.lengths.size() * sizeof(int64_t);
    }
    at = ids_at;
    for (int64_t i = 0; i < n; ++i) {
      const FeatureRequest& f = requests[i].feature;
      const ShardSpec& spec = FindShard(f.shard)->spec;
      auto check = [&](absl::Span<const int64_t> ids, int64_t first) {
        return CheckIds(ids, spec.rows, RequestWhat(kind, i, spec), first);
      };
      if (absl::Status st = up->AppendSpan(at, f.ids, check); !st.ok()) return st;
      at += f.ids.size() * sizeof(int64_t);
    }
    at = weights_at;
    for (int64_t i = 0; i < n; ++i) {
      const FeatureRequest& f = requests[i].feature;
      if (f.weights.empty()) {
        at += f.ids.size() * sizeof(float);  // never read: the request is unweighted
        continue;
      }
      const ShardSpec& spec = FindShard(f.shard)->spec;
      auto check = [&](absl::Span<const float> w, int64_t first) {
        return CheckFinite(w, RequestWhat(kind, i, spec), "weights", first);
      };
      if (absl::Status st = up->AppendSpan(at, f.weights, check); !st.ok()) return st;
      at += f.weights.size() * sizeof(float);
    }
    return absl::OkStatus();
  }

  // The planner's view of the shards (device pointers).
  ShardResolver Resolver() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      Shard* s = FindShard(id);
      ShardView v;
      v.weights = s->weights.get();
      v.state = reinterpret_cast<float*>(s->state.get());
      v.spec = &s->spec;
      v.state_width = s->state_width;
      v.step = s->step;
      return v;
    };
  }

  // For the shared request validation (ValidateRequests).
  const ShardSpec* FindSpec(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Shard* s = FindShard(id);
    return s == nullptr ? nullptr : &s->spec;
  }

  Shard* FindShard(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = shards_.find(id);
    return it == shards_.end() ? nullptr : it->second.get();
  }

  const CudaBackendOptions options_;
  const cudaStream_t stream_;  // owned; non-blocking
  const std::string device_name_;
  const int max_blocks_;
  mutable absl::Mutex mu_;
  std::map<ShardId, std::unique_ptr<Shard>> shards_ ABSL_GUARDED_BY(mu_);
  ShardId next_id_ ABSL_GUARDED_BY(mu_) = 0;
  backend::MemoryBudget budget_;
  // Per-call scratch, grown on demand and reused (const calls use it too).
  mutable DeviceBuffer scratch_ ABSL_GUARDED_BY(mu_);
  mutable DeviceBuffer staging_ ABSL_GUARDED_BY(mu_);  // pinned host memory
  // Shard creation, apart from the data calls (MakeShard).
  const cudaStream_t init_stream_;  // owned; non-blocking
  absl::Mutex init_mu_;
  DeviceBuffer init_staging_ ABSL_GUARDED_BY(init_mu_);  // pinned host memory
  cudaEvent_t events_[kMaxDownloadChunks] = {};        // DownloadOutputs' chunk events
  mutable absl::Mutex lost_mu_;
  mutable absl::Status lost_ ABSL_GUARDED_BY(lost_mu_);  // OK until the device is lost
};

}  // namespace

absl::Status InjectDeviceFaultForTest(backend::EmbeddingBackend* b) {
  auto* cuda = dynamic_cast<CudaBackend*>(b);
  if (cuda == nullptr) return absl::InvalidArgumentError("not a CUDA backend");
  return cuda->InjectFault();
}

absl::StatusOr<std::unique_ptr<EmbeddingBackend>> CreateCudaBackend(
    const CudaBackendOptions& options) {
  if (options.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device must be >= 0, got ", options.device));
  }
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError("memory_limit_bytes must be >= 0");
  }

  int count = 0;
  EMBER_RETURN_IF_CUDA_ERROR(cudaGetDeviceCount(&count));
  if (count == 0) return absl::UnavailableError("no CUDA device visible");
  if (options.device >= count) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", options.device,
                                               " requested but only ", count, " visible"));
  }
  EMBER_RETURN_IF_CUDA_ERROR(cudaSetDevice(options.device));
  EMBER_RETURN_IF_CUDA_ERROR(cudaFree(nullptr));  // creates the context now
  cudaDeviceProp prop;
  EMBER_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&prop, options.device));
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", options.device, " (", prop.name,
                                               ") has compute capability ", prop.major, ".",
                                               prop.minor, "; this build needs 8.0 or newer"));
  }
  cudaStream_t stream, init_stream;
  EMBER_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (cudaError_t e = cudaStreamCreateWithFlags(&init_stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    cudaStreamDestroy(stream);
    EMBER_RETURN_IF_CUDA_ERROR(e);
  }
  const int max_blocks = std::max(1, prop.multiProcessorCount * 16);
  auto backend = std::make_unique<CudaBackend>(options, stream, init_stream, prop.name, max_blocks);
  if (absl::Status s = backend->CreateEvents(); !s.ok()) return s;
  return std::unique_ptr<EmbeddingBackend>(std::move(backend));
}

}  // namespace cuda
}  // namespace ember
