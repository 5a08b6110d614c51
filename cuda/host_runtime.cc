// See host_runtime.h. Each function here defines the runtime API function
// of the same name (C linkage, declared by cuda_runtime_api.h).
#include "cuda/host_runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

// A stream: a thread running its queue in order. Never freed (a destroyed
// stream's thread is joined), so events and waiters that still hold one
// stay valid, as handles may in CUDA.
struct CUstream_st {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  int64_t queued = 0;    // operations ever queued
  int64_t finished = 0;  // operations run (or skipped once the device is lost)
  bool stop = false;
  uint64_t rng = 0;      // the delays' generator
  std::thread worker;
};

// An event: complete once its stream has run `target` operations.
struct CUevent_st {
  CUstream_st* stream = nullptr;
  int64_t target = 0;
};

namespace {

std::atomic<cudaError_t> sticky{cudaSuccess};
thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;  // cudaSetDevice's, per thread as in CUDA

// Every stream, for cudaFree's wait, and the pinned allocations by start.
std::mutex registry_mu;
std::set<CUstream_st*>& Streams() {
  static auto* s = new std::set<CUstream_st*>();
  return *s;
}
std::map<uintptr_t, size_t>& Pinned() {
  static auto* p = new std::map<uintptr_t, size_t>();
  return *p;
}
// The pinned allocations mapped into the device (cudaHostAllocMapped), by
// start: the ones cudaHostGetDevicePointer answers for.
std::map<uintptr_t, size_t>& Mapped() {
  static auto* p = new std::map<uintptr_t, size_t>();
  return *p;
}
std::mutex event_mu;  // an event's (stream, target)

// Each operation waits a pseudo-random 0 to this many microseconds before it
// runs ($EMBER_HOST_CUDA_DELAY_US, default 20; 0: none), so that work runs
// later than its caller may assume, as on a device: a buffer reused before
// the copy that reads it has run shows up.
int MaxDelayMicros() {
  static const int delay = [] {
    const char* env = std::getenv("EMBER_HOST_CUDA_DELAY_US");
    return env != nullptr ? std::max(0, std::atoi(env)) : 20;
  }();
  return delay;
}

cudaError_t Fail(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}
cudaError_t Sticky() { return sticky.load(); }

void Work(CUstream_st* s) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [s] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stopped and drained
    std::function<void()> op = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    if (const int max = MaxDelayMicros(); max > 0) {
      s->rng = s->rng * 6364136223846793005ULL + 1442695040888963407ULL;
      std::this_thread::sleep_for(std::chrono::microseconds((s->rng >> 33) % (max + 1)));
    }
    if (Sticky() == cudaSuccess) op();  // a lost device runs nothing more
    lock.lock();
    ++s->finished;
    s->cv.notify_all();
  }
}

CUstream_st* NewStream() {
  auto* s = new CUstream_st();
  s->rng = reinterpret_cast<uintptr_t>(s);
  s->worker = std::thread(Work, s);
  std::lock_guard<std::mutex> lock(registry_mu);
  Streams().insert(s);
  return s;
}

CUstream_st* Resolve(cudaStream_t s) {
  if (s != nullptr) return s;
  static CUstream_st* default_stream = NewStream();
  return default_stream;
}

// Queues `op`; returns the count the stream reaches when it has run it.
int64_t Enqueue(CUstream_st* s, std::function<void()> op) {
  std::lock_guard<std::mutex> lock(s->mu);
  s->queue.push_back(std::move(op));
  s->cv.notify_all();
  return ++s->queued;
}

void WaitFor(CUstream_st* s, int64_t target) {
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->finished >= target; });
}

void WaitIdle(CUstream_st* s) {
  int64_t target;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    target = s->queued;
  }
  WaitFor(s, target);
}

void WaitAllStreams() {
  std::set<CUstream_st*> streams;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    streams = Streams();
  }
  for (CUstream_st* s : streams) WaitIdle(s);
}

// Whether `p` lies inside one of `blocks` (start -> bytes).
bool InBlock(const std::map<uintptr_t, size_t>& blocks, const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = blocks.upper_bound(at);
  if (it == blocks.begin()) return false;
  --it;
  return at < it->first + it->second;
}

bool IsPinned(const void* p) { return InBlock(Pinned(), p); }
bool IsMapped(const void* p) { return InBlock(Mapped(), p); }

// 256-byte aligned (as cudaMalloc's), exactly `bytes` long (so that a
// sanitizer sees an overrun).
void* Allocate(size_t bytes) {
  void* p = nullptr;
  return posix_memalign(&p, 256, std::max<size_t>(bytes, 1)) == 0 ? p : nullptr;
}

int current_device_count() {
  const char* env = std::getenv("EMBER_HOST_CUDA_DEVICES");
  return env != nullptr ? std::max(0, std::atoi(env)) : 1;
}

}  // namespace

namespace ember {
namespace cuda {

cudaError_t HostLaunch(cudaStream_t stream, std::function<void()> op) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  Enqueue(Resolve(stream), std::move(op));
  return cudaSuccess;
}

size_t HostMappedBytes() {
  std::lock_guard<std::mutex> lock(registry_mu);
  size_t bytes = 0;
  for (const auto& [start, n] : Mapped()) bytes += n;
  return bytes;
}

cudaError_t HostLaunchFault(cudaStream_t stream) {
  return HostLaunch(stream, [] {
    cudaError_t expected = cudaSuccess;
    sticky.compare_exchange_strong(expected, cudaErrorIllegalAddress);
  });
}

}  // namespace cuda
}  // namespace ember

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return Sticky() != cudaSuccess ? Sticky() : e;
}

const char* CUDARTAPI cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "unknown error";
  }
}

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  *count = current_device_count();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  if (device < 0 || device >= current_device_count()) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= current_device_count()) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "host runtime", sizeof(prop->name) - 1);
  prop->major = 8;
  prop->minor = 0;
  prop->multiProcessorCount = 2;
  prop->totalGlobalMem = size_t{16} << 30;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMalloc(void** p, size_t bytes) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  *p = Allocate(bytes);
  return *p != nullptr ? cudaSuccess : Fail(cudaErrorMemoryAllocation);
}

cudaError_t CUDARTAPI cudaFree(void* p) {
  if (p == nullptr) return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
  if (IsPinned(p)) return Fail(cudaErrorInvalidValue);  // cudaMallocHost's: cudaFreeHost
  WaitAllStreams();  // cudaFree synchronises the device
  std::free(p);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMallocHost(void** p, size_t bytes) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  *p = Allocate(bytes);
  if (*p == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(registry_mu);
  Pinned()[reinterpret_cast<uintptr_t>(*p)] = bytes;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaHostAlloc(void** p, size_t bytes, unsigned int flags) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  *p = Allocate(bytes);
  if (*p == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(registry_mu);
  Pinned()[reinterpret_cast<uintptr_t>(*p)] = bytes;
  if (flags & cudaHostAllocMapped) Mapped()[reinterpret_cast<uintptr_t>(*p)] = bytes;
  return cudaSuccess;
}

// The device's address of a mapped allocation is its host address (one
// address space, as with UVA); an allocation that is not mapped has none.
cudaError_t CUDARTAPI cudaHostGetDevicePointer(void** device, void* host, unsigned int flags) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  if (!IsMapped(host)) return Fail(cudaErrorInvalidValue);
  *device = host;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  if (!IsPinned(p)) return Fail(cudaErrorInvalidValue);
  WaitAllStreams();
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    Pinned().erase(reinterpret_cast<uintptr_t>(p));
    Mapped().erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  *stream = NewStream();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return Fail(cudaErrorInvalidValue);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stop = true;
    s->cv.notify_all();
  }
  s->worker.join();  // runs what was queued first, as CUDA does
  // Out of the registry only now, so a cudaFree meanwhile waited for it.
  std::lock_guard<std::mutex> lock(registry_mu);
  Streams().erase(s);
  return cudaSuccess;  // the record stays (see CUstream_st)
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  WaitIdle(Resolve(stream));
  return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return e;
  CUstream_st* s = Resolve(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->finished == s->queued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  *event = new CUevent_st();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  delete event;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  CUstream_st* s = Resolve(stream);
  int64_t target;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    target = s->queued;
  }
  std::lock_guard<std::mutex> lock(event_mu);
  event->stream = s;
  event->target = target;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  CUstream_st* s;
  int64_t target;
  {
    std::lock_guard<std::mutex> lock(event_mu);
    s = event->stream;
    target = event->target;
  }
  if (s != nullptr) WaitFor(s, target);
  return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                                      enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  // A mapped host block named as device memory by an explicit direction:
  // undefined on a device (the addresses must match the kind), refused
  // here so that a caller that does it is caught.
  if ((kind == cudaMemcpyHostToDevice && IsMapped(dst)) ||
      (kind == cudaMemcpyDeviceToHost && IsMapped(src))) {
    return Fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = Resolve(stream);
  const int64_t done = Enqueue(s, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  // Pageable host memory: the copy is done (H2D: the source may be reused;
  // D2H: the destination is written) when the call returns.
  // cudaMemcpyDefault (the direction told by the addresses): asynchronous
  // between pinned (or mapped) blocks only.
  const bool pageable = (kind == cudaMemcpyHostToDevice && !IsPinned(src)) ||
                        (kind == cudaMemcpyDeviceToHost && !IsPinned(dst)) ||
                        (kind == cudaMemcpyDefault && !(IsPinned(src) && IsPinned(dst)));
  if (pageable) {
    WaitFor(s, done);
    if (Sticky() != cudaSuccess) return Fail(Sticky());  // it never ran
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                                        size_t width, size_t height, enum cudaMemcpyKind kind,
                                        cudaStream_t stream) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  if (kind != cudaMemcpyDeviceToDevice) return Fail(cudaErrorInvalidValue);  // all the callers use
  if (dpitch < width || spitch < width) return Fail(cudaErrorInvalidPitchValue);
  return ember::cuda::HostLaunch(stream, [=] {
    for (size_t r = 0; r < height; ++r) {
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                  width);
    }
  });
}

cudaError_t CUDARTAPI cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch,
                                   size_t width, size_t height, enum cudaMemcpyKind) {
  if (cudaError_t e = Sticky(); e != cudaSuccess) return Fail(e);
  if (dpitch < width || spitch < width) return Fail(cudaErrorInvalidPitchValue);
  // Synchronous; the streams here are all non-blocking ones, which a copy
  // on the legacy default stream does not wait for.
  for (size_t r = 0; r < height; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                width);
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  return ember::cuda::HostLaunch(stream, [p, value, bytes] { std::memset(p, value, bytes); });
}
