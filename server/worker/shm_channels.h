// The worker's shared-memory channels (OpenChannel in proto/service.proto):
// regions trainers on the same host created and the worker mapped, through
// which bulk arrays travel instead of inside gRPC messages.
//
// A channel belongs to the credentials that opened it (the authorization
// value, when tokens are on): calls naming it with other credentials are
// refused. It is forgotten on CloseChannel, after `idle_timeout` without a
// call, and when the service goes; a region in use by a call stays mapped
// until the call ends (shared ownership). Thread-safe.
#ifndef EMBER_SERVER_WORKER_SHM_CHANNELS_H_
#define EMBER_SERVER_WORKER_SHM_CHANNELS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/service.pb.h"

namespace ember {
namespace worker {

class ShmChannels {
 public:
  // A mapped region.
  class Region {
   public:
    Region(char* base, size_t size) : base_(base), size_(size) {}
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
  };

  // Limits: region sizes in [4 KiB, max_region_bytes], at most
  // max_channels open at once. `shm_dir`: a directory trainers share with
  // this worker (empty: none; only POSIX shared-memory names then).
  ShmChannels(absl::Duration idle_timeout, uint64_t max_region_bytes, int max_channels,
              std::string shm_dir = "");

  // Maps the region of `req` (OpenChannelRequest): the client's memfd
  // "ember-channel" sealed against shrinking (opened through
  // /proc/<pid>/fd/<memfd>), the POSIX shared-memory name "/ember-...", or
  // the regular file "ember-..." in shm_dir, of at least req.size() bytes,
  // whose first 8 bytes must be req.nonce(). INVALID_ARGUMENT for a bad
  // name or size, FAILED_PRECONDITION for a file without a shm_dir, a
  // descriptor that is not such a memfd, or other bytes than the nonce (not
  // the client's region), NOT_FOUND when a name cannot be opened,
  // RESOURCE_EXHAUSTED past max_channels.
  absl::StatusOr<uint64_t> Open(const ember::v1::OpenChannelRequest& req, const std::string& owner);
  // NOT_FOUND for an unknown channel, PERMISSION_DENIED for another owner's.
  absl::Status Close(uint64_t id, const std::string& owner);
  // The channel's region for transfer `seq` (its idle clock restarts).
  // UNAVAILABLE for an unknown or expired channel (the client opens a new
  // one and retries), PERMISSION_DENIED for another owner's,
  // INVALID_ARGUMENT for a seq not above every earlier one on the channel
  // (a stale or replayed control message; nothing is read).
  absl::StatusOr<std::shared_ptr<const Region>> Use(uint64_t id, const std::string& owner,
                                                    uint64_t seq);

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

  int open_channels() const;
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
  };
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Channel `id` if `owner`'s: UNAVAILABLE when unknown (closed, lapsed),
  // PERMISSION_DENIED for another owner's.
  absl::StatusOr<Channel*> FindLocked(uint64_t id, const std::string& owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration idle_timeout_;
  const uint64_t max_region_bytes_;
  const int max_channels_;
  const std::string shm_dir_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Channel> channels_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_SHM_CHANNELS_H_
