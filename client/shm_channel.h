// The client's end of a shared-memory channel to one worker (OpenChannel in
// proto/service.proto): a region this process creates and the worker maps.
// On the worker's host it is a memfd sealed against shrinking, which the
// worker opens through /proc (nothing named at all); where the worker
// cannot (another PID namespace), a POSIX shared-memory name, and with a
// shared directory a file in it, either unlinked as soon as the worker has
// answered (so nothing is left in /dev/shm whoever dies). Calls lay their
// arrays out in it; one call at a time per channel (ChannelPool).
//
// Or a link channel (OpenLink): the region is this process's own memory,
// the worker keeps a copy laid out the same way, and a call's bytes cross
// a peer link (link/peer_link.h: NCCL between GPUs, or a socket) which this
// process joins as rank 1; ShmTransport sends and receives them.
#ifndef EMBER_CLIENT_SHM_CHANNEL_H_
#define EMBER_CLIENT_SHM_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "link/peer_link.h"
#include "proto/service.grpc.pb.h"

namespace ember {
namespace client {

class ShmChannel {
 public:
  // Creates a region of at least `bytes` (a file in `shm_dir` when it is
  // not empty) and has the worker map it. `prepare` sets a call's deadline
  // and credentials.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Open(
      ember::v1::Worker::Stub* stub, uint64_t bytes, const std::string& shm_dir,
      const std::function<void(grpc::ClientContext*)>& prepare);
  // A link channel of at least `bytes` over a link of kind `kind` on CUDA
  // device `device` (ignored by sockets): the worker's answer names the
  // link, which this joins by `deadline`. The worker's refusal as it gave
  // it (FAILED_PRECONDITION: it offers no such links).
  static absl::StatusOr<std::unique_ptr<ShmChannel>> OpenLink(
      ember::v1::Worker::Stub* stub, uint64_t bytes, cuda::PeerLinks* kind, int device,
      absl::Time deadline, const std::function<void(grpc::ClientContext*)>& prepare);
  // Unmaps the region and asks the worker to forget the channel (best
  // effort; it forgets idle channels anyway).
  ~ShmChannel();

  uint64_t id() const { return id_; }
  // The number of the next transfer through it (1, 2, ...): one per call.
  uint64_t NextSeq() { return ++seq_; }
  char* base() const { return base_; }
  uint64_t size() const { return size_; }
  // Whether the worker reads a lookup's ids from this process's shared
  // buffers on this channel (OpenChannelResponse.reads_id_buffers: a memfd
  // channel, which it opened through /proc, to a worker that knows how).
  bool reads_id_buffers() const { return reads_id_buffers_; }
  // A link channel's link and its memory (the region's size); null for a
  // shared-memory channel.
  cuda::PeerLink* link() const { return link_.get(); }
  char* link_memory() const { return link_memory_; }

 private:
  ShmChannel() = default;
  // How the region is handed to the worker.
  enum class Handover { kMemfd, kName, kFile };
  static absl::StatusOr<std::unique_ptr<ShmChannel>> OpenAs(
      Handover handover, ember::v1::Worker::Stub* stub, uint64_t bytes, const std::string& shm_dir,
      const std::function<void(grpc::ClientContext*)>& prepare);
  ember::v1::Worker::Stub* stub_ = nullptr;
  std::function<void(grpc::ClientContext*)> prepare_;
  uint64_t id_ = 0;
  uint64_t seq_ = 0;
  char* base_ = nullptr;
  uint64_t size_ = 0;
  bool reads_id_buffers_ = false;
  bool heap_ = false;  // base_ is this process's memory (a link channel's), not a mapping
  std::unique_ptr<cuda::PeerLink> link_;
  char* link_memory_ = nullptr;
};

// One channel per worker address, leased to one call at a time; a call that
// finds it busy, or a worker that offers none (another host, turned off),
// goes inline instead.
class ChannelPool {
 public:
  // A channel held for one call; empty: go inline.
  class Lease {
   public:
    Lease() = default;
    Lease(std::unique_lock<std::mutex> lock, ShmChannel* channel, bool* broken,
          bool* ids_refused)
        : lock_(std::move(lock)), channel_(channel), broken_(broken), ids_refused_(ids_refused) {}
    ShmChannel* get() const { return channel_; }
    explicit operator bool() const { return channel_ != nullptr; }
    // The call failed: open a fresh channel next time.
    void Invalidate() {
      if (broken_ != nullptr) *broken_ = true;
    }
    // Whether a lookup may name its ids' shared buffer to the worker
    // (WorkerLookupRequest.id_buffer): where the channel says it reads them
    // and the worker has never refused one (remembered per worker, across
    // the channels opened to it).
    bool NamesIdBuffers() const {
      return channel_ != nullptr && channel_->reads_id_buffers() && ids_refused_ != nullptr &&
             !*ids_refused_;
    }
    void IdBufferRefused() {
      if (ids_refused_ != nullptr) *ids_refused_ = true;
    }

   private:
    std::unique_lock<std::mutex> lock_;
    ShmChannel* channel_ = nullptr;
    bool* broken_ = nullptr;
    bool* ids_refused_ = nullptr;
  };

  // Without a shared directory, channels are offered to workers whose
  // address is a loopback one ("127.*", "localhost", "[::1]"): a trainer
  // and a worker on one host.
  static bool SameHost(const std::string& address);

  // A channel of at least `bytes` to `address` (opened or grown as needed),
  // or an empty lease. With `shm_dir` every address is tried (ClientOptions).
  // With `link`, link channels of that kind (on CUDA device `device`)
  // instead, to every address.
  Lease Acquire(const std::string& address, uint64_t bytes, const std::string& shm_dir,
                ember::v1::Worker::Stub* stub,
                const std::function<void(grpc::ClientContext*)>& prepare,
                cuda::PeerLinks* link = nullptr, int device = 0);

 private:
  struct Slot {
    std::mutex mu;
    std::unique_ptr<ShmChannel> channel;
    bool broken = false;
    bool ids_refused = false;  // the worker refused an id buffer once
    absl::Time retry_after = absl::InfinitePast();  // after a refused open
  };
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> link_warnings_{0};  // link channels refused, said on stderr (the first few)
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_SHM_CHANNEL_H_
