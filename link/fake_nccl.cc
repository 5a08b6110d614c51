// A stand-in for the NCCL library behind nccl_link.cc in tests
// (fake_nccl.h): two-rank communicators over a Unix-domain socket, with
// their transfers queued on the host CUDA runtime's streams.
#include "link/fake_nccl.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cuda/host_runtime.h"
#include "link/abstract_socket.h"

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
    const std::string name(id.internal, strnlen(id.internal, sizeof(id.internal)));
    auto fd = MeetAt(name, rank, absl::Now() + absl::Seconds(60), &st->aborted);
    st->fd = fd.ok() ? *fd : -1;
    st->async = fd.ok() ? ncclSuccess : ncclSystemError;
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
      ok = WriteAll(st->fd, reinterpret_cast<char*>(&size), sizeof(size)) &&
           WriteAll(st->fd, static_cast<char*>(buf), count);
    } else {
      ok = ReadAll(st->fd, reinterpret_cast<char*>(&size), sizeof(size)) && size == count &&
           ReadAll(st->fd, static_cast<char*>(buf), count);
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
