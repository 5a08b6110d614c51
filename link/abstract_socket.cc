#include "link/abstract_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ember {
namespace cuda {
namespace {

bool Abandoned(const std::atomic<bool>* abandon) { return abandon != nullptr && *abandon; }

absl::Status NotThere() {
  return absl::DeadlineExceededError("the other end did not join by the deadline");
}

}  // namespace

absl::StatusOr<int> MeetAt(const std::string& name, int rank, absl::Time deadline,
                           const std::atomic<bool>* abandon) {
  sockaddr_un addr;
  if (name.empty() || name.size() + 1 > sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("no abstract socket name: \"", name, "\""));
  }
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a two-rank link"));
  }
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  const auto* a = reinterpret_cast<const sockaddr*>(&addr);
  if (rank == 0) {
    const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener < 0) {
      return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
    }
    if (::bind(listener, a, len) != 0 || ::listen(listener, 1) != 0) {
      absl::Status s = absl::UnavailableError(absl::StrCat("cannot listen: ", std::strerror(errno)));
      ::close(listener);
      return s;
    }
    int fd = -1;
    while (!Abandoned(abandon)) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left <= 0) break;
      pollfd p{listener, POLLIN, 0};
      const int slice = static_cast<int>(std::min<int64_t>(left, abandon != nullptr ? 20 : 60000));
      const int ready = ::poll(&p, 1, slice);
      if (ready > 0) {
        fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        break;
      }
      if (ready < 0 && errno != EINTR) break;
    }
    ::close(listener);
    if (fd < 0) return NotThere();
    return fd;
  }
  // Rank 1: the listener may not be there yet.
  while (!Abandoned(abandon)) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
    if (::connect(fd, a, len) == 0) return fd;
    const int err = errno;
    ::close(fd);
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN) {
      return absl::UnavailableError(absl::StrCat("cannot connect: ", std::strerror(err)));
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return NotThere();
}

bool WriteAll(int fd, const char* p, uint64_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<uint64_t>(w);
  }
  return true;
}

bool ReadAll(int fd, char* p, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = ECONNRESET;
      return false;
    }
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

}  // namespace cuda
}  // namespace ember
