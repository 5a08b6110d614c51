// Memory a worker on this host can read and write in place: the allocator
// (SharedAllocator) of a KeyedTensor's values (FloatBuffer) and of a
// KeyedJaggedTensor's ids (IdBuffer), std::vectors whose allocator
//   - leaves new elements uninitialised (resize does not zero: every lookup
//     writes every element of its output), and
//   - takes large buffers (256 KiB and more) from shared memory this
//     process can hand to a worker on its host (client.cc): the worker
//     pools its columns straight into the caller's KeyedTensor, so the
//     client copies nothing back, and reads a lookup's ids straight from
//     the caller's KeyedJaggedTensor, so the client copies nothing there
//     either. Freed buffers are kept for the next call (a few), so a fresh
//     output per call that reuses one costs neither page faults nor
//     clearing (a new one is faulted in, zeroed by the kernel, once).
//
// A shared buffer is a memfd ("ember-buffer") the process keeps open; a
// worker maps it through /proc/<pid>/fd/<fd> (same host and PID namespace;
// elsewhere the worker says it cannot and the client copies as before). Its
// first page is a header holding a random nonce the worker checks, so the
// worker maps the client's buffer and nothing else. Nothing has a name:
// nothing is left behind whoever dies.
//
// fork(): in the child, live buffers become private copies (as heap
// memory would be: neither process sees the other's later writes) that are
// never handed to a worker, and the kept ones are dropped, so the two
// processes never share a buffer. (The child copies them at fork.)
//
// Thread-safe.
#ifndef EMBER_CLIENT_SHARED_BUFFER_H_
#define EMBER_CLIENT_SHARED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <atomic>
#include <map>
#include <new>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace ember {
namespace client {

// A memfd called `name` of `size` bytes, sealed against shrinking and
// growing (a worker that maps it can trust it never shrinks under its
// writes, which would fault), close-on-exec; -1 where that failed (errno
// set). Shared buffers and same-host channels (shm_channel.cc) are made so.
int SealedMemfd(const char* name, size_t size);

// What a worker needs to map a shared buffer (WorkerLookupRequest.out_buffer
// and id_buffer).
struct SharedBufferInfo {
  uint64_t id = 0;     // this process's number for the buffer
  int64_t pid = 0;     // the process holding it ...
  int fd = -1;         // ... open as this descriptor
  uint64_t size = 0;   // bytes of the whole file, the header page included
  uint64_t nonce = 0;  // the header's first 8 bytes
  const char* base = nullptr;  // the file's first byte in this process
};

class SharedBuffers {
 public:
  // Buffers below shared_min_bytes() (default kSharedMinBytes) take
  // ordinary memory. Tests lower it (not below kFloorBytes) so that small
  // outputs take the shared path too.
  static constexpr size_t kSharedMinBytes = 256 << 10;
  static constexpr size_t kFloorBytes = 4096;
  size_t shared_min_bytes() const { return shared_min_bytes_.load(std::memory_order_relaxed); }
  void set_shared_min_bytes(size_t bytes) {
    shared_min_bytes_.store(bytes < kFloorBytes ? kFloorBytes : bytes, std::memory_order_relaxed);
  }
  // At most this many shared buffers at once (each holds a descriptor),
  // KeyedTensors and KeyedJaggedTensors together; past it buffers take
  // ordinary memory (their lookups then go through the channel's copies).
  static constexpr int kMaxShared = 64;
  // Freed shared buffers kept for reuse: at most this many, of at most
  // kMaxKeptBytes together (a larger one is unmapped when freed).
  static constexpr int kMaxKept = 4;
  static constexpr uint64_t kMaxKeptBytes = uint64_t{512} << 20;
  // The header before a shared buffer's data.
  static constexpr size_t kHeaderBytes = 4096;

  static SharedBuffers& Global();

  // Room for `bytes` (64-byte aligned at least); never null (throws
  // std::bad_alloc as operator new does).
  void* Allocate(size_t bytes);
  void Free(void* p, size_t bytes);

  // The shared buffer holding [p, p + bytes), if any.
  std::optional<SharedBufferInfo> Find(const void* p, size_t bytes) const;
  // The buffer at `p` may still be written by a worker whose call failed:
  // once freed it is unmapped rather than kept for another lookup.
  void Poison(const void* p);

  // Counts, for tests.
  int shared_buffers() const;  // live and kept
  int kept_buffers() const;

 private:
  struct Buffer {
    SharedBufferInfo info;
    size_t data_bytes = 0;  // usable bytes after the header
    bool poisoned = false;
    bool inherited = false;  // a fork's child's private copy
  };
  static void Destroy(const Buffer& b);
  // A new shared buffer of data_bytes (>= bytes), or ordinary memory.
  void* Create(size_t bytes, size_t data_bytes);
  // pthread_atfork: the parent holds mu_ across fork(); the child makes
  // what it inherited its own (above).
  static void PrepareFork();
  static void ParentAfterFork();
  static void ChildAfterFork();

  std::atomic<size_t> shared_min_bytes_{kSharedMinBytes};
  mutable absl::Mutex mu_;
  std::map<const char*, Buffer> live_ ABSL_GUARDED_BY(mu_);  // by data pointer
  std::vector<Buffer> kept_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int creating_ ABSL_GUARDED_BY(mu_) = 0;  // being made: count against kMaxShared
};

// A std::allocator that default-initialises (no zeroing) and takes large
// arrays from SharedBuffers. Stateless: any two compare equal.
template <typename T>
class SharedAllocator {
 public:
  using value_type = T;
  SharedAllocator() = default;
  template <typename U>
  SharedAllocator(const SharedAllocator<U>&) {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) {
    if (n > static_cast<size_t>(-1) / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(SharedBuffers::Global().Allocate(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) { SharedBuffers::Global().Free(p, n * sizeof(T)); }

  // resize() default-initialises: a float or an id is left as it was.
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }

  template <typename U>
  bool operator==(const SharedAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const SharedAllocator<U>&) const {
    return false;
  }
};

using FloatBuffer = std::vector<float, SharedAllocator<float>>;
using IdBuffer = std::vector<int64_t, SharedAllocator<int64_t>>;

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_SHARED_BUFFER_H_
