// NCCL links (peer_link.h): the only file that calls NCCL. libnccl.so.2 is
// loaded on first use (dlopen), so binaries built with it run where it is
// absent and answer UNAVAILABLE for "nccl" channels only. Communicators are
// non-blocking (config.blocking = 0): initialisation and every call are
// polled against a deadline, and a link that misses one is aborted
// (ncclCommAbort), which is also how a link ends.
//
// NOT YET RUN ON A GPU: no machine with two GPUs has been lent since this
// was written (cuda/README.md says what has run). In CI this file runs on
// the host CUDA runtime over a stand-in for the library (fake_nccl.h), and
// the channel code above it over socket links.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <cstring>
#include <set>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda/cuda_status.h"
#include "link/nccl_api.h"
#include "link/peer_link.h"

namespace ember {
namespace cuda {
namespace {

absl::StatusOr<const NcclApi*> LoadNccl() {
  static absl::StatusOr<const NcclApi*> loaded = []() -> absl::StatusOr<const NcclApi*> {
    // $EMBER_NCCL_LIBRARY, else the loader's path, else the toolkit's.
    void* lib = nullptr;
    std::string tried;
    const char* env = std::getenv("EMBER_NCCL_LIBRARY");
    for (const char* path : {env, "libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}) {
      if (path == nullptr || *path == 0) continue;
      if ((lib = dlopen(path, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", dlerror());
    }
    if (lib == nullptr) return absl::UnavailableError(absl::StrCat("NCCL: cannot load it: ", tried));
    auto* n = new NcclApi;
    bool ok = true;
    auto get = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && *fn != nullptr;
    };
    get(&n->GetUniqueId, "ncclGetUniqueId");
    get(&n->CommInitRankConfig, "ncclCommInitRankConfig");
    get(&n->CommGetAsyncError, "ncclCommGetAsyncError");
    get(&n->CommAbort, "ncclCommAbort");
    get(&n->Send, "ncclSend");
    get(&n->Recv, "ncclRecv");
    get(&n->GetErrorString, "ncclGetErrorString");
    if (!ok) return absl::UnavailableError("NCCL: libnccl.so.2 lacks ncclCommInitRankConfig (< 2.14)");
    return n;
  }();
  return loaded;
}

absl::Status NcclError(const NcclApi& n, ncclResult_t r, const char* what) {
  return absl::UnavailableError(absl::StrCat("NCCL ", what, ": ", n.GetErrorString(r)));
}

// Waits for a non-blocking communicator's pending call to settle.
ncclResult_t Settle(const NcclApi& n, ncclComm_t comm, ncclResult_t r, absl::Time deadline) {
  while (r == ncclInProgress) {
    if (absl::Now() >= deadline) return ncclInProgress;
    absl::SleepFor(absl::Microseconds(20));
    if (n.CommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

// Makes `device` current for a scope, then the caller's again (a client's
// calls run on the trainer's own threads, whose current device is theirs).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    set_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  absl::Status status() const { return CudaErrorToStatus(set_, "cudaSetDevice"); }

 private:
  const int device_;
  int previous_ = -1;
  cudaError_t set_ = cudaSuccess;
};

// Calls on one link run under its lock's caller (thread-compatible).
class NcclLink : public PeerLink {
 public:
  NcclLink(const NcclApi* n, ncclComm_t comm, cudaStream_t stream, int device, int peer)
      : n_(n), comm_(comm), stream_(stream), device_(device), peer_(peer) {}
  ~NcclLink() override {
    DeviceScope scope(device_);
    if (comm_ != nullptr) n_->CommAbort(comm_);
    cudaStreamDestroy(stream_);
    for (void* m : memory_) cudaFree(m);
  }

  absl::Status Send(const void* memory, uint64_t bytes) override {
    if (!lost_.ok()) return lost_;
    DeviceScope scope(device_);
    return Check(n_->Send(memory, bytes, ncclUint8, peer_, comm_, stream_), "send");
  }
  absl::Status Recv(void* memory, uint64_t bytes) override {
    if (!lost_.ok()) return lost_;
    DeviceScope scope(device_);
    return Check(n_->Recv(memory, bytes, ncclUint8, peer_, comm_, stream_), "receive");
  }
  absl::Status CopyIn(void* memory, const void* host, uint64_t bytes) override {
    if (!lost_.ok()) return lost_;
    DeviceScope scope(device_);
    return CheckCuda(cudaMemcpyAsync(memory, host, bytes, cudaMemcpyHostToDevice, stream_),
                     "copy to device");
  }
  absl::Status CopyOut(void* host, const void* memory, uint64_t bytes) override {
    if (!lost_.ok()) return lost_;
    DeviceScope scope(device_);
    return CheckCuda(cudaMemcpyAsync(host, memory, bytes, cudaMemcpyDeviceToHost, stream_),
                     "copy to host");
  }

  absl::Status CopyRows(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                        uint64_t width, uint64_t rows) override {
    if (!lost_.ok()) return lost_;
    if (rows == 0 || width == 0) return absl::OkStatus();
    DeviceScope scope(device_);
    if (absl::Status s = scope.status(); !s.ok()) return Lose(s);
    return CheckCuda(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                       cudaMemcpyDeviceToDevice, stream_),
                     "copy on the device");
  }

  absl::Status Wait(absl::Time deadline) override {
    if (!lost_.ok()) return lost_;
    DeviceScope scope(device_);
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        return Lose(CudaErrorToStatus(e, "peer link stream"));
      }
      // Also once the stream is done: a transfer that failed (the peer went
      // away) may have let the stream go on, its error left on the
      // communicator.
      ncclResult_t async = ncclSuccess;
      if (n_->CommGetAsyncError(comm_, &async) != ncclSuccess ||
          (async != ncclSuccess && async != ncclInProgress)) {
        return Lose(NcclError(*n_, async, "link"));
      }
      if (e == cudaSuccess) return absl::OkStatus();
      if (absl::Now() >= deadline) {
        return Lose(absl::DeadlineExceededError(
            "peer link: queued transfers not done by the deadline (the other end did not queue "
            "its side)"));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  absl::StatusOr<void*> Allocate(uint64_t bytes) override {
    DeviceScope scope(device_);
    void* m = nullptr;
    if (absl::Status s = CudaErrorToStatus(cudaMalloc(&m, std::max<uint64_t>(bytes, 1)),
                                           "peer link memory");
        !s.ok()) {
      return s;
    }
    memory_.insert(m);
    return m;
  }
  void Free(void* memory) override {
    if (memory_.erase(memory) == 0) return;
    DeviceScope scope(device_);
    cudaFree(memory);
  }

 private:
  absl::Status Lose(absl::Status s) {
    lost_ = std::move(s);
    if (comm_ != nullptr) n_->CommAbort(comm_);
    comm_ = nullptr;
    return lost_;
  }
  absl::Status Check(ncclResult_t r, const char* what) {
    r = Settle(*n_, comm_, r, absl::Now() + absl::Seconds(30));
    if (r == ncclSuccess) return absl::OkStatus();
    if (r == ncclInProgress) {
      return Lose(absl::DeadlineExceededError(absl::StrCat("NCCL ", what, ": not queued in 30 s")));
    }
    return Lose(NcclError(*n_, r, what));
  }
  absl::Status CheckCuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return absl::OkStatus();
    return Lose(CudaErrorToStatus(e, what));
  }

  const NcclApi* const n_;
  ncclComm_t comm_;
  const cudaStream_t stream_;
  const int device_;
  const int peer_;
  absl::Status lost_;
  std::set<void*> memory_;
};

class NcclLinksImpl : public PeerLinks {
 public:
  explicit NcclLinksImpl(const NcclApi* n) : n_(n) {}
  std::string name() const override { return "nccl"; }

  absl::Status CopyRowsNow(int device, bool to_device, void* dst, uint64_t dst_pitch,
                           const void* src, uint64_t src_pitch, uint64_t width,
                           uint64_t rows) override {
    if (rows == 0 || width == 0) return absl::OkStatus();
    DeviceScope scope(device);
    if (absl::Status s = scope.status(); !s.ok()) return s;
    cudaError_t e = cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, rows,
                                 to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    // From pageable memory the copy may return before its DMA has landed;
    // the caller reads the rows on streams that do not wait for this one.
    if (e == cudaSuccess && to_device) e = cudaStreamSynchronize(nullptr);
    return CudaErrorToStatus(e, to_device ? "copy to the device" : "copy to the host");
  }

  absl::StatusOr<std::string> NewId() override {
    ncclUniqueId id;
    if (ncclResult_t r = n_->GetUniqueId(&id); r != ncclSuccess) {
      return NcclError(*n_, r, "ncclGetUniqueId");
    }
    return std::string(id.internal, sizeof(id.internal));
  }

  absl::StatusOr<std::unique_ptr<PeerLink>> Join(const std::string& id, int rank, int device,
                                                 absl::Time deadline) override {
    ncclUniqueId uid;
    if (id.size() != sizeof(uid.internal)) {
      return absl::InvalidArgumentError(
          absl::StrCat("an NCCL link id is ", sizeof(uid.internal), " bytes, not ", id.size()));
    }
    if (rank != 0 && rank != 1) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a two-rank link"));
    }
    std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
    DeviceScope scope(device);
    if (absl::Status s = scope.status(); !s.ok()) return s;
    cudaStream_t stream = nullptr;
    if (absl::Status s = CudaErrorToStatus(
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        !s.ok()) {
      return s;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = n_->CommInitRankConfig(&comm, 2, uid, rank, &config);
    if (comm != nullptr) r = Settle(*n_, comm, r, deadline);
    if (r != ncclSuccess) {
      if (comm != nullptr) n_->CommAbort(comm);
      cudaStreamDestroy(stream);
      if (r == ncclInProgress) {
        return absl::DeadlineExceededError(
            "peer link: the other end did not join the NCCL communicator by the deadline");
      }
      return NcclError(*n_, r, "ncclCommInitRankConfig");
    }
    return std::unique_ptr<PeerLink>(new NcclLink(n_, comm, stream, device, 1 - rank));
  }

 private:
  const NcclApi* const n_;
};

}  // namespace

std::unique_ptr<PeerLinks> NcclLinksOver(const NcclApi* api) {
  return std::make_unique<NcclLinksImpl>(api);
}

absl::StatusOr<PeerLinks*> NcclLinks() {
  static absl::StatusOr<PeerLinks*> links = []() -> absl::StatusOr<PeerLinks*> {
    auto n = LoadNccl();
    if (!n.ok()) return n.status();
    return NcclLinksOver(*n).release();
  }();
  return links;
}

}  // namespace cuda
}  // namespace ember
