// Socket links (peer_link.h) and the choice of a kind by name.
#include "link/peer_link.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "link/abstract_socket.h"

namespace ember {
namespace cuda {
namespace {

constexpr char kSocketPrefix[] = "ember-link-";

absl::Status LinkGone(const char* what) {
  return absl::UnavailableError(
      absl::StrCat("peer link: the other end went away (", what, ": ", std::strerror(errno), ")"));
}

void CopyRowsOf(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                uint64_t width, uint64_t rows) {
  for (uint64_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch,
                static_cast<const char*>(src) + r * src_pitch, width);
  }
}

// The operations run in order on the link's own thread (its "stream"); the
// first failure loses the link and drops what is still queued.
class SocketLink : public PeerLink {
 public:
  explicit SocketLink(int fd) : fd_(fd), thread_([this] { Run(); }) {}
  ~SocketLink() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      ::shutdown(fd_, SHUT_RDWR);  // unblocks a transfer in progress
    }
    cv_.notify_all();
    thread_.join();
    ::close(fd_);
    for (void* m : memory_) std::free(m);
  }

  absl::Status Send(const void* memory, uint64_t bytes) override {
    return Queue([this, memory, bytes]() -> absl::Status {
      const uint64_t size = bytes;
      if (!WriteAll(fd_, reinterpret_cast<const char*>(&size), sizeof(size)) ||
          !WriteAll(fd_, static_cast<const char*>(memory), bytes)) {
        return LinkGone("send");
      }
      return absl::OkStatus();
    });
  }
  absl::Status Recv(void* memory, uint64_t bytes) override {
    return Queue([this, memory, bytes]() -> absl::Status {
      uint64_t size = 0;
      if (!ReadAll(fd_, reinterpret_cast<char*>(&size), sizeof(size))) return LinkGone("receive");
      if (size != bytes) {
        return absl::InternalError(absl::StrCat("peer link: the other end sent ", size,
                                                " bytes where ", bytes, " were expected"));
      }
      if (!ReadAll(fd_, static_cast<char*>(memory), bytes)) return LinkGone("receive");
      return absl::OkStatus();
    });
  }
  absl::Status CopyIn(void* memory, const void* host, uint64_t bytes) override {
    return Queue([=] {
      std::memcpy(memory, host, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status CopyOut(void* host, const void* memory, uint64_t bytes) override {
    return Queue([=] {
      std::memcpy(host, memory, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status CopyRows(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                        uint64_t width, uint64_t rows) override {
    return Queue([=] {
      CopyRowsOf(dst, dst_pitch, src, src_pitch, width, rows);
      return absl::OkStatus();
    });
  }

  absl::Status Wait(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool done = cv_.wait_until(lock, absl::ToChronoTime(deadline), [this] {
      return (ops_.empty() && !running_) || !lost_.ok();
    });
    if (!done && lost_.ok()) {
      lost_ = absl::DeadlineExceededError(
          "peer link: queued transfers not done by the deadline (the other end did not queue "
          "its side)");
      ops_.clear();
      ::shutdown(fd_, SHUT_RDWR);
    }
    return lost_;
  }

  absl::StatusOr<void*> Allocate(uint64_t bytes) override {
    void* m = std::aligned_alloc(64, (std::max<uint64_t>(bytes, 1) + 63) / 64 * 64);
    if (m == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("peer link: ", bytes, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    memory_.insert(m);
    return m;
  }
  void Free(void* memory) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (memory_.erase(memory) > 0) std::free(memory);
  }

 private:
  absl::Status Queue(std::function<absl::Status()> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_.ok()) return lost_;
      ops_.push_back(std::move(op));
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !ops_.empty(); });
      if (stop_) return;
      std::function<absl::Status()> op = std::move(ops_.front());
      ops_.pop_front();
      running_ = true;
      lock.unlock();
      absl::Status s = op();
      lock.lock();
      running_ = false;
      if (!s.ok() && lost_.ok()) {
        lost_ = std::move(s);
        ops_.clear();
        ::shutdown(fd_, SHUT_RDWR);
      }
      cv_.notify_all();
    }
  }

  const int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<absl::Status()>> ops_;
  bool running_ = false;
  bool stop_ = false;
  absl::Status lost_;
  std::set<void*> memory_;
  std::thread thread_;  // last: started once the rest is built
};

class SocketLinksImpl : public PeerLinks {
 public:
  std::string name() const override { return "socket"; }

  absl::Status CopyRowsNow(int, bool, void* dst, uint64_t dst_pitch, const void* src,
                           uint64_t src_pitch, uint64_t width, uint64_t rows) override {
    CopyRowsOf(dst, dst_pitch, src, src_pitch, width, rows);  // host memory both
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> NewId() override {
    std::random_device rd;
    return absl::StrFormat("%s%08x%08x%08x%08x", kSocketPrefix, rd(), rd(), rd(), rd());
  }

  absl::StatusOr<std::unique_ptr<PeerLink>> Join(const std::string& id, int rank, int device,
                                                 absl::Time deadline) override {
    if (!absl::StartsWith(id, kSocketPrefix)) {
      return absl::InvalidArgumentError(absl::StrCat("not a socket link id: \"", id, "\""));
    }
    auto fd = MeetAt(id, rank, deadline);
    if (!fd.ok()) {
      return absl::Status(fd.status().code(),
                          absl::StrCat("peer link ", id, ": ", fd.status().message()));
    }
    return std::unique_ptr<PeerLink>(new SocketLink(*fd));
  }

};

}  // namespace

PeerLinks* SocketLinks() {
  static PeerLinks* links = new SocketLinksImpl();
  return links;
}

absl::StatusOr<PeerLinks*> PeerLinksNamed(const std::string& name) {
  if (name == "socket") return SocketLinks();
  if (name == "nccl") return NcclLinks();
  return absl::InvalidArgumentError(
      absl::StrCat("no peer link kind \"", name, "\" (\"nccl\" or \"socket\")"));
}

}  // namespace cuda
}  // namespace ember
