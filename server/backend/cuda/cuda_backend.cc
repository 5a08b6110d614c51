// The CUDA embedding backend's adapter: EmbeddingBackend over shards in GPU
// memory, with the kernels of cuda/tbe_kernels.h (cuda/README.md has the
// design; server/backend/embedding_backend.h the semantics).
//
// Scratch (device) and staging (pinned host) memory are reserved once, when
// the backend starts (CudaBackendOptions::scratch_bytes), and a call that
// does not fit runs in pieces (call_split.h). Every piece stages its
// host inputs into a pinned buffer laid out exactly like the start of the
// scratch, uploading it in 1 MiB chunks as it fills (the DMA of one chunk
// overlaps the host copy of the next), runs its kernels on the backend's
// stream, and downloads the result in chunks that are handed to the
// caller's outputs as each lands.
//
// Double-buffered staging: there are two pinned buffers (slots, held
// through slot_pool.h). A call holds one from before it queues any
// work until that work has finished, and queues all of its work (uploads,
// kernels, downloads) under mu_ on the one stream, so the device runs calls
// in the order they queued and one device scratch serves them all (a
// call's uploads into it queue behind the previous call's kernels and
// downloads). It then leaves mu_ and waits for its own work alone: the
// next call stages and validates its inputs in the other buffer while this
// call's kernels run and its outputs are copied out.
#include "server/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <functional>
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

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cuda/cuda_status.h"
#include "cuda/tbe_kernels.h"
#include "math/embedding_math.h"
#include "math/half.h"
#include "server/backend/cuda/call_split.h"
#include "server/backend/cuda/request_plan.h"
#include "server/backend/cuda/slot_pool.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/overflow_guard.h"
#include "server/backend/shard_registry.h"
#include "server/common/byte_ranges.h"

namespace ember {
namespace backend {
namespace {


// Host <-> device copies of shard rows (init, export, import) go through
// pinned staging in chunks of about this size.
constexpr int64_t kTransferChunkBytes = int64_t{8} << 20;
// Host threads that compute initial values.
constexpr unsigned kMaxInitThreads = 8;

// What a call is taken to need when CUB cannot say (it then does not fit).
constexpr size_t kUnknownTemp = std::numeric_limits<size_t>::max() / 4;

// Where a DeviceBuffer's block lives: device memory (cudaMalloc), pinned
// host memory (cudaMallocHost: staging), or pinned host memory mapped into
// the device's address space (cudaHostAlloc(cudaHostAllocMapped): a
// fused_uvm shard's rows, which kernels read and write in place).
enum class Where { kDevice, kPinnedHost, kMappedHost };

const char* AllocName(Where where) {
  switch (where) {
    case Where::kPinnedHost: return "cudaMallocHost";
    case Where::kMappedHost: return "cudaHostAlloc(mapped)";
    default: return "cudaMalloc";
  }
}

// Allocates `bytes` at `where`: *host is the block as the host sees it
// (nullptr for device memory), *device as kernels and copies see it. A
// failure becomes a Status, and its (non-sticky) error is cleared so that a
// later cudaGetLastError after a launch does not report it again.
absl::Status DeviceAlloc(void** device, void** host, size_t bytes, Where where) {
  *device = *host = nullptr;
  cudaError_t err = cudaSuccess;
  switch (where) {
    case Where::kDevice:
      err = cudaMalloc(device, bytes);
      break;
    case Where::kPinnedHost:
      err = cudaMallocHost(host, bytes);
      *device = *host;
      break;
    case Where::kMappedHost:
      err = cudaHostAlloc(host, bytes, cudaHostAllocMapped);
      if (err == cudaSuccess) {
        err = cudaHostGetDevicePointer(device, *host, 0);
        if (err != cudaSuccess) cudaFreeHost(*host);
      }
      break;
  }
  if (err == cudaSuccess) return absl::OkStatus();
  *device = *host = nullptr;
  cudaGetLastError();
  return cuda::CudaErrorToStatus(err, AllocName(where));
}

// Owns one block allocated at a Where. Not copyable; frees in its
// destructor. The owner makes the right device current before the
// destructor runs.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(Where where = Where::kDevice) : where_(where) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Exactly `bytes` (0: none); previous contents are freed.
  absl::Status Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return absl::OkStatus();
    if (absl::Status s = DeviceAlloc(&ptr_, &host_, bytes, where_); !s.ok()) return s;
    capacity_ = bytes;
    return absl::OkStatus();
  }
  // The same, at `where` from now on.
  absl::Status Allocate(size_t bytes, Where where) {
    Reset();
    where_ = where;
    return Allocate(bytes);
  }

  void Reset() {
    if (host_ != nullptr) {
      cudaFreeHost(host_);
    } else if (ptr_ != nullptr) {
      cudaFree(ptr_);
    }
    ptr_ = host_ = nullptr;
    capacity_ = 0;
  }

  // The block as kernels and copies address it.
  char* get() const { return static_cast<char*>(ptr_); }
  size_t capacity() const { return capacity_; }
  Where where() const { return where_; }

 private:
  Where where_;
  void* ptr_ = nullptr;
  void* host_ = nullptr;
  size_t capacity_ = 0;
};

// Brackets the GPU work of a shard's creation (on its own stream; data
// calls use a SlotLease). On entry it drops any error an earlier,
// already-reported failure left in this thread's last-error slot, so each
// launch check judges that launch alone. On every exit, failures included,
// it waits for the stream: creation never returns while work it queued may
// still read the staging the next creation rewrites.
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

  // Copies `bytes` of device memory at `src` (an input in device memory,
  // FeatureRequest::on_device) to device offset `at` (at >= what was filled
  // before), after uploading the staging filled before it.
  absl::Status AppendDevice(size_t at, const void* src, size_t bytes) {
    if (absl::Status s = Flush(at); !s.ok()) return s;
    if (bytes > 0) {
      EMBER_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(device_ + at, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    sent_ = std::max(sent_, at + bytes);
    return absl::OkStatus();
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

// The floats a request reads besides its weights: a gradient's.
absl::Span<const float> InputFloats(const LookupRequest&) { return {}; }
absl::Span<const float> InputFloats(const GradientRequest& r) { return r.grad; }

// INVALID_ARGUMENT when a lookup's output overlaps any of the call's ids or
// weights (CheckDeviceInputs' rule for inputs in device memory); gradient
// calls write nothing there.
absl::Status CheckNoOverlap(absl::Span<const GradientRequest>, const char*) {
  return absl::OkStatus();
}
absl::Status CheckNoOverlap(absl::Span<const LookupRequest> requests, const char* kind) {
  std::vector<ByteRange> inputs;
  auto range = [](const void* p, size_t bytes) {
    const uint64_t b = reinterpret_cast<uintptr_t>(p);
    return ByteRange(b, b + bytes);
  };
  for (const LookupRequest& r : requests) {
    const FeatureRequest& f = r.feature;
    if (!f.ids.empty()) inputs.push_back(range(f.ids.data(), f.ids.size() * sizeof(int64_t)));
    if (!f.weights.empty()) {
      inputs.push_back(range(f.weights.data(), f.weights.size() * sizeof(float)));
    }
  }
  // Disjoint and in order, for the search.
  const std::vector<ByteRange> merged = MergedRanges(std::move(inputs));
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].output.empty()) continue;
    const ByteRange out =
        range(requests[i].output.data(), requests[i].output.size() * sizeof(float));
    // The last input range that starts before the output ends.
    auto after = std::upper_bound(merged.begin(), merged.end(), ByteRange(out.second, 0));
    if (after != merged.begin() && std::prev(after)->second > out.first) {
      return absl::InvalidArgumentError(absl::StrCat(
          kind, " request ", i, ": its output overlaps the call's ids or weights"));
    }
  }
  return absl::OkStatus();
}

// Host copies of an ApplyGradients call's device inputs, for a call that
// must be cut into pieces (call_split.h reads the ids, weights and
// gradients on the host to cut it).
struct HostInputs {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<float>> weights, grads;
  std::vector<GradientRequest> requests;  // views of the above
};

// A request's output in host memory: rows of `cols` floats, `stride`
// floats apart (cols when packed), `floats` of them in all.
struct OutputRows {
  float* data = nullptr;
  int64_t floats = 0, cols = 1, stride = 1;
};

// A lookup's output on its way back: downloaded in chunks through a slot's
// staging, each chunk marked by an event.
struct PendingOutputs {
  const float* host = nullptr;  // in the slot's staging
  int64_t count = 0, chunk = 0, chunks = 0;
  const cudaEvent_t* events = nullptr;
  std::vector<OutputRows> outputs;  // the requests', in order
};

// Queues the download of a lookup's outputs, plan.total_out floats packed
// in request order at `device`, into staging `host` in chunks (at most
// kMaxDownloadChunks; `events` has that many), for DeliverOutputs to hand
// to the requests' outputs (each request's dim from `plan`).
absl::Status QueueDownload(const float* device, float* host,
                           absl::Span<const backend::LookupRequest> requests,
                           const LookupPlan& plan, const cudaEvent_t* events,
                           cudaStream_t stream, PendingOutputs* pending) {
  const int64_t count = plan.total_out;
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
  pending->host = host;
  pending->count = count;
  pending->chunk = chunk;
  pending->chunks = chunks;
  pending->events = events;
  pending->outputs.clear();
  for (size_t i = 0; i < requests.size(); ++i) {
    const backend::LookupRequest& r = requests[i];
    const int64_t dim = plan.descs[i].dim;
    const int64_t end = i + 1 < requests.size() ? plan.descs[i + 1].out_begin : plan.total_out;
    pending->outputs.push_back(OutputRows{r.output.data(), end - plan.descs[i].out_begin, dim,
                                          r.output_stride == 0 ? dim : r.output_stride});
  }
  return absl::OkStatus();
}

// Copies a queued download into its outputs, each chunk as soon as it has
// landed (rows to their stride, for outputs with one), and empties
// `pending` (nothing pending: OK at once).
absl::Status DeliverOutputs(PendingOutputs* pending) {
  const PendingOutputs p = std::move(*pending);
  *pending = PendingOutputs();
  // Walk the outputs in concatenated order alongside the chunks.
  size_t r = 0;
  int64_t r_pos = 0;       // floats of outputs[r] already written
  int64_t row = 0, col = 0;  // where the next of them goes (strided outputs)
  for (int64_t c = 0; c < p.chunks; ++c) {
    EMBER_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(p.events[c]));
    int64_t b = c * p.chunk;
    const int64_t e = std::min(p.count, b + p.chunk);
    while (b < e) {
      const OutputRows& out = p.outputs[r];
      const int64_t take = std::min<int64_t>(e - b, out.floats - r_pos);
      if (out.stride == out.cols) {
        if (take > 0) std::memcpy(out.data + r_pos, p.host + b, take * sizeof(float));
      } else {
        // Row by row; a chunk may end inside a row.
        for (int64_t done = 0; done < take;) {
          const int64_t n = std::min(take - done, out.cols - col);
          std::memcpy(out.data + row * out.stride + col, p.host + b + done, n * sizeof(float));
          done += n;
          col += n;
          if (col == out.cols) {
            col = 0;
            ++row;
          }
        }
      }
      b += take;
      r_pos += take;
      if (r_pos == out.floats) {
        ++r;
        r_pos = row = col = 0;
      }
    }
  }
  return absl::OkStatus();
}

// Staging buffers: a call's inputs are staged in one while the previous
// call's work runs from the other.
constexpr int kStagingSlots = 2;

// Its events block the waiting thread rather than spin: a call waits on
// them for its kernels while another call stages on the host.
struct StagingSlot {
  DeviceBuffer host{Where::kPinnedHost};
  cudaEvent_t chunk_events[kMaxDownloadChunks] = {};  // QueueDownload's
  cudaEvent_t done = nullptr;                         // SlotLease::MarkEnd's
};

// One call's hold on a staging slot, taken before mu_ and kept until the
// GPU work the call queued has finished (the destructor waits for it), so
// the slot's staging is never rewritten while a copy may still read it.
// On entry it makes the backend's device current (so that no CUDA call of
// this thread lands on another device's context) and drops any error an
// earlier, already-reported failure left in this thread's last-error
// slot, so each launch check judges that launch alone.
class SlotLease {
 public:
  SlotLease(SlotPool* pool, StagingSlot* slots, int device, cudaStream_t stream)
      : pool_(pool), index_(pool->Acquire()), slot_(&slots[index_]), stream_(stream) {
    cudaSetDevice(device);  // a failure shows again in the call's Activate
    cudaGetLastError();
  }
  ~SlotLease() {
    Wait().IgnoreError();
    cudaGetLastError();
    pool_->Release(index_);
  }
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;

  StagingSlot& slot() const { return *slot_; }

  // Called under mu_ before the call queues its first work: from then on
  // there is something to wait for.
  void NoteQueued() { queued_ = true; }

  // Called under mu_ right after the call's last queued work: what Wait
  // waits for.
  void MarkEnd() {
    if (queued_) marked_ = cudaEventRecord(slot_->done, stream_) == cudaSuccess;
  }

  // Waits for the work the call queued: none when it queued nothing; all
  // of the stream's when MarkEnd was not reached or failed.
  absl::Status Wait() const {
    if (!queued_) return absl::OkStatus();
    EMBER_RETURN_IF_CUDA_ERROR(marked_ ? cudaEventSynchronize(slot_->done)
                                       : cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  SlotPool* const pool_;
  const int index_;
  StagingSlot* const slot_;
  const cudaStream_t stream_;
  bool queued_ = false;
  bool marked_ = false;
};

// Declared right after the lock of mu_: marks the end of the call's work
// (SlotLease::MarkEnd) on every way out, before mu_ is released.
class EndMark {
 public:
  explicit EndMark(SlotLease* lease) : lease_(lease) {}
  ~EndMark() { lease_->MarkEnd(); }
  EndMark(const EndMark&) = delete;
  EndMark& operator=(const EndMark&) = delete;

 private:
  SlotLease* const lease_;
};

int ElementBytes(WeightType t) { return t == WeightType::kFp32 ? 4 : 2; }

struct Shard {
  ShardSpec spec;
  int elem_bytes = 4;
  int64_t state_width = 0;
  DeviceBuffer weights;  // [rows, dim] in spec.weight_type
  DeviceBuffer state;    // [rows, state_width] fp32
  int64_t step = 0;      // Adam's t
  backend::ValueBounds bounds;  // what its values stay within (overflow_guard.h)
  bool guard = false;           // this call checks its rows first
  backend::ValueBounds after;   // its bounds after this call, when not guarded
  // A dynamic shard's key index, copied (SyncKeyIndex): key_line_count
  // lines of math/key_index.h's layout; none until the first sync.
  DeviceBuffer key_lines;
  int64_t key_line_count = 0;

  int64_t RowBytes() const { return spec.dim * elem_bytes; }
  int64_t Bytes() const { return spec.rows * (spec.dim * elem_bytes + state_width * 4); }
  // A fused_uvm shard's rows and state are mapped host memory; copies to
  // and from them name no direction (the runtime tells it by the address).
  cudaMemcpyKind ToHost() const {
    return spec.host_mapped ? cudaMemcpyDefault : cudaMemcpyDeviceToHost;
  }
  cudaMemcpyKind FromHost() const {
    return spec.host_mapped ? cudaMemcpyDefault : cudaMemcpyHostToDevice;
  }
  int64_t KeyBytes() const {
    return key_line_count * static_cast<int64_t>(sizeof(backend::math::KeyLine));
  }
};

class CudaBackend : public EmbeddingBackend {
 public:
  CudaBackend(const CudaBackendOptions& options, cudaStream_t stream, cudaStream_t init_stream,
              std::string device_name, int max_blocks)
      : options_(options),
        stream_(stream),
        device_name_(std::move(device_name)),
        max_blocks_(max_blocks),
        budget_(options.memory_limit_bytes > 0
                    ? options.memory_limit_bytes - options.scratch_bytes
                    : 0),
        mapped_budget_(options.mapped_memory_limit_bytes),
        slot_pool_(kStagingSlots),
        init_stream_(init_stream),
        init_staging_(Where::kPinnedHost) {
    split_.device_bytes = split_.host_bytes = static_cast<size_t>(options.scratch_bytes);
    split_.lookup_temp = [](const CallSize& s) {
      size_t bytes = 0;
      return cuda::LookupTempBytes(s.bags, &bytes) == cudaSuccess ? bytes : kUnknownTemp;
    };
    split_.gradient_temp = [](const CallSize& s) {
      size_t bytes = 0;
      return cuda::BackwardTempBytes(s.bags, s.ids, s.end_bit, &bytes) == cudaSuccess ? bytes
                                                                                : kUnknownTemp;
    };
  }

  // The fixed scratch, the staging slots and their events; called once by
  // CreateCudaBackend.
  absl::Status Init() {
    absl::MutexLock lock(&mu_);
    absl::MutexLock init_lock(&init_mu_);
    const size_t bytes = static_cast<size_t>(options_.scratch_bytes);
    absl::Status s = scratch_.Allocate(bytes);
    for (StagingSlot& slot : slots_) {
      if (s.ok()) s = slot.host.Allocate(bytes);
    }
    if (s.ok()) s = init_staging_.Allocate(kTransferChunkBytes);
    if (s.ok()) s = record_.Allocate(sizeof(cuda::OverflowRecord));
    if (s.ok()) s = measure_.Allocate(4 * sizeof(unsigned int));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the backend's scratch (", bytes,
                                                 " bytes, and ", kStagingSlots,
                                                 " pinned staging buffers of as much; "
                                                 "--cuda_scratch_mib): ",
                                                 s.message()));
    }
    const unsigned flags = cudaEventDisableTiming | cudaEventBlockingSync;
    for (StagingSlot& slot : slots_) {
      for (cudaEvent_t& e : slot.chunk_events) {
        EMBER_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e, flags));
      }
      EMBER_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&slot.done, flags));
    }
    return absl::OkStatus();
  }

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    cudaStreamSynchronize(stream_);
    shards_.Clear();
    scratch_.Reset();
    record_.Reset();
    measure_.Reset();
    init_staging_.Reset();
    for (StagingSlot& slot : slots_) {
      slot.host.Reset();
      for (cudaEvent_t e : slot.chunk_events) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      if (slot.done != nullptr) cudaEventDestroy(slot.done);
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

  // Rows at any positions (a dynamic shard's admissions): a chunk at a
  // time through the staging and the scratch, gathered or scattered on the
  // device by CopyRowsKernel, instead of a copy and a wait a row.
  absl::Status ExportRowsAt(ShardId id, absl::Span<const int64_t> rows, absl::Span<float> weights,
                            absl::Span<float> state) const override {
    return Guarded([&] { return DoRowsAt(id, rows, {}, {}, weights, state, /*import=*/false); });
  }
  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    return Guarded([&] { return DoRowsAt(id, rows, weights, state, {}, {}, /*import=*/true); });
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
      EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchFault(stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    });
  }

  // The memory is reserved under mu_; allocation and initialisation run
  // outside it, on a stream and pinned staging of their own (one creation
  // at a time), so a large shard's creation does not stall the data calls
  // on the shards held. The shard is published when it is ready.
  absl::StatusOr<ShardId> DoCreateShard(const ShardSpec& spec) {
    absl::Status s = backend::ValidateShardSpec(spec, backend::kCudaColumnMultiple,
                                                /*maps_host_memory=*/true);
    if (!s.ok()) return s;
    if (backend::IsQuantized(spec.weight_type)) {
      return absl::UnimplementedError(absl::StrCat(
          "shard of table '", spec.table, "': ", backend::WeightTypeName(spec.weight_type),
          " tables are served by CPU workers (the CUDA kernels have no quantized rows yet)"));
    }
    auto shard = std::make_unique<Shard>();
    shard->spec = spec;
    shard->elem_bytes = ElementBytes(spec.weight_type);
    shard->state_width = backend::OptimizerStateWidth(spec.optimizer.type, spec.dim);
    shard->bounds = backend::InitialBounds(spec);
    const int64_t per_row = spec.dim * shard->elem_bytes + shard->state_width * 4;
    if (spec.rows > std::numeric_limits<int64_t>::max() / per_row) {
      return absl::ResourceExhaustedError(
          absl::StrCat("shard of table '", spec.table, "' is larger than 2^63 bytes"));
    }
    // Rows go through the staging (init, export, import) one piece at a time.
    const int64_t staged = std::min<int64_t>(kTransferChunkBytes, options_.scratch_bytes);
    if (shard->RowBytes() > staged) {
      return absl::InvalidArgumentError(absl::StrCat("a row of table '", spec.table, "' (",
                                                     shard->RowBytes(), " bytes) is larger than ",
                                                     "the backend's staging (", staged, " bytes)"));
    }
    const int64_t bytes = shard->Bytes();
    backend::MemoryBudget& budget = spec.host_mapped ? mapped_budget_ : budget_;
    if (absl::Status s = budget.Reserve(bytes, spec.table); !s.ok()) return s;
    if (absl::Status s = MakeShard(shard.get(), bytes); !s.ok()) {
      budget.Release(bytes);
      return s;
    }
    absl::MutexLock lock(&mu_);
    return shards_.Add(std::move(shard));
  }

  // Allocates and initialises an unpublished shard (DoCreateShard).
  absl::Status MakeShard(Shard* shard, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&init_mu_);
    if (absl::Status s = Activate(); !s.ok()) return s;
    const CallScope scope(init_stream_);
    const ShardSpec& spec = shard->spec;
    const Where where = spec.host_mapped ? Where::kMappedHost : Where::kDevice;
    absl::Status s =
        shard->weights.Allocate(static_cast<size_t>(spec.rows * shard->RowBytes()), where);
    if (s.ok()) {
      s.Update(shard->state.Allocate(static_cast<size_t>(spec.rows * shard->state_width * 4),
                                     where));
    }
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(spec.host_mapped ? "mapped host" : "device",
                                                 " memory for shard of table '", spec.table,
                                                 "' (", bytes, " bytes): ", s.message()));
    }
    return InitShard(shard);
  }

  absl::Status DropShard(ShardId id) override {
    absl::MutexLock lock(&mu_);
    if (shards_.Find(id) == nullptr) return ShardNotFound(id);
    if (absl::Status s = Activate(); !s.ok()) return s;
    // Calls that have left mu_ may still have kernels queued that read it.
    // A lost device runs nothing more: its shards are dropped all the same.
    if (const cudaError_t err = cudaStreamSynchronize(stream_);
        err != cudaSuccess && !cuda::IsStickyError(err)) {
      return cuda::CudaErrorToStatus(err, "cudaStreamSynchronize");
    }
    auto shard = shards_.Remove(id);
    if ((*shard)->spec.host_mapped) {
      mapped_budget_.Release((*shard)->Bytes());
    } else {
      budget_.Release((*shard)->Bytes());
    }
    budget_.Release((*shard)->KeyBytes());
    return absl::OkStatus();
  }

  absl::StatusOr<ShardSpec> GetShardSpec(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    return shards_.Spec(id);
  }

  // The copy is written on the data stream, so the lookups queued before
  // a sync find with the index as it was, those after with the new one.
  // Pageable host memory: each copy has read its lines when it returns.
  absl::Status DoSyncKeyIndex(ShardId id, const backend::math::KeyLine* lines, int64_t count,
                              absl::Span<const int64_t> changed) {
    absl::MutexLock lock(&mu_);
    Shard* shard = FindShard(id);
    if (shard == nullptr) return ShardNotFound(id);
    if (absl::Status s = backend::CheckKeySync(lines, count, changed); !s.ok()) return s;
    if (absl::Status s = Activate(); !s.ok()) return s;
    const size_t line = sizeof(backend::math::KeyLine);
    char* to = shard->key_lines.get();
    if (shard->key_line_count != count) {
      // Kernels queued before may still read the old copy.
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      budget_.Release(shard->KeyBytes());
      shard->key_lines.Reset();
      shard->key_line_count = 0;
      const int64_t bytes = count * static_cast<int64_t>(line);
      if (absl::Status s = budget_.Reserve(bytes, shard->spec.table); !s.ok()) return s;
      if (absl::Status s = shard->key_lines.Allocate(static_cast<size_t>(bytes)); !s.ok()) {
        budget_.Release(bytes);
        return s;
      }
      shard->key_line_count = count;
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(shard->key_lines.get(), lines, bytes,
                                                 cudaMemcpyHostToDevice, stream_));
      return absl::OkStatus();
    }
    // Runs of consecutive lines, a copy each.
    for (size_t k = 0; k < changed.size();) {
      size_t e = k + 1;
      while (e < changed.size() && changed[e] == changed[e - 1] + 1) ++e;
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(to + changed[k] * line, lines + changed[k],
                                                 (e - k) * line, cudaMemcpyHostToDevice, stream_));
      k = e;
    }
    return absl::OkStatus();
  }

  // A data call holds a staging slot throughout, queues its work under
  // mu_ and waits for it outside mu_ (the top of this file).
  absl::Status DoLookup(absl::Span<const LookupRequest> requests) {
    SlotLease lease(&slot_pool_, slots_, options_.device, stream_);
    PendingOutputs pending;
    absl::Status st;
    {
      absl::MutexLock lock(&mu_);
      const EndMark end(&lease);
      st = QueueLookup(requests, &lease, &pending);
    }
    if (!st.ok()) return st;
    // Outputs on the device: copied there on the stream, done when it is.
    if (!requests.empty() && requests[0].output_on_device) return lease.Wait();
    return DeliverOutputs(&pending);
  }

  absl::Status DoApplyGradients(absl::Span<const GradientRequest> requests) {
    SlotLease lease(&slot_pool_, slots_, options_.device, stream_);
    absl::Status st;
    {
      absl::MutexLock lock(&mu_);
      const EndMark end(&lease);
      st = QueueGradients(requests, &lease);
    }
    if (!st.ok()) return st;
    // Returns once the update is applied (and a device failure is this
    // call's error).
    return lease.Wait();
  }

  // Validates a Lookup call and queues its work; the download of its last
  // piece is left in `pending` (earlier pieces are delivered before the
  // next one restages the slot).
  absl::Status QueueLookup(absl::Span<const LookupRequest> requests, SlotLease* lease,
                           PendingOutputs* pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    // Shapes now; ids and weights while they are staged (before any kernel).
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kShapesOnly,
                                           /*strided_outputs=*/true, /*device_memory=*/true,
                                           /*finds_keys=*/true);
        !st.ok()) {
      return st;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      const FeatureRequest& f = requests[i].feature;
      if (f.keyed && FindShard(f.shard)->key_line_count == 0) {
        return backend::NoKeyIndex(RequestWhat("lookup", i, FindShard(f.shard)->spec));
      }
    }
    const LookupPlan plan = PlanLookup(requests, Resolver());
    // No bags and no ids anywhere: every output is empty.
    if (plan.total_items == 0) return absl::OkStatus();
    // Ours is the current device before CUB sizes anything.
    if (absl::Status s = Activate(); !s.ok()) return s;
    lease->NoteQueued();
    if (requests[0].feature.on_device) {
      if (absl::Status st = CheckDeviceInputs(requests, "lookup", lease->slot()); !st.ok()) {
        return st;
      }
    }
    bool first = true;
    // In pieces the call's ids and weights are checked whole first, so that
    // errors name the caller's requests (device inputs were, above).
    return CanonicalRefusal(requests, ForEachLookupPiece(
        requests, plan, Resolver(), split_,
        [&](absl::Span<const LookupRequest> piece)
            ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
          if (!first) {
            // The previous piece's output leaves the staging, and its
            // uploads have run (they precede its download on the stream;
            // the synchronisation says so whatever the piece queued),
            // before this piece restages the slot.
            if (absl::Status st = DeliverOutputs(pending); !st.ok()) return st;
            EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
          }
          first = false;
          return QueueLookupPiece(piece, lease->slot(), pending);
        },
        [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return CheckAll(requests); }));
  }

  // A refusal from staging names the first bad value it met, ids of every
  // request before any weights: `refused`, or the first in
  // ValidateRequests' order (the CPU backend's, request by request), which
  // names the same value whichever path a call takes.
  template <typename Request>
  absl::Status CanonicalRefusal(absl::Span<const Request> requests, absl::Status refused) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!absl::IsInvalidArgument(refused)) return refused;
    absl::Status first = CheckAll(requests);
    return first.ok() ? refused : first;
  }
  absl::Status CheckAll(absl::Span<const LookupRequest> requests) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    return ValidateRequests(requests, find_spec, Checks::kAll, /*strided_outputs=*/true,
                            /*device_memory=*/true, /*finds_keys=*/true);
  }
  absl::Status CheckAll(absl::Span<const GradientRequest> requests) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    return ValidateRequests(requests, find_spec, Checks::kAll, /*device_memory=*/true);
  }

  // Validates an ApplyGradients call and queues its work. Adam's step of
  // the shards it names advances as the work is queued, so the next call,
  // queued after it, plans with the step that follows. A shard whose
  // bounds cannot rule an overflow out (overflow_guard.h) has the call's
  // rows checked first, in a launch of their own that this call waits for
  // (the rare path); nothing of a call is applied before its checks pass.
  absl::Status QueueGradients(absl::Span<const GradientRequest> requests, SlotLease* lease)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto find_spec = [this](ShardId id) { return FindSpec(id); };
    // Shapes now; ids, weights and gradients while they are staged (before
    // any kernel) when the call runs whole.
    if (absl::Status st = ValidateRequests(requests, find_spec, Checks::kShapesOnly,
                                           /*device_memory=*/true);
        !st.ok()) {
      return st;
    }
    for (const GradientRequest& r : requests) FindShard(r.feature.shard)->guard = false;
    const GradientPlan plan = PlanGradients(requests, Resolver());
    const bool on_device = !requests.empty() && requests[0].feature.on_device;
    if (on_device || plan.total_ids > 0) {
      // Ours is the current device before the check runs or CUB sizes
      // anything.
      if (absl::Status s = Activate(); !s.ok()) return s;
      lease->NoteQueued();
    }
    // Inputs in device memory: their values checked there first; a call
    // that must be cut is cut on the host (call_split.h), from host copies.
    HostInputs host;
    // The largest |gradient| and |weight| of device inputs (the check's).
    float device_max[2] = {0, 0};
    if (on_device) {
      if (absl::Status st = CheckDeviceInputs(requests, "gradient", lease->slot(), device_max);
          !st.ok()) {
        return st;
      }
      if (plan.total_ids > 0 && !split_.FitsGradients(SizeOf(plan))) {
        if (absl::Status st = CopyToHost(requests, &host); !st.ok()) return st;
        requests = host.requests;
      }
    }
    // Each request's largest |gradient|: from the whole call's check when it
    // is cut (before any piece), else from its staging.
    std::vector<float> grad_max(requests.size(), 0.0f);
    auto decide = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return DecideGuards(
          requests, grad_max, requests[0].feature.on_device ? device_max : nullptr,
          [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS { return FindShard(id); },
          [this](const Shard& s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return Measure(s); });
    };
    backend::OverflowReport seen;
    if (plan.total_ids == 0) {
      // Nothing is staged, so the gradients (of empty bags) are checked here.
      if (absl::Status st = CheckAll(requests); !st.ok()) return st;
    } else if (split_.FitsGradients(SizeOf(plan))) {
      if (absl::Status st = CanonicalRefusal(
              requests, QueueGradientPiece(requests, lease->slot(), absl::MakeSpan(grad_max),
                                           [&](const GradientPlan& p, const cuda::BackwardLaunch& a)
                                               ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                                 const bool guard = decide();
                                                 return LaunchGuarded(p, a, guard, false, &seen);
                                               }));
          !st.ok()) {
        return st;
      }
    } else {
      // In pieces, the first would be applied before the last is checked:
      // the whole call is checked first, its values, then (when the guard
      // asks) its rows, piece by piece, before a piece is applied.
      auto find = [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS { return FindSpec(id); };
      if (absl::Status st = ValidateRequests(requests, find, Checks::kAll,
                                             /*device_memory=*/true, absl::MakeSpan(grad_max));
          !st.ok()) {
        return st;
      }
      const bool guard = decide();
      for (const bool checking : {true, false}) {
        if (checking && (!guard || options_.skip_overflow)) continue;
        bool first = true;
        if (absl::Status st = ForEachGradientPiece(
                requests, plan, Resolver(), split_,
                [&](absl::Span<const GradientRequest> piece)
                    ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
                  // The previous piece's uploads read the slot's staging
                  // until they have run.
                  if (!first) EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
                  first = false;
                  return QueueGradientPiece(
                      piece, lease->slot(), /*grad_max=*/{},
                      [&](const GradientPlan& p, const cuda::BackwardLaunch& a)
                          ABSL_NO_THREAD_SAFETY_ANALYSIS {
                            return LaunchGuarded(p, a, guard, checking, &seen);
                          });
                });
            !st.ok()) {
          return st;
        }
      }
    }
    // Every shard the call names takes an Adam step, ids or not (the
    // interface rule, as in the CPU backend), once for the whole call.
    FinishGradients(plan, seen, [this](ShardId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return FindShard(id);
    });
    return absl::OkStatus();
  }

  // Launches a piece's update as the guard says. Unguarded: applied. With
  // skip_overflow: applied with each guarded row checked first and left
  // alone when it does not fit. Otherwise the rows are checked first
  // (kCheckRows), and a misfit refuses the call, named by a reporting
  // launch; `check_only` stops there (a cut call's first pass). The checks
  // are waited for here.
  absl::Status LaunchGuarded(const GradientPlan& plan, cuda::BackwardLaunch a, bool guard,
                             bool check_only, backend::OverflowReport* seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!guard) {
      if (check_only) return absl::OkStatus();
      EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchBackward(a, max_blocks_, stream_));
      return absl::OkStatus();
    }
    cuda::OverflowRecord* dev = reinterpret_cast<cuda::OverflowRecord*>(record_.get());
    cuda::OverflowRecord got;
    auto run = [&](int32_t mode, bool guarded_apply, bool reset) -> absl::Status {
      if (reset) {
        EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev, &fresh_record_, sizeof(cuda::OverflowRecord),
                                                   cudaMemcpyHostToDevice, stream_));
      }
      a.mode = mode;
      a.guarded_apply = guarded_apply ? 1 : 0;
      a.guard_all = 1;
      a.record = dev;
      EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchBackward(a, max_blocks_, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(&got, dev, sizeof(got), cudaMemcpyDeviceToHost, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    };
    if (options_.skip_overflow) {
      if (check_only) return absl::OkStatus();
      if (absl::Status st = run(cuda::kApplyRows, true, true); !st.ok()) return st;
      NoteMaxima(got, seen);
      skipped_rows_.fetch_add(static_cast<int64_t>(got.skipped), std::memory_order_relaxed);
      return absl::OkStatus();
    }
    if (absl::Status st = run(cuda::kCheckRows, false, true); !st.ok()) return st;
    NoteMaxima(got, seen);
    if (got.first_key != fresh_record_.first_key) {
      if (absl::Status st = run(cuda::kReportRow, false, false); !st.ok()) return st;
      ShardId id;
      const backend::OverflowReport r = ReportOf(plan, got, &id);
      return backend::OverflowRefusal(FindShard(id)->spec, r);
    }
    if (check_only) return absl::OkStatus();
    a.mode = cuda::kApplyRows;
    a.guarded_apply = 0;
    a.guard_all = 0;
    EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchBackward(a, max_blocks_, stream_));
    return absl::OkStatus();
  }

  // The bounds of every value a shard holds, measured on the device (the
  // rare path: its grown bounds could not tell) and waited for.
  // Unmeasurable: bounds that rule nothing out.
  backend::ValueBounds Measure(const Shard& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    backend::ValueBounds b;
    b.weight = std::numeric_limits<double>::infinity();
    const ShardSpec& spec = s.spec;
    cuda::MeasureLaunch m;
    m.weights = s.weights.get();
    m.weight_type = static_cast<int32_t>(spec.weight_type);
    m.adam = spec.optimizer.type == backend::OptimizerType::kAdam ? 1 : 0;
    m.rows = spec.rows;
    m.dim = spec.dim;
    m.state = s.state_width > 0 ? reinterpret_cast<const float*>(s.state.get()) : nullptr;
    m.state_width = s.state_width;
    m.first_acc = backend::FirstAccumulator(spec.optimizer.type, spec.dim);
    m.adam_c = static_cast<float>(backend::AdamRatioBound(spec.optimizer));
    m.out = reinterpret_cast<unsigned int*>(measure_.get());
    unsigned int got[3] = {0, 0, 0};
    if (cudaMemcpyAsync(m.out, got, sizeof(got), cudaMemcpyHostToDevice, stream_) != cudaSuccess ||
        cuda::LaunchMeasure(m, max_blocks_, stream_) != cudaSuccess ||
        cudaMemcpyAsync(got, m.out, sizeof(got), cudaMemcpyDeviceToHost, stream_) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess) {
      return b;
    }
    float w, acc;
    std::memcpy(&w, &got[0], sizeof(w));
    std::memcpy(&acc, &got[1], sizeof(acc));
    b.weight = w;
    b.acc = acc;
    b.adam_ok = got[2] == 0 && (m.adam == 0 || m.adam_c > 0);
    b.measured = true;
    return b;
  }

  // Queues one piece of a Lookup call (all of it when it fits the
  // scratch), staged in `slot`; its download is left in `pending`.
  absl::Status QueueLookupPiece(absl::Span<const LookupRequest> requests, StagingSlot& slot,
                                PendingOutputs* pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t n = static_cast<int64_t>(requests.size());
    const LookupPlan plan = PlanLookup(requests, Resolver());
    if (plan.total_items == 0) return absl::OkStatus();
    const CallSize size = SizeOf(plan);
    const LookupLayout l = LayOutLookup(size, split_.lookup_temp(size));
    if (l.device_bytes > scratch_.capacity() || l.host_bytes > slot.host.capacity()) {
      return absl::InternalError("a lookup piece does not fit the scratch");  // call_split's bug
    }
    char* h = slot.host.get();
    char* d = scratch_.get();
    std::memcpy(h + l.item_begin, plan.item_begin.data(), (n + 1) * sizeof(int64_t));
    std::memcpy(h + l.descs, plan.descs.data(), n * sizeof(cuda::LookupDesc));
    // The arrays, region by region in layout order, uploaded as they fill.
    Uploader up(h, d, stream_);
    if (absl::Status st = StageFeatures(requests, "lookup", l.lengths, l.ids, l.weights, &up);
        !st.ok()) {
      return st;
    }
    if (absl::Status st = up.Flush(l.in_bytes); !st.ok()) return st;
    // Keys to slots, in place in the staged ids, before the gather.
    int64_t id_at = 0;
    for (const LookupRequest& r : requests) {
      const FeatureRequest& f = r.feature;
      if (f.keyed && !f.ids.empty()) {
        const Shard* shard = FindShard(f.shard);
        cuda::KeyFindLaunch k;
        k.ids = At<int64_t>(d, l.ids) + id_at;
        k.n = static_cast<int64_t>(f.ids.size());
        k.lines = reinterpret_cast<const backend::math::KeyLine*>(shard->key_lines.get());
        k.mask = static_cast<uint64_t>(shard->key_line_count) * backend::math::kKeyLineEntries - 1;
        k.missing = shard->spec.rows - 1;
        EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchKeyFind(k, max_blocks_, stream_));
      }
      id_at += static_cast<int64_t>(f.ids.size());
    }
    cuda::LookupLaunch a;
    a.item_begin = At<const int64_t>(d, l.item_begin);
    a.descs = At<const cuda::LookupDesc>(d, l.descs);
    a.num_requests = n;
    a.total_items = plan.total_items;
    a.lengths = At<const int64_t>(d, l.lengths);
    a.num_bags = plan.total_bags;
    a.ids = At<const int64_t>(d, l.ids);
    a.weights = At<const float>(d, l.weights);
    a.offsets = At<int64_t>(d, l.offsets);
    a.out = At<float>(d, l.out);
    a.temp = d + l.temp;
    a.temp_bytes = l.device_bytes - l.temp;
    EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchLookup(a, max_blocks_, stream_));
    if (requests[0].output_on_device) {  // (all alike: validated) no host leg
      int64_t at = 0;
      for (const LookupRequest& r : requests) {
        if (!r.output.empty()) {
          EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(r.output.data(), a.out + at,
                                                     r.output.size() * sizeof(float),
                                                     cudaMemcpyDeviceToDevice, stream_));
        }
        at += static_cast<int64_t>(r.output.size());
      }
      return absl::OkStatus();
    }
    return QueueDownload(a.out, At<float>(h, l.host_out), requests, plan, slot.chunk_events,
                         stream_, pending);
  }

  // Queues one piece of an ApplyGradients call, without the Adam step,
  // staged in `slot`: each request's largest |gradient| goes to grad_max
  // (unless empty) as its host gradients are staged, and `launch` launches
  // the update.
  using GradientLaunch = std::function<absl::Status(const GradientPlan&, const cuda::BackwardLaunch&)>;
  absl::Status QueueGradientPiece(absl::Span<const GradientRequest> requests, StagingSlot& slot,
                                  absl::Span<float> grad_max, const GradientLaunch& launch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t n = static_cast<int64_t>(requests.size());
    const GradientPlan plan = PlanGradients(requests, Resolver());
    const int64_t num_shards = static_cast<int64_t>(plan.slots.size());
    const CallSize size = SizeOf(plan);
    const GradientLayout l = LayOutGradients(size, split_.gradient_temp(size));
    if (l.device_bytes > scratch_.capacity() || l.in_bytes > slot.host.capacity()) {
      return absl::InternalError("a gradient piece does not fit the scratch");  // call_split's bug
    }
    char* h = slot.host.get();
    char* d = scratch_.get();
    std::memcpy(h + l.id_begin, plan.id_begin.data(), (n + 1) * sizeof(int64_t));
    std::memcpy(h + l.descs, plan.descs.data(), n * sizeof(cuda::GradDesc));
    std::memcpy(h + l.updates, plan.updates.data(), num_shards * sizeof(cuda::UpdateDesc));
    std::memcpy(h + l.key_base, plan.key_base.data(), (num_shards + 1) * sizeof(uint64_t));
    // The arrays, region by region in layout order, uploaded as they fill.
    Uploader up(h, d, stream_);
    if (absl::Status st = StageFeatures(requests, "gradient", l.lengths, l.ids, l.weights, &up);
        !st.ok()) {
      return st;
    }
    size_t at = l.grads;
    for (int64_t i = 0; i < n; ++i) {
      const GradientRequest& r = requests[i];
      if (r.feature.on_device) {  // checked on the device (CheckDeviceInputs)
        if (absl::Status st = up.AppendDevice(at, r.grad.data(), r.grad.size() * sizeof(float));
            !st.ok()) {
          return st;
        }
        at += r.grad.size() * sizeof(float);
        continue;
      }
      const ShardSpec& spec = FindShard(r.feature.shard)->spec;
      auto check = [&](absl::Span<const float> g, int64_t first) {
        float m = 0;
        absl::Status st = CheckFinite(g, RequestWhat("gradient", i, spec), "gradient", first, &m);
        if (!grad_max.empty()) grad_max[i] = std::max(grad_max[i], m);
        return st;
      };
      if (absl::Status st = up.AppendSpan(at, r.grad, check); !st.ok()) return st;
      at += r.grad.size() * sizeof(float);
    }
    if (absl::Status st = up.Flush(l.in_bytes); !st.ok()) return st;
    cuda::BackwardLaunch a;
    a.id_begin = At<const int64_t>(d, l.id_begin);
    a.descs = At<const cuda::GradDesc>(d, l.descs);
    a.num_requests = n;
    a.updates = At<const cuda::UpdateDesc>(d, l.updates);
    a.key_base = At<const uint64_t>(d, l.key_base);
    a.num_shards = num_shards;
    a.lengths = At<const int64_t>(d, l.lengths);
    a.num_bags = plan.total_bags;
    a.ids = At<const int64_t>(d, l.ids);
    a.total_ids = plan.total_ids;
    a.weights = At<const float>(d, l.weights);
    a.grads = At<const float>(d, l.grads);
    a.end_bit = plan.end_bit;
    a.max_dim = plan.max_dim;
    a.offsets = At<int64_t>(d, l.offsets);
    a.keys_a = At<uint64_t>(d, l.keys_a);
    a.keys_b = At<uint64_t>(d, l.keys_b);
    a.pos_a = At<int64_t>(d, l.pos_a);
    a.pos_b = At<int64_t>(d, l.pos_b);
    a.src_off = At<int64_t>(d, l.src_off);
    a.scale = At<float>(d, l.scale);
    a.run_id = At<int64_t>(d, l.run_id);
    a.run_begin = At<int64_t>(d, l.run_begin);
    a.hot_units = At<int64_t>(d, l.hot_units);
    a.hot_end = At<int64_t>(d, l.hot_end);
    a.partials = At<float>(d, l.partials);
    a.max_units = l.max_units;
    a.temp = d + l.temp;
    a.temp_bytes = l.device_bytes - l.temp;
    return launch(plan, a);
  }

  absl::Status DoExportRows(ShardId id, int64_t row_begin, int64_t row_end,
                            absl::Span<float> weights, absl::Span<float> state) const {
    // Rows move through a staging slot, held (like a data call's) until
    // the copies are done.
    SlotLease lease(&slot_pool_, slots_, options_.device, stream_);
    const DeviceBuffer& staging = lease.slot().host;
    absl::MutexLock lock(&mu_);
    const EndMark end(&lease);
    const Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateRowRange(s->spec, row_begin, row_end, weights.size(), state.size());
        !st.ok()) {
      return st;
    }
    if (row_end == row_begin) return absl::OkStatus();
    if (absl::Status st = Activate(); !st.ok()) return st;
    lease.NoteQueued();
    const int64_t dim = s->spec.dim, row_bytes = s->RowBytes();
    const int64_t chunk_rows = TransferRows(row_bytes, staging);
    const int64_t n = row_end - row_begin;
    for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n - r0);
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          staging.get(), s->weights.get() + (row_begin + r0) * row_bytes, rows * row_bytes,
          s->ToHost(), stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      LoadRows(s->spec.weight_type, staging.get(), rows * dim, weights.data() + r0 * dim);
    }
    if (s->state_width > 0) {
      // Pageable destination: the copy is staged by the driver.
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          state.data(),
          reinterpret_cast<const float*>(s->state.get()) + row_begin * s->state_width,
          n * s->state_width * sizeof(float), s->ToHost(), stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    return absl::OkStatus();
  }

  absl::Status DoImportRows(ShardId id, int64_t row_begin, int64_t row_end,
                            absl::Span<const float> weights, absl::Span<const float> state) {
    // Rows move through a staging slot, held (like a data call's) until
    // the copies are done.
    SlotLease lease(&slot_pool_, slots_, options_.device, stream_);
    const DeviceBuffer& staging = lease.slot().host;
    absl::MutexLock lock(&mu_);
    const EndMark end(&lease);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st =
            ValidateImport(s->spec, row_begin, row_end, weights, state);
        !st.ok()) {
      return st;
    }
    if (row_end == row_begin) return absl::OkStatus();
    if (absl::Status st = Activate(); !st.ok()) return st;
    lease.NoteQueued();
    const int64_t dim = s->spec.dim, row_bytes = s->RowBytes();
    const int64_t chunk_rows = TransferRows(row_bytes, staging);
    const int64_t n = row_end - row_begin;
    for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n - r0);
      StoreRows(s->spec.weight_type, weights.data() + r0 * dim, rows * dim, staging.get());
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(s->weights.get() + (row_begin + r0) * row_bytes,
                                                 staging.get(), rows * row_bytes,
                                                 s->FromHost(), stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    if (s->state_width > 0) {
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          reinterpret_cast<float*>(s->state.get()) + row_begin * s->state_width, state.data(),
          n * s->state_width * sizeof(float), s->FromHost(), stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    }
    s->bounds = backend::Widen(s->bounds, backend::ImportedBounds(s->spec, weights, state));
    return absl::OkStatus();
  }

  // ExportRowsAt (into out_w, out_s) / ImportRowsAt (`import`: from in_w,
  // in_s). Each chunk's rows, weights (in the weight type) and state are
  // laid out alike in the staging and the scratch.
  absl::Status DoRowsAt(ShardId id, absl::Span<const int64_t> rows, absl::Span<const float> in_w,
                        absl::Span<const float> in_s, absl::Span<float> out_w,
                        absl::Span<float> out_s, bool import) const {
    SlotLease lease(&slot_pool_, slots_, options_.device, stream_);
    const DeviceBuffer& staging = lease.slot().host;
    absl::MutexLock lock(&mu_);
    const EndMark end(&lease);
    Shard* s = FindShard(id);
    if (s == nullptr) return ShardNotFound(id);
    if (absl::Status st = ValidateRowsAt(s->spec, rows, import ? in_w.size() : out_w.size(),
                                         import ? in_s.size() : out_s.size());
        !st.ok()) {
      return st;
    }
    if (import) {
      if (absl::Status st = ValidateImport(s->spec, 0, static_cast<int64_t>(rows.size()), in_w,
                                           in_s);
          !st.ok()) {
        return st;
      }
    }
    if (rows.empty()) return absl::OkStatus();
    if (absl::Status st = Activate(); !st.ok()) return st;
    lease.NoteQueued();
    const int64_t dim = s->spec.dim, row_bytes = s->RowBytes(), width = s->state_width;
    struct ChunkLayout {
      size_t rows, weights, state, bytes;
    };
    auto lay_out = [&](int64_t m) {
      Layout l;
      ChunkLayout c;
      c.rows = l.Add<int64_t>(m);
      c.weights = l.Add<char>(m * row_bytes);
      c.state = l.Add<float>(m * width);
      c.bytes = l.bytes();
      return c;
    };
    const size_t room = std::min(scratch_.capacity(), staging.capacity());
    int64_t chunk = static_cast<int64_t>(rows.size());
    while (chunk > 1 && lay_out(chunk).bytes > room) chunk = (chunk + 1) / 2;
    if (lay_out(chunk).bytes > room) return absl::InternalError("a row does not fit the scratch");
    char* h = staging.get();
    char* d = scratch_.get();
    const int64_t n = static_cast<int64_t>(rows.size());
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t m = std::min(chunk, n - r0);
      const ChunkLayout l = lay_out(m);
      std::memcpy(h + l.rows, rows.data() + r0, m * sizeof(int64_t));
      auto copy = [&](size_t at, char* shard_base, int64_t words) -> absl::Status {
        if (words == 0) return absl::OkStatus();
        cuda::CopyRowsLaunch c;
        c.rows = At<const int64_t>(d, l.rows);
        c.n = m;
        c.words = words;
        c.gather = !import;
        c.from = reinterpret_cast<const uint32_t*>(import ? d + at : shard_base);
        c.to = reinterpret_cast<uint32_t*>(import ? shard_base : d + at);
        EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchCopyRows(c, max_blocks_, stream_));
        return absl::OkStatus();
      };
      if (import) {
        StoreRows(s->spec.weight_type, in_w.data() + r0 * dim, m * dim, h + l.weights);
        std::memcpy(h + l.state, in_s.data() + r0 * width, m * width * sizeof(float));
        EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(d, h, l.bytes, cudaMemcpyHostToDevice, stream_));
      } else {
        EMBER_RETURN_IF_CUDA_ERROR(
            cudaMemcpyAsync(d, h, l.weights, cudaMemcpyHostToDevice, stream_));  // the rows
      }
      if (absl::Status st = copy(l.weights, s->weights.get(), row_bytes / 4); !st.ok()) return st;
      if (absl::Status st = copy(l.state, s->state.get(), width); !st.ok()) return st;
      if (!import) {
        EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(h + l.weights, d + l.weights,
                                                   l.bytes - l.weights, cudaMemcpyDeviceToHost,
                                                   stream_));
      }
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      if (!import) {
        LoadRows(s->spec.weight_type, h + l.weights, m * dim, out_w.data() + r0 * dim);
        std::memcpy(out_s.data() + r0 * width, h + l.state, m * width * sizeof(float));
      }
    }
    if (import) s->bounds = backend::Widen(s->bounds, backend::ImportedBounds(s->spec, in_w, in_s));
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> ExportStep(ShardId id) const override {
    absl::MutexLock lock(&mu_);
    return shards_.Step(id);
  }

  absl::Status ImportStep(ShardId id, int64_t step) override {
    absl::MutexLock lock(&mu_);
    return shards_.SetStep(id, step);
  }

  int64_t AvailableBytes() const override { return budget_.Available(); }
  bool MapsHostMemory() const override { return true; }
  int64_t AvailableMappedBytes() const override { return mapped_budget_.Available(); }

  // Keyed lookups find their ids on the device (KeyFindOne), in the copy
  // of the shard's key index kept here.
  bool FindsKeys() const override { return true; }
  absl::Status SyncKeyIndex(ShardId id, const backend::math::KeyLine* lines, int64_t count,
                            absl::Span<const int64_t> changed) override {
    return Guarded([&] { return DoSyncKeyIndex(id, lines, count, changed); });
  }

  std::string Name() const override { return absl::StrCat("cuda/", device_name_); }
  Memory OutputMemory() const override { return Memory::kCudaDevice; }
  int64_t OverflowSkippedRows() const override {
    return skipped_rows_.load(std::memory_order_relaxed);
  }
  // Outputs in host memory only: the download's copy out of the staging
  // puts each row at its stride (DeliverOutputs).
  bool WritesStridedOutputs() const override { return true; }

 private:
  // The calling thread's current device is per thread: every call that
  // touches the GPU makes ours current first.
  absl::Status Activate() const {
    EMBER_RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device));
    return absl::OkStatus();
  }

  // Rows of `row_bytes` that one copy through `staging` moves (>= 1: shard
  // specs with a row larger than the staging are refused at creation).
  static int64_t TransferRows(int64_t row_bytes, const DeviceBuffer& staging) {
    const int64_t bytes = std::min<int64_t>(kTransferChunkBytes, staging.capacity());
    return std::max<int64_t>(1, bytes / row_bytes);
  }

  // `count` values of the weight type at `src` into fp32 `dst`.
  static void LoadRows(WeightType type, const char* src, int64_t count, float* dst) {
    switch (type) {
      case WeightType::kFp16: {
        const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
        for (int64_t i = 0; i < count; ++i) dst[i] = backend::Fp16ToFloat(in[i]);
        break;
      }
      case WeightType::kBf16: {
        const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
        for (int64_t i = 0; i < count; ++i) dst[i] = backend::Bf16ToFloat(in[i]);
        break;
      }
      default:
        std::memcpy(dst, src, count * sizeof(float));
    }
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
    const int64_t chunk_rows = TransferRows(row_bytes, init_staging_);
    std::vector<float> values;
    const unsigned threads =
        std::max(1u, std::min(kMaxInitThreads, std::thread::hardware_concurrency()));
    for (int64_t r0 = 0; r0 < sp.rows; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, sp.rows - r0);
      values.resize(static_cast<size_t>(rows * dim));
      auto fill = [&](int64_t b, int64_t e) {
        backend::InitialValues(sp.initializer, sp.table_rows, sp.row_offset + r0 + b, e - b,
                               sp.col_offset, dim, values.data() + b * dim);
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
                                                 shard->FromHost(), init_stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(init_stream_));
    }
    const int64_t state_elems = sp.rows * shard->state_width;
    if (state_elems > 0) {
      float* state = reinterpret_cast<float*>(shard->state.get());
      const bool adagrad = sp.optimizer.type == OptimizerType::kAdagrad ||
                           sp.optimizer.type == OptimizerType::kRowwiseAdagrad;
      const float init = adagrad ? sp.optimizer.initial_accumulator_value : 0.0f;
      if (init == 0.0f && !sp.host_mapped) {  // (mapped memory: the fill kernel writes it)
        EMBER_RETURN_IF_CUDA_ERROR(
            cudaMemsetAsync(state, 0, state_elems * sizeof(float), init_stream_));
      } else {
        EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchFill(state, state_elems, init, max_blocks_, init_stream_));
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
      if (cuda::IsStickyError(err)) {
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
  // piece as they are copied; ids and weights in device memory are copied
  // there, device to device (CheckDeviceInputs checked them). `kind` names
  // the requests in messages.
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
      if (f.on_device) {
        if (absl::Status st = up->AppendDevice(at, f.ids.data(), f.ids.size() * sizeof(int64_t));
            !st.ok()) {
          return st;
        }
        at += f.ids.size() * sizeof(int64_t);
        continue;
      }
      const ShardSpec& spec = FindShard(f.shard)->spec;
      auto check = [&](absl::Span<const int64_t> ids, int64_t first) {
        // Keys are any int64 (found on the device).
        return f.keyed ? absl::OkStatus() : CheckIds(ids, spec.rows, RequestWhat(kind, i, spec), first);
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
      if (f.on_device) {
        const size_t bytes = f.weights.size() * sizeof(float);
        if (absl::Status st = up->AppendDevice(at, f.weights.data(), bytes); !st.ok()) return st;
        at += bytes;
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

  // Checks the values of a call's inputs in device memory (every request
  // on_device), on the device, before anything of the call runs: ids in
  // range, weights and gradients finite, the first bad value in
  // ValidateRequests' order named as it names it (RequestWhat(kind, ...),
  // CheckIds, CheckFinite). A lookup's outputs must not overlap its inputs
  // (a later piece of a call cut in pieces would read earlier outputs as
  // its ids, unchecked): INVALID_ARGUMENT.
  // Runs in the call's scratch and staging `slot`, and waits for the
  // check (so for the work queued before it too).
  template <typename Request>
  absl::Status CheckDeviceInputs(absl::Span<const Request> requests, const char* kind,
                                 StagingSlot& slot, float* max_abs = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t room = std::min(scratch_.capacity(), slot.host.capacity());
    struct CheckLayout {
      size_t begin, descs, first_bad, max_bits, bytes;
    };
    auto lay_out = [](size_t m) {
      Layout l;
      CheckLayout c;
      c.begin = l.Add<int64_t>(m + 1);
      c.descs = l.Add<cuda::InputCheckDesc>(m);
      c.first_bad = l.Add<uint64_t>(1);
      c.max_bits = l.Add<uint32_t>(2);
      c.bytes = l.bytes();
      return c;
    };
    // As many requests at once as the scratch takes.
    size_t group = requests.size();
    while (group > 1 && lay_out(group).bytes > room) group = (group + 1) / 2;
    if (lay_out(1).bytes > room) return absl::InternalError("the scratch cannot hold a check");
    if (absl::Status s = CheckNoOverlap(requests, kind); !s.ok()) return s;
    char* h = slot.host.get();
    char* d = scratch_.get();
    // A value read back from device memory (pageable: done on return).
    auto read_back = [this](void* to, const void* from, size_t bytes) -> absl::Status {
      EMBER_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    };
    for (size_t first = 0; first < requests.size(); first += group) {
      const size_t m = std::min(group, requests.size() - first);
      const CheckLayout l = lay_out(m);
      int64_t* begin = At<int64_t>(h, l.begin);
      cuda::InputCheckDesc* descs = At<cuda::InputCheckDesc>(h, l.descs);
      int64_t total = 0;
      for (size_t i = 0; i < m; ++i) {
        const Request& r = requests[first + i];
        const FeatureRequest& f = r.feature;
        const absl::Span<const float> grad = InputFloats(r);
        cuda::InputCheckDesc& c = descs[i];
        c.ids = f.ids.data();
        c.weights = f.weights.empty() ? nullptr : f.weights.data();
        c.grad = grad.empty() ? nullptr : grad.data();
        c.num_ids = f.keyed ? 0 : static_cast<int64_t>(f.ids.size());  // keys: any int64
        c.num_weights = static_cast<int64_t>(f.weights.size());
        c.num_grad = static_cast<int64_t>(grad.size());
        c.rows = FindShard(f.shard)->spec.rows;
        c.begin = begin[i] = total;
        total += c.num_ids + c.num_weights + c.num_grad;
      }
      begin[m] = total;
      if (total == 0) continue;
      uint64_t* first_bad = At<uint64_t>(h, l.first_bad);
      *first_bad = std::numeric_limits<uint64_t>::max();
      uint32_t* max_bits = At<uint32_t>(h, l.max_bits);
      max_bits[0] = max_bits[1] = 0;
      EMBER_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(d, h, l.bytes, cudaMemcpyHostToDevice, stream_));
      cuda::InputCheckLaunch a;
      a.begin = At<const int64_t>(d, l.begin);
      a.descs = At<const cuda::InputCheckDesc>(d, l.descs);
      a.num_requests = static_cast<int64_t>(m);
      a.total = total;
      a.first_bad = At<unsigned long long>(d, l.first_bad);  // NOLINT(runtime/int)
      a.max_bits = At<unsigned int>(d, l.max_bits);
      EMBER_RETURN_IF_CUDA_ERROR(cuda::LaunchCheckInputs(a, max_blocks_, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(first_bad, d + l.first_bad,
                                                 l.max_bits + 2 * sizeof(uint32_t) - l.first_bad,
                                                 cudaMemcpyDeviceToHost, stream_));
      EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
      if (max_abs != nullptr) {
        for (int k = 0; k < 2; ++k) {
          float v;
          std::memcpy(&v, &max_bits[k], sizeof(v));
          max_abs[k] = std::max(max_abs[k], v);
        }
      }
      if (*first_bad == std::numeric_limits<uint64_t>::max()) continue;
      // The request it falls in, and the value, named as the host names it.
      const int64_t bad = static_cast<int64_t>(*first_bad);
      const size_t i = std::upper_bound(begin, begin + m + 1, bad) - begin - 1;
      const cuda::InputCheckDesc c = descs[i];
      const ShardSpec& spec = FindShard(requests[first + i].feature.shard)->spec;
      const std::string what = RequestWhat(kind, first + i, spec);
      int64_t k = bad - c.begin;
      absl::Status refused;
      const bool weight = k < c.num_weights;
      if (!weight) k -= c.num_weights;
      if (!weight && k < c.num_ids) {
        int64_t id = 0;
        if (absl::Status s = read_back(&id, c.ids + k, sizeof(id)); !s.ok()) return s;
        refused = CheckIds(absl::MakeConstSpan(&id, 1), spec.rows, what, k);
      } else {
        if (!weight) k -= c.num_ids;
        float value = 0;
        if (absl::Status s = read_back(&value, (weight ? c.weights : c.grad) + k, sizeof(value));
            !s.ok()) {
          return s;
        }
        refused = CheckFinite(absl::MakeConstSpan(&value, 1), what,
                              weight ? "weights" : "gradient", k);
      }
      if (refused.ok()) {
        return absl::InternalError(absl::StrCat(what, ": the device check found a bad value at ",
                                                bad, " that reads back as good"));
      }
      return refused;
    }
    return absl::OkStatus();
  }

  // Copies an ApplyGradients call's device inputs into `host` (its
  // requests: the same, in host memory).
  absl::Status CopyToHost(absl::Span<const GradientRequest> requests, HostInputs* host) const {
    const size_t n = requests.size();
    host->ids.resize(n);
    host->weights.resize(n);
    host->grads.resize(n);
    host->requests.assign(requests.begin(), requests.end());
    auto copy = [this](auto* to, auto from) -> absl::Status {
      to->resize(from.size());
      if (from.empty()) return absl::OkStatus();
      EMBER_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(to->data(), from.data(),
                                                 from.size() * sizeof(from[0]),
                                                 cudaMemcpyDeviceToHost, stream_));
      return absl::OkStatus();
    };
    for (size_t i = 0; i < n; ++i) {
      GradientRequest& r = host->requests[i];
      if (absl::Status s = copy(&host->ids[i], r.feature.ids); !s.ok()) return s;
      if (absl::Status s = copy(&host->weights[i], r.feature.weights); !s.ok()) return s;
      if (absl::Status s = copy(&host->grads[i], r.grad); !s.ok()) return s;
      r.feature.ids = host->ids[i];
      r.feature.weights = host->weights[i];
      r.grad = host->grads[i];
      r.feature.on_device = false;
    }
    EMBER_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
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
      v.guard = s->guard;
      return v;
    };
  }

  // For the shared request validation (ValidateRequests).
  const ShardSpec* FindSpec(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Shard* s = FindShard(id);
    return s == nullptr ? nullptr : &s->spec;
  }

  Shard* FindShard(ShardId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shards_.Find(id);
  }

  const CudaBackendOptions options_;
  const cudaStream_t stream_;  // owned; non-blocking
  const std::string device_name_;
  const int max_blocks_;
  mutable absl::Mutex mu_;
  backend::ShardRegistry<Shard> shards_ ABSL_GUARDED_BY(mu_);
  backend::MemoryBudget budget_;
  backend::MemoryBudget mapped_budget_;  // fused_uvm shards (mapped host memory)
  // The fixed scratch every data call uses (const calls too), allocated
  // once by Init, and what call_split needs to know of it and the staging.
  mutable DeviceBuffer scratch_ ABSL_GUARDED_BY(mu_);
  Scratch split_;
  // The overflow guard's record (kernel_descs.h), for the calls that check
  // rows (each waits for its checks under mu_), and what resets it.
  DeviceBuffer record_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer measure_ ABSL_GUARDED_BY(mu_);  // Measure's maxima
  const cuda::OverflowRecord fresh_record_ = FreshRecord();
  std::atomic<int64_t> skipped_rows_{0};
  // The staging slots (pinned host memory, scratch_bytes each), each held
  // by one call at a time through a SlotLease.
  mutable SlotPool slot_pool_;
  mutable StagingSlot slots_[kStagingSlots];
  // Shard creation, apart from the data calls (MakeShard).
  const cudaStream_t init_stream_;  // owned; non-blocking
  absl::Mutex init_mu_;
  DeviceBuffer init_staging_ ABSL_GUARDED_BY(init_mu_);  // pinned host memory
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
  if (options.mapped_memory_limit_bytes < 0) {
    return absl::InvalidArgumentError("mapped_memory_limit_bytes must be >= 0");
  }
  if (options.scratch_bytes < kMinCudaScratchBytes) {
    return absl::InvalidArgumentError(absl::StrCat("scratch_bytes must be >= ",
                                                   kMinCudaScratchBytes, ", got ",
                                                   options.scratch_bytes));
  }
  if (options.memory_limit_bytes > 0 && options.memory_limit_bytes <= options.scratch_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_limit_bytes (", options.memory_limit_bytes, ") must exceed scratch_bytes (",
        options.scratch_bytes, "), which it includes"));
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
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<EmbeddingBackend>(std::move(backend));
}

}  // namespace backend
}  // namespace ember
