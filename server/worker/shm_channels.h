// The worker's data channels (OpenChannel in proto/service.proto), through
// which bulk arrays travel instead of inside gRPC messages: shared-memory
// regions trainers on the same host created and the worker mapped, and
// link channels (an NCCL or socket peer link, link/peer_link.h), where each
// side keeps its own copy of a region laid out the same way and a call's
// bytes cross the link: received into the worker's copy when the call
// starts (Use; a CUDA worker on NCCL links copies only the lengths out of
// the link's device memory and its backend reads the rest there), its
// lookup outputs sent back when it succeeded (Transfer::Reply).
//
// A channel belongs to the credentials that opened it (the authorization
// value, when tokens are on): calls naming it with other credentials are
// refused. It is forgotten on CloseChannel, after `idle_timeout` without a
// call, and when the service goes; a region in use by a call stays mapped
// until the call ends (shared ownership). Thread-safe.
#ifndef EMBER_SERVER_WORKER_SHM_CHANNELS_H_
#define EMBER_SERVER_WORKER_SHM_CHANNELS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "link/peer_link.h"
#include "proto/service.pb.h"

namespace ember {
namespace worker {

// Link channels: the kinds offered (none: OpenChannel with a link is
// refused), the CUDA device their links run on, and how long a transfer (or
// a client's join) may take before the channel is given up.
struct LinkChannelOptions {
  std::vector<cuda::PeerLinks*> kinds;
  int device = 0;
  absl::Duration transfer_timeout = absl::Seconds(30);
  // The regions of all open link channels together (each also holds as
  // much link memory: device memory for NCCL, outside the backend's memory
  // limit); past it OpenChannel is RESOURCE_EXHAUSTED.
  int64_t max_bytes = int64_t{4} << 30;
};

class ShmChannels {
 public:
  // A mapped region (`mapped`), or a link channel's copy of one (heap
  // memory, std::free'd).
  class Region {
   public:
    Region(char* base, size_t size, bool mapped = true)
        : base_(base), size_(size), mapped_(mapped) {}
    ~Region();
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;
    size_t size() const { return size_; }
    // The bytes of `slice`, INVALID_ARGUMENT (naming `what`) unless they lie
    // inside the region at a multiple of `align`.
    absl::StatusOr<absl::Span<char>> Bytes(const ember::v1::ShmSlice& slice, size_t align,
                                           const std::string& what) const;

   private:
    char* const base_;
    const size_t size_;
    const bool mapped_;
  };

  // One link channel's link and its memory, once joined.
  struct LinkState;

  // A call's hold on its channel (Use): the region, and for a link channel
  // the link, which no other call uses until this hold goes.
  class Transfer {
   public:
    Transfer() = default;
    Transfer(Transfer&&) = default;
    Transfer& operator=(Transfer&&) = default;
    const std::shared_ptr<const Region>& region() const { return region_; }
    bool linked() const { return link_ != nullptr; }
    // INVALID_ARGUMENT unless `reply` (WorkerLookupRequest.link_reply) lies
    // in the region at a multiple of 4 and covers exactly the bytes of
    // `outputs`, first to last (nothing else of the region goes back); for
    // a shared-memory channel unless it is empty.
    absl::Status CheckReply(
        const ember::v1::ShmSlice& reply,
        const google::protobuf::RepeatedPtrField<ember::v1::ShmSlice>& outputs) const;
    // Link channels: queues `reply`'s bytes to the client (a lookup's
    // outputs, written in the region, or, `in_link_memory`, straight into
    // the link's memory). Nothing for shared memory.
    absl::Status Reply(const ember::v1::ShmSlice& reply, bool in_link_memory = false);
    // A link channel's memory (the region's size and layout), and whether
    // it is device memory (NCCL's) or host memory (a socket link's): a
    // backend that writes outputs there (EmbeddingBackend::OutputMemory)
    // saves the copy into the region and out again.
    bool link_memory_on_device() const;
    absl::StatusOr<absl::Span<char>> LinkBytes(const ember::v1::ShmSlice& slice, size_t align,
                                               const std::string& what) const;

   private:
    friend class ShmChannels;
    std::shared_ptr<const Region> region_;
    std::shared_ptr<LinkState> link_;
    std::unique_lock<std::mutex> lock_;  // link_'s call lock (after link_: let go first)
    absl::Duration reply_timeout_;
  };

  // Limits: region sizes in [4 KiB, max_region_bytes], at most
  // max_channels open at once. `shm_dir`: a directory trainers share with
  // this worker (empty: none; only POSIX shared-memory names then).
  ShmChannels(absl::Duration idle_timeout, uint64_t max_region_bytes, int max_channels,
              std::string shm_dir = "", LinkChannelOptions links = {});
  ~ShmChannels();

  // Maps the region of `req` (OpenChannelRequest): the client's memfd
  // "ember-channel" sealed against shrinking (opened through
  // /proc/<pid>/fd/<memfd>), the POSIX shared-memory name "/ember-...", or
  // the regular file "ember-..." in shm_dir, of at least req.size() bytes,
  // whose first 8 bytes must be req.nonce(). INVALID_ARGUMENT for a bad
  // name or size, FAILED_PRECONDITION for a file without a shm_dir, a
  // descriptor that is not such a memfd, or other bytes than the nonce (not
  // the client's region), NOT_FOUND when a name cannot be opened,
  // RESOURCE_EXHAUSTED past max_channels.
  //
  // With req.link(): a link channel of that kind (FAILED_PRECONDITION when
  // it is not offered), whose link's id goes to `*link_id`; the worker joins
  // it as rank 0 in the background, and the client has until
  // transfer_timeout to join too.
  absl::StatusOr<uint64_t> Open(const ember::v1::OpenChannelRequest& req, const std::string& owner,
                                std::string* link_id = nullptr);
  // NOT_FOUND for an unknown channel, PERMISSION_DENIED for another owner's.
  absl::Status Close(uint64_t id, const std::string& owner);
  // The channel's region for transfer `seq` (its idle clock restarts).
  // UNAVAILABLE for an unknown or expired channel (the client opens a new
  // one and retries), PERMISSION_DENIED for another owner's,
  // INVALID_ARGUMENT for a seq not above every earlier one on the channel
  // (a stale or replayed control message; nothing is read).
  //
  // A link channel's call first receives the `sent` bytes of the region
  // (the client sent them with the call) into the link's memory and this
  // side's copy of the region, one call at a time; where the link's memory
  // is device memory and `host_slices` is given, only those slices (those
  // inside the region) are copied into the region: the caller reads the
  // rest on the device (LinkBytes). Any refusal of a link channel's call,
  // and a transfer that fails or misses transfer_timeout (UNAVAILABLE),
  // also drops the channel: its link may be out of step with the client's.
  // `sent` must be empty for a shared-memory channel.
  absl::StatusOr<Transfer> Use(uint64_t id, const std::string& owner, uint64_t seq,
                               const ember::v1::ShmSlice& sent = ember::v1::ShmSlice(),
                               const std::vector<ember::v1::ShmSlice>* host_slices = nullptr);
  // Drops link channel `id` of `owner` (a call on it was refused before it
  // could receive: its link is out of step). Nothing for a shared-memory
  // channel or an unknown one.
  void Abandon(uint64_t id, const std::string& owner);
  // Whether `id` is a link channel of `owner`'s.
  bool IsLink(uint64_t id, const std::string& owner) const;

  // The client's shared buffer `b` (WorkerLookupRequest.out_buffer or
  // id_buffer) for channel `id`: mapped on first use and kept (up to
  // kMaxBuffers per channel, the least recently used unmapped past that,
  // and any the client has closed unmapped at the next call); only the
  // nonce is read here (the caller reads ids from it or writes outputs
  // into it, within its checked slices). FAILED_PRECONDITION when it cannot be opened through
  // /proc/<pid>/fd/<fd> or is not the client's buffer (a memfd named
  // "ember-buffer", sealed against shrinking, holding the nonce),
  // INVALID_ARGUMENT for a size outside [8 KiB, max_region_bytes], and as
  // Use for the channel.
  static constexpr int kMaxBuffers = 16;
  absl::StatusOr<std::shared_ptr<const Region>> MapBuffer(uint64_t id, const std::string& owner,
                                                          const ember::v1::SharedBuffer& b);

  int open_channels() const;  // of both kinds
  int link_channels() const;
  int64_t link_channels_opened() const {  // since it started
    return links_opened_.load(std::memory_order_relaxed);
  }
  absl::Duration idle_timeout() const { return idle_timeout_; }

 private:
  struct Channel {
    std::shared_ptr<const Region> region;
    std::string owner;
    absl::Time last_used;
    uint64_t last_seq = 0;  // of the latest transfer it served
    // Mapped shared buffers, least recently used first.
    struct Buffer {
      ember::v1::SharedBuffer buffer;
      std::shared_ptr<const Region> region;
      ino_t inode;  // of the memfd: gone from /proc/<pid>/fd/<fd>, the client let it go
    };
    std::vector<Buffer> buffers;
    std::shared_ptr<LinkState> link;  // a link channel's
  };
  // INVALID_ARGUMENT for a region size outside [4096, max_region_bytes],
  // RESOURCE_EXHAUSTED with max_channels open (after the idle ones lapse).
  absl::Status CheckRoom(uint64_t size);
  absl::StatusOr<uint64_t> OpenLink(const ember::v1::OpenChannelRequest& req,
                                    const std::string& owner, std::string* link_id);
  // Receives `sent` into the link's memory for a link channel's call, and
  // copies it (or only `host_slices` of it, when given and the memory is
  // the device's) into the region.
  absl::Status Receive(LinkState& link, const Region& region, const ember::v1::ShmSlice& sent,
                       const std::vector<ember::v1::ShmSlice>* host_slices);
  // Links of channels dropped under mu_, let go once it is released (an
  // NCCL link's abort and cudaFree may wait on the device): declared before
  // the lock, so destroyed after it.
  using Gone = std::vector<std::shared_ptr<LinkState>>;
  void ExpireLocked(absl::Time now, Gone* gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets a channel, its link (if any) moved to `gone`; the next one.
  std::map<uint64_t, Channel>::iterator DropLocked(std::map<uint64_t, Channel>::iterator it,
                                                  Gone* gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Channel `id` if `owner`'s: UNAVAILABLE when unknown (closed, lapsed),
  // PERMISSION_DENIED for another owner's.
  absl::StatusOr<Channel*> FindLocked(uint64_t id, const std::string& owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration idle_timeout_;
  const uint64_t max_region_bytes_;
  const int max_channels_;
  const std::string shm_dir_;
  const LinkChannelOptions links_;
  // Aborts the links of replies no client took (LinkState), every second;
  // runs where links are offered.
  void Reap();
  std::thread reaper_;
  std::atomic<int64_t> links_opened_{0};
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, Channel> channels_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_SHM_CHANNELS_H_
