// A peer link: one end of a two-rank link between a trainer and a worker,
// through which a data channel's bulk bytes travel (OpenChannelRequest.link
// in proto/service.proto: "nccl" or "socket"). Rank 0 (the worker) makes the
// link's id, hands it to the client in the gRPC answer, and both ends join
// it; from then on each end queues transfers on its link, and the two ends
// queue them in the same order (the channel's sequence numbers see to
// that): every Send on one end meets the Recv of the same size on the
// other. Everything that is not a transfer (negotiation, ordering, sizes,
// errors, teardown) is the channel's code, the same whichever kind of link
// carries the bytes.
//
// Two kinds:
//   "nccl"    an NCCL communicator of two ranks between two GPUs
//             (nccl_link.cc: the only file that calls NCCL; libnccl.so.2
//             is loaded when first needed, so a binary runs without it).
//             Memory is device memory; transfers and copies run on the
//             link's CUDA stream.
//   "socket"  the same over a Unix-domain socket (abstract name) between
//             two processes on one host, in host memory: what runs the
//             channel code where there is no GPU (CI, tests, the demo's
//             check of the protocol). It frames every transfer with its
//             size, so two ends that disagree about a size lose the link
//             (INTERNAL) instead of reading each other's next transfer.
//
// Thread-compatible: one call at a time per link (a channel's lease).
#ifndef EMBER_LINK_PEER_LINK_H_
#define EMBER_LINK_PEER_LINK_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ember {
namespace cuda {

class PeerLink {
 public:
  virtual ~PeerLink() = default;  // aborts whatever is still queued

  // Queues a transfer of `bytes` of this link's memory (Allocate) to the
  // other end, or from it; queued operations run in the order they were
  // queued, after the call returns.
  virtual absl::Status Send(const void* memory, uint64_t bytes) = 0;
  virtual absl::Status Recv(void* memory, uint64_t bytes) = 0;
  // Queues a copy between host memory and the link's memory, in the same
  // order as the transfers. The host bytes must stay put until Wait.
  virtual absl::Status CopyIn(void* memory, const void* host, uint64_t bytes) = 0;
  virtual absl::Status CopyOut(void* host, const void* memory, uint64_t bytes) = 0;
  // Queues a copy of `rows` rows of `width` bytes between device memories
  // of the link's device (the link's own, or a trainer's arrays): row r
  // from src + r * src_pitch to dst + r * dst_pitch (pitches >= width).
  virtual absl::Status CopyRows(void* dst, uint64_t dst_pitch, const void* src,
                                uint64_t src_pitch, uint64_t width, uint64_t rows) = 0;

  // Waits for everything queued so far. DEADLINE_EXCEEDED when that has
  // not finished by `deadline` (a peer that never queued its side), and
  // UNAVAILABLE or INTERNAL when the link failed (the peer went away, two
  // sizes disagreed); the link is then lost for good: it is aborted, and
  // this and every later call answer the same status.
  virtual absl::Status Wait(absl::Time deadline) = 0;

  // The link's memory (device memory for NCCL), 64-byte aligned; freed by
  // Free or with the link.
  virtual absl::StatusOr<void*> Allocate(uint64_t bytes) = 0;
  virtual void Free(void* memory) = 0;
};

// A kind of link.
class PeerLinks {
 public:
  virtual ~PeerLinks() = default;
  virtual std::string name() const = 0;  // "nccl", "socket"

  // A new link's id (rank 0 makes it).
  virtual absl::StatusOr<std::string> NewId() = 0;
  // Joins link `id` as `rank` (0 or 1) on `device` (a CUDA device index;
  // ignored by sockets). Returns once both ends have joined;
  // DEADLINE_EXCEEDED when the other end has not by `deadline`,
  // INVALID_ARGUMENT for an id this kind did not make.
  virtual absl::StatusOr<std::unique_ptr<PeerLink>> Join(const std::string& id, int rank,
                                                         int device, absl::Time deadline) = 0;
  // Copies rows as CopyRows does, at once, between host memory and device
  // memory of `device` (`to_device`: host to device), outside any link: a
  // trainer's arrays where its call goes without one.
  virtual absl::Status CopyRowsNow(int device, bool to_device, void* dst, uint64_t dst_pitch,
                                   const void* src, uint64_t src_pitch, uint64_t width,
                                   uint64_t rows) = 0;
};

// NCCL links. UNAVAILABLE where the build has no NCCL or libnccl.so.2
// cannot be loaded.
absl::StatusOr<PeerLinks*> NcclLinks();
// Socket links (always there).
PeerLinks* SocketLinks();
// "nccl" or "socket"; INVALID_ARGUMENT for another name.
absl::StatusOr<PeerLinks*> PeerLinksNamed(const std::string& name);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_LINK_PEER_LINK_H_
