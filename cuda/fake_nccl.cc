// A stand-in for the NCCL library behind nccl_link.cc in tests
// (fake_nccl.h): two-rank communicators over a Unix-domain socket, with
// their transfers queued on the host CUDA runtime's streams.
#include "cuda/fake_nccl.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cuda/host_runtime.h"

namespace ember {
namespace cuda {
namespace {

// What a communicator's queued transfers share: they may still run after
// ncclCommAbort let the handle go.
struct State {
  std::atomic<int> fd{-1};
  std::atomic<bool> aborted{false};
  std::atomic<ncclResult_t> async{ncclInProgress};  // the init's result, then the first error
  ~State() {
    if (fd >= 0) ::close(fd);
  }
  void Fail(ncclResult_t r) {
    ncclResult_t expected = ncclSuccess;
    async.compare_exchange_strong(expected, r);
  }
};

struct Comm {
  std::shared_ptr<State> state = std::make_shared<State>();
  std::thread init;
};

Comm* Of(ncclComm_t comm) { return reinterpret_cast<Comm*>(comm); }

bool AddressOf(const ncclUniqueId& id, sockaddr_un* addr, socklen_t* len) {
  const size_t n = strnlen(id.internal, sizeof(id.internal));
  if (n == 0 || n + 1 > sizeof(addr->sun_path)) return false;
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  std::memcpy(addr->sun_path + 1, id.internal, n);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return true;
}

// Connects the two ranks (rank 0 listens), polling `aborted` every 20 ms.
int Connect(const ncclUniqueId& id, int rank, const State& st) {
  sockaddr_un addr;
  socklen_t len;
  if (!AddressOf(id, &addr, &len)) return -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  const auto* a = reinterpret_cast<const sockaddr*>(&addr);
  if (rank == 0) {
    const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener < 0 || ::bind(listener, a, len) != 0 || ::listen(listener, 1) != 0) {
      if (listener >= 0) ::close(listener);
      return -1;
    }
    int fd = -1;
    while (!st.aborted && absl::Now() < deadline) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) {
        fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        break;
      }
    }
    ::close(listener);
    return fd;
  }
  while (!st.aborted && absl::Now() < deadline) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (::connect(fd, a, len) == 0) return fd;
    ::close(fd);
    absl::SleepFor(absl::Milliseconds(2));
  }
  return -1;
}

bool Io(int fd, char* p, uint64_t n, bool write) {
  while (n > 0) {
    const ssize_t r = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

ncclResult_t GetUniqueId(ncclUniqueId* id) {
  std::random_device rd;
  std::memset(id->internal, 0, sizeof(id->internal));
  const std::string name = absl::StrFormat("ember-fake-nccl-%08x%08x", rd(), rd());
  std::memcpy(id->internal, name.data(), name.size());
  return ncclSuccess;
}

ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                ncclConfig_t* config) {
  if (nranks != 2 || (rank != 0 && rank != 1) || config == nullptr || config->blocking != 0) {
    return ncclInvalidArgument;  // only what nccl_link.cc asks for
  }
  auto* c = new Comm;
  c->init = std::thread([st = c->state, id, rank] {
    const int fd = Connect(id, rank, *st);
    st->fd = fd;
    st->async = fd >= 0 ? ncclSuccess : ncclSystemError;
  });
  *comm = reinterpret_cast<ncclComm_t>(c);
  return ncclInProgress;
}

ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  *error = Of(comm)->state->async;
  return ncclSuccess;
}

ncclResult_t CommAbort(ncclComm_t comm) {
  Comm* c = Of(comm);
  c->state->aborted = true;
  if (c->state->fd >= 0) ::shutdown(c->state->fd, SHUT_RDWR);  // unblocks a queued transfer
  c->init.join();
  if (c->state->fd >= 0) ::shutdown(c->state->fd, SHUT_RDWR);  // joined meanwhile
  delete c;
  return ncclSuccess;
}

// Queues one transfer on `stream`: a size, then the bytes.
ncclResult_t Transfer(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream, bool send) {
  const std::shared_ptr<State> st = Of(comm)->state;
  if (type != ncclUint8 || peer < 0 || peer > 1) return ncclInvalidArgument;
  if (st->async != ncclSuccess) return st->async == ncclInProgress ? ncclInvalidUsage : st->async.load();
  const cudaError_t e = HostLaunch(stream, [st, buf, count, send] {
    if (st->async != ncclSuccess) return;
    uint64_t size = count;
    bool ok;
    if (send) {
      ok = Io(st->fd, reinterpret_cast<char*>(&size), sizeof(size), true) &&
           Io(st->fd, static_cast<char*>(buf), count, true);
    } else {
      ok = Io(st->fd, reinterpret_cast<char*>(&size), sizeof(size), false) && size == count &&
           Io(st->fd, static_cast<char*>(buf), count, false);
    }
    if (!ok) st->Fail(ncclRemoteError);
  });
  return e == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}

ncclResult_t Send(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                  cudaStream_t stream) {
  return Transfer(const_cast<void*>(buf), count, type, peer, comm, stream, true);
}

ncclResult_t Recv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                  cudaStream_t stream) {
  return Transfer(buf, count, type, peer, comm, stream, false);
}

const char* GetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInProgress: return "operation in progress";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclSystemError: return "unhandled system error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    default: return "fake NCCL error";
  }
}

}  // namespace

const NcclApi* FakeNccl() {
  static const NcclApi api = {GetUniqueId, CommInitRankConfig, CommGetAsyncError, CommAbort,
                              Send,        Recv,               GetErrorString};
  return &api;
}

}  // namespace cuda
}  // namespace ember
