#include "client/shared_buffer.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace ember {
namespace client {
namespace {

constexpr std::align_val_t kAlign{64};

void* Ordinary(size_t bytes) { return ::operator new(bytes, kAlign); }

}  // namespace

int SealedMemfd(const char* name, size_t size) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

SharedBuffers& SharedBuffers::Global() {
  // Never destroyed: buffers may be freed during exit (Python arrays).
  static SharedBuffers* const buffers = [] {
    auto* b = new SharedBuffers();
    pthread_atfork(&PrepareFork, &ParentAfterFork, &ChildAfterFork);
    return b;
  }();
  return *buffers;
}

void SharedBuffers::PrepareFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { Global().mu_.Lock(); }

void SharedBuffers::ParentAfterFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { Global().mu_.Unlock(); }

void SharedBuffers::ChildAfterFork() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  SharedBuffers& g = Global();
  for (const Buffer& b : g.kept_) Destroy(b);
  g.kept_.clear();
  for (auto& [data, b] : g.live_) {
    // A private copy of the bytes moved to the same address: the parent's
    // (and its workers') later writes and ours no longer meet, as with heap
    // memory. Should that fail, the buffer stays shared, and is still never
    // reused or handed to a worker.
    char* base = const_cast<char*>(b.info.base);
    void* copy = mmap(nullptr, b.info.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
    if (copy != MAP_FAILED) {
      std::memcpy(copy, base, b.info.size);
      if (mremap(copy, b.info.size, b.info.size, MREMAP_MAYMOVE | MREMAP_FIXED, base) ==
          MAP_FAILED) {
        munmap(copy, b.info.size);
      }
    }
    close(b.info.fd);
    b.info.fd = -1;
    b.inherited = true;
  }
  g.mu_.Unlock();
}

void SharedBuffers::Destroy(const Buffer& b) {
  munmap(const_cast<char*>(b.info.base), b.info.size);
  if (b.info.fd >= 0) close(b.info.fd);
}

void* SharedBuffers::Allocate(size_t bytes) {
  if (bytes < shared_min_bytes()) return Ordinary(bytes);
  const size_t data_bytes = (bytes + 4095) / 4096 * 4096;
  {
    absl::MutexLock lock(&mu_);
    // A kept buffer that fits without wasting more than it holds.
    for (size_t i = 0; i < kept_.size(); ++i) {
      if (kept_[i].data_bytes >= bytes && kept_[i].data_bytes / 2 <= bytes) {
        Buffer b = kept_[i];
        kept_.erase(kept_.begin() + i);
        char* data = const_cast<char*>(b.info.base) + kHeaderBytes;
        live_[data] = b;
        return data;
      }
    }
    if (static_cast<int>(live_.size() + kept_.size()) + creating_ >= kMaxShared) {
      if (kept_.empty()) return Ordinary(bytes);
      Destroy(kept_.front());
      kept_.erase(kept_.begin());
    }
    ++creating_;  // its slot, held while it is made outside the lock
  }
  void* data = Create(bytes, data_bytes);
  absl::MutexLock lock(&mu_);
  --creating_;
  return data;
}

void* SharedBuffers::Create(size_t bytes, size_t data_bytes) {
  // (Slow: outside the lock.)
  const size_t size = kHeaderBytes + data_bytes;
  const int fd = SealedMemfd("ember-buffer", size);
  if (fd < 0) return Ordinary(bytes);
  // Faulted in here: the pages are this process's, not charged to the
  // first worker that writes them.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return Ordinary(bytes);
  }
  std::random_device rd;
  Buffer b;
  b.info.pid = getpid();
  b.info.fd = fd;
  b.info.size = size;
  b.info.nonce = (static_cast<uint64_t>(rd()) << 32) | rd();
  b.info.base = static_cast<const char*>(base);
  b.data_bytes = data_bytes;
  std::memcpy(base, &b.info.nonce, sizeof(b.info.nonce));
  char* data = static_cast<char*>(base) + kHeaderBytes;
  absl::MutexLock lock(&mu_);
  b.info.id = next_id_++;
  live_[data] = b;
  return data;
}

void SharedBuffers::Free(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (bytes >= kFloorBytes) {  // maybe shared (whatever the threshold was then)
    absl::MutexLock lock(&mu_);
    auto it = live_.find(static_cast<const char*>(p));
    if (it != live_.end()) {
      Buffer b = it->second;
      live_.erase(it);
      if (b.poisoned || b.inherited || b.info.size > kMaxKeptBytes) {
        Destroy(b);
        return;
      }
      // Within kMaxKept buffers and kMaxKeptBytes, the oldest let go first.
      uint64_t kept_bytes = b.info.size;
      for (const Buffer& k : kept_) kept_bytes += k.info.size;
      while (!kept_.empty() &&
             (static_cast<int>(kept_.size()) >= kMaxKept || kept_bytes > kMaxKeptBytes)) {
        kept_bytes -= kept_.front().info.size;
        Destroy(kept_.front());
        kept_.erase(kept_.begin());
      }
      kept_.push_back(b);
      return;
    }
  }
  ::operator delete(p, kAlign);
}

std::optional<SharedBufferInfo> SharedBuffers::Find(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  absl::MutexLock lock(&mu_);
  auto it = live_.upper_bound(c);
  if (it == live_.begin()) return std::nullopt;
  --it;
  const char* data = it->first;
  if (it->second.inherited || c < data || bytes > it->second.data_bytes ||
      c - data > static_cast<std::ptrdiff_t>(it->second.data_bytes - bytes)) {
    return std::nullopt;
  }
  return it->second.info;
}

void SharedBuffers::Poison(const void* p) {
  const char* c = static_cast<const char*>(p);
  absl::MutexLock lock(&mu_);
  auto it = live_.upper_bound(c);
  if (it == live_.begin()) return;
  --it;
  if (c < it->first + it->second.data_bytes) it->second.poisoned = true;
}

int SharedBuffers::shared_buffers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size() + kept_.size());
}

int SharedBuffers::kept_buffers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(kept_.size());
}

}  // namespace client
}  // namespace ember
